# the lock manager, the global tier of a cxlrt lock: a C-level API only (cxlrt/lockmgr.pxd).
