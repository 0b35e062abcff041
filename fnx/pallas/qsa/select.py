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
launch, so one region serves every launch of its call site; past 64K context, op "qsa_select_long", one per segment
and one per row: see `qsa_select`), else a zeroed buffer of its own. The interpreter runs the programs in order, so
there the last arriver is program P - 1."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import grid_sync, pdl
from fnx.pallas.qsa.pallas import (HIGHEST, LOWEST_KEY, TOPK_MAX_BLOCKS, _pow2, _sortable, top_set, topk_early,
                                   topk_search)

F32 = jnp.float32
BLOCK = 128          # block keys a program scores
LONG_SEG = 8192      # a long row's segment (rows of more than TOPK_MAX_BLOCKS): in the stock sm_90 build a segment
                     # top-k over 16,384 keys spilled (104 registers at 8 warps, 32 at 16); over 8,192 none


def applies(n_blocks: int, k: int, cr: int, hi: int, di: int, whole: int = TOPK_MAX_BLOCKS,
            seg: int = LONG_SEG) -> str | None:
    """None when `qsa_select` serves a call with these sizes, else why not. Rows of more than `whole` blocks (past
    64K tokens of context: op "qsa_select_long") run in segments of `seg` (`segmented`)."""
    if not k < n_blocks:
        return f"{n_blocks} blocks <= top-k {k}: every block is taken, there is nothing to choose"
    if n_blocks > whole and -(-n_blocks // seg) * k > TOPK_MAX_BLOCKS:
        return (f"{n_blocks} blocks in {-(-n_blocks // seg)} segments of {seg}: {-(-n_blocks // seg) * k} "
                f"candidates per row > {TOPK_MAX_BLOCKS} (one program holds them)")
    if cr < 2 or cr & (cr - 1):
        return f"compress ratio {cr}: the kernel writes a block's tokens as a power-of-two vector (>= 2)"
    if di < 16 or di & (di - 1):
        return f"indexer head_dim {di}: a power of two >= 16"
    if hi > 16:
        return f"{hi} indexer heads > 16 (one MMA tile of rows)"
    return None


def segmented(n_blocks: int, whole: int = TOPK_MAX_BLOCKS) -> bool:
    """Whether a row of n_blocks runs in segments (op "qsa_select_long"; not `pallas.long_rows`, which says whether
    the two-launch top-k serves such rows)."""
    return n_blocks > whole


def _masked_at(mask, at, size: int):
    """Store offsets `at` with the masked-off lanes pointed past the buffer (`size` elements) at distinct places: on
    the GPU a masked lane touches no memory wherever it points; the Pallas interpreter writes a masked lane's old
    value back (the last of equal offsets wins, which could undo another lane's store) unless the offset is out of
    bounds, where it drops the write."""
    lanes = jax.lax.broadcasted_iota(jnp.int32, at.shape, 0)
    if at.ndim == 2:
        lanes = lanes * at.shape[1] + jax.lax.broadcasted_iota(jnp.int32, at.shape, 1)
    return jnp.where(mask, at, size + lanes)


def _tokens(out_ref, r, sel, slot, blk, pos, *, k, cr, n_out, capacity):
    """A row's token list: the chosen blocks' (blk, where sel) cr tokens at their slots (-1 for a block not complete
    at pos), one column at a time ([lanes] values and offsets live, not [lanes, cr]), then the tail's cr - 1."""
    good = blk * cr + (cr - 1) <= pos
    at = _masked_at(sel, r * n_out + slot * cr, out_ref.shape[0])
    for j in range(cr):
        plt.store(out_ref.at[at + j], jnp.where(good, blk * cr + j, -1), mask=sel)
    part = jnp.arange(cr, dtype=jnp.int32)
    tail = (pos + 1) // cr * cr + part
    tail = jnp.where((tail <= pos) & (tail < capacity), tail, -1)
    plt.store(out_ref.at[_masked_at(part < cr - 1, r * n_out + k * cr + part, out_ref.shape[0])], tail,
              mask=part < cr - 1)


def _kernel(q_ref, pos_ref, blk_ref, ctr_ref, key_ref, *rest, length, n_blocks, seg, hi, di, bn, cr, k, n_out,
            capacity, base, progs, early, interpret, searches=(None, None)):
    n_seg = -(-n_blocks // seg)
    if n_seg > 1:
        cand_key_ref, cand_id_ref, out_ref = rest
    else:
        (out_ref,) = rest
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
    stride = n_seg * seg                                     # a row's keys (its segments one after another)
    plt.store(key_ref.at[_masked_at(ok, r * stride + blocks, key_ref.shape[0])], key, mask=ok)
    # ---- the last of a segment's programs: the top-k over the segment (one segment: the row), then the token list
    # or, with several segments, the segment's k candidates, and the last segment to finish takes the k best of them
    if not interpret:
        plt.debug_barrier()                  # every thread's key stores before the arrival
    if n_seg == 1:
        old = plt.atomic_add(ctr_ref, (jnp.int32(base) + r,), jnp.int32(1))
        last, s_id = old % progs == progs - 1, jnp.int32(0)
    else:
        s_id = c * bn // seg
        ps = (jnp.minimum(seg, n_blocks - s_id * seg) + bn - 1) // bn      # this segment's programs
        old = plt.atomic_add(ctr_ref, (jnp.int32(base) + r * (n_seg + 1) + s_id,), jnp.int32(1))
        last = old % ps == ps - 1

    @pl.when(last)
    def _():
        lane = jnp.arange(seg, dtype=jnp.int32)
        blk = s_id * seg + lane
        inseg = blk < n_blocks
        row = plt.load(key_ref.at[r * stride + jnp.where(inseg, blk, 0)], mask=inseg, other=LOWEST_KEY)
        row = jnp.where(inseg, row, LOWEST_KEY)
        sel, slot = top_set(row, k, early, searches[0])
        if n_seg == 1:
            _tokens(out_ref, r, sel, slot, blk, pos, k=k, cr=cr, n_out=n_out, capacity=capacity)
            return
        # the segment's k best, in ascending block order, at its place among the row's n_seg * k candidates
        at = _masked_at(sel, (r * n_seg + s_id) * k + slot, cand_key_ref.shape[0])
        plt.store(cand_key_ref.at[at], row, mask=sel)
        plt.store(cand_id_ref.at[at], blk, mask=sel)
        if not interpret:
            plt.debug_barrier()
        old2 = plt.atomic_add(ctr_ref, (jnp.int32(base) + r * (n_seg + 1) + n_seg,), jnp.int32(1))

        @pl.when(old2 % n_seg == n_seg - 1)
        def _():
            n_cand = n_seg * k
            lane2 = jnp.arange(_pow2(n_cand), dtype=jnp.int32)
            ok2 = lane2 < n_cand
            at2 = r * n_cand + jnp.where(ok2, lane2, 0)
            ckey = jnp.where(ok2, plt.load(cand_key_ref.at[at2], mask=ok2, other=LOWEST_KEY), LOWEST_KEY)
            cid = plt.load(cand_id_ref.at[at2], mask=ok2, other=0)
            sel2, slot2 = top_set(ckey, k, early, searches[1])
            _tokens(out_ref, r, sel2, slot2, cid, pos, k=k, cr=cr, n_out=n_out, capacity=capacity)


def qsa_select(q_idx: jax.Array, blocks: jax.Array, positions: jax.Array, capacity: int, cr: int, k: int, *,
               interpret: bool = False, whole: int = TOPK_MAX_BLOCKS, seg: int = LONG_SEG) -> jax.Array:
    """Token positions [B, L, k * cr + cr - 1] int32 (-1: unused): the same set per row as
    `fnx.model.qsa.select_token_indices` on the reference ops (up to near-equal scores, see the module's note).
    q_idx [B, L, Hi, di] (normed, RoPE'd); blocks [B, NB, di]; positions [B, L]; `capacity` the KV cache's.
    A row of more than `whole` blocks (TOPK_MAX_BLOCKS: past 64K tokens of context) runs in segments of `seg` (a
    power of two):
    the last of a segment's scoring programs writes the segment's k best keys and blocks as candidates (a counter per
    segment), and the last segment to finish (a counter per row) takes the k best of the row's candidates, in the
    same launch. A row's k best are among its segments' (the same order: score, then lower block), and the candidates
    stay in ascending block order, so ties still go to the lower blocks."""
    bsz, length, hi, di = q_idx.shape
    n_blocks = blocks.shape[1]
    if seg & (seg - 1) or not max(BLOCK, k) <= seg <= TOPK_MAX_BLOCKS or whole > TOPK_MAX_BLOCKS:
        raise ValueError(f"qsa_select: seg={seg} must be a power of two in [max({BLOCK}, k={k}), {TOPK_MAX_BLOCKS}] "
                         f"and whole={whole} at most {TOPK_MAX_BLOCKS}")
    why = applies(n_blocks, k, cr, hi, di, whole, seg)
    if why is not None:
        raise ValueError(f"qsa_select: {why}")
    rows, bn = bsz * length, BLOCK
    n_seg = -(-n_blocks // seg) if segmented(n_blocks, whole) else 1
    if n_seg == 1:
        seg = _pow2(n_blocks)                # one segment: the row, padded to a power of two
    progs, n_out = -(-n_blocks // bn), k * cr + cr - 1
    searches = (topk_search(seg, rows), topk_search(_pow2(n_seg * k), rows))    # the segments', the candidates'
    ctrs, base = grid_sync.counters(rows * (n_seg + 1 if n_seg > 1 else 1), interpret)
    dt = jnp.promote_types(q_idx.dtype, blocks.dtype)
    kernel = functools.partial(_kernel, length=length, n_blocks=n_blocks, seg=seg, hi=hi, di=di, bn=bn, cr=cr, k=k,
                               n_out=n_out, capacity=int(capacity), base=base, progs=progs, early=topk_early(),
                               interpret=interpret, searches=searches)
    params = {}
    if not interpret:
        widest = max(seg, _pow2(n_seg * k) if n_seg > 1 else 0)
        # (stock sm_90 build: 8 warps hold a segment of 8,192 and 4,096 candidates without spills, 16 warps 8,192
        # candidates; the other way round each spilled a few registers)
        warps = 4 if widest < 4096 else 16 if n_seg > 1 and _pow2(n_seg * k) >= 8192 else 8
        params["compiler_params"] = plt.CompilerParams(num_warps=warps, num_stages=1)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    i32 = jnp.int32
    scratch = [jax.ShapeDtypeStruct((rows * n_seg * seg,), i32)]
    if n_seg > 1:
        scratch += [jax.ShapeDtypeStruct((rows * n_seg * k,), i32)] * 2
    *_, out = pdl.pallas_call(
        kernel, grid=(rows, progs), in_specs=[whole] * 4, out_specs=(whole,) * (len(scratch) + 1),
        out_shape=(*scratch, jax.ShapeDtypeStruct((rows * n_out,), i32)),
        interpret=interpret, name="qsa_select_long" if n_seg > 1 else "qsa_select", **params,
    )(q_idx.astype(dt).reshape(rows * hi, di), positions.astype(i32).reshape(rows),
      blocks.astype(dt).reshape(bsz * n_blocks, di), ctrs)
    return out.reshape(bsz, length, n_out)
