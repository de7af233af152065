from typing import Any

from cxlrt.backend import Backend
from cxlrt.mapping import Mapping

PARAMS: dict[str, Any]
LOCK_TIMEOUT_S: float

class ChmBackend(Backend):
    sidecar: Mapping | None
    sidecar_path: str
    def __init__(self, path: str, params: dict[str, Any], node: int, size: int) -> None: ...
    def bind(self, nodes: int, uuid: int, fresh: bool) -> None: ...
    def resident(self) -> tuple[int, int]: ...
    def writeback(self, drop: bool = False) -> int: ...
