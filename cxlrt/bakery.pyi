# Lamport's bakery, the global tier of a cxlrt lock: a C-level API only (cxlrt/bakery.pxd).
