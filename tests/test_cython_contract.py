"""The C contract is usable from outside: an external .pyx subclasses Backend."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

import cxlrt
from cxlrt.status import CODES

SRC = '''
# cython: language_level=3
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free
from cxlrt.backend cimport (Backend, cxl_ops, cxl_region, cxl_load64, cxl_store64, cxl_persist,
                            CXL_CAP_COHERENT, CXL_CAP_MAPPABLE, CXL_F_DIRECT, CXL_F_NOFLUSH,
                            CXL_OPS_ABI)

cdef int _nop(void* ctx, uint64_t off, uint64_t n) noexcept nogil:
    return 0

cdef int _fence(void* ctx) noexcept nogil:
    return 0

cdef cxl_ops OPS
OPS.abi = CXL_OPS_ABI
OPS.flush = _nop
OPS.flush_nodrain = _nop
OPS.fence = _fence

cdef cxl_ops OLD_OPS  # as a backend built against another layout fills it: no abi word
OLD_OPS.flush = _nop
OLD_OPS.flush_nodrain = _nop
OLD_OPS.fence = _fence

cdef class HeapBackend(Backend):
    cdef char* mem
    def __init__(self, uint64_t size, bint old=False):
        self.mem = <char*>calloc(1, size)
        self.reg.base = self.mem
        self.reg.size = size
        self.reg.caps = CXL_CAP_COHERENT | CXL_CAP_MAPPABLE
        self.reg.flags = CXL_F_DIRECT | CXL_F_NOFLUSH
        self.reg.ops = &OLD_OPS if old else &OPS
    def __dealloc__(self):
        free(self.mem)

def roundtrip(HeapBackend b, uint64_t off, uint64_t v):
    cdef uint64_t out = 0
    cdef int rc
    cdef cxl_region* r = b.region()  # raises once the backend is closed
    with nogil:
        rc = cxl_store64(r, off, v)
        if rc == 0:
            rc = cxl_persist(r, off, 8)
        if rc == 0:
            rc = cxl_load64(r, off, &out)
    return rc, out
'''


@pytest.mark.slow
def test_external_backend_compiles_and_runs(tmp_path):
    from Cython.Build import cythonize  # in the `test` extra: a missing one is a failure
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    root = pathlib.Path(cxlrt.__file__).resolve().parent
    pyx = tmp_path / "extbackend.pyx"
    pyx.write_text(SRC)
    ext = cythonize([Extension("extbackend", [str(pyx)], include_dirs=[str(root / "includes")])],
                    include_path=[str(root.parent)], quiet=True)
    dist = Distribution({"ext_modules": ext})
    cmd = build_ext(dist)
    cmd.build_lib = str(tmp_path)
    cmd.build_temp = str(tmp_path / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    (so,) = list(tmp_path.glob("extbackend*.so"))
    spec = importlib.util.spec_from_file_location("extbackend", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    b = mod.HeapBackend(4096)
    assert mod.roundtrip(b, 64, 1234) == (0, 1234)
    assert mod.roundtrip(b, 4096, 1)[0] == CODES["CXLRT_E_RANGE"]  # no crash
    with pytest.raises(cxlrt.RegionError, match="another layout.*rebuild it"):
        mod.roundtrip(mod.HeapBackend(4096, old=True), 64, 1)
    b.close()
    with pytest.raises(cxlrt.RegionClosedError):
        mod.roundtrip(b, 64, 1)
