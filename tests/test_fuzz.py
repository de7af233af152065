"""The fuzzer of region images (issue 9): its CI-sized run, and proof that it catches failures.

The long run is one command: ``python -m cxlrt.fuzz --images 1000000 --jobs 2``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cxlrt import fuzz
from cxlrt import superblock as sb

# Images of the CI run: ~45 images/s on two loaded cores with the seeds' 20 ms lease
# (about 7 minutes); the bound below leaves room for a slower machine.
CI_IMAGES = int(os.environ.get("CXLRT_FUZZ_IMAGES", "20000"))
CI_SEED = 20260509


@pytest.fixture
def out_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CXLRT_LOCAL_DIR", str(tmp_path))
    return tmp_path / "fuzz"


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return fuzz.make_seeds(str(tmp_path_factory.mktemp("seeds")))


def test_seed_images_are_valid_regions(seeds):
    for s in seeds.values():
        info = sb.unpack(s.image[:sb.SB_BYTES], len(s.image), s.name)
        assert info["nodes"] == fuzz.NODES
        assert {"kv/fuzz", "chan/fuzz", "obj/a", "obj/b", "obj/c"} <= set(s.meta["dir"])
        assert len(s.meta["kv"]["used"]) == 5
        assert set(s.targets) == {"superblock", "nodes", "locks", "directory", "alloc", "kv",
                                  "payload", "channel"}


def test_fixups_make_a_corruption_pass_its_check_word(seeds):
    s = seeds["clean"]
    muts = [["w", 24, 4, 7, "sb.nodes"]]
    with pytest.raises(sb.ChecksumError):
        sb.unpack(bytes(fuzz.apply(s.image, muts)[:sb.SB_BYTES]), len(s.image), "x")
    fixed = fuzz.apply(s.image, muts + [["fix", "sb", 0]])
    with pytest.raises(sb.RegionError, match="not where layout version"):
        sb.unpack(bytes(fixed[:sb.SB_BYTES]), len(s.image), "x")  # past the checksum now


def test_images_are_a_function_of_the_seed(seeds, out_dir):
    a, b = fuzz.Fuzzer(str(out_dir), seed=5), fuzz.Fuzzer(str(out_dir), seed=5)
    a.seeds = b.seeds = seeds
    assert [a.case(i) for i in range(50)] == [b.case(i) for i in range(50)]
    c = fuzz.Fuzzer(str(out_dir), seed=6)
    c.seeds = seeds
    assert [a.case(i) for i in range(50)] != [c.case(i) for i in range(50)]


@pytest.mark.slow
def test_harness_reports_a_crash_with_a_replayable_case_and_a_hang(out_dir):
    fz = fuzz.Fuzzer(str(out_dir), seed=3, jobs=2, timeout=2.0, progress=False,
                     inject={3: "segv", 7: "hang"})
    rep = fz.run(12)
    assert rep.images == 12  # the images after each failure ran on a fresh worker
    assert [(c["image"], c["op"], c["detail"]) for c in rep.crashes] == [
        (3, "inject", "killed by SIGSEGV")]
    assert [(h["image"], h["op"]) for h in rep.hangs] == [(7, "inject")]
    crash = Path(rep.crashes[0]["dir"])
    assert "Segmentation fault" in (crash / "stack.txt").read_text()
    assert "in _inject" in (Path(rep.hangs[0]["dir"]) / "stack.txt").read_text()
    case = json.loads((crash / "case.json").read_text())
    assert case["run_seed"] == 3 and case["case"]["i"] == 3
    # The saved case replays alone, and dies of the same signal.
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "cxlrt.fuzz", "--replay",
                        crash], capture_output=True, timeout=60)
    assert p.returncode == -signal.SIGSEGV, p.stderr[-2000:]
    assert b"op inject" in p.stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ci_sized_run_has_no_crash_and_no_hang(out_dir):
    fz = fuzz.Fuzzer(str(out_dir), seed=CI_SEED, jobs=2, progress=False)
    rep = fz.run(CI_IMAGES)
    d = rep.as_dict()
    print(f"\n{rep.images} images in {rep.seconds:.0f} s ({rep.rate:.0f}/s), "
          f"{d['features']} outcomes seen, corpus {d['corpus']}")
    for exc, n in d["exceptions_by_type"].items():
        print(f"  {exc:24s} {n}")
    assert rep.images == CI_IMAGES
    assert not rep.crashes, json.dumps(rep.crashes, indent=1)
    assert not rep.hangs, json.dumps(rep.hangs, indent=1)
