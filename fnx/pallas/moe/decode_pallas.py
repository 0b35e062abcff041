"""The MoE decode layer after its router in two Pallas (Triton lowering) launches, for M <= MAX_TOKENS tokens:
routed experts (gate/up, SiLU x up, down), the weighted combine and the sigmoid-gated shared expert.

Inputs: x [M, D]; the routing (weights w [M, K] in x.dtype, ids [M, K]); the shared expert's gate and up
projections and its gate logit (the model computes them in the router's fused GEMV); the expert and shared-expert
weights. The M*K (token, k) pairs are the slots, in token-major order. Slot s owns its expert when no earlier slot
holds the same id: owners compute, the other slots do nothing, so each distinct expert's weights are read once
(weight-major) and applied to every token.

Kernel 1, grid (M*K, I / bn): an owner slot's gate rows [j*bn, +bn) and up rows [I + j*bn, +bn) over the whole D
axis (the D / cw chunk loads unrolled, every load issued before the arithmetic), multiplied in fp32 on the CUDA
cores for each token ("fma", no token padding), rounded to x.dtype, a = silu(g) * u rounded as the reference;
act [M*K, M, I].
Kernel 2, output columns [j*bn2, +bn2) of every token. For an owner slot, its expert's down rows over the whole I
axis, out = round(act @ down.T), and for each token routed to that expert the product round(out * w), added in
fp32. Non-owner slots mask their weight loads (no memory traffic) and add nothing. The shared expert:
a = silu(gate) * up (rounded as the reference), round(a @ shared_down.T), times round(sigmoid(gate logit)); the
result is round(round(routed sum) + shared). `DecodeTiles.group` = 0: grid (D / bn2,), each program walks every
slot in order, then the shared expert, and writes y. `group` = g: grid (D / bn2, M*K / g + 1), each program takes
g slots and writes their fp32 partial sum, the last grid row writes the shared term; one XLA fusion sums the
partials in slot order, rounds, and adds the shared term (more programs: the measured default).

Order of the combine: token 0's experts are its own slots, so its fp32 sum runs in k order, as the reference's.
A later token whose expert an earlier token also chose adds that term at the owner's place: the same terms, a
different fp32 order (an ulp of the sum at most). Deterministic: no atomics, a fixed order.

Variants (`DecodeTiles`): `acc` 1 keeps one token's gate/up products as tiles over the D chunks and sums each row
once; `e2m1` "f16" reads NVFP4 codes through fp16 bits (the same weights); `meta` 1 computes each slot's owner
flag, token choices and routing weights once per call (`slot_meta`) instead of in every program (`meta` 2: kernel 1
finds them and writes them for kernel 2, without the extra XLA launch); `hoist` 1 has a
kernel-2 program issue every slot's weight loads (and the shared expert's) before its arithmetic, so that group 0
(no partials and no XLA sum: one launch fewer per layer) waits one memory round trip, not one per slot; `tok` 1
runs kernel 2 as one program per (output tile, token) over that token's K experts in k order (their loads first,
the combine in the kernel): each token's row has the bits of that token run alone, and an expert two tokens chose
is read by both (the second read mostly from L2); `dot` 1 multiplies each owner slot's dequantized tile (exact in
bf16) with the token rows padded to 16 on the tensor cores, every token at once (no per-token branch; `dot` 2 with
the chunks in a loop whose loads Triton pipelines `stages` deep). The shared expert's inputs may be windows (buffer, start
column) into the fused router / shared-expert products.

Weights: dense arrays (rounded to x.dtype as the reference does) or FP8 E4M3 with one fp32 scale per 128x128
block, each element dequantized as round(q * scale) to x.dtype, exactly the reference dequantizer's value; NVFP4
(E2M1 codes decoded with integer ops, E4M3 scales per 16 values, the fp32 global per row, (code * scale) * global
rounded once as the reference): the low and high nibbles meet the even and odd activation columns, loaded with a
stride of 2, so no tile is ever interleaved. With `DecodeTiles.wround` 0 (the measured default for FP8 and NVFP4)
no weight is rounded: FP8 block scales multiply the activation columns and NVFP4's global multiplies each row's
sum, as the GEMV kernels do; the results then differ from the reference by the weights' bf16 rounding. NVFP4 with
`DecodeTiles.gsum` 1 (and wround 0) also leaves the group scales off the weights: each 16-value group's products
are summed first and its scale multiplies the sum (other formats ignore it)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fnx.pallas import dispatch, kernel_math, stacked
from fnx.pallas.kernel_math import rnd
from fnx.pallas.moe import reference

F32 = jnp.float32
MAX_TOKENS = 8          # the CUDA-core multiply does M x the arithmetic per weight byte: small M only
UNROLL_SLOTS = 16       # kernel 2 unrolls its slot loop up to here (M = 1: the K slots), else a fori_loop
FORMATS = ("dense", "fp8_block", "nvfp4")
E2M1_DECODES = ("int", "f16", "asm", "asmq", "asmi", "hfma", "hfmab", "mma")
_HFMA = ("hfma", "hfma_jnp", "hfmab", "hfmab_jnp")     # "_jnp": the interpreter's form of the PTX block
_MMA = ("mma", "mma_jnp")
MMA_DECODES = _MMA      # the decodes whose kernel 1 takes `mma_activations(x)` as its activation operand


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    bn: int = 8          # kernel 1: intermediate columns per program (gate and up rows each)
    cw: int = 512        # kernel 1: D columns per unrolled load (FP8: divides 128 or a multiple of 128)
    bn2: int = 16        # kernel 2: output columns per program
    cw2: int = 128       # kernel 2: I columns per unrolled load (divides I, I_shared and, for FP8, 128)
    group: int = 0       # kernel 2: 0 = one program per output tile walks every slot and combines in the kernel;
                         # g > 0 = g slots per program (g divides M*K), fp32 partials summed by one XLA fusion
    num_warps: int = 4
    num_warps2: int = 4
    acc: int = 0         # one token: 0 = each chunk's products summed across the row at once (a cross-thread
                         # reduction per chunk); 1 = kept as tiles, added elementwise, summed once per row (more
                         # registers, one reduction). More tokens: 0 = a row reduction per chunk and routed token;
                         # 1 = each routed token's products summed per 16 columns (`_part_sums`; with gsum, the
                         # scaled NVFP4 group sums) and kept as a [bn, cw/16] tile over the chunks, one row
                         # reduction per token at the end (gate/up, the routed down terms and the shared expert's)
    e2m1: str = "int"    # NVFP4 codes: "int" (fp32 bits built from the fields), "f16" (the code placed as fp16
                         # bits, one conversion; 2^14 folded into the group scale), "asm" (the f16 placement for
                         # four bytes per inline-PTX block, two codes per integer op: `kernel_math._E2M1_ASM`; on
                         # a GPU only, the interpreter runs "f16"), "asmq" (the same placed from shifts of the
                         # whole 32-bit word, no byte permutes: `kernel_math._e2m1_asm_q`), "asmi" (each pair of
                         # codes masked out, the shifts as integer multiplies: the FMA pipe, not the ALU pipe;
                         # `kernel_math._e2m1_asm_i`): the same values.
                         # "hfma" (one token, gsum 1, acc 1): each group's codes decoded and multiplied with the
                         # activations in half2 inside one inline-PTX block (`kernel_math.e2m1_hfma_group_sums`),
                         # the activations scaled by a power
                         # of two per row into fp16's range first; the interpreter runs the same fp16 arithmetic.
                         # "hfmab": the same byte by byte (elementwise: no assumption on Triton's register layout;
                         # each byte's two products summed in fp16, a group's 8 bytes in fp32)
                         # "mma" (kernel 1 at one token, acc 1, wround 0): the gate and up codes of the same columns
                         # as the A fragment of one tensor-core MMA per lane, its activations as B, the lanes' D
                         # fragments accumulated and the diagonal kept once (`kernel_math.E2M1_MMA_ASM`,
                         # `E2M1_MMA_DIAG_ASM`; no FMA and no conversion per weight); the activations' fp16 pairs
                         # and each token's 2^-s computed once before the launch (`mma_activations`); kernel 2
                         # decodes with "asm"; the interpreter runs the same products in jnp. Its first form
                         # (prescale per program, a select per block) measured on the H200: 32% fewer instructions,
                         # 127 registers, half the occupancy, slower (moe README); this form (precomputed pairs,
                         # accumulated fragments) at 8 rows is the five-token NVFP4 default (`MEASURED_TOKENS`).
                         # Its tiles must give each lane 4 consecutive code bytes of one row (`_mma_fits`)
    meta: int = 0        # 0: each program finds from the slot ids whether its slot owns its expert, which tokens
                         # chose it and their routing weights (a few reductions over the M*K ids per program);
                         # 1: one XLA fusion computes them for every slot first and the programs load them;
                         # 2: kernel 1 finds them as in 0 and its first program per slot writes them, so kernel
                         # 2's programs load them (the reductions once per slot, no extra launch)
    hoist: int = 0       # kernel 2: 0 = each slot's weight loads are issued when its turn comes; 1 = every slot's
                         # of the program and the shared expert's are issued before any arithmetic (one memory
                         # round trip per program instead of one per slot: what a program walking all K slots,
                         # group 0, waits on; the slots must be unrolled, M*K <= UNROLL_SLOTS, or grouped)
    tok: int = 0         # kernel 2: 1 = one program per (output tile, token), walking that token's K experts in k
                         # order with their loads issued first, the combine in the kernel (group 0): M*D/bn2
                         # programs of K slots where group 1 runs M*K*D/bn2 of one slot, each a token's terms in
                         # the reference's order; an expert two tokens chose is read twice (the second from L2)
    wround: int = 1      # 1: every dequantized FP8 / NVFP4 weight rounded to x.dtype, as the reference's
                         # dequantize-then-matmul; 0: the scales applied in fp32 and no weight rounded, as the GEMV
                         # kernels do (FP8: each 128-column block's scale on the activation columns; NVFP4: code *
                         # group scale, exact in fp32, and the row's global on the row's sum): fewer instructions per
                         # weight, results within the weights' bf16 rounding of the reference
    gsum: int = 0        # NVFP4 with wround 0: 1 = each 16-value group's products summed first and its scale applied
                         # to the group sum (one multiply per group instead of one per weight, and the scales are
                         # not spread over the tile's columns); the scales then enter in a different fp32 order.
                         # Other formats ignore it
    tmajor: int = 0      # several tokens: 0 = for each weight chunk, a branch per routed token whose activation load
                         # sits inside it (the loads wait one after another: a memory round trip per chunk);
                         # 1 = a branch per routed token around all of its chunks, so that token's activation loads
                         # are issued together (the weights decoded in that branch: an expert two tokens chose
                         # decodes twice). The same products in the same order per token (in the interpreter the
                         # results agree within an output rounding: XLA compiles a branch's arithmetic on its own).
                         # One token: no branch
    branch: int = 1      # several tokens: 1 = the products of a token not routed to the slot's expert are skipped
                         # by a branch (most experts serve one of the five tokens, but each branch's activation
                         # loads wait behind its condition); 0 = every token's products computed without a branch
                         # (M x the multiply-adds per weight; every load issued up front) and the terms of tokens not
                         # routed there discarded: the same values for the routed ones; 2 = branches in the gate/up
                         # kernel only, 3 = in the down kernel only. One token: no branch
    dot: int = 0         # 1 = the routed experts' products on the tensor cores: each owner slot's dequantized tile
                         # (exact in bf16: FP8 codes, NVFP4 code * group scale) times the token rows padded to 16
                         # (`_token_rows`: rows past M repeat row M - 1, never stored) in one `dot` per chunk, fp32
                         # accumulation; FP8 block scales and NVFP4 globals on the partial / row sums (wround 0) or
                         # in the rounded weights (wround 1). Every token's products at once, so no per-token
                         # branch (branch, tmajor ignored); the shared expert stays on the CUDA cores. Needs bf16
                         # activations, bn and bn2 >= 16, gsum 0, tok 0, FP8 chunks of at most one 128-column block.
                         # 2 = the same with the chunks in a loop (`lax.fori_loop`), whose loads Triton pipelines
                         # `stages` deep, instead of every chunk's loads issued up front (registers for one chunk)
    stages: int = 1      # Triton's num_stages for both launches (software pipelining of looped loads: dot 2)
    flat: int = 0        # several tokens: 1 = every (token, k) slot computes its own token's products alone, as a
                         # one-token slot does: no owner reduction, no per-token branch, one token's activation row
                         # per program, and the down terms' partials summed per token in k order (the reference's
                         # order) by the XLA combine; the last M rows of the down grid compute each token's shared
                         # expert. An expert two tokens chose is read by both slots (the second read mostly from L2;
                         # at five tokens ~48 of the 50 pairs hold distinct experts). Needs group g dividing K, meta 0,
                         # tok 0 and dot 0; the one-token tiles apply (`default_tiles`). One token: the same kernels
    x2d: int = 0         # 1 = the activations of the routed products loaded as [rows, columns] tiles shaped like the
                         # weight tiles (Triton gives both one register layout: no shared-memory round trip to spread
                         # one activation vector over the rows); NVFP4 reads its even and odd columns as two contiguous
                         # halves: x is passed with each cw chunk's even columns first, then its odd (`pair_columns`,
                         # one XLA op), and the gate/up kernel writes the activation rows so for the down kernel's cw2
                         # chunks. The same products in the same order. Not with e2m1 "hfma"/"hfmab", dot or tok
    persist: int = 0     # kernel 1 (gate/up) as this many resident programs (0: one program per (slot, row tile)),
                         # each walking its share of the tasks with the next task's weight loads issued before the
                         # current task's arithmetic (`_gate_up_persist_kernel`): the expert id -> weight address ->
                         # weights round trips of one task overlap another's decode. One token per slot (M = 1 or
                         # flat 1), acc 1, meta 0, dot 0. The same values
    persist2: int = 0    # kernel 2 (down) likewise (`_down_persist_kernel`): resident programs walking the (slot group,
                         # column tile) tasks with the next task's down-row loads issued first, then the shared-expert
                         # tasks. One token per slot, a group g > 0, meta 0, tok 0, dot 0. The same values
    mma2: int = 0        # kernel 2 (down) on NVFP4 with e2m1 "mma" (1): each program's bn2 rows as two halves at the
                         # same columns, the A fragment's two row groups of one MMA per lane (as kernel 1's gate and
                         # up rows), the slot's activation row scaled by a power of two into fp16's range in the
                         # program (`_hx_prescale`) and loaded as fp16 pairs per chunk (`_one_token_down_mma`).
                         # One token per slot (M = 1 or flat 1), a group g > 0, wround 0, meta 0, tok 0, dot 0,
                         # x2d 0, hoist 0, persist2 0, and each half's code tile at least 4 bytes per lane:
                         # (bn2 / 2) * cw2 >= 256 * num_warps2, cw2 >= 128. The interpreter runs the jnp products.
                         # Measured level on the H200 (thirty-second session, moe README): off. 2: the same with
                         # kernel 1's output turned into fp16 pairs and each slot's 2^-s by one XLA fusion between
                         # the launches (`mma_activations`), as kernel 1's "mma" takes x: no prescale per program
    ahead: int = 0       # kernel 1 with e2m1 "mma": 0 = every chunk's weight loads issued before any arithmetic (all
                         # of a program's code bytes live in registers at once); k > 0 = the loads of chunk c + k
                         # issued when chunk c is computed (at most k + 1 chunks live: fewer registers per program,
                         # more programs per SM; the same values)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _load(ref, idx, shape, mask):
    """ref[idx], or a masked load (masked-off lanes load nothing and hold unspecified values: the caller
    discards their products; an FP8 or integer fill value does not lower for every dtype)."""
    if mask is None:
        return ref[idx]
    return plgpu.load(ref.at[idx], mask=jnp.full(shape, mask))


def _raw(fmt, refs, lead, r0, rows, c0, cw, mask=None):
    """The loads of rows [r0, r0+rows) x columns [c0, c0+cw) of a weight (`lead`: the expert index, or () for a
    2-D weight), as stored: a kernel issues every chunk's loads first and dequantizes chunk by chunk (`_deq`), so
    the loads are in flight together while only one chunk's fp32 tile is live (with several tokens each tile is
    used several times; dequantizing every chunk up front would keep them all in registers)."""
    w_ref = refs[0]
    if fmt == "nvfp4":
        group = 16
        return (_load(w_ref, (*lead, pl.ds(r0, rows), pl.ds(c0 // 2, cw // 2)), (rows, cw // 2), mask),
                _load(refs[1], (*lead, pl.ds(r0, rows), pl.ds(c0 // group, cw // group)), (rows, cw // group), mask),
                _load(refs[2], (*lead, pl.ds(r0, rows)), (rows,), mask))
    q = _load(w_ref, (*lead, pl.ds(r0, rows), pl.ds(c0, cw)), (rows, cw), mask)
    if fmt != "fp8_block":
        return (q,)
    if cw <= 128:
        return q, refs[1][(*lead, r0 // 128, c0 // 128)]
    return q, refs[1][(*lead, r0 // 128, pl.ds(c0 // 128, cw // 128))]


def _e2m1_f16(c):
    """E2M1 codes -> value * 2^-14 in fp32, through fp16 bits (`kernel_math.e2m1_f16`; the conversion is exact)."""
    return kernel_math.e2m1_f16(c).astype(F32)


class _Chunks:
    """A program's weight chunks (`_raw` loads of chunk c = load(c)), issued in order: all n at once (ahead 0), or
    each chunk's when the chunk `ahead` before it is first used (`DecodeTiles.ahead`). Indexing returns the loads."""

    def __init__(self, load, n: int, ahead: int = 0):
        self._load, self._n, self._ahead, self._got = load, n, ahead, []
        if not ahead:
            self._issue(n - 1)

    def _issue(self, last: int):
        while len(self._got) <= min(last, self._n - 1):
            self._got.append(self._load(len(self._got)))

    def __getitem__(self, c: int):
        self._issue(c + self._ahead)
        return self._got[c]

    def __len__(self) -> int:
        return self._n


