"""The non-coherent emulation of CXL shared memory, installed as ``cxlrt.emulation``."""
