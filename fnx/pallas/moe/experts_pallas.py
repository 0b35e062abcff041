"""Weight-major MoE decode experts in Pallas (Triton lowering): each distinct expert's weights are read once and
applied to all M tokens.

Before the kernels (jnp, reference.dedupe): the M*K routed ids -> the distinct experts in ascending order, padded
with E to a static S = min(M*K, E) slots, and each (token, k)'s slot.

Stage 1, grid (S, I / block_n): slot s, intermediate columns [j, j + block_n): read the gate rows and the up rows
of expert `experts[s]` in block_k chunks along D, h = x @ W.T in fp32 for all M tokens (padded to 16 rows),
round to x.dtype, a = silu(gate) * up (each step rounded as the reference), store act [S, Mp, I].
Stage 2, grid (S, D / block_n): out[s] = act[s] @ down[e].T, fp32 accumulate, one rounding, y [S, Mp, D].
A slot holding E (no expert) skips its body (pl.when): no weight reads, no stores; nothing reads it back.
The combine (jnp, deterministic): outs[t, k] = y[slot[t, k], t], then reference.combine.

Weights: dense arrays, FP8 E4M3 with fp32 scales per 128x128 block (a tile lies inside one block, so one
scalar scale per tile), NVFP4 (nibbles decoded with integer ops, scales expanded per 16 values, the gate/up
globals per row), each dequantized in fp32 and rounded once to x.dtype, exactly as the reference dequantizer.
NVFP4 tiles are never interleaved: the low nibbles (even columns) and high nibbles (odd columns) are dotted with
the activations' even and odd columns, split outside the kernels."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fnx.pallas import kernel_math, stacked
from fnx.pallas.dot_acc import dot_acc
from fnx.pallas.dot_acc import fused as dot_acc_fused
from fnx.pallas.moe import reference

F32 = jnp.float32
MAX_TOKENS = 32
MAX_BLOCK_ROWS = 128    # rows per block of the prefill grouped matmul (experts_blocks)
MIN_ROWS = 16  # jnp.dot in the Triton lowering wants every dim >= 16


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_n: int = 32        # stage 1: intermediate columns per program (gate and up each)
    block_k: int = 128       # stage 1: D per step
    block_n2: int = 64       # stage 2: output (D) columns per program
    block_k2: int = 128      # stage 2: I per step
    num_warps: int = 4
    num_stages: int = 3
    split_act: int = 0       # NVFP4 down experts: 1 = stage 1 writes the even and odd intermediate columns as the two
                             # halves of its output (weight rows at a stride of 2), so stage 2 reads its operand
                             # halves in place instead of XLA copying them out (two strided slices of the act
                             # buffer: 255 us for a 4-layer 2,048-token prefill chunk, H100); the same bits
    split_store: int = 1     # NVFP4 down experts: 1 = stage 1 computes its columns as by default (contiguous weight
                             # rows) and its store puts each even column in the act buffer's first half and each odd
                             # one in the second (an array-indexed store), so stage 2 reads its operand halves in
                             # place with no XLA slices (split_act's layout without its strided weight rows, which
                             # measured +5.9% at 2,048 tokens); the same bits. On: H100 (cc01f54), the 4-layer
                             # chunk's kernel time 18,180 -> 17,864 us at 2,048 tokens, 5,706 -> 5,513 at 512
    mma16: int = 0           # NVFP4 / FP8 gate/up experts: 1 = stage 1 multiplies on fp16 tensor cores, the rows
                             # prescaled by a power of two into fp16's range before the launch
                             # (`kernel_math.hfma_prescale`) and scaled back after the K loop. NVFP4: each code times
                             # its E4M3 group scale formed in fp16 (exact: no fp32 step, no conversion to bf16 per
                             # weight), the row's global scale after the K loop; FP8: the E4M3 weights as fp16
                             # (exact), each 128-column block's products summed, then times its block scale. The
                             # weights are not rounded to bf16 first (as the decode kernels' `wround` 0): within
                             # the tolerance of the reference, not its bits
    aligned: int = 1         # the K loops' NVFP4 column offsets (k0 / 2 for the packed bytes and the activation
                             # halves, k0 / 16 for the group scales) marked as multiples of their step, so the tiles
                             # load as 16-byte vectors (pipelined: cp.async) instead of a byte or two at a time;
                             # stock sm_90 build of the 64-row NVFP4 blocks: gate/up 952 -> 682 instructions a K step,
                             # down 663 -> 445. The same bits. H100 (fifty-first session), the 4-layer 2,048-token
                             # chunk: 14,428 -> 12,989 us (gate/up 3,991 -> 3,364, down 2,312 -> 1,508); 0: the
                             # earlier loads
    e2m1_asm: int = 1        # NVFP4 gate/up with mma16: the codes decoded four bytes per inline-PTX block into fp16
                             # pairs (`kernel_math.e2m1_pair_f16`), where the jnp decode works on one 32-bit value per
                             # code; the same values (the interpreter runs the jnp decode). With dot_acc: the chunk
                             # 12,151 -> 11,931 us (gate/up 2,562 -> 2,344), H100; 0: the jnp decode
    dot_acc: int = 0         # 1: the K loops' products accumulate in the tensor core (`fnx.pallas.dot_acc`, as
                             # FNX_DOT_ACC=1 does for every kernel), not by one FADD per accumulator element a step;
                             # fp32 sums in the tensor core's order (an ulp apart). The NVFP4 prefill blocks' default
                             # (BLOCK_TILES_BY_FORMAT): with aligned and e2m1_asm the chunk 12,241 -> 11,931 us (down
                             # 1,508 -> 1,440), H100. 0: as FNX_DOT_ACC says (bf16 / FP8 blocks: not measured)
    down16: int = 0          # NVFP4 down experts: 1 = stage 1 stores its act as fp16, each row's block_n columns
                             # prescaled by a power of two into fp16's range (`kernel_math.hfma_prescale` of their
                             # max |a|; the 2^-s in a second output [S, I / block_n, Mp]), and stage 2 multiplies on
                             # fp16 tensor cores: each code times its E4M3 group scale in fp16 (exact, the gate/up's
                             # `mma16` decode, by inline PTX with e2m1_asm), each K step's products times its rows'
                             # 2^-s, the row global after the loop. Where 0 decodes every weight through fp32 and
                             # bf16 (stock sm_90 build: 11.8 instructions a weight against the gate/up's 4.9). Needs
                             # block_n a multiple of block_k2 (a K step inside one stage-1 column block). Within the
                             # tolerance of the reference, not its bits (the weights are not rounded to bf16)
    sahead: int = 0          # NVFP4 blocks: 1 = each K step's group scales loaded one step ahead and carried in
                             # registers. A step's [rows, K / 16] E4M3 scales are 2 bytes a thread, too few for the
                             # pipeliner's cp.async, so in the stock sm_90 build (TTGIR) they are a plain load inside
                             # the K loop that each step waits on after its copies arrive: a memory round trip per K
                             # step on the program's critical path (40 steps at D = 2,560 in the gate/up kernel, 10 in
                             # the down kernel). Ahead, the next step's load is in flight during this step's products.
                             # The same bits. The NVFP4 blocks' default (BLOCK_TILES_BY_FORMAT): the 4-layer
                             # 2,048-token chunk at 8K 11,921.8 -> 11,831.4 us (-90.4; two base runs 30 us apart),
                             # H100, 715b89e, 2026-12-07. 0: the scales loaded inside the step


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _e2m1(c):
    """uint32 E2M1 codes -> value * 2^-14 in fp32 through fp16 bits (Hopper has no FP4 conversion; the caller's
    scale carries 2^14: `kernel_math.e2m1_f16`). Faster than building fp32 bits from the fields in the decode
    kernels (BENCHMARKS.md, eleventh session); the products are the same bits."""
    return kernel_math.e2m1_f16(c).astype(F32)


def _rows(r0, n, stride=1):
    """Rows r0, r0 + stride, ... (n of them) as an index (a plain slice at stride 1)."""
    return pl.ds(r0, n) if stride == 1 else pl.ds(r0, n, stride)


def _weight_tile(fmt, refs, e, r0, bn, k0, bk, dt, meta, stride=1, aligned=False, sc=None):
    """Rows r0, r0 + stride, ... (bn of them), input columns [k0, k0+bk) of expert e's matrix, dequantized and
    rounded to dt: [bn, bk]. NVFP4 returns the pair (even columns, odd columns), each [bn, bk/2]: the low and high
    nibbles of the packed bytes as they lie, never interleaved in registers; the caller dots them with the even and
    odd activation columns."""
    rs = _rows(r0, bn, stride)
    if fmt == "dense":
        (w_ref,) = refs
        return w_ref[e, rs, pl.ds(k0, bk)].astype(dt)
    if fmt == "fp8_block":
        w_ref, s_ref = refs
        bo, bi = meta
        q = w_ref[e, rs, pl.ds(k0, bk)].astype(F32)
        s = s_ref[e, r0 // bo, k0 // bi]            # the rows lie in one block (bo a multiple of the tile's span)
        return (q * s).astype(dt)
    # nvfp4: packed [bn, bk/2] (low nibble = even element), scale per `group` values, global per row
    p, sc = _nvfp4_codes(refs, e, rs, bn, k0, bk, meta, F32, aligned, sc=sc)
    sc = sc * (refs[2][e, rs].astype(F32) * kernel_math.E2M1_F16_SCALE)[:, None]
    return (_e2m1(p & 0xF) * sc).astype(dt), (_e2m1(p >> 4) * sc).astype(dt)


def _nvfp4_scales(refs, e, rs, k0, bk, group, aligned=False):
    """An NVFP4 tile's group scales as stored (E4M3), [bn, bk/group], of rows `rs` and input columns [k0, k0+bk)."""
    return refs[1][e, rs, pl.ds(_part(k0, group, bk, aligned), bk // group)]


def _nvfp4_codes(refs, e, rs, bn, k0, bk, group, scale_dtype, aligned=False, codes_dtype=jnp.uint32, sc=None):
    """An NVFP4 tile's packed codes [bn, bk/2] (`codes_dtype`) and its group scales in `scale_dtype`, one per packed
    byte ([bn, bk/2]), of rows `rs` and input columns [k0, k0+bk); sc: the scales loaded already
    (`_nvfp4_scales`, `Tiles.sahead`)."""
    w_ref = refs[0]
    p = w_ref[e, rs, pl.ds(_part(k0, 2, bk, aligned), bk // 2)].astype(codes_dtype)
    if sc is None:
        sc = _nvfp4_scales(refs, e, rs, k0, bk, group, aligned)
    sc = sc.astype(scale_dtype)                                                                    # [bn, bk/group]
    return p, jnp.broadcast_to(sc[:, :, None], (bn, bk // group, group // 2)).reshape(bn, bk // 2)


def _part(k0, div: int, step: int, aligned: bool = False):
    """k0 // div for a K offset k0 that is a multiple of `step` (a traced loop index times the step, or an int),
    marked as a multiple of step // div: Python's floor division of a traced int lowers to a signed division with
    sign fixes, after which Triton no longer knows the offset's alignment and loads the tile an element at a time
    (the stock sm_90 build of the NVFP4 blocks: byte loads of the packed weights, 2-byte loads of the activations).
    Only with `aligned` (`Tiles.aligned` 1); otherwise the plain division."""
    q = k0 // div
    return q if isinstance(q, int) or not aligned else pl.multiple_of(q, max(1, step // div))


def _tile_dot(acc, x_tiles, w, fuse=False):
    """acc + x @ w.T in fp32 for a dense tile w, or the sum over the even and odd halves for an NVFP4 pair. With
    `fuse` (`Tiles.dot_acc`) or FNX_DOT_ACC=1 each product accumulates into acc in turn (`dot_acc`: the tensor
    core's own accumulation)."""
    ws = w if isinstance(w, tuple) else (w,)
    if not (fuse or dot_acc_fused()):
        part = _dot_t(x_tiles[0], ws[0])
        for x, wt in zip(x_tiles[1:], ws[1:]):
            part = part + _dot_t(x, wt)
        return acc + part
    for x, wt in zip(x_tiles, ws):
        acc = dot_acc(acc, x, wt, trans_b=True, precision=None, fuse=True)
    return acc


def _dot_t(a, b):
    """a [m, k] @ b[n, k].T in fp32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _unpack(experts_ref, rest, fmt, bk, aligned=False):
    """A kernel's common start: (activation refs (even, odd columns for NVFP4, else one), weight refs, output ref,
    slot, column block, expert id, activation columns per K step, K step -> its first activation column)."""
    halves = fmt == "nvfp4"
    a_refs, rest = (rest[:2], rest[2:]) if halves else (rest[:1], rest[1:])
    *w_refs, out_ref = rest
    s, j = pl.program_id(0), pl.program_id(1)
    col = (lambda k0: _part(k0, 2, bk, aligned)) if halves else (lambda k0: k0)
    return a_refs, w_refs, out_ref, s, j, experts_ref[s], (bk // 2 if halves else bk), col


def _silu_mul(acc_g, acc_u, dt):
    """a = silu(g) * u from the fp32 gate / up products, each step rounded to dt as the reference."""
    g = acc_g.astype(dt).astype(F32)
    sig = (1.0 / (1.0 + jnp.exp(-g))).astype(dt).astype(F32)
    silu = (g * sig).astype(dt).astype(F32)
    return (silu * acc_u.astype(dt).astype(F32)).astype(dt)


def _f16_tile(refs, e, r0, bn, k0, bk, meta, stride=1, aligned=False, asm=False, sc=None):
    """`_weight_tile`'s NVFP4 pair for `Tiles.mma16`: code * 2^-14 * group scale in fp16 (exact), without the
    row's global scale (the caller scales the products): ([bn, bk/2], [bn, bk/2]) fp16. With `asm` the codes are
    decoded four bytes per inline-PTX block (`kernel_math.e2m1_pair_f16`; a compiled kernel only)."""
    p, sc = _nvfp4_codes(refs, e, _rows(r0, bn, stride), bn, k0, bk, meta, jnp.float16,    # E4M3 -> fp16: exact
                         aligned, jnp.uint8 if asm else jnp.uint32, sc=sc)
    lo, hi = kernel_math.e2m1_pair_f16(p, asm)
    return lo * sc, hi * sc


def _gate_up_kernel(experts_ref, *rest, fmt, meta, n_exp, m, mp, inter, d, bn, bk, per_slot=False, split=False,
                    mma16=False, gather=False, split_store=False, aligned=False, asm=False, fuse=False, down16=None,
                    sahead=False):
    """Program (s, j): the intermediate columns [j bn, (j+1) bn) of slot s. With `split` the act buffer holds the
    even intermediate columns in its first half and the odd ones in its second (the NVFP4 down kernel's operand
    halves, so no copy splits them): the program computes its even and odd columns as two tiles of bn / 2 from the
    gate and up rows at a stride of 2. With `mma16` (NVFP4, FP8) the activations are fp16, prescaled per row (the last
    input after the weights: each row's 2^-s), and the products fp16 (`_f16_tile`; FP8: the E4M3 weights as fp16,
    a 128-column block's steps summed before its scale). With `gather` the first input after the expert ids is
    row_of [S, Mp] and the activations (and 2^-s) are token rows: the program reads its slot's rows by index. With
    `split_store` the columns are computed as by default and stored into the halves `split` writes. With `down16`
    (the activations' dtype: `Tiles.down16`) the act is stored as fp16, each row's columns of this program times a
    power of two, and the last output [S, I / bn, Mp] takes each row's 2^-s at row j. With `sahead` (NVFP4,
    `Tiles.sahead`) each K step's group scales are loaded a step ahead."""
    back_ref = rowof_ref = s16_ref = None
    if down16 is not None:
        *rest, s16_ref = rest
    if gather:          # the slot's rows are gathered here from the token rows (`row_of`), not from a slot buffer
        rowof_ref, *rest = rest
    if mma16:
        *rest, back_ref, out_ref = rest
        rest = (*rest, out_ref)
    x_refs, w_refs, act_ref, s, j, e, kw, col = _unpack(experts_ref, rest, fmt, bk, aligned)
    dt = act_ref.dtype if down16 is None else down16
    xdt = jnp.float16 if mma16 else dt
    parts = ((j * bn, 1, j * bn),) if not split else \
        tuple((j * bn + par, 2, par * (inter // 2) + j * (bn // 2)) for par in (0, 1))   # (first row, stride, column)
    width = bn // len(parts)

    n_acc = 2 * len(parts)          # (gate, up) per part
    fp8_16 = mma16 and fmt == "fp8_block"
    sub = meta[1] // bk if fp8_16 else 1    # FP8 on fp16: a 128-column block's steps summed before its scale

    def first_row(i):                   # accumulator i: the gate (even i) or up rows of its part, and their stride
        r0, stride, _ = parts[i // 2]
        return r0 + (inter if i % 2 else 0), stride

    def tile(i, k0, sc=None):
        r0, stride = first_row(i)
        if not mma16:
            return _weight_tile(fmt, w_refs, e, r0, width, k0, bk, dt, meta, stride, aligned, sc=sc)
        if fmt == "nvfp4":
            return _f16_tile(w_refs, e, r0, width, k0, bk, meta, stride, aligned, asm, sc=sc)
        return w_refs[0][e, _rows(r0, width, stride), pl.ds(k0, bk)].astype(jnp.float16)   # E4M3 -> fp16: exact

    @pl.when(e < n_exp)
    def _():
        rows = jax.lax.broadcasted_iota(jnp.int32, (mp, kw), 0)
        lead = (s,) if per_slot else ()
        src = rowof_ref[s, pl.ds(0, mp)] if gather else None        # [mp] token rows (padding: row 0, unused)

        def x_tile(r, k0):
            if gather:      # an array-indexed load: every index is a row of r, so no mask
                return r[src[:, None], col(k0) + jnp.arange(kw, dtype=jnp.int32)[None, :]]
            return plgpu.load(r.at[(*lead, pl.ds(0, mp), pl.ds(col(k0), kw))], mask=rows < m, other=0.0)

        n_steps = d // (bk * sub)
        ahead = sahead and fmt == "nvfp4"       # (sub is 1 for NVFP4)

        def scales(kk):             # every accumulator's group scales of step kk (the last step's again past the end)
            k0 = pl.multiple_of(jnp.minimum(kk, n_steps - 1) * bk, bk)
            return tuple(_nvfp4_scales(w_refs, e, _rows(first_row(i)[0], width, first_row(i)[1]), k0, bk, meta,
                                       aligned) for i in range(n_acc))

        def step(kk, carry):
            accs, sc = carry if ahead else (carry, (None,) * n_acc)
            nxt = scales(kk + 1) if ahead else None             # in flight during this step's products
            blk = [jnp.zeros((mp, width), F32)] * n_acc if fp8_16 else list(accs)
            for t in range(sub):
                k0 = pl.multiple_of((kk * sub + t) * bk, bk)
                xs = [x_tile(r, k0).astype(xdt) for r in x_refs]
                blk = [_tile_dot(blk[i], xs, tile(i, k0, sc[i]), fuse) for i in range(n_acc)]
            if fp8_16:
                bo = meta[0]
                blk = [accs[i] + blk[i] * w_refs[1][e, first_row(i)[0] // bo, kk] for i in range(n_acc)]
            return (tuple(blk), nxt) if ahead else tuple(blk)

        zero = (jnp.zeros((mp, width), F32),) * n_acc
        accs = jax.lax.fori_loop(0, n_steps, step, (zero, scales(0)) if ahead else zero)
        accs = accs[0] if ahead else accs
        if mma16:       # products of prescaled rows: 2^-s back per row; NVFP4's global (x 2^14) per weight row
            if gather:
                back = back_ref[src][:, None]
            else:
                back = plgpu.load(back_ref.at[(*lead, pl.ds(0, mp))], mask=jnp.arange(mp) < m, other=0.0)[:, None]
            scaled = []
            for i, a in enumerate(accs):
                a = a * back
                if fmt == "nvfp4":
                    r0, stride = first_row(i)
                    a = a * (w_refs[2][e, _rows(r0, width, stride)].astype(F32) * kernel_math.E2M1_F16_SCALE)[None, :]
                scaled.append(a)
            accs = scaled
        acts = [_silu_mul(acc_g, acc_u, dt) for acc_g, acc_u in zip(accs[0::2], accs[1::2])]
        if s16_ref is not None:     # the program's columns of each row into fp16's range by one power of two
            mx = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(a.astype(F32)), axis=1) for a in acts])
            up, back16 = kernel_math.hfma_prescale(mx)
            acts = [(a.astype(F32) * up[:, None]).astype(jnp.float16) for a in acts]
            s16_ref[s, j, :] = back16
        for (_, _, c0), a in zip(parts, acts):
            if split_store:     # column c to c // 2 (even c) or inter / 2 + c // 2 (odd c): the down kernel's halves
                c = c0 + jnp.arange(width, dtype=jnp.int32)
                pos = c // 2 + (c % 2) * (inter // 2)
                act_ref[s, jnp.arange(mp, dtype=jnp.int32)[:, None], pos[None, :]] = a
            else:
                act_ref[s, :, pl.ds(c0, width)] = a


def _down_kernel(experts_ref, *rest, fmt, meta, n_exp, inter, bn, bk, odd_at=0, aligned=False, fuse=False,
                 col_block=0, asm=False, sahead=False):
    """Program (s, j): output columns [j bn, (j+1) bn) of slot s. NVFP4: the two act refs give the even and odd
    intermediate columns; with `odd_at` both are the one split act buffer (`_gate_up_kernel`'s `split`), the odd
    columns from column odd_at on. With `col_block` (NVFP4, `Tiles.down16`: stage 1's block_n) the act is fp16,
    prescaled per row and col_block columns, and the input after the weights gives each row's 2^-s per column
    block: fp16 products, each K step's scaled back by its rows' 2^-s (asm: the codes decoded by inline PTX).
    `sahead` (NVFP4, `Tiles.sahead`): each K step's group scales loaded a step ahead."""
    s16_ref = None
    if col_block:
        *rest, y_ref = rest
        *rest, s16_ref = rest
        rest = (*rest, y_ref)
    a_refs, w_refs, y_ref, s, j, e, kw, col = _unpack(experts_ref, rest, fmt, bk, aligned)
    dt = y_ref.dtype
    offsets = (0, odd_at) if len(a_refs) == 2 else (0,)
    rows = y_ref.shape[1]

    @pl.when(e < n_exp)
    def _():
        n_steps = inter // bk
        ahead = sahead and fmt == "nvfp4"

        def scales(kk):             # step kk's group scales (the last step's again past the end)
            k0 = pl.multiple_of(jnp.minimum(kk, n_steps - 1) * bk, bk)
            return _nvfp4_scales(w_refs, e, pl.ds(j * bn, bn), k0, bk, meta, aligned)

        def step(kk, carry):
            acc, sc = carry if ahead else (carry, None)
            nxt = scales(kk + 1) if ahead else None             # in flight during this step's products
            k0 = pl.multiple_of(kk * bk, bk)
            a = [r[s, :, pl.ds(o + col(k0), kw)] for r, o in zip(a_refs, offsets)]
            if not col_block:
                w = _weight_tile(fmt, w_refs, e, j * bn, bn, k0, bk, dt, meta, aligned=aligned, sc=sc)
                acc = _tile_dot(acc, a, w, fuse)
            else:
                w = _f16_tile(w_refs, e, j * bn, bn, k0, bk, meta, aligned=aligned, asm=asm, sc=sc)
                part = _tile_dot(jnp.zeros((rows, bn), F32), a, w, fuse)
                acc = acc + part * s16_ref[s, (kk * bk) // col_block, :][:, None]
            return (acc, nxt) if ahead else acc

        zero = jnp.zeros((rows, bn), F32)
        acc = jax.lax.fori_loop(0, n_steps, step, (zero, scales(0)) if ahead else zero)
        acc = acc[0] if ahead else acc
        if col_block:       # the row's global scale (x 2^14: the fp16 codes' 2^-14)
            acc = acc * (w_refs[2][e, pl.ds(j * bn, bn)].astype(F32) * kernel_math.E2M1_F16_SCALE)[None, :]
        y_ref[s, :, pl.ds(j * bn, bn)] = acc.astype(dt)


def _check(fmt, meta, rows_tile, k_tile, name, shape):
    if fmt == "fp8_block":
        bo, bi = meta
        if bo % rows_tile or bi % k_tile:
            raise NotImplementedError(f"Pallas MoE: {name} FP8 blocks {meta} must be multiples of the tile "
                                      f"({rows_tile} rows x {k_tile} inputs); use impl='gather'")
    if fmt == "nvfp4" and (k_tile % meta or (meta // 2) & (meta // 2 - 1)):
        raise NotImplementedError(f"Pallas MoE: {name} NVFP4 group {meta} must divide the tile width {k_tile} "
                                  "(and be twice a power of two); use impl='gather'")


# The prefill blocks' tiles, measured on the H200 (BENCHMARKS.md, tenth session; released shapes, blocks of 64
# rows): M = 1024 tokens, bf16 experts, 2.55 ms against 2.93 ms at 64-wide tiles (XLA's grouped matmul 7.90 ms).
BLOCK_TILES = Tiles(block_n=128, block_k=64, block_n2=128, block_k2=64, num_warps=8)
# NVFP4 experts decode each tile with integer ops first; 64-wide tiles with 4 warps measured faster (fifteenth
# session, 95044db): 1,024 tokens 4.40 ms against 6.11 ms at BLOCK_TILES, 4,096 tokens 8.54 against 11.78 ms.
# With `mma16` (the gate/up on fp16 tensor cores, no fp32 / bf16 step per weight) the NVFP4 blocks took 6.35 ms
# against 6.88 ms for 4,096 tokens (H100, 75817ec, one run each; compiled tests passed there): on by default.
BLOCK_TILES_BY_FORMAT = {"nvfp4": Tiles(block_n=64, block_k=64, block_n2=64, block_k2=64, mma16=1, dot_acc=1,
                                         sahead=1)}


BLOCK_TILES_ENV = "FNX_MOE_BLOCK_TILES"     # a benchmark knob: fields replaced in the prefill blocks' tiles


def block_tiles(gate_up) -> Tiles:
    """The prefill blocks' default tiles for these experts' format (before shrinking to the dims), with the fields
    FNX_MOE_BLOCK_TILES names replaced (e.g. "split_act=1"; read when a program is traced)."""
    t = BLOCK_TILES_BY_FORMAT.get(reference.weight_format(gate_up), BLOCK_TILES)
    spec = os.environ.get(BLOCK_TILES_ENV, "").strip()
    if spec:
        from fnx.pallas import dispatch
        t = dataclasses.replace(t, **dispatch.fields_override(spec, Tiles, BLOCK_TILES_ENV))
    return t


def default_tiles(d: int, inter: int, base: Tiles | None = None) -> Tiles:
    """`base` (the decode defaults: Tiles()) shrunk to the (test-sized) dims."""
    t = base or Tiles()
    bn = min(t.block_n, _pow2(inter))
    while inter % bn:
        bn //= 2
    return dataclasses.replace(t, block_n=bn, block_k=min(t.block_k, d), block_n2=min(t.block_n2, d),
                               block_k2=min(t.block_k2, inter))


def tiles_not_applicable(gate_up, down, tiles: Tiles) -> str | None:
    """None when `tiles` fit these weights' dims and quantization blocks, else why not."""
    d, inter = down.shape[1], down.shape[-1]
    bn, bk, bn2, bk2 = tiles.block_n, tiles.block_k, tiles.block_n2, tiles.block_k2
    if inter % bn or d % bk or d % bn2 or inter % bk2 or min(bn, bk, bn2, bk2) < 16:
        return f"Pallas MoE tiles {tiles} do not divide D={d}, I={inter} (or are < 16)"
    if tiles.split_act and bn < 2 * MIN_ROWS:
        return f"Pallas MoE tiles {tiles}: split_act computes two tiles of block_n / 2 >= {MIN_ROWS} columns"
    if tiles.down16 and reference.weight_format(down) == "nvfp4" and bn % bk2:
        return (f"Pallas MoE tiles {tiles}: down16 scales each K step of stage 2 by one stage-1 column block, so "
                f"block_n ({bn}) must be a multiple of block_k2 ({bk2})")
    try:
        fmt1, _, meta1 = reference.kernel_operands(gate_up)
        fmt2, _, meta2 = reference.kernel_operands(down)
        if tiles.mma16 and fmt1 == "fp8_block" and d % meta1[1]:
            return f"Pallas MoE tiles {tiles}: mma16 over FP8 experts takes D={d} in whole {meta1[1]}-column blocks"
        _check(fmt1, meta1, bn, bk, "gate_up_proj", gate_up.shape)
        _check(fmt2, meta2, bn2, bk2, "down_proj", down.shape)
    except NotImplementedError as e:
        return str(e)
    return None


GATHER_ENV = "FNX_MOE_KERNEL_GATHER"


def kernel_gather() -> bool:
    """Whether the gate/up kernel reads a block's rows from the token rows itself (`FNX_MOE_KERNEL_GATHER`, read
    when a program is traced; on by default, `=0` off) where `row_of` is given, instead of XLA gathering the
    prepared rows into a [blocks, B, D] buffer first (at 2,048 tokens that gather wrote and the kernel read ~270 MB a
    layer). The same values: the same rows meet the same tiles. Measured on an H100 (4 layers, 2026-12-06, c20cb50):
    a 2,048-token prefill chunk 18,102 against 18,888 us of kernels (the gather's 396 us gone and the gate/up
    kernels 401 us faster, their rows now mostly from L2), a 512-token chunk 5,692 against 5,902."""
    v = os.environ.get(GATHER_ENV, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{GATHER_ENV}={v!r}: use 1 (the kernel gathers the rows) or 0 (XLA gathers them first)")
    return v == "1"


def experts_slots(gate_up, down, x: jax.Array, experts: jax.Array, *, interpret: bool = False,
                  tiles: Tiles | None = None, row_of: jax.Array | None = None,
                  gather: bool | None = None) -> jax.Array:
    """x [M, D] (every slot's tokens) or [S, M, D] (each slot its own rows: the prefill blocks), experts [S] int32
    (empty slots = E) -> y [S, Mp, D] (x.dtype): row t of slot s is expert experts[s] applied to row t of its
    tokens (rows >= M and empty slots are unspecified). With `row_of` [S, M] int32, x is rows [R, D] and slot s's
    row t is x[row_of[s, t]]: the kernels' row-wise operand preparation (the even / odd columns, the fp16
    prescale) runs on the R rows, then its results are gathered into the slots (the same values as gathering x
    first: every step is per row): by XLA into a slot buffer, or with `gather` (None: `kernel_gather()`) by the
    gate/up kernel itself, each program reading its slot's rows from the prepared rows."""
    per_slot = x.ndim == 3 or row_of is not None
    m, d = (row_of.shape[1], x.shape[-1]) if row_of is not None else x.shape[-2:]
    n_exp, two_i, _ = gate_up.shape
    inter = two_i // 2
    if m > (MAX_BLOCK_ROWS if per_slot else MAX_TOKENS):
        raise NotImplementedError(f"the Pallas MoE decode kernel takes M <= {MAX_TOKENS} tokens (blocks of up to "
                                  f"{MAX_BLOCK_ROWS} rows), got {m}; use impl='grouped' for prefill")
    tiles = tiles or default_tiles(d, inter)
    why = tiles_not_applicable(gate_up, down, tiles)
    if why:
        raise NotImplementedError(why)
    bn, bk, bn2, bk2 = tiles.block_n, tiles.block_k, tiles.block_n2, tiles.block_k2
    fmt1, w1, meta1 = reference.kernel_operands(gate_up)
    fmt2, w2, meta2 = reference.kernel_operands(down)
    s = experts.shape[0]
    mp = max(MIN_ROWS, _pow2(m))
    dt = x.dtype
    params = plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    # NVFP4: the activations split into their even and odd columns here (a copy of activations only), so each
    # nibble of a packed byte meets its own contiguous activation tile
    xs = (x[..., 0::2], x[..., 1::2]) if fmt1 == "nvfp4" else (x,)
    split = bool(tiles.split_act) and fmt2 == "nvfp4"
    split_store = bool(tiles.split_store) and fmt2 == "nvfp4" and not split
    mma16 = bool(tiles.mma16) and fmt1 in ("nvfp4", "fp8_block")
    back = ()
    if mma16:       # each row into fp16's range by a power of two (exact both ways), its 2^-s for the kernel
        up, down_s = kernel_math.hfma_prescale(jnp.max(jnp.abs(x.astype(F32)), axis=-1))
        xh = (x.astype(F32) * up[..., None]).astype(jnp.float16)
        xs, back = ((xh[..., 0::2], xh[..., 1::2]) if fmt1 == "nvfp4" else (xh,)), (down_s,)
    gather = row_of is not None and (kernel_gather() if gather is None else gather)
    down16 = bool(tiles.down16) and fmt2 == "nvfp4"
    asm = bool(tiles.e2m1_asm) and not interpret
    lead = ()
    if gather:                  # the kernel reads its rows; rows past m name row 0 (their results are unused)
        lead = (jnp.pad(row_of.astype(jnp.int32), ((0, 0), (0, mp - m))),)
    elif row_of is not None:    # the prepared rows into their slots
        xs, back = tuple(a[row_of] for a in xs), tuple(a[row_of] for a in back)
    act_shape = jax.ShapeDtypeStruct((s, mp, inter), jnp.float16 if down16 else dt)
    act = stacked.call(     # expert weights may be layers of stacks (fnx.pallas.stacked): read in place
        functools.partial(_gate_up_kernel, fmt=fmt1, meta=meta1, n_exp=n_exp, m=m, mp=mp, inter=inter, d=d,
                          bn=bn, bk=bk, per_slot=per_slot, split=split, mma16=mma16, gather=gather,
                          split_store=split_store, aligned=bool(tiles.aligned),
                          asm=asm and mma16 and fmt1 == "nvfp4", fuse=bool(tiles.dot_acc),
                          down16=jnp.dtype(dt) if down16 else None, sahead=bool(tiles.sahead)),
        (experts, *lead, *xs, *w1, *back),
        out_shape=(act_shape, jax.ShapeDtypeStruct((s, inter // bn, mp), F32)) if down16 else act_shape,
        grid=(s, inter // bn),
        interpret=interpret, compiler_params=params, name="moe_gate_up",
    )
    act, back16 = act if down16 else (act, None)
    halves = split or split_store               # the act buffer holds the even columns, then the odd ones
    acts = (act, act) if halves else (act[:, :, 0::2], act[:, :, 1::2]) if fmt2 == "nvfp4" else (act,)
    return stacked.call(
        functools.partial(_down_kernel, fmt=fmt2, meta=meta2, n_exp=n_exp, inter=inter, bn=bn2, bk=bk2,
                          odd_at=inter // 2 if halves else 0, aligned=bool(tiles.aligned),
                          fuse=bool(tiles.dot_acc), col_block=bn if down16 else 0, asm=asm,
                          sahead=bool(tiles.sahead)),
        (experts, *acts, *w2, *((back16,) if down16 else ())),
        out_shape=jax.ShapeDtypeStruct((s, mp, d), dt),
        grid=(s, d // bn2),
        interpret=interpret, compiler_params=params, name="moe_down",
    )


def experts(gate_up, down, x: jax.Array, idx: jax.Array, *, interpret: bool = False,
            tiles: Tiles | None = None) -> jax.Array:
    """x [M, D], idx [M, K] -> per-(token, k) outputs [M, K, D], as reference.experts."""
    m = x.shape[0]
    uniq, slot = reference.dedupe(idx, gate_up.shape[0])
    y = experts_slots(gate_up, down, x, uniq, interpret=interpret, tiles=tiles)
    return y[slot, jnp.arange(m)[:, None]]


def experts_blocks(gate_up, down, xb: jax.Array, block_expert: jax.Array, *, interpret: bool = False,
                   tiles: Tiles | None = None, row_of: jax.Array | None = None) -> jax.Array:
    """The prefill grouped matmul: xb [n_blocks, B, D] (rows of one expert per block, zero padded),
    block_expert [n_blocks] int32 (E: an unused block, skipped, its rows unspecified) -> y [n_blocks, B, D]
    (x.dtype), each block's rows through its expert; each
    block reads its expert's weights once (tensor-core tiles of B rows). The sort into blocks and the gather back
    are the caller's (fnx.model.moe._expert_grouped). With `row_of` [n_blocks, B], xb is the rows [R, D] the
    blocks take theirs from (`experts_slots`)."""
    b = row_of.shape[1] if row_of is not None else xb.shape[1]
    why = blocks_not_applicable(gate_up, down, b, tiles)
    if why:
        raise NotImplementedError(f"Pallas grouped MoE: {why}")
    tiles = tiles or default_tiles(xb.shape[-1], down.shape[-1], block_tiles(gate_up))
    return experts_slots(gate_up, down, xb, block_expert, interpret=interpret, tiles=tiles, row_of=row_of)[:, :b]


def blocks_not_applicable(gate_up, down, b: int, tiles: Tiles | None = None) -> str | None:
    """None when experts_blocks serves blocks of `b` rows of these weights (at `tiles`, default `block_tiles`
    shrunk to the dims), else why not."""
    if b & (b - 1) or b < MIN_ROWS or b > MAX_BLOCK_ROWS:
        return f"block rows must be a power of two in [{MIN_ROWS}, {MAX_BLOCK_ROWS}], got {b}"
    return tiles_not_applicable(gate_up, down,
                                tiles or default_tiles(down.shape[1], down.shape[-1], block_tiles(gate_up)))
