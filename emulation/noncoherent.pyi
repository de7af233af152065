from typing import Any

from cxlrt.backend import Backend
from cxlrt.mapping import Mapping

PARAMS: dict[str, Any]

def sidecars(path: str) -> list[str]: ...

class EmuBackend(Backend):
    mapping: Mapping | None
    sidecar: Mapping | None
    sidecar_path: str
    def __init__(self, path: str, params: dict[str, Any], node: int, size: int) -> None: ...
    def bind(self, nodes: int, uuid: int, fresh: bool) -> None: ...
