"""Loading KV blocks straight into CUDA tensors.

On a mappable backend the region is registered with CUDA once (page-locked
in place, cudaHostRegister), so each block is an asynchronous host-to-device copy
from the payload itself; elsewhere blocks go through a pinned staging buffer made for the call.
Either way the call waits for its copies: the hit must stay pinned until the
device has read the payloads.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

import numpy as np

from cxlrt.caps import Caps

_registered: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # backend -> base address
_lock = threading.Lock()
_PIECE = 128 << 30  # cudaHostRegister takes at most this much in one call on some drivers


def _register(region: Any) -> None:
    """Page-lock the region's mapping for CUDA once per backend (kept until it is freed)."""
    import torch
    backend = region.backend
    with _lock:
        if backend in _registered:
            return
        view = region.view(0, region.size)
        arr = np.frombuffer(view, dtype=np.uint8)
        base = arr.ctypes.data
        del arr
        view.release()  # hold no view: Region.close() must stay possible
        cudart = torch.cuda.cudart()
        for at in range(0, region.size, _PIECE):
            rc = cudart.cudaHostRegister(base + at, min(_PIECE, region.size - at), 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of {region.spec} failed ({rc})")
        _registered[backend] = base
        weakref.finalize(backend, _unregister, base, region.size)


def _unregister(base: int, size: int) -> None:
    import torch
    for at in range(0, size, _PIECE):
        torch.cuda.cudart().cudaHostUnregister(base + at)


def load_cuda(cache: Any, hit: Any, out: Any, start: int, stop: int) -> None:
    import torch
    n = stop - start
    bb = cache.block_bytes
    if not out.is_contiguous():
        raise ValueError("out: the CUDA tensor must be contiguous")
    dst = out.view(torch.uint8).reshape(-1)
    if dst.numel() < n * bb:
        raise ValueError(f"out: {dst.numel()} bytes, {n} blocks need {n * bb}")
    stream = torch.cuda.current_stream(out.device)
    if Caps.MAPPABLE in cache.region.caps:
        _register(cache.region)
        for i, v in enumerate(cache.views(hit)[start:stop]):
            with warnings.catch_warnings():  # read-only source: torch warns, we only read
                warnings.simplefilter("ignore", UserWarning)
                src = torch.from_numpy(np.frombuffer(v, dtype=np.uint8))
            dst[i * bb:(i + 1) * bb].copy_(src, non_blocking=True)
        cache._count_loaded(n * bb)
    else:
        staging = torch.empty(n * bb, dtype=torch.uint8, pin_memory=True)
        cache.load(hit, staging, start=start, stop=stop)
        dst[:n * bb].copy_(staging, non_blocking=True)
    stream.synchronize()
