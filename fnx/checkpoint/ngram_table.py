"""The PLE n-gram table as a row-addressable view over its checkpoint shards, never concatenated in host memory.

The release stores the table as `split_ngram_parts` shards `[rows/parts, width]` (bf16, or FP8 E4M3 with one
per-tensor `weight_scale`). `rows(ids)` reads just the requested rows out of the memory-mapped shards."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


def check_row_ids(ids, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids as an array, ids flattened to int64), after checking they are integers in [0, n_rows)."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"n-gram ids must be integers, got {ids.dtype}")
    flat = ids.reshape(-1).astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= n_rows):
        raise IndexError(f"n-gram ids must lie in [0, {n_rows}), got [{flat.min()}, {flat.max()}]")
    return ids, flat


@dataclass(frozen=True)
class NgramTableView:
    shards: tuple            # one read-only [rows_per_shard, width] array per shard (memory-mapped views)
    files: tuple[str, ...]   # the file each shard lives in, for error messages
    scale: np.ndarray | None = None   # the per-tensor scale of an FP8 table ([1], its stored dtype), else None

    def __post_init__(self):
        if not self.shards:
            raise ValueError("an n-gram table needs at least one shard")
        first = self.shards[0]
        for f, s in zip(self.files, self.shards):
            if s.shape != first.shape or s.dtype != first.dtype:
                raise ValueError(f"n-gram shard in {f} is {s.dtype} {s.shape}, but shard 0 is {first.dtype} "
                                 f"{first.shape}; every shard must have the same shape and dtype")

    @property
    def rows_per_shard(self) -> int:
        return self.shards[0].shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows_per_shard * len(self.shards), self.shards[0].shape[1])

    @property
    def dtype(self) -> np.dtype:
        return self.shards[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(int(s.nbytes) for s in self.shards)

    def rows(self, ids) -> np.ndarray:
        """ids [...] (any integer array) -> the stored rows [..., width] in the stored dtype."""
        ids, flat = check_row_ids(ids, self.shape[0])
        out = np.empty((flat.size, self.shape[1]), self.dtype)
        shard, local = np.divmod(flat, self.rows_per_shard)
        for s in np.unique(shard):
            sel = shard == s
            out[sel] = self.shards[int(s)][local[sel]]
        return out.reshape(*ids.shape, self.shape[1])

    def lookup(self, ids, dtype=ml_dtypes.bfloat16) -> np.ndarray:
        """Rows as the model reads them: bf16 tables as stored; FP8 tables as (row in the scale's dtype) * scale,
        rounded to the scale's dtype as the reference does, then cast to `dtype`."""
        r = self.rows(ids)
        if self.scale is None:
            return r.astype(dtype)
        sdt = self.scale.dtype
        return (r.astype(np.float32) * self.scale.astype(np.float32)).astype(sdt).astype(dtype)
