"""Build cxlrt's Cython extensions.

Environment knobs (pip cannot pass build_ext flags through PEP 517 easily):
  CXLRT_DEBUG=1     a debug build (cxlrt/includes/debug.h): -O1 -g, CXL_ASSERT checks the
                    invariants the hot paths rely on (abort with file:line and the
                    condition), and the test hooks exist (negative controls such as
                    cxlrt.channel._test_skip_observe; a release build compiles their
                    branches out, and the tests that need them skip there). .ci/run runs
                    tests/algorithms on such a build too.
  CXLRT_DEBUG=2     level 1 plus expensive walks (CXL_ASSERT2: the whole chunk table after
                    each change under the allocator lock), mimalloc's MI_DEBUG levels
  CXLRT_TRACE=1     Cython line tracing (coverage, profilers: linetrace, CYTHON_TRACE_NOGIL)
                    at -O0; independent of CXLRT_DEBUG, and far slower
  CXLRT_ANNOTATE=1  write Cython's HTML annotation next to each .pyx
  CXLRT_ONLY=a,b    build only these extensions (developer convenience)
A change of knob needs a full rebuild: `python setup.py build_ext --inplace --force`.
"""

import importlib.util
import os
import sys

from setuptools import Extension, setup

MIN_CYTHON = (3, 1)

try:
    import Cython
    from Cython.Build import cythonize
except ImportError:
    sys.exit("cxlrt needs Cython >= 3.1 to build: pip install 'Cython>=3.1,<4'")

if tuple(int(x) for x in Cython.__version__.split(".")[:2]) < MIN_CYTHON:
    sys.exit(f"cxlrt needs Cython >= 3.1, found {Cython.__version__}")

DEBUG = int(os.environ.get("CXLRT_DEBUG", "0") or 0)
TRACE = os.environ.get("CXLRT_TRACE") == "1"
ANNOTATE = os.environ.get("CXLRT_ANNOTATE") == "1"

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": False,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
    "embedsignature": True,
    "profile": False,
    "linetrace": TRACE,
}

MACROS = [("CXLRT_DEBUG", str(DEBUG))]
if TRACE:
    MACROS += [("CYTHON_TRACE_NOGIL", "1")]
# Debug is -O1 -g and no line tracing: the asserts are what it is for. Tracing
# (CYTHON_TRACE_NOGIL) makes nogil code take the GIL on every line, which deadlocks where
# a thread holds a C mutex and waits for the GIL while the GIL holder waits for that
# mutex (tests/algorithms/test_lock.py hung so, in the emulation's line lock).
CFLAGS = ["-O0", "-g"] if TRACE else ["-O1", "-g"] if DEBUG else ["-O3"]
INCLUDE = ["cxlrt/includes"]

# (extension name, source): backends/ and emulation/ install as cxlrt.backends
# and cxlrt.emulation, so the tree shows the layers and imports stay in one namespace.
MODULES = [
    ("cxlrt.status", "cxlrt/status.pyx"),
    ("cxlrt.mapping", "cxlrt/mapping.pyx"),
    ("cxlrt.crash", "cxlrt/crash.pyx"),
    ("cxlrt.shm", "cxlrt/shm.pyx"),
    ("cxlrt.backend", "cxlrt/backend.pyx"),
    ("cxlrt.superblock", "cxlrt/superblock.pyx"),
    ("cxlrt.layoutinfo", "cxlrt/layoutinfo.pyx"),
    ("cxlrt.region", "cxlrt/region.pyx"),
    ("cxlrt.nodelocal", "cxlrt/nodelocal.pyx"),
    ("cxlrt.liveness", "cxlrt/liveness.pyx"),
    ("cxlrt.lockmgr", "cxlrt/lockmgr.pyx"),
    ("cxlrt.lock", "cxlrt/lock.pyx"),
    ("cxlrt.alloc", "cxlrt/alloc.pyx"),
    ("cxlrt.microbench", "cxlrt/microbench.pyx"),
    ("cxlrt.kvpins", "cxlrt/kvpins.pyx"),
    ("cxlrt.kvindex", "cxlrt/kvindex.pyx"),
    ("cxlrt.kvevict", "cxlrt/kvevict.pyx"),
    ("cxlrt.kvclaim", "cxlrt/kvclaim.pyx"),
    ("cxlrt.kvformat", "cxlrt/kvformat.pyx"),
    ("cxlrt.kvwrite", "cxlrt/kvwrite.pyx"),
    ("cxlrt.kvcache", "cxlrt/kvcache.pyx"),
    ("cxlrt.channel", "cxlrt/channel.pyx"),
    ("cxlrt.staging", "cxlrt/staging.pyx"),
    ("cxlrt.backends.file", "backends/file.pyx"),
    ("cxlrt.backends.numa", "backends/numa.pyx"),
    ("cxlrt.backends.dax", "backends/dax.pyx"),
    ("cxlrt.emulation.noncoherent", "emulation/noncoherent.pyx"),
    ("cxlrt.emulation.chm", "emulation/chm.pyx"),
]
# rdma: links libibverbs, so it is built only where its headers are (libibverbs-dev);
# elsewhere `rdma:` says how to get it (cxlrt/registry.py).
VERBS_H = os.environ.get("CXLRT_VERBS_H", "/usr/include/infiniband/verbs.h")
if os.path.exists(VERBS_H):
    MODULES.append(("cxlrt.backends.rdma", "backends/rdma.pyx"))


