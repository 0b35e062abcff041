"""The QSA indexer's token choice in one launch (op "qsa_select"): scores, top-k and token list together.

At decode the model's indexer step is four launches a QSA layer: XLA's product of the indexer queries with the
cached block keys, XLA's relu-sum-and-mask fusion, the top-k kernel (`pallas.qsa_block_topk`) and XLA's fusion
that turns the chosen blocks into token positions with the incomplete tail after them
(`fnx.model.qsa.select_token_indices`). This kernel does all of it.

Grid (B * L, P): program (r, c) scores blocks [c * bn, (c + 1) * bn) of query row r (one MMA of the row's indexer
heads, padded to 16, against the bn block keys; fp32 accumulation of the exact bf16 products), sums the relu'd
head scores, masks the blocks not complete at the row's position to -inf and writes them as order-preserving int32
keys to a scratch row. Each program then adds 1 to the row's counter (acquire-release); the last of the row's P
programs to arrive (its add returns P - 1 modulo P) holds every key of the row and runs the top-k of
`pallas.top_set` (ties to the lower blocks, as lax.top_k) and writes the row's token positions: each chosen block's
cr tokens in ascending block order (-1 for a chosen block that is not complete, as where fewer than k are), then
the cr - 1 slots of the incomplete tail (-1 where empty or past the cache).

Numerics: the scores are those of `reference.qsa_index_scores` without the common 1 / sqrt(di) factor (a positive
factor; only the row's order is used) and with the products summed in the tensor cores' order, so blocks whose
scores lie within a rounding of each other may rank differently from XLA's sums; exact ties (e.g. all-zero scores)
stay exact and go to the lower blocks.

Counters: a region of the decode program's `grid_sync.CounterPool` (B * L counters, each advanced by exactly P per
launch, so one region serves every launch of its call site), else a zeroed buffer of its own. The interpreter runs
the programs in order, so there the last arriver is program P - 1."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import grid_sync, pdl
from fnx.pallas.qsa.pallas import HIGHEST, LOWEST_KEY, TOPK_MAX_BLOCKS, _pow2, _sortable, top_set, topk_early

F32 = jnp.float32
BLOCK = 128          # block keys a program scores


def applies(n_blocks: int, k: int, cr: int, hi: int, di: int) -> str | None:
    """None when `qsa_select` serves a call with these sizes, else why not."""
    if not k < n_blocks:
        return f"{n_blocks} blocks <= top-k {k}: every block is taken, there is nothing to choose"
    if n_blocks > TOPK_MAX_BLOCKS:
        return (f"{n_blocks} blocks > {TOPK_MAX_BLOCKS}: a row's keys must fit one program (64K tokens of context at "
                "cr = 4); longer rows run the scores and the two-launch top-k")
    if cr < 2 or cr & (cr - 1):
        return f"compress ratio {cr}: the kernel writes a block's tokens as a power-of-two vector (>= 2)"
    if di < 16 or di & (di - 1):
        return f"indexer head_dim {di}: a power of two >= 16"
    if hi > 16:
        return f"{hi} indexer heads > 16 (one MMA tile of rows)"
    return None


def _masked_at(mask, at, size: int):
    """Store offsets `at` with the masked-off lanes pointed past the buffer (`size` elements) at distinct places: on
    the GPU a masked lane touches no memory wherever it points; the Pallas interpreter writes a masked lane's old
    value back (the last of equal offsets wins, which could undo another lane's store) unless the offset is out of
    bounds, where it drops the write."""
    lanes = jax.lax.broadcasted_iota(jnp.int32, at.shape, 0)
    if at.ndim == 2:
        lanes = lanes * at.shape[1] + jax.lax.broadcasted_iota(jnp.int32, at.shape, 1)
    return jnp.where(mask, at, size + lanes)


def _kernel(q_ref, pos_ref, blk_ref, ctr_ref, key_ref, out_ref, *, length, n_blocks, nbp, hi, di, bn, cr, k,
            n_out, capacity, base, progs, early, interpret):
    r, c = pl.program_id(0), pl.program_id(1)
    b = r // length
    pos = pos_ref[r]
    # ---- scores of this program's blocks
    heads = jnp.arange(16, dtype=jnp.int32)
    cols = jnp.arange(di, dtype=jnp.int32)
    hok = heads < hi
    q = plt.load(q_ref.at[(r * hi + jnp.where(hok, heads, 0))[:, None], cols[None, :]],
                 mask=jnp.broadcast_to(hok[:, None], (16, di)), other=0)                        # [16, di]
    blocks = c * bn + jnp.arange(bn, dtype=jnp.int32)
    ok = blocks < n_blocks
    kb = plt.load(blk_ref.at[(b * n_blocks + jnp.where(ok, blocks, 0))[:, None], cols[None, :]],
                  mask=jnp.broadcast_to(ok[:, None], (bn, di)), other=0)                        # [bn, di]
    d = jnp.dot(q, kb.T, precision=HIGHEST, preferred_element_type=F32)                        # [16, bn]
    s = jnp.sum(jnp.maximum(d, 0.0), axis=0)                 # the padding heads add relu(0) = 0
    complete = blocks * cr + (cr - 1) <= pos
    key = _sortable(jnp.where(complete, s, -jnp.inf))
    plt.store(key_ref.at[_masked_at(ok, r * nbp + blocks, key_ref.shape[0])], key, mask=ok)
    # ---- the last of the row's programs: the top-k over the whole row, then the token list
    if not interpret:
        plt.debug_barrier()                  # every thread's key stores before the arrival
    old = plt.atomic_add(ctr_ref, (jnp.int32(base) + r,), jnp.int32(1))

    @pl.when(old % progs == progs - 1)
    def _():
        lane = jnp.arange(nbp, dtype=jnp.int32)
        inrow = lane < n_blocks
        row = plt.load(key_ref.at[r * nbp + jnp.where(inrow, lane, 0)], mask=inrow, other=LOWEST_KEY)
        sel, slot = top_set(jnp.where(inrow, row, LOWEST_KEY), k, early)
        part = jnp.arange(cr, dtype=jnp.int32)
        good = lane * cr + (cr - 1) <= pos
        at = _masked_at(sel, r * n_out + slot * cr, out_ref.shape[0])
        for j in range(cr):         # a block's tokens one at a time: [nbp] values and offsets live, not [nbp, cr]
            plt.store(out_ref.at[at + j], jnp.where(good, lane * cr + j, -1), mask=sel)
        tail = (pos + 1) // cr * cr + part
        tail = jnp.where((tail <= pos) & (tail < capacity), tail, -1)
        plt.store(out_ref.at[_masked_at(part < cr - 1, r * n_out + k * cr + part, out_ref.shape[0])], tail,
                  mask=part < cr - 1)


def qsa_select(q_idx: jax.Array, blocks: jax.Array, positions: jax.Array, capacity: int, cr: int, k: int, *,
               interpret: bool = False) -> jax.Array:
    """Token positions [B, L, k * cr + cr - 1] int32 (-1: unused): the same set per row as
    `fnx.model.qsa.select_token_indices` on the reference ops (up to near-equal scores, see the module's note).
    q_idx [B, L, Hi, di] (normed, RoPE'd); blocks [B, NB, di]; positions [B, L]; `capacity` the KV cache's."""
    bsz, length, hi, di = q_idx.shape
    n_blocks = blocks.shape[1]
    why = applies(n_blocks, k, cr, hi, di)
    if why is not None:
        raise ValueError(f"qsa_select: {why}")
    rows, nbp, bn = bsz * length, _pow2(n_blocks), BLOCK
    progs, n_out = -(-n_blocks // bn), k * cr + cr - 1
    ctrs, base = grid_sync.counters(rows, interpret)
    dt = jnp.promote_types(q_idx.dtype, blocks.dtype)
    kernel = functools.partial(_kernel, length=length, n_blocks=n_blocks, nbp=nbp, hi=hi, di=di, bn=bn, cr=cr, k=k,
                               n_out=n_out, capacity=int(capacity), base=base, progs=progs, early=topk_early(),
                               interpret=interpret)
    params = {}
    if not interpret:
        params["compiler_params"] = plt.CompilerParams(num_warps=8 if nbp >= 4096 else 4, num_stages=1)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    _, out = pdl.pallas_call(
        kernel, grid=(rows, progs), in_specs=[whole] * 4, out_specs=(whole, whole),
        out_shape=(jax.ShapeDtypeStruct((rows * nbp,), jnp.int32), jax.ShapeDtypeStruct((rows * n_out,), jnp.int32)),
        interpret=interpret, name="qsa_select", **params,
    )(q_idx.astype(dt).reshape(rows * hi, di), positions.astype(jnp.int32).reshape(rows),
      blocks.astype(dt).reshape(bsz * n_blocks, di), ctrs)
    return out.reshape(bsz, length, n_out)
