from cxlrt.mapping import Mapping

MUTEX_BYTES: int

def init_robust_mutexes(m: Mapping, offset: int, count: int, stride: int) -> None: ...
