"""KV blocks straight between a region and CUDA tensors.

A mappable region is page-locked for CUDA in place (cudaHostRegister), once, by
``Region.register_cuda()``; a load is then one asynchronous host-to-device copy per
block from the payload itself. Other backends (and stores, whose bytes must go
through the writer's protocol) use a pinned bounce buffer made once per cache and
reused: two halves, so the copy of one chunk overlaps the CPU side of the next.
Every path waits for its copies before it returns, then checks each payload's
header again: a block whose payload was reused while the device read it raises,
as on the CPU path, instead of leaving another writer's bytes in the tensor.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

import numpy as np

from cxlrt.caps import Caps
from cxlrt.errors import ClaimLost, CxlrtError, UnsupportedError

PIECE = 128 << 30          # cudaHostRegister takes at most this much in one call on some drivers
BOUNCE = 8 << 20           # bytes per half of a cache's bounce buffer (at least one block)
_after_enqueue = None      # test hook: called between enqueueing a load's copies and its check


class CudaRegistrationError(CxlrtError, RuntimeError):
    """cudaHostRegister failed: the region is not page-locked for CUDA, and no copy
    silently falls back to pageable memory."""


class Registration:
    """A region's mapping page-locked for CUDA, piece by piece; close() unregisters.
    Held by the region's dependents, so Region.close() ends it before the unmap."""

    def __init__(self, region: Any, cudart: Any) -> None:
        self.spec, self.size, self._cudart = region.spec, region.size, cudart
        view = region.view(0, region.size)
        arr = np.frombuffer(view, dtype=np.uint8)
        self.base = arr.ctypes.data
        del arr
        view.release()  # hold no view: Region.close() must stay possible
        self._done: list[int] = []
        for at in range(0, self.size, PIECE):
            n = min(PIECE, self.size - at)
            rc = int(cudart.cudaHostRegister(self.base + at, n, 0))
            if rc != 0:
                self.close()
                raise CudaRegistrationError(
                    f"{self.spec}: cudaHostRegister of bytes [{at}, {at + n}) failed "
                    f"(cudaError {rc}); nothing stays registered. Is the memory lockable "
                    "(RLIMIT_MEMLOCK, a DAX device whose driver allows it)?")
            self._done.append(at)

    def close(self) -> None:
        done, self._done = self._done, []
        for at in done:
            self._cudart.cudaHostUnregister(self.base + at)

    @property
    def closed(self) -> bool:
        return not self._done


_regs: dict[int, Any] = {}   # id(backend) -> the _Unregister of its registration
_reg_lock = threading.Lock()


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError:
        raise UnsupportedError("register_cuda: torch is not installed") from None
    if not torch.cuda.is_available():
        raise UnsupportedError("register_cuda: no CUDA device is visible to this process "
                               f"(torch {torch.__version__})")
    return torch


def register(region: Any) -> Any:
    """Page-lock `region` for CUDA (idempotent per backend); see Region.register_cuda.
    Returns the dependent the region must close before its unmap, or None when the
    backend was registered already."""
    if Caps.MAPPABLE not in region.caps:
        raise UnsupportedError(f"register_cuda: {region.backend.scheme}: memory is not "
                               "mappable; CUDA copies go through a pinned bounce buffer")
    torch = _torch_cuda()
    key = id(region.backend)
    with _reg_lock:
        held = _regs.get(key)
        if held is not None and not held.reg.closed:
            return None
        reg = Registration(region, torch.cuda.cudart())
        holder = _regs[key] = _Unregister(reg, key)  # the strong reference
    weakref.finalize(region.backend, holder.close)  # or when the backend goes unclosed
    return holder


class _Unregister:
    """The region dependent that ends a registration when the region closes."""

    def __init__(self, reg: Registration, key: int) -> None:
        self.reg, self.key = reg, key

    def close(self) -> None:
        with _reg_lock:
            if _regs.get(self.key) is self:
                del _regs[self.key]
        self.reg.close()


def registered(region: Any) -> bool:
    held = _regs.get(id(region.backend))
    return held is not None and not held.reg.closed


def tensor(region: Any, off: int, shape: Any, dtype: Any) -> Any:
    """A CPU torch tensor over region bytes [off, off + nbytes) (see Region.tensor)."""
    import torch
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(shape)
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"tensor: shape must be non-negative ints, got {shape!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"tensor: dtype must be a torch.dtype, got {dtype!r}")
    item = torch.empty((), dtype=dtype).element_size()
    if off % item:
        raise ValueError(f"tensor: offset {off} is not aligned to {dtype} ({item} bytes)")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    view = region.view(off, count * item)  # range and mappability checked there
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # torch warns on any memoryview it does not own
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=dtype, count=count).view(shape)


# --- the bounce buffer --------------------------------------------------------------------


