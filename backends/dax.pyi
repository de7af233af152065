from typing import Any

from cxlrt.backend import Backend
from cxlrt.mapping import Mapping

PARAMS: dict[str, Any]

def describe(path: str) -> tuple[str, int, int]: ...
def medium_size(path: str) -> int: ...
def is_device(path: str) -> bool: ...

class DaxBackend(Backend):
    mapping: Mapping
    mode: str
    map_sync: bool
    def __init__(self, path: str, params: dict[str, Any], node: int, size: int) -> None: ...
    def bind(self, nodes: int, uuid: int, fresh: bool) -> None: ...
