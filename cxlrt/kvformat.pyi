DIR_PREFIX: str
FORMAT_MAGIC: int
FORMAT_VERSION: int
REC_CLAIM: int

def header_checksum(head: bytes | bytearray | memoryview) -> int: ...
