"""Turn the buffers users hand the KV cache into flat byte views.

numpy arrays, bytes-likes and CPU torch tensors all become C-contiguous ``B``
memoryviews sharing their memory, so the Cython copy loops see one type.
"""

from __future__ import annotations

from typing import Any


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "is_cuda")


def cuda_target(obj: Any) -> bool:
    return _is_torch(obj) and bool(obj.is_cuda)


def cuda_buffers(objs: Any) -> bool:
    """A CUDA tensor, or a non-empty sequence of them (mixing in host buffers is refused):
    the target or source of the CUDA path (cxlrt._cuda)."""
    if isinstance(objs, (list, tuple)):
        on = [cuda_target(o) for o in objs]
        if any(on) and not all(on):
            raise TypeError("blocks: CUDA tensors and host buffers cannot be mixed in one store")
        return bool(on) and on[0]
    return cuda_target(objs)


def _bytes_of(obj: Any, writable: bool, what: str) -> memoryview:
    if _is_torch(obj):
        import torch
        if obj.is_cuda:
            raise TypeError(f"{what}: a CUDA tensor here must be the whole target (one tensor, "
                            "or a sequence of CUDA tensors only)")
        if not obj.is_contiguous():
            raise ValueError(f"{what}: the tensor must be contiguous")
        obj = obj.detach().reshape(-1).view(torch.uint8).numpy()
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{what}: expected a buffer (numpy array, torch tensor, bytes-like), "
                        f"got {type(obj).__name__}") from None
    if writable and mv.readonly:
        raise TypeError(f"{what}: the buffer is read-only")
    if not mv.c_contiguous:
        raise ValueError(f"{what}: the buffer must be C-contiguous")
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def _split(objs: Any, n: int, bb: int, writable: bool, what: str) -> list[memoryview]:
    if isinstance(objs, (list, tuple)):
        if len(objs) != n:
            raise ValueError(f"{what}: expected {n} buffers, got {len(objs)}")
        out = []
        for i, o in enumerate(objs):
            mv = _bytes_of(o, writable, f"{what}[{i}]")
            if mv.nbytes < bb:
                raise ValueError(f"{what}[{i}]: {mv.nbytes} bytes, a block is {bb}")
            out.append(mv[:bb])
        return out
    mv = _bytes_of(objs, writable, what)
    if mv.nbytes < n * bb:
        raise ValueError(f"{what}: {mv.nbytes} bytes, {n} blocks need {n * bb}")
    return [mv[i * bb:(i + 1) * bb] for i in range(n)]


def destinations(out: Any, n: int, bb: int) -> list[memoryview]:
    """n writable block-sized views into `out` (one buffer, or a sequence of n)."""
    return _split(out, n, bb, True, "out")


def sources(blocks: Any, n: int, bb: int) -> list[memoryview]:
    """n block-sized views of `blocks` (one buffer, or a sequence of n)."""
    return _split(blocks, n, bb, False, "blocks")
