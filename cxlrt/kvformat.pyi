DIR_PREFIX: str
FORMAT_MAGIC: int
FORMAT_VERSION: int

def header_checksum(head: bytes | bytearray | memoryview) -> int: ...
