"""Region tensors, CUDA host registration, and KV loads and stores with CUDA tensors.

The registration bookkeeping and Region.tensor run everywhere; the copies need a
GPU and skip, saying so, where none is visible (perf/gpu_check.py is the one
script to run on a GPU machine: the same checks plus bandwidth).
"""

from __future__ import annotations

import numpy as np
import pytest

import cxlrt
from cxlrt import _cuda
from cxlrt.caps import Caps
from cxlrt.errors import CxlrtError, OutOfRangeError, RegionError, UnsupportedError
from tests.algorithms.test_kvcache import BB, block_for, chain, open_cache

torch = pytest.importorskip("torch")
GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="no CUDA device here: the CUDA copy paths "
                               "run where a GPU is visible (and in perf/gpu_check.py)")


def _mappable(r) -> bool:
    return Caps.MAPPABLE in r.caps


def test_tensor_is_a_window_on_the_medium(backend):
    r = backend.create(nodes=1)
    off = r.alloc(4096)
    if not _mappable(r):
        with pytest.raises(UnsupportedError):
            r.tensor(off, (4,), torch.float32)
        r.close()
        return
    t = r.tensor(off, (4, 8), torch.float32)
    assert t.shape == (4, 8) and t.dtype == torch.float32 and not t.is_cuda
    t[:] = torch.arange(32, dtype=torch.float32).view(4, 8)
    got = np.frombuffer(r.dma_read(off, 128), dtype=np.float32)
    assert got.tolist() == list(range(32))
    with pytest.raises(RegionError, match="still alive"):
        r.close()  # the tensor is a view of the mapping
    del t
    with pytest.raises(ValueError, match="aligned"):
        r.tensor(off + 2, (2,), torch.float32)
    with pytest.raises(OutOfRangeError):
        r.tensor(r.size - 8, (4,), torch.float32)
    with pytest.raises(TypeError, match="torch.dtype"):
        r.tensor(off, (2,), np.float32)
    with pytest.raises(ValueError, match="shape"):
        r.tensor(off, (2, -1), torch.float32)
    assert r.tensor(off, (0, 3), torch.int64).shape == (0, 3)
    r.close()


@pytest.mark.skipif(GPU, reason="checks the error of a machine without a GPU")
def test_register_cuda_without_a_gpu_is_a_clear_error(backend):
    r = backend.create(nodes=1)
    with pytest.raises(UnsupportedError, match="not mappable" if not _mappable(r) else "CUDA"):
        r.register_cuda()
    assert not r.cuda_registered
    r.close()


class _Cudart:
    """cudaHostRegister that refuses its `fail`-th piece and records what is held."""

    def __init__(self, fail: int) -> None:
        self.fail, self.calls, self.held = fail, 0, set()

    def cudaHostRegister(self, addr, n, flags):  # noqa: N802 (the CUDA name)
        self.calls += 1
        if self.calls == self.fail:
            return 700
        assert addr not in self.held and n <= _cuda.PIECE
        self.held.add(addr)
        return 0

    def cudaHostUnregister(self, addr):  # noqa: N802
        self.held.remove(addr)
        return 0


def test_registration_goes_in_pieces_and_fails_closed(region_dir, monkeypatch):
    monkeypatch.setattr(_cuda, "PIECE", 1 << 20)  # so a 4 MiB region takes 4 pieces
    r = cxlrt.open(f"file:{region_dir}/r", node=0, create=True, size="4M", nodes=1)
    ok = _Cudart(fail=0)
    reg = _cuda.Registration(r, ok)
    assert ok.calls == 4 and len(ok.held) == 4
    reg.close()
    assert not ok.held and reg.closed
    bad = _Cudart(fail=3)
    with pytest.raises(_cuda.CudaRegistrationError, match=r"\[2097152, 3145728\)"):
        _cuda.Registration(r, bad)
    assert not bad.held  # the two pieces that took were given back: nothing half-registered
    r.close()


# --- the copies (a GPU) -------------------------------------------------------------------


def _stored(backend, n=6, **kw):
    r = backend.create(nodes=1)
    c = open_cache(r, **kw)
    keys = c.block_hashes(chain(0, n))
    want = [block_for(k) for k in keys]
    assert c.store(keys, want) == keys
    return r, c, keys, want


