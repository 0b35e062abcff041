"""A minimal safetensors reader: parses the header and hands out read-only memory-mapped NumPy views, one tensor
at a time, so a load never holds more than the tensor being converted."""

from __future__ import annotations

import mmap
import os

import ml_dtypes
import numpy as np

from fnx._safetensors import read_header

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


class SafetensorsError(ValueError):
    pass


class SafetensorsFile:
    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        base, header, size = read_header(self.path, SafetensorsError)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None
        self.metadata = header.pop("__metadata__", {}) or {}
        self._base = base
        self._entries = header
        for name, e in header.items():
            if e.get("dtype") not in DTYPES:
                raise SafetensorsError(f"{self.path}: tensor {name!r} has unsupported dtype {e.get('dtype')!r}")
            start, end = e["data_offsets"]
            want = int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(DTYPES[e["dtype"]]).itemsize
            if end - start != want or self._base + end > size:
                raise SafetensorsError(f"{self.path}: tensor {name!r} ({e['dtype']} {e['shape']}) does not fit its "
                                       f"byte range {start}..{end} (file holds {size - self._base} data bytes); "
                                       "the file is truncated or corrupt")

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> str:
        return self._entries[name]["dtype"]

    def nbytes(self, name: str) -> int:
        start, end = self._entries[name]["data_offsets"]
        return end - start

    def offset(self, name: str) -> int:
        return self._base + self._entries[name]["data_offsets"][0]

    def release(self, name: str) -> None:
        """Tell the kernel the tensor's pages may be dropped from this process (they stay in the page cache), so a
        streaming load's resident memory does not grow with every tensor read."""
        if self._map is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = self.offset(name)
        page = mmap.PAGESIZE
        lo = start - start % page
        hi = start + self.nbytes(name)
        if hi > lo:
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the tensor's bytes (no copy)."""
        e = self._entries[name]
        start, end = e["data_offsets"]
        arr = np.frombuffer(self._map, dtype=DTYPES[e["dtype"]], count=(end - start) // np.dtype(
            DTYPES[e["dtype"]]).itemsize, offset=self._base + start)
        return arr.reshape(e["shape"])
