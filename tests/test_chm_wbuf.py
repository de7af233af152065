"""The CXL-HM device's write buffer (``chm:?policy=staging&wbuf=``): HyMCache's write
isolation. A DMA write of a page not in DRAM lands in the buffer while it has a free
frame; the buffer flushes only while reads leave the SSD idle; the runtime asks before
it writes (Region.admit, KVCache.admit) and skips what the buffer has no room for; and
nothing admitted is lost, whoever dies, while the device persists.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest

import cxlrt
from cxlrt.check import check, repair
from cxlrt.emulation import chmside
from cxlrt.kvcache import KVCache

from .chmdevice import die_inside

PAGE = 4096


def _spec(d, *, wbuf="32K", idle="never", extra=""):
    return (f"chm:{d}/r?policy=staging&dram=64K&page=4K&wbuf={wbuf}&wbidle={idle}"
            + (f"&{extra}" if extra else ""))


def _open(d, create=True, node=0, **kw):
    """A region whose write buffer is empty (formatting a region fills it)."""
    if create:
        r = cxlrt.open(_spec(d, **kw), node=node, create=True, size="4M", nodes=2)
    else:
        r = cxlrt.open(_spec(d, **kw), node=node)
    r.drain()
    return r


def _alloc(r, n):
    """n bytes of the region, page-aligned, with the write buffer empty after (the
    allocator's own header writes land in it too)."""
    off = r.alloc(n, align=PAGE)
    r.drain()
    return off


def _file_bytes(d, off, n):
    with open(f"{d}/r", "rb") as f:
        f.seek(off)
        return f.read(n)


def test_buffered_writes_stay_in_dram_until_drained_and_reads_see_them(region_dir):
    r = _open(region_dir)  # 8 buffer frames
    off = _alloc(r, 8 * PAGE)
    data = os.urandom(8 * PAGE)
    before = r.backend.stats()
    r.dma_write(off, data)
    after = r.backend.stats()
    assert after["buffered"] - before["buffered"] == 8
    assert after["direct_writes"] == before["direct_writes"]
    assert _file_bytes(region_dir, off, 8 * PAGE) != data  # not on the SSD yet
    assert r.dma_read(off, 8 * PAGE) == data
    r.drain()
    assert _file_bytes(region_dir, off, 8 * PAGE) == data
    assert r.backend.stats()["flushes"] == after["flushes"] + 1  # one batch
    assert r.dma_read(off, 8 * PAGE) == data  # still mapped, now clean
    assert r.load(off + 5 * PAGE + 8, 16) == data[5 * PAGE + 8:5 * PAGE + 24]
    r.close()


def test_admit_says_no_when_full_and_a_write_past_it_goes_through(region_dir):
    r = _open(region_dir)
    off = _alloc(r, 16 * PAGE)
    data = os.urandom(16 * PAGE)
    assert r.admit(6 * PAGE)  # 6 pages, one more for a straddle, one piece
    r.dma_write(off, data[:6 * PAGE])
    assert not r.admit(2 * PAGE)  # 2 frames free, 4 needed
    assert r.admit(PAGE // 2)
    s = r.backend.stats()
    assert (s["admits"], s["refusals"]) == (2, 1)
    # Past the room: the rest goes through to the SSD, whole and right.
    r.dma_write(off + 6 * PAGE, data[6 * PAGE:])
    assert r.backend.stats()["direct_writes"] == s["direct_writes"] + 1
    assert _file_bytes(region_dir, off + 8 * PAGE, 8 * PAGE) == data[8 * PAGE:]
    assert r.dma_read(off, 16 * PAGE) == data
    r.drain()
    assert r.admit(6 * PAGE)
    assert _file_bytes(region_dir, off, 16 * PAGE) == data
    assert r.admit(8 * PAGE)  # all 8 frames: it fits only when laid out aligned
    with pytest.raises(ValueError, match="more than the device's whole write buffer"):
        r.admit(8 * PAGE + 1)
    with pytest.raises(ValueError, match="more than the device's whole write buffer"):
        r.admit(0, 2**64 - 1)
    with pytest.raises(ValueError, match="pieces must be at least 1"):
        r.admit(PAGE, 0)
    r.close()


def test_without_a_buffer_admit_is_always_yes(region_dir):
    for spec in (f"file:{region_dir}/f", f"chm:{region_dir}/c?policy=staging&dram=64K&page=4K",
                 f"chm:{region_dir}/l?policy=lru&dram=64K&page=4K"):
        with cxlrt.open(spec, node=0, create=True, size="1M", nodes=2) as r:
            assert r.admit(1 << 30, 5)
            r.drain()


def test_reads_never_flush_and_an_idle_ssd_lets_a_write_flush(region_dir):
    r = _open(region_dir, idle=2_000_000, extra="lat=1000")  # 2 ms idle, 1 us a request
    off = _alloc(r, 16 * PAGE)
    data = os.urandom(8 * PAGE)
    r.dma_write(off + 8 * PAGE, os.urandom(8 * PAGE))  # SSD (outside the buffer's reach)
    r.drain()
    r.dma_write(off, data)  # fills the buffer
    f0 = r.backend.stats()["flushes"]
    time.sleep(0.01)
    for _ in range(20):
        r.dma_read(off + 8 * PAGE, 8 * PAGE)  # SSD reads: reads never flush
    assert r.backend.stats()["flushes"] == f0
    assert not r.admit(PAGE)  # just read: the SSD is not idle
    assert r.backend.stats()["flushes"] == f0
    time.sleep(0.01)
    assert not r.admit(PAGE)  # idle: it starts a batch, whose pages are taken until it ends
    assert r.backend.stats()["flushes"] == f0 + 1
    time.sleep(0.01)
    assert r.admit(PAGE)
    assert _file_bytes(region_dir, off, 8 * PAGE) == data
    r.close()


def test_a_flush_runs_behind_the_reads_and_its_pages_are_not_free_until_it_ends(region_dir):
    # Requests of 0.1 ms; a page written back takes 5 ms, so a batch of 8 takes 40 ms.
    # A flush runs in the background: a read that comes during it waits for the page
    # being written, not for the batch. Only DMA writes and admissions start flushes,
    # so the region's heartbeat (CPU stores) does not.
    r = _open(region_dir, idle=0, extra="lat=100000&wbw=0.0008192")
    off = _alloc(r, 16 * PAGE)
    r.dma_write(off, os.urandom(8 * PAGE))  # buffered
    time.sleep(0.1)
    f0 = r.backend.stats()["flushes"]
    t = time.perf_counter()
    assert not r.admit(PAGE // 2)  # idle: flushes a batch of the 8; they are taken till it ends
    assert time.perf_counter() - t < 0.005  # the flush is not waited for
    assert r.backend.stats()["flushes"] > f0
    t = time.perf_counter()
    r.dma_read(off + 12 * PAGE, PAGE)  # from the SSD, during the flush
    took = time.perf_counter() - t
    assert 0.0001 <= took < 0.015, took
    time.sleep(0.1)
    assert r.admit(PAGE // 2)
    assert _file_bytes(region_dir, off, 8 * PAGE) == r.dma_read(off, 8 * PAGE)
    r.close()


# A holder killed inside the controller, in the write buffer's last frame: (frame entry
# flags, bytes in the frame, bytes on the SSD, what a read must then see).
KILLED_IN_BUFFER = {
    # mid buffered write: the frame named and half filled; the write never returned
    "buffering": (8, b"\xee", b"\x11", b"\x11"),
    # mid flush: the SSD has the bytes, the frame is still dirty, the count not yet down
    "flushing": (1 | 2, b"\x22", b"\x22", b"\x22"),
}


@pytest.mark.parametrize("step", sorted(KILLED_IN_BUFFER))
def test_a_holder_killed_in_the_buffer_is_repaired_and_the_count_recounted(region_dir, step):
    flags, frame_byte, ssd_byte, want = KILLED_IN_BUFFER[step]
    r = _open(region_dir)
    off = _alloc(r, PAGE)
    r.dma_write(off, ssd_byte * PAGE)
    r.drain()
    params = {"page": PAGE, "dram": 64 * 1024, "wbuf": 32 * 1024, "policy": "staging"}
    geo = chmside.geometry(r.size, params)
    f, pg = geo["frames"] - 1, off // PAGE

    def left_in_buffer(m, ftab, pmap):
        old = pmap[pg]
        if old:
            ftab[old - 1] = 0
        ftab[f] = (pg + 1) << 8 | flags
        pmap[pg] = f + 1
        data = geo["data"] + f * PAGE
        memoryview(m)[data:data + PAGE] = frame_byte * PAGE
        struct.pack_into("<Q", m, WB_DIRTY_AT, 0)  # a count that lies

    die_inside(f"{region_dir}/r.chm", geo, left_in_buffer)
    assert r.dma_read(off, PAGE) == want * PAGE
    assert r.backend.stats()["repairs"] == 1
    dirty = 1 if step == "flushing" else 0
    assert r.backend.write_buffer() == (geo["wb_frames"], dirty)  # recounted from the frames
    r.drain()
    assert _file_bytes(region_dir, off, PAGE) == want * PAGE
    r.close()


WB_DIRTY_AT = chmside.HEADER.size + 24  # after ssd_free_ns, hand, wb_hand (chm.pxd)


def _kv_block(key: bytes, bb: int) -> bytes:
    return (key * (bb // len(key) + 1))[:bb]


def test_nothing_admitted_is_lost_when_its_writer_dies_or_the_device_power_cycles(region_dir):
    bb, spec = 8192, _spec(region_dir, wbuf="128K", extra="").replace("dram=64K", "dram=256K")
    cxlrt.format(spec, size="4M", nodes=2)
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # admit what the buffer takes, say which, and die without closing
        try:
            os.close(rd)
            r = cxlrt.open(spec, node=1)
            r.drain()
            c = KVCache(r, "kv", block_bytes=bb, capacity_blocks=32)
            admitted = []
            for i in range(32):
                key = b"k%015d" % i
                if c.admit([key], [_kv_block(key, bb)]):
                    admitted.append(key)
            os.write(wr, b",".join(admitted) + b"." + str(c.region.backend.stats()["refusals"])
                     .encode())
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(3)
    os.close(wr)
    with os.fdopen(rd, "rb") as f:
        got = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), (status, got)
    keys, refusals = got.rsplit(b".", 1)
    admitted = keys.split(b",")
    assert 2 <= len(admitted) < 32 and int(refusals) == 32 - len(admitted), got
    for power_cycle in (False, True):
        with cxlrt.open(spec, node=0) as r:
            if power_cycle:
                r.backend.writeback(drop=True)  # a device that persists, restarted: DRAM empty
                assert r.backend.resident() == (0, 0)
            c = KVCache(r, "kv", create=False)
            with c.lookup(admitted) as hit:
                assert len(hit) == len(admitted)
                out = c.load(hit)
            assert [out[i].tobytes() for i in range(len(admitted))] == \
                [_kv_block(k, bb) for k in admitted]
        # The killed writer's node is recovered like any dead node's: one repair at most.
        if check(spec)["problems"]:
            repair(spec, 1)  # node 1 was the writer's
        assert check(spec)["problems"] == []


def test_the_concurrent_writes_script_reads_back_what_it_stored(tmp_path):
    # perf/chm_writes.py checks every request's bytes while another process writes, on
    # all three devices; a short run keeps that path working (the figures are perf/'s).
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "perf", "chm_writes.py")
    out = tmp_path / "w.json"
    res = subprocess.run([sys.executable, script, "--pool", "8", "--per", "3", "--requests",
                          "2", "--writes", "6", "--dram", "4", "--wbuf", "2", "--png", "",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["device"] for r in rows] == ["lru", "staging", "isolated"]
    assert all(r["alone"] > 0 and r["with_writes"] > 0 and r["offered"] >= r["stored"]
               for r in rows)
    for bad, msg in ((["--wbuf", "16"], "--wbuf must be smaller than --dram"),
                     (["--wbuf", "1"], "--wbuf must be larger than --block"),
                     (["--per", "9", "--pool", "8"], "--per cannot exceed --pool")):
        r = subprocess.run([sys.executable, script, *bad], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_a_one_page_buffer_admits_a_page_at_a_time(region_dir):
    r = _open(region_dir, wbuf="4K")
    assert r.admit(0) and r.admit(PAGE) and r.admit(PAGE // 2)
    with pytest.raises(ValueError, match="more than the device's whole write buffer"):
        r.admit(PAGE + 1)
    off = _alloc(r, PAGE)
    r.dma_write(off, b"\x33" * PAGE)
    assert r.backend.write_buffer() == (1, 1)
    assert not r.admit(PAGE)
    r.drain()
    assert r.admit(PAGE)
    r.close()


def test_cpu_accesses_move_a_page_out_of_the_buffer(region_dir):
    # Metadata is the cache's: a CPU load or store of a buffered page moves it to a
    # cache frame, dirty if it was, so the buffer holds only DMA data.
    r = _open(region_dir)
    off = _alloc(r, 2 * PAGE)
    data = os.urandom(2 * PAGE)
    r.dma_write(off, data)
    assert r.backend.write_buffer() == (8, 2)
    assert r.load(off + 8, 8) == data[8:16]  # a CPU load: the page moves, still dirty
    assert r.backend.write_buffer() == (8, 1)
    r.store64(off + PAGE, 77)  # a CPU store: so does this one
    assert r.backend.write_buffer() == (8, 0)
    assert r.backend.resident()[1] >= 2  # both dirty in cache frames now
    want = data[:PAGE] + (77).to_bytes(8, "little") + data[PAGE + 8:]
    assert r.dma_read(off, 2 * PAGE) == want
    r.backend.writeback(drop=True)
    assert _file_bytes(region_dir, off, 2 * PAGE) == want
    r.close()


def test_a_holder_killed_moving_a_page_out_of_the_buffer_loses_nothing(region_dir):
    # Killed inside _migrate: the cache frame named and half copied (FILL), the page
    # map already naming it, the buffer frame still holding the only dirty copy.
    r = _open(region_dir)
    off = _alloc(r, PAGE)
    r.dma_write(off, b"\x11" * PAGE)
    r.drain()
    params = {"page": PAGE, "dram": 64 * 1024, "wbuf": 32 * 1024, "policy": "staging"}
    geo = chmside.geometry(r.size, params)
    f, g, pg = geo["frames"] - 1, 2, off // PAGE

    def moving(m, ftab, pmap):
        old = pmap[pg]
        if old:
            ftab[old - 1] = 0
        ftab[f] = (pg + 1) << 8 | 1 | 2  # valid, dirty: the newest bytes
        memoryview(m)[geo["data"] + f * PAGE:geo["data"] + (f + 1) * PAGE] = b"\x22" * PAGE
        ftab[g] = (pg + 1) << 8 | 8  # half copied
        memoryview(m)[geo["data"] + g * PAGE:geo["data"] + (g + 1) * PAGE] = b"\xee" * PAGE
        pmap[pg] = g + 1

    die_inside(f"{region_dir}/r.chm", geo, moving)
    assert r.dma_read(off, PAGE) == b"\x22" * PAGE
    r.backend.writeback(drop=True)
    assert _file_bytes(region_dir, off, PAGE) == b"\x22" * PAGE
    r.close()
