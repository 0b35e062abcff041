"""The safetensors header, read and checked once for the two readers that need it (fnx.checkpoint.safetensors_io
for whole checkpoints, fnx.ple.table for the n-gram table's shards)."""

from __future__ import annotations

import json
import os
import struct


def read_header(path: str, error: type[Exception]) -> tuple[int, dict, int]:
    """(offset of the data, the header dict with its "__metadata__" entry, file size) of a safetensors file;
    `error` (a ValueError subclass) says what is wrong with a short, truncated or corrupt one."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise error(f"{path}: too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise error(f"{path}: header length {n} exceeds the file size {size}; the file is truncated")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise error(f"{path}: corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise error(f"{path}: corrupt safetensors header (not a JSON object)")
    return 8 + n, header, size
