"""The CXL hybrid-memory device model (``chm:``): its policies do what they claim.

The algorithm suite runs over chm-lru and chm-staging through the `backend` fixture;
these tests pin the device's own behaviour: where bytes live (DRAM frame or SSD file),
what each policy fills, what the modelled SSD time adds up to, and that the device
recovers from a process killed inside its controller.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import cxlrt
from cxlrt.emulation import chmside

from .chmdevice import die_inside

PAGE = 4096


def _open(d, policy, *, dram="64K", extra="", node=0, create=True):
    spec = f"chm:{d}/r?policy={policy}&dram={dram}&page=4K" + (f"&{extra}" if extra else "")
    if create:
        return cxlrt.open(spec, node=node, create=True, size="4M", nodes=2)
    return cxlrt.open(spec, node=node)


def _file_bytes(d, off, n):
    with open(f"{d}/r", "rb") as f:
        f.seek(off)
        return f.read(n)


def test_lru_hits_a_set_that_fits_and_never_one_four_times_dram(region_dir):
    r = _open(region_dir, "lru", dram="64K")  # 16 frames
    off = r.alloc(256 * 1024, align=PAGE)
    data = os.urandom(256 * 1024)
    r.dma_write(off, data)
    small = 32 * 1024
    r.dma_read(off, small)
    before = r.backend.stats()
    assert r.dma_read(off, small) == data[:small]
    after = r.backend.stats()
    assert after["hits"] - before["hits"] == small // PAGE
    assert after["fills"] == before["fills"]
    # A scan of 4x DRAM in order evicts each page before it comes round again.
    r.dma_read(off, 256 * 1024)
    before = r.backend.stats()
    assert r.dma_read(off, 256 * 1024) == data
    after = r.backend.stats()
    assert after["fills"] - before["fills"] == 64
    assert after["hits"] == before["hits"]
    r.close()


def test_lru_writes_back_dirty_victims_and_writeback_empties_dram(region_dir):
    r = _open(region_dir, "lru", dram="64K")
    off = r.alloc(128 * 1024, align=PAGE)
    data = os.urandom(128 * 1024)
    r.dma_write(off, data)
    st = r.backend.stats()
    assert st["writebacks"] >= 16  # the first half was pushed out by the second
    assert _file_bytes(region_dir, off, 64 * 1024) == data[:64 * 1024]
    pages, dirty = r.backend.resident()
    assert pages == 16 and dirty > 0
    assert _file_bytes(region_dir, off + 64 * 1024, 64 * 1024) != data[64 * 1024:]
    assert r.backend.writeback(drop=True) == dirty
    assert r.backend.resident() == (0, 0)
    assert _file_bytes(region_dir, off, len(data)) == data
    assert r.dma_read(off, len(data)) == data
    r.close()


def test_staging_dma_bypasses_dram_in_one_request(region_dir):
    r = _open(region_dir, "staging", dram="64K")
    off = r.alloc(256 * 1024, align=PAGE)
    data = os.urandom(256 * 1024)
    resident = r.backend.resident()
    before = r.backend.stats()
    r.dma_write(off, data)
    assert _file_bytes(region_dir, off, len(data)) == data  # straight to the SSD
    assert r.dma_read(off, len(data)) == data
    after = r.backend.stats()
    assert r.backend.resident() == resident  # nothing filled
    assert after["direct_writes"] - before["direct_writes"] == 1
    assert after["direct_reads"] - before["direct_reads"] == 1
    assert after["fills"] == before["fills"]
    r.close()


def test_staging_serves_pages_in_dram_from_dram(region_dir):
    r = _open(region_dir, "staging", dram="64K")
    off = r.alloc(3 * PAGE, align=PAGE)
    r.store64(off + PAGE, 0xABCD)  # a CPU store: the middle page is now in DRAM, dirty
    before = r.backend.stats()
    got = r.dma_read(off, 3 * PAGE)
    after = r.backend.stats()
    assert int.from_bytes(got[PAGE:PAGE + 8], "little") == 0xABCD
    assert after["hits"] - before["hits"] == 1
    assert after["direct_reads"] - before["direct_reads"] == 2  # the pages either side
    r.close()


@pytest.mark.parametrize("policy", ["lru", "staging"])
def test_modelled_ssd_time_adds_up(region_dir, policy):
    r = _open(region_dir, policy, dram="64K", extra="lat=20000&bw=4")
    off = r.alloc(512 * 1024, align=PAGE)
    r.backend.writeback(drop=True)
    before = r.backend.stats()
    r.dma_read(off, 512 * 1024)
    busy = r.backend.stats()["busy_ns"] - before["busy_ns"]
    if policy == "staging":
        assert busy == 20000 + int(512 * 1024 / 4)  # one request
    else:
        assert busy == 128 * (20000 + int(PAGE / 4))  # a request per page; DRAM was empty
    r.close()


@pytest.mark.parametrize("other", ["policy=staging", "dram=128K", "lat=5", "bw=2", "wbw=1",
                                   "pin=2000000"])
def test_other_parameters_on_a_live_device_are_refused(region_dir, other):
    r = _open(region_dir, "lru")
    kw = dict(p.split("=") for p in other.split("&"))
    policy = kw.pop("policy", "lru")
    dram = kw.pop("dram", "64K")
    with pytest.raises(ValueError, match="the device was set up with policy=lru"):
        _open(region_dir, policy, dram=dram, extra="&".join(f"{k}={v}" for k, v in kw.items()),
              create=False, node=1)
    r.close()


@pytest.mark.parametrize("spec, match", [
    ("policy=mru", "expected one of lru, staging"),
    ("page=5000", "power of two"),
    ("dram=1K", "smaller than one page"),
    ("bw=-1", "expected 0.0"),
    ("page=4K&dram=16T", "too many"),
    ("policy=lru&wbuf=16K", "wbuf= is the staging policy's write buffer"),
    ("policy=staging&page=4K&dram=64K&wbuf=64K", "leaves no DRAM for the cache"),
    ("policy=staging&wbidle=soon", "expected ns from 0 to 10.*12, or never"),
    ("policy=staging&pin=999", "pin"),
])
def test_bad_parameters_are_clear_errors(region_dir, spec, match):
    with pytest.raises(ValueError, match=match):
        cxlrt.open(f"chm:{region_dir}/r?{spec}", node=0, create=True, size="1M", nodes=2)
    with pytest.raises(ValueError, match=match):
        cxlrt.format(f"chm:{region_dir}/r?{spec}", size="1M", nodes=2)
    assert not os.listdir(region_dir)  # no region file left behind by the refusal


def test_a_recreated_region_file_starts_with_an_empty_device(region_dir):
    r = _open(region_dir, "lru")
    off = r.alloc(PAGE, align=PAGE)
    r.dma_write(off, b"\x5a" * PAGE)
    assert r.backend.resident()[1] > 0
    r.close()
    os.unlink(f"{region_dir}/r")  # the sidecar, with dirty frames, stays behind
    r = _open(region_dir, "lru")
    assert r.dma_read(off, PAGE) != b"\x5a" * PAGE
    r.close()


# What a holder killed between two steps of the controller can leave (frame 3 and the
# page under test): (frame entry flags, page map names frame 3, frame bytes, on the SSD)
KILLED_AT = {
    # inside a fill: the frame named, its bytes not yet the page's
    "fill": (8, True, b"\xee", b"\x11"),
    # inside an eviction of a dirty page: unmapped, not yet written back
    "evict": (1 | 2, False, b"\x22", b"\x11"),
    # after the write-back, before the entry was cleared
    "evicted": (1, False, b"\x11", b"\x11"),
}


@pytest.mark.parametrize("step", sorted(KILLED_AT))
def test_a_process_killed_inside_the_controller_is_repaired(region_dir, step):
    flags, mapped, frame_byte, ssd_byte = KILLED_AT[step]
    want = b"\x22" * PAGE if step == "evict" else b"\x11" * PAGE
    r = _open(region_dir, "lru", dram="64K")
    off = r.alloc(PAGE, align=PAGE)
    r.dma_write(off, ssd_byte * PAGE)
    r.backend.writeback(drop=True)
    geo = chmside.geometry(r.size, {"page": PAGE, "dram": 64 * 1024})
    pg = off // PAGE

    def half_filled(m, ftab, pmap):  # a frame naming the page, in the state `step` leaves
        ftab[3] = (pg + 1) << 8 | flags
        pmap[pg] = 4 if mapped else 0
        memoryview(m)[geo["data"] + 3 * PAGE:geo["data"] + 4 * PAGE] = frame_byte * PAGE

    die_inside(f"{region_dir}/r.chm", geo, half_filled)
    assert r.dma_read(off, PAGE) == want
    assert r.backend.stats()["repairs"] == 1
    r.backend.writeback(drop=True)
    assert _file_bytes(region_dir, off, PAGE) == want  # and nothing left half done
    r.close()


def test_nodes_share_one_device(region_dir):
    a = _open(region_dir, "lru")
    b = _open(region_dir, "lru", create=False, node=1)
    off = a.alloc(PAGE, align=PAGE)
    a.store64(off, 77)  # in device DRAM only, and node 1 sees it: one device
    assert b.load64(off) == 77
    assert _file_bytes(region_dir, off, 8) != (77).to_bytes(8, "little")
    assert a.backend.stats() == b.backend.stats()
    a.close()
    b.close()


def test_the_turns_script_reads_back_what_it_stored(tmp_path):
    # perf/chm_turns.py asserts every byte it reads against what it stored, on both
    # devices; a short run here keeps that path working (the figures are perf/'s).
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "perf", "chm_turns.py")
    out = tmp_path / "t.json"
    res = subprocess.run([sys.executable, script, "--turns", "3", "--grow", "3", "--dram", "1",
                          "--reps", "1", "--png", "", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    turns = json.loads(out.read_text())["turns"]
    assert [t["turn"] for t in turns] == [2, 3]
    assert all(t["lru_gbps"] > 0 and t["staging_gbps"] > 0 for t in turns)
    bad = subprocess.run([sys.executable, script, "--turns", "0"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--turns must be at least 1" in bad.stderr


def test_the_random_reads_script_reads_back_what_it_stored(tmp_path):
    # perf/chm_random.py checks every request's bytes against the pool it stored, with
    # prefetch on and off, on both devices; a short run keeps that path working.
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "perf", "chm_random.py")
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, script, "--pool", "8", "--per", "3", "--requests",
                          "2", "--dram", "1", "--compute", "0,50", "--png", "", "--json",
                          str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert sorted((r["policy"], r["compute_us"]) for r in rows) == [
        ("lru", 0.0), ("lru", 50.0), ("staging", 0.0), ("staging", 50.0)]
    assert all(r["on"] > 0 and r["off"] > 0 for r in rows)
    for bad, msg in ((["--per", "9", "--pool", "8"], "--per cannot exceed --pool"),
                     (["--compute", "x"], "a comma list"), (["--compute", "-1"], "negative")):
        r = subprocess.run([sys.executable, script, *bad], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


@pytest.mark.parametrize("policy", ["lru", "staging"])
def test_close_waits_out_threads_inside_the_device(region_dir, policy):
    # A lock waiter polls the device without the GIL; closing its region under it used
    # to unlock the device lock through the retired (zeroed) mapping, which left the
    # real lock owned for good, or divide by a zeroed page size (SIGFPE). Now close()
    # waits the thread out, the waiter gets a clear error, and the device stays usable.
    spec = f"chm:{region_dir}/r?policy={policy}&dram=64K&page=4K&lat=20000"
    a = cxlrt.open(spec, node=0, create=True, size="4M", nodes=11)
    la = a.lock("w")
    assert la.acquire()
    for i in range(10):
        # A node of its own each time: the waiter's node-local lock tier is left held by
        # the close (a known lock-layer issue, not the device's; see the issue note).
        b = cxlrt.open(spec, node=i + 1)
        lb = b.lock("w")
        out = []

        def wait(lb, out):
            try:
                out.append(lb.acquire(timeout=20))
            except Exception as e:  # what the waiter saw is the result
                out.append(e)

        t = threading.Thread(target=wait, args=(lb, out))
        t.start()
        time.sleep(0.02 + 0.003 * i)
        b.close()
        t.join(10)
        assert not t.is_alive() and len(out) == 1, out
        assert isinstance(out[0], cxlrt.RegionClosedError), out
        assert a.dma_read(a.heap[0], 8) is not None  # the device lock is free
    la.release()
    a.close()


def test_a_device_of_another_format_is_refused_not_rebuilt(region_dir):
    # Its DRAM may hold the only copy of data: an old sidecar is never silently replaced.
    r = _open(region_dir, "lru")
    off = r.alloc(PAGE, align=PAGE)
    r.dma_write(off, b"\x5a" * PAGE)
    r.close()
    with open(f"{region_dir}/r.chm", "r+b") as f:
        f.seek(8)
        f.write((chmside.VERSION - 1).to_bytes(4, "little"))
    with open(f"{region_dir}/r.chm", "rb") as f:
        before = f.read()
    with pytest.raises(ValueError, match="built by another version of cxlrt"):
        _open(region_dir, "lru", create=False)
    with open(f"{region_dir}/r.chm", "rb") as f:
        assert f.read() == before  # left as it was, dirty frames and all
    os.unlink(f"{region_dir}/r")  # a region file made again gets a new device
    r = _open(region_dir, "lru")
    assert r.dma_read(off, PAGE) != b"\x5a" * PAGE
    r.close()


def test_the_end_to_end_script_serves_every_way_with_the_same_tokens(tmp_path):
    # perf/chm_endtoend.py runs the demo (which checks every token against a monolithic
    # run) on a DRAM-only cache and on both device policies; a small workload keeps it
    # working (the figures are perf/'s).
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "perf", "chm_endtoend.py")
    out = tmp_path / "e.json"
    res = subprocess.run([sys.executable, script, "--turns", "2", "--conversations", "2",
                          "--system-tokens", "128", "--user-tokens", "32", "--new-tokens", "8",
                          "--ratio", "2", "--page", "16", "--png", "", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["way"] for r in rows] == ["dram", "staging", "lru"]
    assert all(r["tokens_equal"] and len(r["hit_rate"]) == 2 for r in rows)
    assert rows[0]["evictions"] > 0  # the DRAM-only cache is smaller than the footprint
    bad = subprocess.run([sys.executable, script, "--ratio", "0"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--ratio must be at least 1" in bad.stderr