@needs_gpu
@pytest.mark.parametrize("bounce_blocks", [1, 4])
def test_load_into_cuda_tensors(backend, monkeypatch, bounce_blocks):
    monkeypatch.setattr(_cuda, "BOUNCE", bounce_blocks * BB)  # several chunks per call
    r, c, keys, want = _stored(backend)
    with c.lookup(keys) as hit:
        dst = torch.full((6 * BB,), 7, dtype=torch.uint8, device="cuda")
        c.load(hit, dst)
        assert dst.cpu().numpy().tobytes() == b"".join(want)
        parts = [torch.empty(BB // 2, dtype=torch.float16, device="cuda") for _ in range(3)]
        c.load(hit, parts, start=2, stop=5)
        assert b"".join(p.cpu().view(torch.uint8).numpy().tobytes() for p in parts) \
            == b"".join(want[2:5])
    assert r.cuda_registered == _mappable(r)
    r.close()
    assert not r.cuda_registered  # close() unregistered before the unmap


@needs_gpu
def test_a_registered_region_reopens_and_registers_again(backend):
    r, c, keys, want = _stored(backend, n=2)
    if not _mappable(r):
        r.close()
        pytest.skip("registration is for mappable backends")
    r.register_cuda()
    r.register_cuda()  # idempotent
    t = r.tensor(0, (64,), torch.uint8)
    assert t.is_pinned()  # page-locked in place: torch sees registered memory as pinned
    del t
    r.close()
    r2 = backend.open(0)
    r2.register_cuda()  # refused with cudaErrorHostMemoryAlreadyRegistered had close leaked it
    assert r2.cuda_registered
    r2.close()


@needs_gpu
@pytest.mark.parametrize("bounce_blocks", [1, 3])
def test_store_from_cuda_tensors(backend, monkeypatch, bounce_blocks):
    monkeypatch.setattr(_cuda, "BOUNCE", bounce_blocks * BB)
    r = backend.create(nodes=1)
    c = open_cache(r)
    keys = c.block_hashes(chain(0, 7))
    want = [block_for(k) for k in keys]
    src = torch.from_numpy(np.frombuffer(b"".join(want), dtype=np.uint8).copy()).cuda()
    assert c.store(keys[:5], src[:5 * BB]) == keys[:5]
    assert c.store(keys, [src[i * BB:(i + 1) * BB] for i in range(7)]) == keys[5:]
    with c.lookup(keys) as hit:
        assert c.load(hit).tobytes() == b"".join(want)
    with pytest.raises(TypeError, match="mixed"):
        c.store(keys, [src[:BB], bytes(BB)])
    r.close()


def _wreck_header(r, c, key) -> None:
    """Overwrite a payload's header as a writer that reused its memory would."""
    e = next(e for e in c.entries() if e["key"] == key)
    r.dma_write(e["offset"], bytes(32))


@needs_gpu
def test_a_payload_reused_before_the_copy_raises(backend):
    r, c, keys, want = _stored(backend, n=4)
    with c.lookup(keys) as hit:
        _wreck_header(r, c, keys[2])
        dst = torch.empty(4 * BB, dtype=torch.uint8, device="cuda")
        with pytest.raises(CxlrtError, match=r"(views|load): slot \d+ .*cannot be right"):
            c.load(hit, dst)
    r.close()


@needs_gpu
def test_a_payload_reused_while_the_device_reads_raises(backend, monkeypatch):
    """The registered path's post-copy check: the header is wrecked after the copies
    were enqueued, before the call waits for them."""
    r, c, keys, want = _stored(backend, n=4)
    if not _mappable(r):
        r.close()
        pytest.skip("the bounce path checks each chunk after its CPU copy (as load() does)")
    monkeypatch.setattr(_cuda, "_after_enqueue", lambda cache, hit: _wreck_header(r, c, keys[1]))
    with c.lookup(keys) as hit:
        dst = torch.empty(4 * BB, dtype=torch.uint8, device="cuda")
        # "load:", not "views:": the check after the copies caught it, not the one before
        with pytest.raises(CxlrtError, match=r"load: slot \d+ .*cannot be right"):
            c.load(hit, dst)
    monkeypatch.setattr(_cuda, "_after_enqueue", None)
    r.close()
