"""CRC-32 of a file, read in 4 MiB blocks (checkpoint and data-cache integrity checks)."""

import zlib


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return crc
