"""Loading KV blocks straight into CUDA tensors.

On a mappable backend the region is registered with CUDA once (page-locked
in place, cudaHostRegister), so each block is an asynchronous host-to-device copy
from the payload itself; elsewhere blocks go through one pinned staging buffer.
Either way the call waits for its copies: the hit must stay pinned until the
device has read the payloads.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from cxlrt.caps import Caps

_registered: dict[int, Any] = {}  # id(region) -> the view kept alive while registered


def _register(region: Any) -> None:
    import torch
    if id(region) in _registered:
        return
    view = region.view(0, region.size)
    ptr = np.frombuffer(view, dtype=np.uint8).ctypes.data
    rc = torch.cuda.cudart().cudaHostRegister(ptr, region.size, 0)
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of {region.spec} failed ({rc})")
    _registered[id(region)] = view


def load_cuda(cache: Any, hit: Any, out: Any, start: int) -> None:
    import torch
    n = len(hit) - start
    bb = cache.block_bytes
    if not out.is_contiguous():
        raise ValueError("out: the CUDA tensor must be contiguous")
    dst = out.view(torch.uint8).reshape(-1)
    if dst.numel() < n * bb:
        raise ValueError(f"out: {dst.numel()} bytes, {n} blocks need {n * bb}")
    stream = torch.cuda.current_stream(out.device)
    if Caps.MAPPABLE in cache.region.caps:
        _register(cache.region)
        for i, v in enumerate(cache.views(hit)[start:]):
            with warnings.catch_warnings():  # read-only source: torch warns, we only read
                warnings.simplefilter("ignore", UserWarning)
                src = torch.from_numpy(np.frombuffer(v, dtype=np.uint8))
            dst[i * bb:(i + 1) * bb].copy_(src, non_blocking=True)
    else:
        staging = torch.empty(n * bb, dtype=torch.uint8, pin_memory=True)
        cache.load(hit, staging, start=start)
        dst[:n * bb].copy_(staging, non_blocking=True)
    stream.synchronize()