def _generate():
    # layoutinfo.pyx includes member lists written from the struct declarations (the
    # .pxd stays their one source). Loaded by path: importing the cxlrt package here
    # would import its compiled modules, and PEP 517 builds do not put this folder on
    # sys.path. Run on every build; an unchanged output is not rewritten, and a changed
    # one is newer than layoutinfo.c, so cythonize below translates it again.
    root = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "_layoutgen", os.path.join(root, "cxlrt", "_layoutgen.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.write(root)


def _extensions():
    # Cython names a module after its path (backends/file.pyx -> backends.file),
    # which is also how it finds the module's own .pxd; the installed name is
    # cxlrt.backends.file. Cythonize by path, then install under the real name
    # (the init symbol, PyInit_file, depends only on the last component).
    _generate()
    only = set(filter(None, os.environ.get("CXLRT_ONLY", "").split(",")))
    chosen = [(name, src) for name, src in MODULES if not only or name in only]
    exts = cythonize(
        [Extension(src[:-4].replace("/", "."), [src], include_dirs=INCLUDE,
                   define_macros=MACROS, extra_compile_args=CFLAGS) for _, src in chosen],
        compiler_directives=DIRECTIVES,
        include_path=["."],
        annotate=ANNOTATE,
        # No compile_time_env: CXLRT_DEBUG in .pyx code is debug.h's C macro, so the
        # generated C is the same at every level and only the C compile differs (a
        # Cython-time value would be folded into a .c that a later level reuses).
        # build_ext --force translates again too: CXLRT_TRACE changes the C.
        force="--force" in sys.argv,
        # Translating the .pyx files is a third of a fresh build: on every core, as the
        # C compile below is (the README's first command counts this time).
        nthreads=os.cpu_count() or 1,
    )
    assert [e.name for e in exts] == [src[:-4].replace("/", ".") for _, src in chosen]
    for ext, (name, _) in zip(exts, chosen, strict=True):
        ext.name = name
        if name == "cxlrt.backends.rdma":
            ext.libraries = ["ibverbs"]
            ext.include_dirs = [*ext.include_dirs, "backends"]
    return exts


setup(
    package_dir={"cxlrt": "cxlrt", "cxlrt.backends": "backends",
                 "cxlrt.emulation": "emulation"},
    packages=["cxlrt", "cxlrt.includes", "cxlrt.serving", "cxlrt.integrations", "cxlrt.backends",
              "cxlrt.emulation"],
    package_data={
        "cxlrt": ["*.pxd", "*.pyi", "py.typed"],
        "cxlrt.includes": ["*.pxd", "*.h"],
        "cxlrt.backends": ["*.pxd", "*.pyi"],
        "cxlrt.emulation": ["*.pxd", "*.pyi"],
    },
    ext_modules=_extensions(),
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
    zip_safe=False,
)
