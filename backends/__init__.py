"""Hardware and OS backends of cxlrt, installed as ``cxlrt.backends``."""