class _Bounce:
    """Two pinned halves of `half` bytes each, and an event per half that says when the
    device has finished with it."""

    def __init__(self, torch: Any, half: int) -> None:
        self.half = half
        self.buf = torch.empty(2 * half, dtype=torch.uint8, pin_memory=True)
        self.events = [None, None]
        self.lock = threading.Lock()

    def take(self, k: int) -> Any:
        """Half k, once the device no longer reads or writes it."""
        ev = self.events[k]
        if ev is not None:
            ev.synchronize()
            self.events[k] = None
        return self.buf[k * self.half:(k + 1) * self.half]

    def mark(self, k: int, stream: Any) -> None:
        import torch
        ev = torch.cuda.Event()
        ev.record(stream)
        self.events[k] = ev


_bounces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # KVCache -> _Bounce
_bounce_lock = threading.Lock()


def _bounce(cache: Any, torch: Any) -> _Bounce:
    bb = cache.block_bytes
    per = max(1, BOUNCE // bb)
    with _bounce_lock:
        b = _bounces.get(cache)
        if b is None:
            b = _bounces[cache] = _Bounce(torch, per * bb)
    return b


def _flat(t: Any, what: str, need: int) -> Any:
    import torch
    if not t.is_contiguous():
        raise ValueError(f"{what}: the CUDA tensor must be contiguous")
    flat = t.view(torch.uint8).reshape(-1) if t.dim() else t.reshape(1).view(torch.uint8)
    if flat.numel() < need:
        raise ValueError(f"{what}: {flat.numel()} bytes, {need} needed")
    return flat


def _targets(objs: Any, n: int, bb: int, what: str) -> list[Any]:
    """n block-sized uint8 CUDA slices of `objs` (one tensor, or a sequence of n)."""
    if isinstance(objs, (list, tuple)):
        if len(objs) != n:
            raise ValueError(f"{what}: expected {n} tensors, got {len(objs)}")
        return [_flat(o, f"{what}[{i}]", bb)[:bb] for i, o in enumerate(objs)]
    flat = _flat(objs, what, n * bb)
    return [flat[i * bb:(i + 1) * bb] for i in range(n)]


# --- load ---------------------------------------------------------------------------------


def load_cuda(cache: Any, hit: Any, out: Any, start: int, stop: int) -> None:
    import torch
    n, bb = stop - start, cache.block_bytes
    dst = _targets(out, n, bb, "out")
    stream = torch.cuda.current_stream(dst[0].device)
    region = cache.region
    if Caps.MAPPABLE in region.caps:
        region.register_cuda()  # once; a failure raises, never a pageable fallback
        views = cache.views(hit, start=start, stop=stop)  # each header checked (and flushed)
        with warnings.catch_warnings():  # read-only source: torch warns, we only read
            warnings.simplefilter("ignore", UserWarning)
            for d, v in zip(dst, views, strict=True):
                d.copy_(torch.frombuffer(v, dtype=torch.uint8), non_blocking=True)
        if _after_enqueue is not None:
            _after_enqueue(cache, hit)
        stream.synchronize()
        del views
        cache._recheck(hit, start, stop)  # still the stored payloads after the device read
        cache._count_loaded(n * bb)
        return
    b = _bounce(cache, torch)
    per = b.half // bb
    with b.lock:
        for k, i in enumerate(range(start, stop, per)):
            j = min(stop, i + per)
            half = b.take(k % 2)
            cache.load(hit, half[:(j - i) * bb], start=i, stop=j)  # checked before and after
            for m in range(i, j):
                dst[m - start].copy_(half[(m - i) * bb:(m - i + 1) * bb], non_blocking=True)
            b.mark(k % 2, stream)
        stream.synchronize()  # the halves were checked after their CPU copies already
        b.events = [None, None]


# --- store --------------------------------------------------------------------------------


def store_cuda(cache: Any, keys: list, blocks: Any) -> list:
    """Store CUDA tensors: each chunk comes to a pinned half by an asynchronous copy,
    then goes through the ordinary store (its claim, copy and publish), while the
    next chunk is on its way."""
    import torch
    n, bb = len(keys), cache.block_bytes
    src = _targets(blocks, n, bb, "blocks")
    if n == 0:
        return []
    stream = torch.cuda.current_stream(src[0].device)
    b = _bounce(cache, torch)
    per = b.half // bb
    stored: list = []
    chunks = list(range(0, n, per))
    with b.lock:
        def fetch(k: int) -> None:
            i = chunks[k]
            half = b.take(k % 2)
            for m in range(i, min(n, i + per)):
                half[(m - i) * bb:(m - i + 1) * bb].copy_(src[m], non_blocking=True)
            b.mark(k % 2, stream)

        fetch(0)
        try:
            for k, i in enumerate(chunks):
                if k + 1 < len(chunks):
                    fetch(k + 1)
                b.events[k % 2].synchronize()
                b.events[k % 2] = None
                j = min(n, i + per)
                half = b.buf[(k % 2) * b.half:(k % 2) * b.half + (j - i) * bb]
                try:
                    stored += cache.store(keys[i:j], half.numpy())
                except ClaimLost as e:
                    raise ClaimLost(f"{e} (CUDA store: {len(stored)} blocks of earlier "
                                    "chunks were stored too; later chunks were not tried)",
                                    stored + list(e.stored), list(e.lost)) from None
        finally:
            stream.synchronize()
            b.events = [None, None]
    return stored
