"""The `cxlrt` command as a newcomer meets it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def cxlrt(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "cxlrt", *args], capture_output=True, text=True,
                       timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"cxlrt {' '.join(args)} exited {p.returncode}:\n{p.stderr}")
    return p


@pytest.mark.parametrize("cmd", [[], ["format"], ["info"], ["demo"]])
def test_help(cmd):
    p = cxlrt(*cmd, "--help")
    assert "usage: cxlrt" in p.stdout
    assert "emu:" in p.stdout or cmd == ["demo"]


def test_format_then_info(region_dir):
    spec = f"emu:{region_dir}/rack"
    p = cxlrt("format", spec, "--size", "8M", "--nodes", "4")
    assert "8.0 MiB, 4 nodes" in p.stdout
    human = cxlrt("info", spec).stdout
    assert "nodes    4" in human and "section  heap" in human
    info = json.loads(cxlrt("info", spec, "--json").stdout)
    assert (info["size"], info["nodes"]) == (8 << 20, 4)
    assert info["sections"]["heap"][0] > 0


def test_info_lists_kv_caches_with_their_counters(region_dir):
    import cxlrt as rt
    spec = f"emu:{region_dir}/rack?check=1"
    with rt.open(spec, node=0, create=True, size="8M", nodes=2) as r:
        c = rt.KVCache(r, "llama", block_bytes=4096, capacity_blocks=16, salt=b"m")
        keys = c.block_hashes(range(64))
        c.store(keys, [bytes(4096)] * 4)
        with c.lookup(keys):
            pass
        c.lookup(c.block_hashes(range(100, 116))).release()
    human = cxlrt("info", spec).stdout
    assert "kv cache 'llama': 4/16 blocks of 4.0 KiB" in human
    assert "4 hits, 1 misses, 4 stores, 0 evictions" in human
    (kv,) = json.loads(cxlrt("info", spec, "--json").stdout)["kv_caches"]
    assert (kv["name"], kv["occupancy"], kv["block_tokens"], kv["algorithm"]) == (
        "llama", 4, 16, "blake2b")


@pytest.mark.parametrize("args,msg,code", [
    (["info", "file:/nonexistent/x"], "cxlrt format", 2),
    (["info", "tape:/x"], "unknown region scheme", 2),
    (["format", "emu:/dev/shm/x?evict=7", "--size", "1M", "--nodes", "2"], "evict=", 2),
    (["format", "file:/dev/shm/cxlrt-tiny-never", "--size", "4K", "--nodes", "2"],
     "too small", 2),
])
def test_errors_are_one_line_not_tracebacks(args, msg, code):
    p = cxlrt(*args, check=False)
    assert p.returncode == code
    assert msg in p.stderr
    assert "Traceback" not in p.stderr


def test_info_on_corrupt_region_exits_1(region_dir):
    path = f"{region_dir}/junk"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 16))
    p = cxlrt("info", f"file:{path}", check=False)
    assert p.returncode == 1
    assert "not a cxlrt region" in p.stderr


def test_demo_quick_json_reports_every_mode_equal_to_the_monolithic_run():
    p = cxlrt("demo", "--quick", "--json", "--conversations", "2", "--turns", "2")
    report = json.loads(p.stdout)  # --json: nothing but the report on stdout
    assert report["ok"] is True
    assert (report["config"]["conversations"], report["config"]["turns"]) == (2, 2)
    assert report["config"]["system_tokens"] == 128  # --quick's, not the default's
    for mode in ("nocache", "tcp", "tcp_cache", "cxlrt"):
        m = report["modes"][mode]
        assert m["tokens_equal"] is True and len(m["turns"]) == 2
        assert m["overall"]["ttft_mean_s"] > 0
    assert report["modes"]["cxlrt"]["turns"][1]["prefix_hit_rate"] > 0
    assert report["ratios"]["cxlrt/tcp"]["ttft_mean"] > 0
    assert report["ratios"]["cxlrt/tcp_cache"]["ttft_mean"] > 0
    split = report["modes"]["cxlrt"]["turns"][1]["ttft_split_s"]
    assert sum(split.values()) == pytest.approx(report["modes"]["cxlrt"]["turns"][1]
                                                ["ttft_mean_s"], abs=1e-6)
    path = report["region"]["spec"][4:].split("?")[0]
    assert not os.path.exists(path)  # the emulated rack is removed afterwards


def test_demo_modes_runs_only_those():
    p = cxlrt("demo", "--quick", "--json", "--turns", "2", "--modes", "cxlrt, tcp_cache")
    report = json.loads(p.stdout)
    assert report["ok"] is True and list(report["modes"]) == ["tcp_cache", "cxlrt"]
    assert list(report["ratios"]) == ["cxlrt/tcp_cache"]
    assert report["config"]["modes"] == ["tcp_cache", "cxlrt"]


def test_demo_table_names_modes_and_verdict():
    out = cxlrt("demo", "--quick", "--turns", "2").stdout
    for text in ("(a) no cache", "(b) TCP", "(c) cxlrt", "TTFT mean", "(c)/(a)", "(c)/(b)",
                 "(c)/(b')",
                 "tokens equal to the monolithic run: (a) no cache yes, (b) TCP yes, "
                 "(b') TCP+cache yes, (c) cxlrt yes"):
        assert text in out


@pytest.mark.parametrize("args,msg", [(["--prefill", "0"], "--prefill"),
                                      (["-D", "-2"], "--decode"),
                                      (["--turns", "x"], "--turns"),
                                      (["--prefill", "40", "--decode", "40"], "at most 64"),
                                      (["--modes", "cxlrt,udp"], "unknown mode 'udp'"),
                                      (["--modes", "tcp,tcp"], "named twice"),
                                      (["--modes", ""], "--modes")])
def test_demo_bad_options_are_one_line_errors(args, msg):
    p = cxlrt("demo", "--quick", *args, check=False)
    assert p.returncode == 2
    assert msg in p.stderr
    assert "Traceback" not in p.stderr
