from typing import Any

from cxlrt.backend import Backend
from cxlrt.mapping import Mapping

PARAMS: dict[str, Any]

class FileBackend(Backend):
    mapping: Mapping | None
    def __init__(self, path: str, params: dict[str, Any], node: int, size: int) -> None: ...
    def bind(self, nodes: int, uuid: int, fresh: bool) -> None: ...
