"""Reference for the UVA row gather: the same chunk lookup and byte addressing as the kernel, reading a device
array that stands in for host memory (byte address a is word a // 4 of `mem`).

The table's rows live in C chunks of host memory; chunk c holds rows [starts[c], starts[c+1]) from its base
address (lo[c] + 2^32 hi[c]). Row r of chunk c starts at byte base(c) + (r - starts[c]) * row_bytes."""

from __future__ import annotations

import jax.numpy as jnp


def chunk_of(ids, starts):
    """ids [N] int32, starts [C] int32 ascending (starts[0] = 0) -> the chunk of each id [N] int32."""
    return jnp.sum((starts[None, :] <= ids[:, None]).astype(jnp.int32), axis=1) - 1


def gather_words(ids, starts, lo, hi, mem, row_bytes: int):
    """ids [N] int32 -> [N, row_bytes // 4] uint32, the rows' bytes as little-endian words, read from `mem`
    (uint32 words; the emulated addresses are byte offsets into it, so hi must be 0)."""
    c = chunk_of(ids, starts)
    local = (ids - starts[c]).astype(jnp.uint32)
    words = row_bytes // 4
    off = local[:, None] * jnp.uint32(row_bytes) + jnp.arange(words, dtype=jnp.uint32)[None, :] * jnp.uint32(4)
    addr = lo[c][:, None] + off
    del hi
    return mem[(addr // 4).astype(jnp.int32)]
