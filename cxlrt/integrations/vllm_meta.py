"""What the connector's scheduler half tells its workers each step, and back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class BlockMove:
    """Blocks of one request to load from, or store into, cxlrt.

    ``keys[r][i]`` is the key of ``block_ids[i]`` in tensor-parallel rank r's
    cache (the salt names the rank, so each rank has its own keys).
    """

    req_id: str
    keys: list[list[bytes]]
    block_ids: list[int]


@dataclass
class CxlrtMetadata(KVConnectorMetadata):
    loads: list[BlockMove] = field(default_factory=list)
    saves: list[BlockMove] = field(default_factory=list)


@dataclass
class CxlrtWorkerMetadata(KVConnectorWorkerMetadata):
    """Requests whose load ran this step (loaded or failed): the scheduler unpins them."""

    loaded: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CxlrtWorkerMetadata)
        return CxlrtWorkerMetadata(self.loaded | other.loaded)
