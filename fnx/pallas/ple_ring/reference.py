"""Reference for the PLE ring's kernels: what `post` stores and what `wait` returns, over a stand-in array that
plays the control block (byte address a is word a // 4 of `mem`, lo the block's byte offset in it, hi 0)."""

from __future__ import annotations

import jax.numpy as jnp

from fnx.pallas.ple_ring import layout


def _word(mem, lo, byte):
    return mem[(lo[0] + byte) // 4].astype(jnp.int32)


def post(ids, lo, mem):
    """ids [N] -> (seq [N] int32, pairs [N, 2] int32): seq = max(DONE, ABANDONED) + 1 (wrap-safe), pair (seq, id)."""
    done, aband = _word(mem, lo, layout.DONE), _word(mem, lo, layout.ABANDONED)
    seq = jnp.where(aband - done > 0, aband, done) + 1
    seq = jnp.full(ids.shape, seq, jnp.int32)
    return seq, jnp.stack([seq, ids.astype(jnp.int32)], axis=1)


def wait(seq, lo, mem, n: int, row_bytes: int, max_ids: int):
    """-> (words [N, row_bytes // 4] uint32, ok [N] int32): the ring's first N rows where DONE == seq, else zeros."""
    ok = _word(mem, lo, layout.DONE) == seq[0]
    words = row_bytes // 4
    base = lo[0] + layout.rows_offset(max_ids)
    addr = base + jnp.arange(n, dtype=jnp.uint32)[:, None] * row_bytes + jnp.arange(words, dtype=jnp.uint32) * 4
    rows = mem[(addr // 4).astype(jnp.int32)]
    return jnp.where(ok, rows, jnp.uint32(0)), jnp.full((n,), ok, jnp.int32)