class _Grouped:
    """An NVFP4 chunk for group sums (`DecodeTiles.gsum`): the (low, high) nibble code tiles [rows, cw/2] without
    their scales, and the group scales [rows, cw/16] in fp32 (with E2M1_F16_SCALE folded in for the fp16-bit
    decodes): `_group_sums` multiplies each 16-value group's sum once."""

    def __init__(self, codes, sc):
        self.codes, self.sc = codes, sc


class _Packed(_Grouped):
    """An NVFP4 chunk for e2m1 "hfma" / "hfmab": the packed bytes [rows, cw/2] (decoded inside the product) and the
    group scales as `_Grouped`'s; mode: the e2m1 value (a "_jnp" mode: the PTX block's fp16 arithmetic in jnp, for
    the interpreter)."""

    def __init__(self, packed, sc, mode):
        self.packed, self.sc, self.mode = packed, sc, mode


def _group_sums(g, xs):
    """[rows, cw/16]: per row and 16-column group, sum_c code * x over its 8 low and 8 high nibble columns, times
    the group's scale. A byte's two codes are the same group's: packed columns [8j, 8j+8) are group j.
    A `_Packed` chunk takes `_hx`'s activations and sums in fp16 (`kernel_math.e2m1_hfma_group_sums`)."""
    if isinstance(g, _Packed):
        sums = kernel_math.e2m1_hfma_byte_group_sums if g.mode.startswith("hfmab") else \
            kernel_math.e2m1_hfma_group_sums
        return sums(g.packed, xs, asm=not g.mode.endswith("_jnp")) * g.sc
    rows, half = g.codes[0].shape
    part = None
    for c, x in zip(g.codes, xs):
        t = jnp.sum((c * _bx(x)).reshape(rows, half // 8, 8), axis=2)
        part = t if part is None else part + t
    return part * g.sc


def _deq(fmt, raw, rows, cw, dt, e2m1="int", wround=True, gsum=False):
    """A chunk loaded by `_raw`, dequantized in fp32 and rounded to dt as the reference does, in fp32: a tuple of
    one [rows, cw] tile, or for NVFP4 two [rows, cw/2] tiles, the even and the odd columns (the low and high
    nibbles as the bytes hold them: never interleaved; `_xs` loads the matching activation columns). NVFP4 with
    e2m1 "f16": code * 2^-14 times (scale * 2^14) is code * scale exactly (a power of two moves between two exact
    factors), so the product with the global scale rounds as the reference's. Without `wround` no weight is
    rounded and the scales that `_col_scale` / `_row_scale` return are left out: FP8 gives q, NVFP4 code * scale
    (exact in fp32). A dense weight already in dt (or bf16 under fp32) rounds to itself: no rounding is issued.
    NVFP4 with `gsum` (and no `wround`): a `_Grouped`, the codes and the unspread group scales."""
    if fmt == "nvfp4":
        group = 16
        p, sc, s2 = raw
        sc = sc.astype(F32)
        if e2m1 in ("f16", "asm", "asmq", "asmi") + _HFMA:
            sc = sc * kernel_math.E2M1_F16_SCALE
        if e2m1 in _HFMA:
            return _Packed(p, sc, e2m1)      # `check`: gsum 1, wround 0
        if e2m1 in ("asm", "asmq", "asmi"):
            codes = kernel_math.e2m1_pair_f32(p, asm=True,
                                              variant={"asm": "prmt", "asmq": "shifts", "asmi": "imad"}[e2m1])
        else:
            p = p.astype(jnp.uint32)
            code = _e2m1_f16 if e2m1 == "f16" else reference.e2m1_bits_to_f32
            codes = (code(p & 0xF), code(p >> 4))
        if gsum and not wround:
            return _Grouped(codes, sc)
        sc = kernel_math.group_bytes(sc, group)
        if not wround:
            return tuple(c * sc for c in codes)
        s2 = s2[:, None]
        return tuple(rnd(c * sc * s2, dt) for c in codes)
    q = raw[0].astype(F32)
    if fmt == "fp8_block":
        if not wround:
            return (q,)
        s = raw[1]
        q = q * kernel_math.block_cols(s, cw)
        return (rnd(q, dt),)
    if _exact_in(raw[0].dtype, dt):
        return (q,)
    return (rnd(q, dt),)


def _exact_in(src, dt) -> bool:
    """True when every src value is a dt value (rounding to dt changes nothing)."""
    src, dt = jnp.dtype(src), jnp.dtype(dt)
    return src == dt or (src == jnp.dtype(jnp.bfloat16) and dt == jnp.dtype(F32))


def _col_scale(fmt, raw, cw, wround):
    """Without `wround`, an FP8 chunk's block scales per activation column (a scalar for one block, else [cw]):
    x * s per column is the scale of every row of the tile (the tile's rows sit in one 128-row block). Else None."""
    if wround or fmt != "fp8_block":
        return None
    return kernel_math.block_cols(raw[1], cw)


def _row_scale(fmt, raw, wround):
    """Without `wround`, an NVFP4 tile's global scale per row [rows], for its row sums. Else None."""
    return raw[2] if not wround and fmt == "nvfp4" else None


def _scaled(xs, cs):
    """Activation pieces times the column scales (`_col_scale`), or as they are."""
    return xs if cs is None else [x * cs for x in xs]


def _rows(acc, rs):
    """Row sums times the row scales (`_row_scale`), or as they are."""
    return acc if rs is None else acc * rs


def _xs(ref, lead, c0, cw, halves, rows: int = 0):
    """Activation columns [c0, c0+cw) of ref[lead] in fp32: one vector, or for NVFP4 weights the even and the odd
    columns (strided loads). Unmasked: a slot that owns no expert reads its (unwritten) act rows too, and its
    products are discarded with `where`, never added. rows > 0 (`DecodeTiles.x2d`): each piece as a [rows, n] tile
    (every row the same), and NVFP4's halves are the chunk's two contiguous halves of a row stored as
    `pair_columns` leaves it (even columns first, then odd)."""
    lead = tuple(jnp.int32(i) if isinstance(i, int) else i for i in lead)
    if rows:
        n = cw // 2 if halves else cw
        cols = lax.broadcasted_iota(jnp.int32, (rows, n), 1)
        at = tuple(jnp.full(cols.shape, i, jnp.int32) for i in lead)
        return [ref[(*at, c0 + h * n + cols)].astype(F32) for h in range(2 if halves else 1)]
    if halves:
        return [ref[(*lead, pl.ds(c0 + h, cw // 2, stride=2))].astype(F32) for h in (0, 1)]
    return [ref[(*lead, pl.ds(c0, cw))].astype(F32)]


def _bx(x):
    """An activation piece against a [rows, n] weight tile: a vector as one row, an x2d tile as it is."""
    return x if x.ndim == 2 else x[None, :]


def pair_columns(x, cw: int):
    """x [..., N] with each chunk of cw columns reordered to its even columns, then its odd: the NVFP4 activation
    layout of `DecodeTiles.x2d` (a byte's low nibble multiplies an even column, its high nibble the odd one)."""
    lead, n = x.shape[:-1], x.shape[-1]
    return jnp.swapaxes(x.reshape(*lead, n // cw, cw // 2, 2), -1, -2).reshape(*lead, n)


def _paired_cols(cols, cw: int):
    """Where `pair_columns` with chunks of cw puts each of the columns `cols` (int32)."""
    r = cols % cw
    return cols - r + (r % 2) * (cw // 2) + r // 2


def _store_act(act_ref, s, i, rg, a, pair):
    """act[s, i, rg:rg+len(a)] = a, or with pair > 0 at the columns `pair_columns(., pair)` gives them."""
    if not pair:
        act_ref[s, i, pl.ds(rg, a.shape[0])] = a
        return
    cols = _paired_cols(rg + lax.broadcasted_iota(jnp.int32, a.shape, 0), pair)
    act_ref[jnp.full(cols.shape, s, jnp.int32), jnp.full(cols.shape, i, jnp.int32), cols] = a


def _hfma(e2m1, fmt) -> bool:
    """True when NVFP4 chunks of this kernel go through e2m1 "hfma" (its activations prescaled, `_hx`)."""
    return fmt == "nvfp4" and e2m1 in _HFMA


def _decode_only(e2m1):
    """The code decode of e2m1 where a kernel needs the codes themselves (the shared expert's terms)."""
    return {"hfma": "asm", "hfmab": "asm", "hfma_jnp": "f16", "hfmab_jnp": "f16", "mma": "asm",
            "mma_jnp": "f16"}.get(e2m1, e2m1)


def mma_activations(x):
    """x [M, D] -> uint32 [M, D/2 + 1] (e2m1 "mma"'s activation operand): per row the fp16 pairs {x'[2p], x'[2p + 1]} of
    x' = x * 2^s (`kernel_math.hfma_prescale` of the row's max |x|, as `_hx_prescale` finds it in a program) and in
    the last column the fp32 bits of 2^-s: computed once per launch instead of in each program."""
    xf = x.astype(F32)
    up, down = kernel_math.hfma_prescale(jnp.max(jnp.abs(xf), axis=1))
    x16 = (xf * up[:, None]).astype(jnp.float16).astype(F32)
    pairs = kernel_math.hfma_pairs(x16[:, 0::2], x16[:, 1::2])
    return jnp.concatenate([pairs, lax.bitcast_convert_type(down, jnp.uint32)[:, None]], axis=1)


def _hx_prescale(ref, lead, n, cw):
    """(2^s, 2^-s) for the activation row ref[lead] of n columns, read in chunks of cw: `kernel_math.hfma_prescale`
    of its max |x|."""
    lead = tuple(jnp.int32(i) if isinstance(i, int) else i for i in lead)
    mx = None
    for c in range(n // cw):
        t = jnp.max(jnp.abs(ref[(*lead, pl.ds(c * cw, cw))].astype(F32)))
        mx = t if mx is None else jnp.maximum(mx, t)
    return kernel_math.hfma_prescale(mx)


def _hx(ref, lead, c0, cw, up, mode):
    """Activation columns [c0, c0+cw) of ref[lead] times `up`, rounded to fp16, as the e2m1 `mode`'s group sums
    take them. "hfma": the half2 pairs {x'[8w+q], x'[8w+q+4]} (`kernel_math.hfma_pairs`, two gathered loads);
    "hfmab": the pairs {x'[2e], x'[2e+1]} (two strided loads); "hfma_jnp": the [cw] vector, "hfmab_jnp": its even
    and odd columns (fp32 holding fp16 values)."""
    lead = tuple(jnp.int32(i) if isinstance(i, int) else i for i in lead)
    to16 = lambda v: (v.astype(F32) * up).astype(jnp.float16).astype(F32)
    if mode == "hfma_jnp":
        return to16(ref[(*lead, pl.ds(c0, cw))])
    if mode.startswith("hfmab"):
        even, odd = (to16(ref[(*lead, pl.ds(c0 + h, cw // 2, stride=2))]) for h in (0, 1))
        return (even, odd) if mode == "hfmab_jnp" else kernel_math.hfma_pairs(even, odd)
    cols = c0 + kernel_math.hfma_pair_columns(cw // 2)
    at = tuple(jnp.full(cols.shape, i, jnp.int32) for i in lead)
    lo = plgpu.load(ref.at[(*at, cols)]).astype(F32) * up
    hi = plgpu.load(ref.at[(*at, cols + 4)]).astype(F32) * up
    return kernel_math.hfma_pairs(lo, hi)


def _part_sums(ws, xs):
    """[rows, cw/16]: per row and 16-column group, sum_c w[r, c] * x[c] over the tile pieces: a `_Grouped` chunk's
    scaled group sums, or the products of each 16 columns of a plain tile summed (8 of each NVFP4 nibble tile:
    packed columns [8j, 8j+8) are group j)."""
    if isinstance(ws, _Grouped):
        return _group_sums(ws, xs)
    per = 16 // len(ws)
    part = None
    for w, x in zip(ws, xs):
        rows, n = w.shape
        t = jnp.sum((w * _bx(x)).reshape(rows, n // per, per), axis=2)
        part = t if part is None else part + t
    return part


def _rowdot(ws, xs):
    """sum_c w[r, c] * x[c] in fp32 over the tile pieces: [rows]."""
    if isinstance(ws, _Grouped):
        return jnp.sum(_group_sums(ws, xs), axis=1)
    acc = jnp.sum(ws[0] * _bx(xs[0]), axis=1)
    for w, x in zip(ws[1:], xs[1:]):
        acc = acc + jnp.sum(w * _bx(x), axis=1)
    return acc


def _tile_fma(acc, ws, xs):
    """acc (a tuple of tiles shaped like ws, or None) + w * x elementwise, per tile piece: no reduction (group
    sums: one [rows, cw/16] tile of scaled group sums)."""
    prods = [_group_sums(ws, xs)] if isinstance(ws, _Grouped) else [w * _bx(x) for w, x in zip(ws, xs)]
    return tuple(prods) if acc is None else tuple(a + p for a, p in zip(acc, prods))


def _tiles_sum(acc):
    """The row sums of `_tile_fma`'s tiles: [rows]."""
    out = jnp.sum(acc[0], axis=1)
    for a in acc[1:]:
        out = out + jnp.sum(a, axis=1)
    return out


def _silu_mul(g, u, dt):
    """silu(g) * u on values already rounded to dt, each step rounded as the reference's dt ops."""
    sig = rnd(1.0 / (1.0 + jnp.exp(-g)), dt)
    return rnd(rnd(g * sig, dt) * u, dt)


def _owner(flat, e, s):
    """True when no slot before s holds expert e (flat: the slot ids, padded with -1)."""
    pos = lax.broadcasted_iota(jnp.int32, flat.shape, 0)
    return jnp.sum(jnp.where((flat == e) & (pos < s), 1, 0)) == 0


def _load_ids(ids_ref, n, sp):
    pos = lax.broadcasted_iota(jnp.int32, (sp,), 0)
    return plgpu.load(ids_ref.at[pl.ds(0, sp)], mask=pos < n, other=-1)


def _routes_to(flat, e, k, i):
    """True when token i routed one of its k experts to e (flat: the slot ids, token-major)."""
    tok = lax.broadcasted_iota(jnp.int32, flat.shape, 0) // k
    return jnp.sum(jnp.where((flat == e) & (tok == i), 1, 0)) > 0


def _accumulate(m, hits, accs, add, branch=True):
    """accs[i] = add(i, accs[i]) for each token; with several tokens only where hits[i] (the tokens routed to this
    slot's expert): a branch per token skips the others' multiply-adds, where at M = 5 most experts serve one token.
    One token is always routed to its own slot's expert: no branch. Without `branch` every token's sum is computed
    (the caller discards those of tokens not routed here)."""
    if m == 1 or not branch:
        return [add(i, accs[i]) for i in range(m)]
    return [lax.cond(hits[i], functools.partial(add, i), lambda a: a, accs[i]) for i in range(m)]


_dot = kernel_math.dot
MP = 16                 # token rows of a `dot` (tl.dot's minimum)


def _token_rows(ref, lead, m, c0, cw, halves):
    """The activation tile rows [0, MP) x columns [c0, c0+cw) of ref[lead] (M rows), in bf16, as `dot`'s left
    operand: rows past M repeat row M - 1 (their products are never kept), so no padded copy exists. For NVFP4
    weights the even and the odd columns (the low and high nibbles' activations)."""
    rows = jnp.minimum(lax.broadcasted_iota(jnp.int32, (MP, cw // 2 if halves else cw), 0), m - 1)
    cols = lax.broadcasted_iota(jnp.int32, rows.shape, 1)
    at = tuple(jnp.full(rows.shape, i, jnp.int32) for i in lead)
    if halves:
        return [ref[(*at, rows, c0 + 2 * cols + h)].astype(jnp.bfloat16) for h in (0, 1)]
    return [ref[(*at, rows, c0 + cols)].astype(jnp.bfloat16)]


def _dot_chunk(fmt, raw, rows, cw, dt, e2m1, wround, xs):
    """[MP, rows] fp32: a chunk's products on the tensor cores, the token rows `xs` (`_token_rows`) times the
    chunk's weights dequantized as `_deq` does (without group sums), each piece exact in bf16; without `wround` an
    FP8 chunk's block scale multiplies its partial (the chunk is one 128x128 block's columns)."""
    ws = _deq(fmt, raw, rows, cw, dt, e2m1, wround, False)
    part = None
    for x, w in zip(xs, ws):
        p = _dot(x, w.astype(jnp.bfloat16), trans_b=True)
        part = p if part is None else part + p
    if fmt == "fp8_block" and not wround:
        part = part * raw[1]
    return part


def _row_scale_load(fmt, refs, lead, r0, rows, wround):
    """`_row_scale` without a chunk: an NVFP4 weight's global scales of rows [r0, r0+rows) when no weight is
    rounded, else None."""
    if wround or fmt != "nvfp4":
        return None
    return refs[2][(*lead, pl.ds(r0, rows))]


def _token_row(tile, i):
    """Row i of an [MP, n] register tile as [n] (a masked sum over the rows: tiles cannot be indexed)."""
    rows = lax.broadcasted_iota(jnp.int32, tile.shape, 0)
    return jnp.sum(jnp.where(rows == i, tile, 0.0), axis=0)


def _gate_up_kernel(ids_ref, x_ref, *rest, fmt, m, k, n_slots, sp, inter, d, bn, cw, acc_tiles, e2m1, meta, wround,
                    gsum=False, tmajor=False, branch=True, dot=0, flat_slots=False, x2d=False, act_pair=0, ahead=0):
    # x2d: x's pieces as [bn, .] tiles (`DecodeTiles.x2d`; NVFP4: x arrives paired); act_pair > 0: the activation rows
    # stored paired in chunks of act_pair columns (the down kernel's NVFP4 x2d layout)
    if meta == 1:
        own_ref, hit_ref, *rest = rest
    if meta == 2:       # this kernel finds the slot metadata and writes it for the down kernel
        rw_ref, *rest = rest
        *w_refs, act_ref, own_out, hit_out, coef_out = rest
    else:
        *w_refs, act_ref = rest
    s, j = pl.program_id(0), pl.program_id(1)
    e = ids_ref[s]
    dt = act_ref.dtype
    # flat slots (m is 1 here): slot s = (token s // k, its k-th pick) multiplies that token's row alone
    xrow = (lambda i: s // k) if flat_slots else (lambda i: i)    # noqa: E731
    if meta == 1:
        owner = own_ref[s] != 0
    elif m == 1 and meta == 0:  # one token's K experts are distinct: every slot owns its expert, no reduction
        owner = None
    else:
        flat = _load_ids(ids_ref, n_slots, sp)
        owner = _owner(flat, e, s)
    if meta == 2:
        @pl.when(j == 0)
        def _():    # slot s's owner flag, and per token whether it chose e (owners only) and its weight for e
            pos = lax.broadcasted_iota(jnp.int32, (sp,), 0)
            rw = plgpu.load(rw_ref.at[pl.ds(0, sp)], mask=pos < n_slots, other=0).astype(F32)
            own_out[s] = owner.astype(jnp.int32)
            for i in range(m):
                h = (flat == e) & ((pos // k) == i)
                hit_out[s * m + i] = (owner & (jnp.sum(jnp.where(h, 1, 0)) > 0)).astype(jnp.int32)
                coef_out[s * m + i] = jnp.sum(jnp.where(h, rw, 0.0))

    def body():
        nk = d // cw
        rg, ru = j * bn, inter + j * bn
        if dot:                     # every token's rows at once on the tensor cores
            xs_of = lambda c: _token_rows(x_ref, (), m, c * cw, cw, fmt == "nvfp4")  # noqa: E731
            if dot == 2:            # the chunks in a loop: Triton pipelines their loads (`stages`)
                z = jnp.zeros((MP, bn), F32)
                tg, tu = lax.fori_loop(0, nk, lambda c, carry: tuple(t + _dot_chunk(
                    fmt, _raw(fmt, w_refs, (e,), r0, bn, c * cw, cw), bn, cw, dt, e2m1, wround, xs_of(c))
                    for t, r0 in zip(carry, (rg, ru))), (z, z))
                rs_g, rs_u = (_row_scale_load(fmt, w_refs, (e,), r0, bn, wround) for r0 in (rg, ru))
            else:                   # every chunk's loads issued first
                raws = [[_raw(fmt, w_refs, (e,), r0, bn, c * cw, cw) for c in range(nk)] for r0 in (rg, ru)]
                tg, tu = (functools.reduce(lambda acc, c, rw=rw: acc + _dot_chunk(
                    fmt, rw[c], bn, cw, dt, e2m1, wround, xs_of(c)), range(nk), jnp.zeros((MP, bn), F32))
                    for rw in raws)
                rs_g, rs_u = (_row_scale(fmt, rw[0], wround) for rw in raws)
            if rs_g is not None:
                tg, tu = tg * rs_g[None, :], tu * rs_u[None, :]
            a = _silu_mul(rnd(tg, dt), rnd(tu, dt), dt)
            for i in range(m):      # tokens not routed here store their values too, never read by the down kernel
                act_ref[s, i, pl.ds(rg, bn)] = _token_row(a, i).astype(dt)
            return
        raw_g = _Chunks(lambda c: _raw(fmt, w_refs, (e,), rg, bn, c * cw, cw), nk, ahead)
        raw_u = _Chunks(lambda c: _raw(fmt, w_refs, (e,), ru, bn, c * cw, cw), nk, ahead)
        if m == 1 and acc_tiles:    # products kept as tiles over the chunks, one row reduction at the end
            _one_token_gate_up(x_ref, act_ref, fmt, raw_g, raw_u, xrow(0), s, rg, d=d, cw=cw, bn=bn, dt=dt,
                               e2m1=e2m1, wround=wround, gsum=gsum, x2d=x2d, act_pair=act_pair)
            return
        deq = functools.partial(_deq, fmt, rows=bn, cw=cw, dt=dt, e2m1=e2m1, wround=wround, gsum=gsum)
        cs = [(_col_scale(fmt, raw_g[c], cw, wround), _col_scale(fmt, raw_u[c], cw, wround)) for c in range(nk)]
        rs_g, rs_u = _row_scale(fmt, raw_g[0], wround), _row_scale(fmt, raw_u[0], wround)
        if m == 1:
            hits = None
        elif meta == 1:
            hits = [hit_ref[s * m + i] != 0 for i in range(m)]
        else:
            hits = [_routes_to(flat, e, k, i) for i in range(m)]
        gtiles = acc_tiles      # (m > 1 here) per-token tiles of 16-column partial sums
        z = jnp.zeros((bn, cw // 16) if gtiles else (bn,), F32)
        accs = [(z, z) for _ in range(m)]
        part = _part_sums if gtiles else _rowdot
        if tmajor:      # one branch per routed token over every chunk: its activation loads issued together

            def token(i, acc):
                for c in range(nk):
                    xv = _xs(x_ref, (xrow(i),), c * cw, cw, fmt == "nvfp4", bn if x2d else 0)
                    acc = (acc[0] + part(deq(raw_g[c]), _scaled(xv, cs[c][0])),
                           acc[1] + part(deq(raw_u[c]), _scaled(xv, cs[c][1])))
                return acc
            accs = _accumulate(m, hits, accs, token, branch)
        for c in range(0 if tmajor else nk):
            wg, wu = deq(raw_g[c]), deq(raw_u[c])

            def add(i, acc, wg=wg, wu=wu, c=c):
                xv = _xs(x_ref, (xrow(i),), c * cw, cw, fmt == "nvfp4", bn if x2d else 0)
                return acc[0] + part(wg, _scaled(xv, cs[c][0])), acc[1] + part(wu, _scaled(xv, cs[c][1]))
            accs = _accumulate(m, hits, accs, add, branch)
        if gtiles:
            accs = [(jnp.sum(a, axis=1), jnp.sum(b, axis=1)) for a, b in accs]
        for i in range(m):      # tokens not routed here: silu(0) * 0 = 0 with a branch; never read by the down kernel
            a = _silu_mul(rnd(_rows(accs[i][0], rs_g), dt), rnd(_rows(accs[i][1], rs_u), dt), dt)
            _store_act(act_ref, s, i, rg, a.astype(dt), act_pair)

    if owner is None:
        body()
    else:
        pl.when(owner)(body)


def _one_token_gate_up(x_ref, act_ref, fmt, raw_g, raw_u, xr, s, rg, *, d, cw, bn, dt, e2m1, wround, gsum, x2d,
                       act_pair):
    """One slot's gate and up rows [rg, rg+bn) for its one token (x row xr) from their loaded chunks (`_raw`), the
    products kept as tiles over the chunks and each row summed once (`DecodeTiles.acc` 1); act[s, 0, rg:rg+bn] =
    silu(g) * u rounded as the reference."""
    nk = d // cw
    rs_g, rs_u = _row_scale(fmt, raw_g[0], wround), _row_scale(fmt, raw_u[0], wround)
    if fmt == "nvfp4" and e2m1 in _MMA:
        _one_token_gate_up_mma(x_ref, act_ref, raw_g, raw_u, xr, s, rg, d=d, cw=cw, bn=bn, dt=dt, asm=e2m1 == "mma",
                               rs=(rs_g, rs_u), act_pair=act_pair)
        return
    deq = functools.partial(_deq, fmt, rows=bn, cw=cw, dt=dt, e2m1=e2m1, wround=wround, gsum=gsum)
    cs = [(_col_scale(fmt, raw_g[c], cw, wround), _col_scale(fmt, raw_u[c], cw, wround)) for c in range(nk)]
    tg = tu = None
    hf = _hfma(e2m1, fmt)
    if hf:                  # the activations in fp16's range: x * 2^s, the sums times 2^-s
        up, down = _hx_prescale(x_ref, (xr,), d, cw)
    for c in range(nk):
        if hf:
            xv = _hx(x_ref, (xr,), c * cw, cw, up, e2m1)
        else:
            xv = _xs(x_ref, (xr,), c * cw, cw, fmt == "nvfp4", bn if x2d else 0)
        tg = _tile_fma(tg, deq(raw_g[c]), _scaled(xv, cs[c][0]))
        tu = _tile_fma(tu, deq(raw_u[c]), _scaled(xv, cs[c][1]))
    sg_, su_ = _tiles_sum(tg), _tiles_sum(tu)
    if hf:
        sg_, su_ = sg_ * down, su_ * down
    a = _silu_mul(rnd(_rows(sg_, rs_g), dt), rnd(_rows(su_, rs_u), dt), dt)
    _store_act(act_ref, s, 0, rg, a.astype(dt), act_pair)


def _mma_operand(ref, row, n, cw, asm):
    """Row `row` of `mma_activations`' output in ref (uint32 [rows, n/2 + 1]): (its 2^-s, c -> chunk c's fp16 pairs
    as loaded (asm) or as (even, odd) values for the jnp products)."""
    ri = jnp.int32(row) if isinstance(row, int) else row

    def xv_of(c):
        pr = ref[ri, pl.ds(c * cw // 2, cw // 2)]
        return pr if asm else kernel_math.unpack_f16_pairs(pr)
    return lax.bitcast_convert_type(ref[ri, n // 2], F32), xv_of


def _mma_row_sums(raw_a, raw_b, xv_of, *, rows, cw, nk, down, asm):
    """The row sums of two NVFP4 tiles at the same columns (`_raw`'s nk chunks of `rows` rows each) against one
    activation row, through e2m1 "mma" (`kernel_math.e2m1_mma_row_pair`: raw_a in the MMA's first row group, raw_b in
    its second): xv_of(c) the chunk's prescaled fp16 pairs (asm) or (even, odd) values; down the row's 2^-s.
    Returns (a, b) [rows] fp32, each sum_c code_c * scale_c * x_c (the rows' global scales not applied)."""
    spread = lambda sc: kernel_math.group_bytes(kernel_math.f16_pairs(sc.astype(F32)))   # noqa: E731
    tot = jnp.zeros((rows, cw // 2), F32)
    for c in range(nk):
        tot = kernel_math.e2m1_mma_row_pair(raw_a[c][0], raw_b[c][0], spread(raw_a[c][1]), spread(raw_b[c][1]),
                                           xv_of(c), tot, asm=asm)
    tot = kernel_math.e2m1_mma_diag(tot, asm=asm)
    t4 = jnp.sum(tot.reshape(rows, cw // 8, 4), axis=1)      # [rows, 4]: a, b, 0, 0
    pos = lax.broadcasted_iota(jnp.int32, (rows, 4), 1)
    back = down * kernel_math.E2M1_F16_SCALE
    return tuple(jnp.sum(jnp.where(pos == i, t4, 0.0), axis=1) * back for i in (0, 1))


def _one_token_gate_up_mma(x_ref, act_ref, raw_g, raw_u, xr, s, rg, *, d, cw, bn, dt, asm, rs, act_pair):
    """`_one_token_gate_up` with e2m1 "mma": each chunk's gate and up codes, times their group scales, against the
    activations scaled by a power of two into fp16's range (`kernel_math.e2m1_mma_row_pair`: tensor-core MMAs with
    asm, the same products in jnp otherwise); the terms summed per row once, times 2^-s, 2^14 and the rows' global
    scales. x_ref holds `mma_activations`' pairs and 2^-s (uint32 [M, D/2 + 1]), loaded as they are."""
    down, xv_of = _mma_operand(x_ref, xr, d, cw, asm)
    sg_, su_ = _mma_row_sums(raw_g, raw_u, xv_of, rows=bn, cw=cw, nk=d // cw, down=down, asm=asm)
    a = _silu_mul(rnd(_rows(sg_, rs[0]), dt), rnd(_rows(su_, rs[1]), dt), dt)
    _store_act(act_ref, s, 0, rg, a.astype(dt), act_pair)


def _gate_up_persist_kernel(ids_ref, x_ref, *rest, fmt, k, n_slots, inter, d, bn, cw, e2m1, wround, gsum,
                            flat_slots, x2d, act_pair, n_prog):
    """Kernel 1 as `n_prog` resident programs (`DecodeTiles.persist`): program p takes the tasks t = p, p + n_prog,
    ... of the n_slots * I / bn (slot, row tile) tasks in slot-major order and issues the next task's weight loads
    (its expert id read first) before the current task's arithmetic, so a program's memory round trips overlap its
    decode instead of each short program waiting for its own. One token per slot (M = 1 or flat slots), the
    `_one_token_gate_up` arithmetic: the same values as the grid of one program per task."""
    *w_refs, act_ref = rest
    nj, nk = inter // bn, d // cw
    dt = act_ref.dtype

    def loads(s, j):
        e = ids_ref[s]
        return tuple([_raw(fmt, w_refs, (e,), r0, bn, c * cw, cw) for c in range(nk)]
                     for r0 in (j * bn, inter + j * bn))

    def compute(s, j, raws):
        _one_token_gate_up(x_ref, act_ref, fmt, raws[0], raws[1], s // k if flat_slots else 0, s, j * bn, d=d,
                           cw=cw, bn=bn, dt=dt, e2m1=e2m1, wround=wround, gsum=gsum, x2d=x2d, act_pair=act_pair)

    _resident_tasks(n_prog, n_slots, nj, loads, compute)


def _resident_tasks(n_prog, n_rows, nj, loads, compute):
    """This program's share of the n_rows * nj (row, column tile) tasks in row-major order, tasks p, p + n_prog, ...
    (`DecodeTiles.persist` / `persist2`): loads(row, j) for the next task is issued before compute(row, j, loaded)
    for the current one. A task index past the end loads the last task's (valid) address and computes nothing."""
    pid = pl.program_id(0)
    total = n_rows * nj

    def task(i):
        t = jnp.minimum(pid + i * n_prog, total - 1)
        return t // nj, t % nj

    def step(i, loaded):
        nxt = loads(*task(i + 1))     # issued before this task's arithmetic
        row, j = task(i)
        pl.when(pid + i * n_prog < total)(lambda: compute(row, j, loaded))
        return nxt

    lax.fori_loop(0, -(-total // n_prog), step, loads(*task(0)))


def _shared_loads(sfmt, sh_refs, c0, bn, cw, inter_s):
    """The shared expert's down rows [c0, c0+bn) over its I_s columns, as stored (loads issued, not yet used)."""
    return [_raw(sfmt, sh_refs, (), c0, bn, c * cw, cw) for c in range(inter_s // cw)]


def _shared_terms(sfmt, sg_ref, su_ref, ssig_ref, offs, tokens, bn, cw, inter_s, dt, e2m1, wround, loads,
                  raw=None, gsum=False, tiles=False):
    """The shared expert's output columns for each of `tokens` (ints, or a program's token index):
    round(round(silu(gate) * up @ down.T) * round(sigmoid(gate logit))), each [bn] fp32 holding dt values.
    tiles: each token's 16-column partial sums kept as a [bn, cw/16] tile over the chunks (`DecodeTiles.acc` with
    several tokens), one row reduction per token at the end."""
    raw = raw or loads()
    acc = [jnp.zeros((bn, cw // 16) if tiles else (bn,), F32) for _ in tokens]
    part = _part_sums if tiles else _rowdot
    for c in range(inter_s // cw):
        w_c = _deq(sfmt, raw[c], bn, cw, dt, _decode_only(e2m1), wround, gsum)
        cs = _col_scale(sfmt, raw[c], cw, wround)
        for n, i in enumerate(tokens):
            g = _xs(sg_ref, (i,), offs[0] + c * cw, cw, sfmt == "nvfp4")
            u = _xs(su_ref, (i,), offs[1] + c * cw, cw, sfmt == "nvfp4")
            acc[n] = acc[n] + part(w_c, _scaled([_silu_mul(a, b, dt) for a, b in zip(g, u)], cs))
    if tiles:
        acc = [jnp.sum(a, axis=1) for a in acc]
    rs = _row_scale(sfmt, raw[0], wround)
    out = []
    for n, i in enumerate(tokens):
        gate = rnd(1.0 / (1.0 + jnp.exp(-ssig_ref[i, offs[2]].astype(F32))), dt)
        out.append(rnd(rnd(_rows(acc[n], rs), dt) * gate, dt))
    return out


def _one_token_down_term(fmt, raw, act_ref, s, coef, *, bn, cw, inter, dt, e2m1, wround, gsum, x2d):
    """Slot s's routed term for its one token over the down rows loaded in `raw` (`_raw`'s chunks of one column
    tile): round(round(act[s, 0] @ down.T) * coef), [bn] fp32 holding dt values."""
    hf = _hfma(e2m1, fmt)
    if hf:                  # this slot's activation row in fp16's range: x * 2^s, the sums times 2^-s
        up, down = _hx_prescale(act_ref, (s, 0), inter, cw)
    acc = jnp.zeros((bn,), F32)
    for c in range(inter // cw):
        w_c = _deq(fmt, raw[c], bn, cw, dt, e2m1, wround, gsum)
        if hf:
            acc = acc + _rowdot(w_c, _hx(act_ref, (s, 0), c * cw, cw, up, e2m1))
        else:
            xv = _scaled(_xs(act_ref, (s, 0), c * cw, cw, fmt == "nvfp4", bn if x2d else 0),
                         _col_scale(fmt, raw[c], cw, wround))
            acc = acc + _rowdot(w_c, xv)
    if hf:
        acc = acc * down
    return rnd(rnd(_rows(acc, _row_scale(fmt, raw[0], wround)), dt) * coef, dt)


def _one_token_down_mma(raw_a, raw_b, act_ref, s, coef, *, h, cw, inter, dt, asm, pre=False):
    """`_one_token_down_term` with e2m1 "mma" (`DecodeTiles.mma2`) for the down rows of raw_a and raw_b (`_raw`'s
    chunks of two h-row halves of one column tile, NVFP4): both halves against slot s's activation row at the same
    columns, as one MMA's two row groups (`kernel_math.e2m1_mma_row_pair`: raw_a in the gate rows, raw_b in the up
    rows); the row scaled into fp16's range by 2^s here (`_hx_prescale`) and loaded as fp16 pairs per chunk, or
    with `pre` act_ref holding `mma_activations` of the rows (uint32 [slots, I/2 + 1]: the pairs and 2^-s).
    Returns each half's round(round(act[s, 0] @ down.T) * coef), [h] fp32 holding dt values."""
    if pre:
        down, xv_of = _mma_operand(act_ref, s, inter, cw, asm)
    else:
        up, down = _hx_prescale(act_ref, (s, 0), inter, cw)
        xv_of = lambda c: _hx(act_ref, (s, 0), c * cw, cw, up, "hfmab" if asm else "hfmab_jnp")  # noqa: E731
    sums = _mma_row_sums(raw_a, raw_b, xv_of, rows=h, cw=cw, nk=inter // cw, down=down, asm=asm)
    return tuple(rnd(rnd(_rows(v, _row_scale("nvfp4", r[0], False)), dt) * coef, dt)
                 for v, r in zip(sums, (raw_a, raw_b)))


def _down_persist_kernel(ids_ref, rw_ref, act_ref, sg_ref, su_ref, ssig_ref, *rest, fmt, sfmt, n_w, k, n_slots, d,
                         inter, inter_s, bn, cw, group, e2m1, offs, wround, gsum, x2d, n_shared, n_prog):
    """Kernel 2 as `n_prog` resident programs (`DecodeTiles.persist2`), one token per slot (M = 1 or flat slots),
    grouped slots (`DecodeTiles.group` g): program p takes the routed tasks p, p + n_prog, ... of the n_slots / g
    groups x D / bn column tiles, issuing the next task's down-row loads (its experts' ids read first) before the
    current task's arithmetic, and writes each group's fp32 partial as the grid kernel does; then its share of the
    n_shared x D / bn shared-expert tasks (token t's shared term, row n_slots / g + t), likewise. The same
    values as the grid of one program per (column tile, row)."""
    dn_refs, sh_refs, y_ref = rest[:n_w], rest[n_w:-1], rest[-1]
    dt = sg_ref.dtype
    nj, nk, n_groups = d // bn, inter // cw, n_slots // group

    def loads(gi, j):
        return tuple([_raw(fmt, dn_refs, (ids_ref[gi * group + u],), j * bn, bn, c * cw, cw) for c in range(nk)]
                     for u in range(group))

    def compute(gi, j, raws):
        acc = jnp.zeros((bn,), F32)
        for u in range(group):
            s = gi * group + u
            acc = acc + _one_token_down_term(fmt, raws[u], act_ref, s, rw_ref[s].astype(F32), bn=bn, cw=cw,
                                             inter=inter, dt=dt, e2m1=e2m1, wround=wround, gsum=gsum, x2d=x2d)
        y_ref[gi, 0, pl.ds(j * bn, bn)] = acc

    _resident_tasks(n_prog, n_groups, nj, loads, compute)

    def shared_loads(r, j):
        return _shared_loads(sfmt, sh_refs, j * bn, bn, cw, inter_s)

    def shared(r, j, raw):          # token r's shared term
        y_ref[n_groups + r, 0, pl.ds(j * bn, bn)] = _shared_terms(
            sfmt, sg_ref, su_ref, ssig_ref, offs, (r,), bn, cw, inter_s, dt, e2m1, wround, None, raw=raw,
            gsum=gsum)[0]

    _resident_tasks(n_prog, n_shared, nj, shared_loads, shared)


def _down_kernel(ids_ref, rw_ref, act_ref, sg_ref, su_ref, ssig_ref, *rest, fmt, sfmt, n_w, m, k, n_slots, sp,
                 inter, inter_s, bn, cw, group, e2m1, offs, meta, hoist, wround, gsum=False, acc_tiles=False,
                 tmajor=False, branch=True, dot=0, flat_slots=False, x2d=False, mma2=0, mma_asm=True, finish=None):
    if meta:
        own_ref, hit_ref, coef_ref, *rest = rest
    if finish is not None:      # (counters, the partials, the combined output) after the weights
        *rest, ctr_ref, y_ref, o_ref = rest
        rest = (*rest, y_ref)
    dn_refs, sh_refs, y_ref = rest[:n_w], rest[n_w:-1], rest[-1]
    dt = sg_ref.dtype
    c0 = pl.program_id(0) * bn
    nk = inter // cw
    one = m == 1 and not meta       # one token: its K experts are distinct, each slot owns its expert
    if not meta and not one:
        flat = _load_ids(ids_ref, n_slots, sp)
        pos = lax.broadcasted_iota(jnp.int32, (sp,), 0)
        rw = plgpu.load(rw_ref.at[pl.ds(0, sp)], mask=pos < n_slots, other=0).astype(F32)
        tok = pos // k

    def slot_loads(s):
        """Slot s's routing facts and its weight loads (issued, not yet used)."""
        e = ids_ref[s]
        if meta:     # loaded: the owner flag, and per token whether it chose this expert and with what weight
            own = own_ref[s] != 0
            routed = [hit_ref[s * m + i] != 0 for i in range(m)]
            coefs = [coef_ref[s * m + i] for i in range(m)]
        elif one:    # the token chose this slot's expert with this slot's weight: no reductions over the ids
            own, routed, coefs = None, [True], [rw_ref[s].astype(F32)]
        else:
            own = _owner(flat, e, s)
            hits = [(flat == e) & (tok == i) for i in range(m)]
            routed = [own & (jnp.sum(jnp.where(h, 1, 0)) > 0) for h in hits]
            coefs = [jnp.sum(jnp.where(h, rw, 0.0)) for h in hits]
        if dot == 2:    # the weights are loaded in the chunk loop
            return routed, coefs, (e, own)
        return routed, coefs, [_raw(fmt, dn_refs, (e,), c0, bn, c * cw, cw, mask=own) for c in range(nk)]

    gtiles = m > 1 and acc_tiles    # per-token tiles of 16-column partial sums (`DecodeTiles.acc`)

    hf = _hfma(e2m1, fmt)   # (`check`: one token)

    def slot(s, accs, loaded=None):
        routed, coefs, raw = loaded or slot_loads(s)
        if dot:                 # every token's rows at once on the tensor cores
            xs_of = lambda c: _token_rows(act_ref, (s,), m, c * cw, cw, fmt == "nvfp4")  # noqa: E731
            if dot == 2:        # the chunks in a loop, their loads pipelined by Triton (`stages`)
                e, own = raw
                tile = lax.fori_loop(0, nk, lambda c, t: t + _dot_chunk(
                    fmt, _raw(fmt, dn_refs, (e,), c0, bn, c * cw, cw, mask=own), bn, cw, dt, e2m1, wround, xs_of(c)),
                    jnp.zeros((MP, bn), F32))
                rs = _row_scale_load(fmt, dn_refs, (e,), c0, bn, wround)
            else:
                tile = None
                for c in range(nk):
                    part = _dot_chunk(fmt, raw[c], bn, cw, dt, e2m1, wround, xs_of(c))
                    tile = part if tile is None else tile + part
                rs = _row_scale(fmt, raw[0], wround)
            if rs is not None:
                tile = tile * rs[None, :]
            out = []
            for i in range(m):
                term = rnd(rnd(_token_row(tile, i), dt) * coefs[i], dt)
                out.append(accs[i] + jnp.where(routed[i], term, 0.0))
            return tuple(out)
        if one:                 # one token per slot, always routed to it: `_one_token_down_term`
            return (accs[0] + _one_token_down_term(fmt, raw, act_ref, s, coefs[0], bn=bn, cw=cw, inter=inter, dt=dt,
                                                   e2m1=e2m1, wround=wround, gsum=gsum, x2d=x2d),)
        acc = [jnp.zeros((bn, cw // 16) if gtiles else (bn,), F32) for _ in range(m)]
        if hf:                  # this slot's activation row in fp16's range: x * 2^s, the sums times 2^-s
            up, down = _hx_prescale(act_ref, (s, 0), inter, cw)
        part = _part_sums if gtiles else _rowdot
        if tmajor and m > 1:    # one branch per routed token over every chunk (`DecodeTiles.tmajor`; not hf: M = 1)

            def token(i, a):
                for c in range(nk):
                    xv = _scaled(_xs(act_ref, (s, i), c * cw, cw, fmt == "nvfp4", bn if x2d else 0),
                                 _col_scale(fmt, raw[c], cw, wround))
                    a = a + part(_deq(fmt, raw[c], bn, cw, dt, e2m1, wround, gsum), xv)
                return a
            acc = _accumulate(m, routed, acc, token, branch)
        for c in range(0 if tmajor and m > 1 else nk):
            w_c = _deq(fmt, raw[c], bn, cw, dt, e2m1, wround, gsum)
            cs = _col_scale(fmt, raw[c], cw, wround)

            def add(i, a, w_c=w_c, c=c, cs=cs):
                if hf:
                    return a + _rowdot(w_c, _hx(act_ref, (s, i), c * cw, cw, up, e2m1))
                xv = _scaled(_xs(act_ref, (s, i), c * cw, cw, fmt == "nvfp4", bn if x2d else 0), cs)
                return a + part(w_c, xv)
            acc = _accumulate(m, routed, acc, add, branch)
        if gtiles:
            acc = [jnp.sum(a, axis=1) for a in acc]
        if hf:
            acc = [a * down for a in acc]
        rs = _row_scale(fmt, raw[0], wround)
        out = []
        for i in range(m):
            term = rnd(rnd(_rows(acc[i], rs), dt) * coefs[i], dt)
            out.append(accs[i] + jnp.where(routed[i], term, 0.0))
        return tuple(out)

    shared_loads = functools.partial(_shared_loads, sfmt, sh_refs, c0, bn, cw, inter_s)
    shared = functools.partial(_shared_terms, sfmt, sg_ref, su_ref, ssig_ref, offs, range(m), bn, cw, inter_s,
                               dt, e2m1, wround, shared_loads, gsum=gsum, tiles=gtiles)

    zeros = tuple(jnp.zeros((bn,), F32) for _ in range(m))
    if group == 0:          # one program: every slot, the combine and the shared expert, y in dt
        accs = zeros
        if hoist:           # every load first (`check`: the slots are unrolled)
            loaded = [slot_loads(s) for s in range(n_slots)]
            sh_raw = shared_loads()
            for s in range(n_slots):
                accs = slot(s, accs, loaded[s])
            sh_terms = shared(sh_raw)
        else:
            if n_slots <= UNROLL_SLOTS:
                for s in range(n_slots):
                    accs = slot(s, accs)
            else:
                accs = lax.fori_loop(0, n_slots, slot, accs)
            sh_terms = shared()
        for i, sh in enumerate(sh_terms):
            y_ref[i, pl.ds(c0, bn)] = (rnd(accs[i], dt) + sh).astype(y_ref.dtype)
        return
    # grid axis 1: `group` slots per program, their fp32 partial sums in row gi; the last row is the shared term
    gi = pl.program_id(1)
    n_groups = n_slots // group

    @pl.when(gi < n_groups)
    def _():
        if mma2:    # e2m1 "mma" (`check`: one token per slot): the tile's two row halves in one MMA per lane
            h = bn // 2
            halves = [jnp.zeros((h,), F32)] * 2
            for t in range(group):
                s = gi * group + t
                e = ids_ref[s]
                raws = [[_raw(fmt, dn_refs, (e,), c0 + u * h, h, c * cw, cw) for c in range(nk)] for u in (0, 1)]
                terms = _one_token_down_mma(*raws, act_ref, s, rw_ref[s].astype(F32), h=h, cw=cw, inter=inter,
                                            dt=dt, asm=mma_asm, pre=mma2 == 2)
                halves = [a + b for a, b in zip(halves, terms)]
            for u in (0, 1):
                y_ref[gi, 0, pl.ds(c0 + u * h, h)] = halves[u]
            return
        accs = zeros
        slots = [gi * group + t for t in range(group)]
        loaded = [slot_loads(s) for s in slots] if hoist else [None] * group
        for s, ld in zip(slots, loaded):
            accs = slot(s, accs, ld)
        for i in range(m):
            y_ref[gi, i, pl.ds(c0, bn)] = accs[i]

    if flat_slots:  # (m is 1 here) row n_groups + t: token t's shared term, of the `flat` tokens
        @pl.when(gi >= n_groups)
        def _():
            sh = _shared_terms(sfmt, sg_ref, su_ref, ssig_ref, offs, (gi - n_groups,), bn, cw, inter_s, dt, e2m1,
                               wround, shared_loads, gsum=gsum, tiles=gtiles)[0]
            y_ref[gi, 0, pl.ds(c0, bn)] = sh
        return

    @pl.when(gi == n_groups)
    def _():
        for i, sh in enumerate(shared()):
            y_ref[gi, i, pl.ds(c0, bn)] = sh
    if finish is not None:
        _finish_combine(y_ref, o_ref, ctr_ref, finish, n_groups, m, c0, bn, dt)


def _finish_combine(y_ref, o_ref, ctr_ref, finish, n_groups, m, c0, bn, dt):
    """The combine in the kernel (`moe_decode`'s finish_base): the column tile's last program, by an atomic count of
    its n_groups + 1 programs (the counters a `grid_sync.CounterPool` region), sums the routed partials in group order,
    rounds, adds the shared term and rounds (the XLA combine's arithmetic, in group order); see
    `fnx.pallas.gemv.pallas.finish_tile` for the memory ordering."""
    base, interpret = finish
    rows = n_groups + 1
    if not interpret:
        plgpu.debug_barrier()
    old = plgpu.atomic_add(ctr_ref, (jnp.int32(base) + pl.program_id(0),), jnp.int32(1))

    @pl.when(old % rows == rows - 1)
    def _():
        for i in range(m):
            acc = y_ref[0, i, pl.ds(c0, bn)]
            for g in range(1, n_groups):
                acc = acc + y_ref[g, i, pl.ds(c0, bn)]
            o_ref[i, pl.ds(c0, bn)] = (rnd(acc, dt) + y_ref[n_groups, i, pl.ds(c0, bn)]).astype(o_ref.dtype)


def _down_tok_kernel(ids_ref, rw_ref, act_ref, sg_ref, su_ref, ssig_ref, *rest, fmt, sfmt, n_w, k, n_slots, sp,
                     inter, inter_s, bn, cw, e2m1, offs, wround, gsum=False):
    """DecodeTiles.tok 1: program (j, t) writes output columns [j*bn, +bn) of token t. It issues the down rows of
    token t's K experts (and the shared expert's) first, then adds each expert's term in k order, as the
    reference does for every token. Expert e's activations for token t are in the act row of e's owner slot
    (the first slot holding e: the gate/up kernel computed them there, weight-major)."""
    dn_refs, sh_refs, y_ref = rest[:n_w], rest[n_w:-1], rest[-1]
    dt = sg_ref.dtype
    c0, t = pl.program_id(0) * bn, pl.program_id(1)
    nk = inter // cw
    flat = _load_ids(ids_ref, n_slots, sp)
    pos = lax.broadcasted_iota(jnp.int32, (sp,), 0)
    slots = [t * k + kk for kk in range(k)]
    experts = [ids_ref[s] for s in slots]
    raw = [[_raw(fmt, dn_refs, (e,), c0, bn, c * cw, cw) for c in range(nk)] for e in experts]
    sh_raw = _shared_loads(sfmt, sh_refs, c0, bn, cw, inter_s)
    acc = jnp.zeros((bn,), F32)
    for s, e, r in zip(slots, experts, raw):
        owner = jnp.min(jnp.where(flat == e, pos, sp))      # a token picks distinct experts: one term each
        out = jnp.zeros((bn,), F32)
        for c in range(nk):
            xv = _scaled(_xs(act_ref, (owner, t), c * cw, cw, fmt == "nvfp4"), _col_scale(fmt, r[c], cw, wround))
            out = out + _rowdot(_deq(fmt, r[c], bn, cw, dt, e2m1, wround, gsum), xv)
        out = _rows(out, _row_scale(fmt, r[0], wround))
        acc = acc + rnd(rnd(out, dt) * rw_ref[s].astype(F32), dt)
    sh = _shared_terms(sfmt, sg_ref, su_ref, ssig_ref, offs, (t,), bn, cw, inter_s, dt, e2m1, wround, None,
                       sh_raw, gsum)[0]
    y_ref[t, pl.ds(c0, bn)] = (rnd(acc, dt) + sh).astype(y_ref.dtype)


def check(gate_up, down, shared_down, m: int, k: int, tiles: DecodeTiles, x_dtype=None) -> str | None:
    """None when the kernels cover M tokens routed to k experts each with these weights and tiles (and activations of
    x_dtype, when given), else why not."""
    if m > MAX_TOKENS:
        return f"the fused MoE decode kernels take M <= {MAX_TOKENS} tokens, got {m}"
    fmts = {n: reference.weight_format(w) for n, w in (("gate_up_proj", gate_up), ("down_proj", down),
                                                       ("shared down_proj", shared_down))}
    for name, fmt in fmts.items():
        if fmt not in FORMATS:
            return f"the fused MoE decode kernels stream bf16/fp32, FP8-block or NVFP4 weights, not {fmt} ({name})"
        w = {"gate_up_proj": gate_up, "down_proj": down, "shared down_proj": shared_down}[name]
        if fmt == "fp8_block" and tuple(w.block) != (128, 128):
            return f"{name}: FP8 blocks {tuple(w.block)}, the kernels read 128x128 blocks"
        if fmt == "nvfp4" and w.group != 16:
            return f"{name}: NVFP4 groups of {w.group}, the kernels read groups of 16"
    t = tiles
    _, two_i, d = gate_up.shape
    inter, inter_s = two_i // 2, shared_down.shape[-1]
    for name, v in (("bn", t.bn), ("cw", t.cw), ("bn2", t.bn2), ("cw2", t.cw2)):
        if v <= 0 or v & (v - 1):
            return f"tile {name}={v} is not a power of two"
    if inter % t.bn or d % t.cw or d % t.bn2 or inter % t.cw2 or inter_s % t.cw2:
        return f"tiles {t} do not divide D={d}, I={inter}, I_shared={inter_s}"
    if t.cw < 16 or t.cw2 < 16 or ("nvfp4" in fmts.values() and min(t.cw, t.cw2) < 32):
        return f"tiles {t}: load widths below 16 (32 with NVFP4 weights)"
    n_slots = m * k
    if t.acc not in (0, 1) or t.meta not in (0, 1, 2) or t.hoist not in (0, 1) or t.e2m1 not in E2M1_DECODES \
            or t.wround not in (0, 1) or t.gsum not in (0, 1) or t.tmajor not in (0, 1) \
            or t.branch not in (0, 1, 2, 3):
        return f"tiles {t}: acc, hoist, wround, gsum and tmajor must be 0 or 1, meta 0, 1 or 2, branch 0 to 3 " \
               f"and e2m1 one of {E2M1_DECODES}"
    if t.flat not in (0, 1):
        return f"tiles {t}: flat must be 0 or 1"
    if t.flat and m > 1 and (t.group == 0 or k % t.group or t.meta or t.tok or t.dot):
        return f"tiles {t}: flat 1 gives each (token, k) slot its own token: it needs a group of slots per down " \
               f"program that divides K = {k} (a group never spans two tokens), meta 0, tok 0 and dot 0"
    if t.persist < 0 or (t.persist and (not (m == 1 or t.flat) or not t.acc or t.meta or t.dot)):
        return f"tiles {t}: persist {t.persist} (resident gate/up programs) computes one token per slot: it needs " \
               f"M = 1 or flat 1 (got M = {m}), acc 1, meta 0 and dot 0"
    if t.persist2 < 0 or (t.persist2 and (not (m == 1 or t.flat) or not t.group or t.meta or t.tok or t.dot)):
        return f"tiles {t}: persist2 {t.persist2} (resident down programs) computes one token per slot into " \
               f"grouped partials: it needs M = 1 or flat 1 (got M = {m}), a group > 0, meta 0, tok 0 and dot 0"
    if t.x2d not in (0, 1) or (t.x2d and (t.e2m1 in _HFMA or t.dot or t.tok)):
        return f"tiles {t}: x2d must be 0 or 1, and x2d 1 (activation tiles) takes no e2m1 'hfma'/'hfmab', dot or tok"
    one_token = m == 1 or t.flat
    if t.e2m1 == "mma" and (not one_token or not t.acc or t.wround or t.tok or t.dot or t.x2d or not _mma_fits(t)):
        return f"tiles {t}: e2m1 'mma' multiplies one token's gate and up codes on the tensor cores: it needs M = 1 " \
               f"or flat 1 (got M = {m}), acc 1, wround 0, tok 0, dot 0, x2d 0, cw >= 128 and bn * cw >= 256 * " \
               f"num_warps (4 consecutive code bytes per lane; got bn {t.bn}, cw {t.cw}, num_warps {t.num_warps})"
    if t.ahead < 0 or (t.ahead and (t.e2m1 != "mma" or t.persist)):
        return f"tiles {t}: ahead {t.ahead} (chunk loads issued k chunks ahead) is a knob of kernel 1's e2m1 'mma' " \
               "grid (persist 0); 0 issues every chunk's loads first"
    if t.mma2 not in (0, 1, 2) or (t.mma2 and (
            fmts["down_proj"] != "nvfp4" or not one_token or not t.group or t.wround or t.meta or t.tok or t.dot
            or t.x2d or t.hoist or t.persist2 or t.bn2 < 2 or not _mma_fits(t, t.bn2 // 2, t.cw2, t.num_warps2))):
        return f"tiles {t}: mma2 1 / 2 (kernel 2 on the tensor cores, e2m1 'mma') needs NVFP4 down weights (got " \
               f"{fmts['down_proj']}), M = 1 or flat 1 (got M = {m}), a group > 0, wround 0, meta 0, tok 0, dot 0, " \
               f"x2d 0, hoist 0, persist2 0, cw2 >= 128 and (bn2 / 2) * cw2 >= 256 * num_warps2 (4 consecutive " \
               f"code bytes per lane)"
    if t.e2m1 in ("hfma", "hfmab") and (not one_token or not t.acc or not t.gsum or t.wround or t.tok):
        return f"tiles {t}: e2m1 '{t.e2m1}' multiplies one token's activations inside the code decode: it needs M = 1 " \
               f"or flat 1 (got M = {m}), acc 1, gsum 1, wround 0 and tok 0"
    if t.gsum and t.wround:
        return f"tiles {t}: gsum 1 applies each NVFP4 group's scale to its sum, so no weight is dequantized on its " \
               "own: it needs wround 0"
    if t.hoist and not t.group and n_slots > UNROLL_SLOTS:
        return f"tiles {t}: hoist 1 with group 0 issues every slot's loads at once, which needs the M*K = " \
               f"{n_slots} slots unrolled (at most {UNROLL_SLOTS}); give a group"
    if t.tok not in (0, 1) or (t.tok and (t.group or t.meta == 2 or k > UNROLL_SLOTS)):
        return f"tiles {t}: tok 1 (a down program per output tile and token) combines in the kernel (group 0), " \
               f"issues the K = {k} experts' loads at once (at most {UNROLL_SLOTS}) and takes no metadata from " \
               "the gate/up kernel (meta 0 or 1)"
    if t.group < 0 or (t.group and n_slots % t.group):
        return f"tiles {t}: group={t.group} must divide the M*K = {n_slots} slots"
    if t.dot not in (0, 1, 2) or t.stages not in range(1, 6):
        return f"tiles {t}: dot must be 0, 1 or 2 and stages 1 to 5"
    if t.dot:
        dense_dt = {jnp.dtype(w.dtype) for w, f in ((gate_up, fmts["gate_up_proj"]), (down, fmts["down_proj"]))
                    if f == "dense"}
        if x_dtype is not None and jnp.dtype(x_dtype) != jnp.dtype(jnp.bfloat16):
            return f"tiles {t}: dot {t.dot} multiplies bf16 tiles on the tensor cores; the activations are " \
                   f"{jnp.dtype(x_dtype).name}"
        if dense_dt - {jnp.dtype(jnp.bfloat16)}:
            return f"tiles {t}: dot {t.dot} multiplies bf16 tiles; dense expert weights in {sorted(map(str, dense_dt))}"
        if t.bn < 16 or t.bn2 < 16:
            return f"tiles {t}: dot {t.dot} needs bn and bn2 >= 16 (tl.dot's minimum)"
        if t.gsum or t.tok:
            return f"tiles {t}: dot {t.dot} takes no group sums (gsum 0) and no per-token down programs (tok 0)"
        if "fp8_block" in (fmts["gate_up_proj"], fmts["down_proj"]) and (t.cw > 128 or t.cw2 > 128):
            return f"tiles {t}: dot {t.dot} on FP8 experts scales each chunk's partial by its block's scale: cw and " \
                   "cw2 at most 128"
    if d // t.cw > 64 or inter // t.cw2 > 64:
        return f"tiles {t}: too many chunks to unroll"
    if "fp8_block" in fmts.values() and (128 % t.bn or 128 % t.bn2 or t.cw2 > 128 or (128 % t.cw and t.cw % 128)):
        return f"tiles {t}: FP8 128x128 blocks need bn, bn2, cw2 to divide 128 and cw to divide 128 or be a " \
               "multiple of it"
    return None


# Measured on the H200 (M = 1, released shapes, random router; BENCHMARKS.md, ninth to eleventh sessions): the whole
# layer after XLA's router took 51.8 us with FP8 experts at these tiles (XLA's gather path 82.0 us, the first tiles
# 84.7; the same tiles with acc 0 53.9), 58.1 us with bf16 experts at theirs (XLA 76.6 us; the tenth session's
# tiles 69.9), 60.5 us with NVFP4 experts at theirs (XLA 94.2 us; the integer E2M1 decode at its best tiles 78.6 -
# 85.1; at five tokens 249.6 against XLA's 268.7); one slot per down program (group 1) beat the in-kernel combine
# (group 0) by 10-20 us: 160 programs of 11 slots each left the GPU half idle. Repeats of one case differ by up to
# ~10%. The sixteenth session (89aa848, same harness): unrounded weights (`wround` 0) took the FP8 layer from 64.0
# to 55.4 us, NVFP4 from 70.8 to 62.9 us, and to 56.3 us with its products kept as tiles (acc 1); at five tokens
# NVFP4 258.4 -> 236.6 us (FP8 231.7 -> 243.1, within the noise; `auto` keeps XLA there). So the kernels are bound by
# their instructions per weight, and the defaults round no weight.
MEASURED = {"fp8_block": DecodeTiles(bn=4, cw=512, bn2=8, cw2=128, group=1, num_warps=4, num_warps2=2, acc=1,
                                     wround=0),
            "dense": DecodeTiles(bn=8, cw=512, bn2=8, cw2=128, group=1, num_warps=4, num_warps2=2, acc=1),
            "nvfp4": DecodeTiles(bn=4, cw=512, bn2=8, cw2=128, group=1, num_warps=4, num_warps2=2, acc=1,
                                 e2m1="asm", wround=0, gsum=1)}
# NVFP4 at one token, the eighteenth session (85747e6): the layer took 44.5 us with the group sums (gsum 1) on the
# inline-PTX decode, against 57.2 us for the seventeenth session's default ("f16", gsum 0) and 59.7 for gsum 1 on "f16".
# Several tokens (the MTP verify window), where they differ from MEASURED. The seventeenth session (9a1f780): the
# NVFP4 layer at five tokens took 207.0 us with the E2M1 decode in inline PTX (e2m1 "asm") against 235.9 with "f16"
# (and 217.9 with the slot metadata once, meta 1); at one token "asm" took 64.0 against 59.0 us, so it stays "f16".
# In the 48-layer MTP round at 8K (ac51c89) the MoE family fell from 7.86 to 6.83 ms of kernel time with it.
# At five tokens the eighteenth session measured "asm" at 202.6 us, with gsum 1 (acc 0: a row reduction per chunk)
# at 218.1 and with meta 1 at 203.0: gsum and meta stay 0 there. acc 1 means another arrangement for several tokens
# (tiles of 16-column partial sums per token) than the one measured above (`DecodeTiles.acc`).
# The nineteenth session (93f8284) measured it at five tokens: 199.7 us for the old default (acc 0, gsum 0), 183.3
# with acc 1, 184.9 with acc 1 and gsum 1, and 176.5 with acc 1, gsum 1 and one-warp down programs (num_warps2 1),
# now the NVFP4 default there. At one token "hfma" (55.8 us) and "hfmab" (46.2) lost to "asm" (43.3).
# FP8 at five tokens had not run acc 1 on a GPU and stayed 0 (until flat slots, below).
# The twenty-fourth session (6abfc64, bracketed, random router): flat slots (`DecodeTiles.flat`, every (token, k)
# slot computing its own token with the one-token tiles) took five NVFP4 tokens from 182.1 us to 111.1 (one-warp
# down programs; 121.3 with two, 119.5 with two slots per down program) and five FP8 tokens from 235.2 to 140.0 (two
# slots per down program; 148.8 with one, 146.0 with one-warp programs), where XLA's gather path takes 276.3 (NVFP4)
# and 167.2 us (FP8); bf16 experts 280.6 -> 168.1 us (4-column gate/up and one-warp down programs; XLA 180.1).
# So flat slots are the several-token default of every format.
# The twenty-sixth session (19088ee): activation tiles (x2d 1) and the shift-only PTX decode (e2m1 "asmq") cut the
# NVFP4 programs' SASS by 8-11% but not their time (4-layer verify program at 8K: gate/up 196.4 -> 192.6 us, down
# 112.7 -> 119.0 us per call; the harness within its noise): both stay off.
# The twenty-eighth session: Nsight Compute puts the five-token gate/up kernel at 75% of the issue slots and 65% of
# the ALU pipe, DRAM at 36%; x2d + "asmq" executed only 3.4% fewer instructions on the device's compiler. e2m1 "asmi"
# (the decode's shifts as integer multiplies, on the FMA pipe: -5% SASS in a stock Triton, ptxas refactors part of
# it back into LEA / SHF) took 117.2 us per five-token NVFP4 layer in the harness against 125.5 / 117.6 / 105.9 for
# the default bracketing it (d14da57): inside the spread, stays off.
# The thirty-second session (4615334): e2m1 "mma" with its activations precomputed once per launch took five flat
# NVFP4 tokens from 117.3 / 118.5 us (the default bracketing it) to 97.96 at 8 rows per program (102.8 at 4), and in
# the 4-layer MTP round at 8K the verify program's gate/up kernels from 195.7 to 141.8 us per call (the draft's 84.8
# -> 68.6). At one token it lost (53.8 against 51.7 us): M = 1 keeps "asm".
MEASURED_TOKENS = {"nvfp4": dataclasses.replace(MEASURED["nvfp4"], flat=1, num_warps2=1, e2m1="mma", bn=8),
                   "fp8_block": dataclasses.replace(MEASURED["fp8_block"], flat=1, group=2),
                   "dense": dataclasses.replace(MEASURED["dense"], flat=1, bn=4, num_warps2=1)}


TOKENS_TILES_ENV = "FNX_MOE_TOKENS_TILES"
M1_TILES_ENV = "FNX_MOE_M1_TILES"      # the same for the one-token tiles (e.g. "group=0,hoist=1": the combine in the
                                       # down kernel, no XLA sum of the partials after it; one launch fewer a layer)


def _mma_fits(t, rows: int | None = None, cw: int | None = None, num_warps: int | None = None) -> bool:
    """Whether e2m1 "mma"'s operand layout holds for a code tile of `rows` x `cw` columns on `num_warps` (default:
    kernel 1's bn, cw, num_warps of tiles t): its MMA block takes each lane's packed codes as 4 consecutive bytes of
    one row (a quad's lanes on that row), which Triton's layout gives when the [rows, cw/2] code tile has at least 4
    bytes per lane (rows * cw >= 256 * num_warps) and cw >= 128. Smaller tiles spread fewer bytes per lane and the
    fragments mix rows: the thirty-second H200 session measured NaN at bn 4, cw 128 on 4 warps (one token), the
    same layer finite at bn 8 (the interpreter's jnp form cannot see it)."""
    rows, cw, num_warps = (t.bn if rows is None else rows, t.cw if cw is None else cw,
                           t.num_warps if num_warps is None else num_warps)
    return cw >= 128 and rows * cw >= 256 * num_warps


def tiles_override(spec: str, what: str = TOKENS_TILES_ENV) -> dict:
    """"field=value,..." (DecodeTiles fields; e2m1 a name, the others integers) -> the fields to replace. A benchmark
    knob: `FNX_MOE_TOKENS_TILES` changes the several-token defaults of every layer without a code change."""
    return dispatch.fields_override(spec, DecodeTiles, what, ("e2m1",))


def default_tiles(d: int, inter: int, inter_s: int, fmt: str = "fp8_block", m: int = 1) -> DecodeTiles:
    """The measured tiles for the expert format and `m` tokens, shrunk until they divide the (test-sized) dims.
    Several tokens: `FNX_MOE_TOKENS_TILES` (read when a program is traced) replaces fields of the defaults; one
    token: `FNX_MOE_M1_TILES`."""
    t = MEASURED.get(fmt, MEASURED["fp8_block"])     # a format outside FORMATS: `check` says why not
    over = {}
    if m == 1 and os.environ.get(M1_TILES_ENV, "").strip():
        over = tiles_override(os.environ[M1_TILES_ENV], M1_TILES_ENV)
        t = dataclasses.replace(t, **over)
    if m > 1:
        over = tiles_override(os.environ[TOKENS_TILES_ENV]) if os.environ.get(TOKENS_TILES_ENV) else {}
        base = MEASURED_TOKENS.get(fmt, t)
        if over.get("flat") and not base.flat:  # flat slots asked of owner-slot defaults: the one-token tiles
            base = dataclasses.replace(t, flat=1)
        t = dataclasses.replace(base, **over)
    cw = min(t.cw, _pow2(d))
    while d % cw:
        cw //= 2
    cw2 = min(t.cw2, _pow2(min(inter, inter_s)))
    while inter % cw2 or inter_s % cw2:
        cw2 //= 2
    bn = min(t.bn, _pow2(inter))
    while inter % bn:
        bn //= 2
    bn2 = min(t.bn2, _pow2(d))
    while d % bn2:
        bn2 //= 2
    t = dataclasses.replace(t, bn=bn, cw=cw, bn2=bn2, cw2=cw2)
    if t.e2m1 == "mma" and not _mma_fits(t) and "e2m1" not in over:
        # test-sized dims: the defaults' "mma" needs tiles these dims cannot hold; the one-token decode instead
        # (an "mma" asked for by FNX_MOE_TOKENS_TILES / FNX_MOE_M1_TILES is kept, and `check` says why it cannot run)
        t = dataclasses.replace(t, e2m1=MEASURED.get(fmt, MEASURED["fp8_block"]).e2m1)
    return t


def slot_meta(ids, w, dt):
    """For the M*K slots (token-major): own [S] int32 (1 where no earlier slot holds the same expert), hit [S*M]
    int32 (1 where the slot owns its expert and token i chose it) and coef [S*M] fp32 (token i's routing weight
    for that expert, in dt, else 0): what each decode program otherwise finds with reductions over the ids."""
    m, k = ids.shape
    flat = ids.reshape(-1).astype(jnp.int32)
    n = flat.shape[0]
    same = flat[:, None] == flat[None, :]                                          # [S, S]
    own = ~jnp.any(same & (jnp.arange(n)[None, :] < jnp.arange(n)[:, None]), axis=1)
    chose = same.reshape(n, m, k)                                                  # token i, its k-th pick
    hit = own[:, None] & jnp.any(chose, axis=2)                                    # [S, M]
    coef = jnp.sum(jnp.where(chose, w.astype(dt).astype(F32)[None], 0.0), axis=2)  # [S, M]
    return own.astype(jnp.int32), hit.reshape(-1).astype(jnp.int32), coef.reshape(-1)


def window_array(a, size: int, m: int) -> jax.Array:
    """The [M, size] array of a window (a plain array, or (buffer, start): sliced)."""
    return kernel_math.take_window(*kernel_math.window_operand(a, size, (m,), "moe_decode"), size)


def moe_decode(x, w, ids, gate_up, down, s_gate, s_up, s_sig, shared_down, *, interpret: bool = False,
               tiles: DecodeTiles | None = None, x_acts=None, counters=None, finish_base: int | None = None
               ) -> jax.Array:
    """x [M, D]; w [M, K] (x.dtype), ids [M, K] int32; s_gate, s_up [M, I_s], s_sig [M, 1] (x.dtype), each an
    array or a window (buffer [M, W], start column) read in place; gate_up [E, 2I, D], down [E, D, I], shared_down
    [D, I_s] -> the MoE block's output [M, D] (x.dtype). x_acts: `mma_activations(x)` made already (the router's
    programs can write it), taken by e2m1 "mma" instead of its own XLA fusion; other decodes ignore it.
    finish_base (tiles with a group, owner slots, not persistent): the combine in the down kernel (`_finish_combine`),
    on counters[finish_base:finish_base + D / bn2] (int32 multiples of the group rows: `grid_sync.CounterPool`)."""
    m, d = x.shape
    k = ids.shape[1]
    inter, inter_s = down.shape[-1], shared_down.shape[-1]
    tiles = tiles or default_tiles(d, inter, inter_s, reference.weight_format(gate_up), m)
    why = check(gate_up, down, shared_down, m, k, tiles, x.dtype)
    if why:
        raise NotImplementedError(f"Pallas MoE decode: {why}")
    dt = x.dtype
    if interpret and tiles.e2m1 in ("asm", "asmq", "asmi"):     # the interpreter runs no PTX: the same values
        tiles = dataclasses.replace(tiles, e2m1="f16")
    if interpret and tiles.e2m1 in ("hfma", "hfmab", "mma"):    # the PTX block's arithmetic in jnp
        tiles = dataclasses.replace(tiles, e2m1=tiles.e2m1 + "_jnp")
    e2m1_down = _decode_only(tiles.e2m1) if tiles.e2m1 in _MMA else tiles.e2m1    # "mma": kernel 1 only
    (sg, og), (su, ou), (ss, os_) = (kernel_math.window_operand(a, n, (m,), "moe_decode")
                                     for a, n in ((s_gate, inter_s), (s_up, inter_s), (s_sig, 1)))
    n_slots = m * k
    sp = _pow2(n_slots)
    flat = bool(tiles.flat) and m > 1
    km = 1 if flat else m       # token rows per slot in the kernels: flat slots hold their own token's only
    fmt1, w1, _ = reference.kernel_operands(gate_up)
    fmt2, w2, _ = reference.kernel_operands(down)
    fmt3, w3, _ = reference.kernel_operands(shared_down)
    flat_ids = ids.reshape(-1).astype(jnp.int32)
    rw = w.reshape(-1).astype(dt)
    meta = slot_meta(ids, w, dt) if tiles.meta == 1 else ()
    x2d = bool(tiles.x2d)
    x_in = pair_columns(x, tiles.cw) if x2d and fmt1 == "nvfp4" else x     # NVFP4 x2d: each chunk's halves contiguous
    if tiles.e2m1 in _MMA:  # e2m1 "mma": the fp16 activation pairs and each token's 2^-s, once for every program
        if x_acts is not None and x_acts.shape != (m, d // 2 + 1):
            raise ValueError(f"moe_decode: x_acts {tuple(x_acts.shape)} must be mma_activations(x) [{m}, {d // 2 + 1}]")
        x_in = mma_activations(x) if x_acts is None else x_acts
    act_pair = tiles.cw2 if x2d and fmt2 == "nvfp4" else 0
    act_shape = jax.ShapeDtypeStruct((n_slots, km, inter), dt)
    meta_shapes = (jax.ShapeDtypeStruct((n_slots,), jnp.int32), jax.ShapeDtypeStruct((n_slots * m,), jnp.int32),
                   jax.ShapeDtypeStruct((n_slots * m,), F32))
    if tiles.persist:       # resident programs walking the (slot, row tile) tasks
        n_prog = min(tiles.persist, n_slots * (inter // tiles.bn))
        act = stacked.call(
            functools.partial(_gate_up_persist_kernel, fmt=fmt1, k=k, n_slots=n_slots, inter=inter, d=d,
                              bn=tiles.bn, cw=tiles.cw, e2m1=tiles.e2m1, wround=bool(tiles.wround),
                              gsum=bool(tiles.gsum), flat_slots=flat, x2d=x2d, act_pair=act_pair, n_prog=n_prog),
            (flat_ids, x_in, *w1), out_shape=act_shape, grid=(n_prog,), interpret=interpret,
            name="moe_decode_gate_up_persist",
            compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.stages))
    else:
        act = stacked.call(     # expert weights may be layers of stacks (fnx.pallas.stacked): read in place
            functools.partial(_gate_up_kernel, fmt=fmt1, m=km, k=k, n_slots=n_slots, sp=sp, inter=inter, d=d,
                              bn=tiles.bn, cw=tiles.cw, acc_tiles=bool(tiles.acc), e2m1=tiles.e2m1,
                              meta=tiles.meta, wround=bool(tiles.wround), gsum=bool(tiles.gsum),
                              tmajor=bool(tiles.tmajor), branch=tiles.branch in (1, 2), dot=tiles.dot,
                              flat_slots=flat, x2d=x2d, act_pair=act_pair, ahead=tiles.ahead),
            (flat_ids, x_in, *meta[:2], *((rw,) if tiles.meta == 2 else ()), *w1),
            out_shape=(act_shape, *meta_shapes) if tiles.meta == 2 else act_shape,
            grid=(n_slots, inter // tiles.bn),
            interpret=interpret, name="moe_decode_gate_up",
            compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.stages),
        )
    if tiles.meta == 2:
        act, *meta = act
    if tiles.mma2 == 2:     # kernel 2's "mma" operand: kernel 1's rows as fp16 pairs and each slot's 2^-s, once
        act = mma_activations(act.reshape(n_slots, inter))
    if finish_base is not None and (tiles.tok or tiles.persist2):
        raise ValueError(f"moe_decode: the combine in the down kernel needs its grid of (column tile, group) "
                         f"programs, not tok / persist2 tiles ({tiles})")
    fin = None
    if tiles.tok:
        return stacked.call(
            functools.partial(_down_tok_kernel, fmt=fmt2, sfmt=fmt3, n_w=len(w2), k=k, n_slots=n_slots, sp=sp,
                              inter=inter, inter_s=inter_s, bn=tiles.bn2, cw=tiles.cw2, e2m1=e2m1_down,
                              offs=(og, ou, os_), wround=bool(tiles.wround), gsum=bool(tiles.gsum)),
            (flat_ids, rw, act, sg.astype(dt), su.astype(dt), ss.astype(dt), *w2, *w3),
            out_shape=jax.ShapeDtypeStruct((m, d), dt), grid=(d // tiles.bn2, m),
            interpret=interpret, name="moe_decode_down",
            compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps2, num_stages=tiles.stages),
        )
    g = tiles.group
    n_groups = n_slots // g if g else 0
    n_shared = m if flat else 1     # grid rows of shared terms: one per token (flat), else one for every token
    out_shape = (n_groups + n_shared, km, d) if g else (m, d)
    if tiles.persist2:      # resident programs walking the (slot group, column tile) tasks, then the shared ones
        n_prog2 = min(tiles.persist2, n_groups * (d // tiles.bn2))
        y = stacked.call(
            functools.partial(_down_persist_kernel, fmt=fmt2, sfmt=fmt3, n_w=len(w2), k=k, n_slots=n_slots, d=d,
                              inter=inter, inter_s=inter_s, bn=tiles.bn2, cw=tiles.cw2, group=g, e2m1=e2m1_down,
                              offs=(og, ou, os_), wround=bool(tiles.wround), gsum=bool(tiles.gsum), x2d=x2d,
                              n_shared=n_shared, n_prog=n_prog2),
            (flat_ids, rw, act, sg.astype(dt), su.astype(dt), ss.astype(dt), *w2, *w3),
            out_shape=jax.ShapeDtypeStruct(out_shape, F32), grid=(n_prog2,), interpret=interpret,
            name="moe_decode_down_persist",
            compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps2, num_stages=tiles.stages))
    else:
        args2 = (flat_ids, rw, act, sg.astype(dt), su.astype(dt), ss.astype(dt), *meta, *w2, *w3)
        y_shape = jax.ShapeDtypeStruct(out_shape, F32 if g else dt)
        if finish_base is not None:
            why = None if g and not flat and counters is not None and counters.dtype == jnp.int32 and \
                0 <= finish_base <= counters.shape[0] - d // tiles.bn2 else \
                f"tiles {tiles} (a group, owner slots), int32 counters [{finish_base} + {d // tiles.bn2}]"
            if why:
                raise ValueError(f"moe_decode: the combine in the down kernel needs {why}")
            fin = (finish_base, interpret)
            args2 = args2 + (counters,)
            y_shape = (y_shape, jax.ShapeDtypeStruct((m, d), dt))
        y = stacked.call(
            functools.partial(_down_kernel, fmt=fmt2, sfmt=fmt3, n_w=len(w2), m=km, k=k, n_slots=n_slots, sp=sp,
                              inter=inter, inter_s=inter_s, bn=tiles.bn2, cw=tiles.cw2, group=g, e2m1=e2m1_down,
                              offs=(og, ou, os_), meta=bool(tiles.meta), hoist=bool(tiles.hoist),
                              wround=bool(tiles.wround), gsum=bool(tiles.gsum), acc_tiles=bool(tiles.acc),
                              tmajor=bool(tiles.tmajor), branch=tiles.branch in (1, 3), dot=tiles.dot,
                              flat_slots=flat, x2d=x2d, mma2=tiles.mma2, mma_asm=not interpret, finish=fin),
            args2,
            out_shape=y_shape,
            grid=(d // tiles.bn2, n_groups + n_shared) if g else (d // tiles.bn2,),
            interpret=interpret, name="moe_decode_down",
            compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps2, num_stages=tiles.stages),
        )
    if fin is not None:
        return y[1]
    if not g:
        return y
    if flat:    # token t's groups are rows [t*K/g, (t+1)*K/g): its terms in k order, then its shared term
        routed = jnp.sum(y[:n_groups, 0].reshape(m, n_groups // m, d), axis=1)
        return (routed.astype(dt).astype(F32) + y[n_groups:, 0]).astype(dt)
    # the routed partials in group order, rounded once, then the shared term (already rounded): as the reference
    return (jnp.sum(y[:n_groups], axis=0).astype(dt).astype(F32) + y[n_groups]).astype(dt)
