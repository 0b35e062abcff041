"""Weight-streaming GEMV / skinny GEMM in Pallas (Triton lowering) for M = 1..32 tokens.

y[M, N] = x[M, K] @ W[N, K].T with W streamed once from HBM. Grid (N / BN, S): program (n, s) owns BN output
rows and the s-th of S equal slices of the K axis (split-K, so narrow layers still fill the GPU's SMs); it walks
its slice BK columns at a time, converting the weight tile to bf16 in registers and calling `dot` against the
token tile (tokens padded to >= 16 rows: the MMA is idle most of the time, the bytes are what count). Partials
are fp32 [S, Mp, N]; XLA sums them (a small fused reduction) when S > 1, else the kernel writes x.dtype.

Whole-K modes (`Tiles.mode` "fma" / "dot", bf16 and FP8): grid (N / BN,); each program owns BN rows and all of K,
its K / BK chunk loads unrolled and every weight tile loaded before any arithmetic, so all of its loads are in
flight at once and no split-K sum follows. "fma" multiplies in fp32 on the CUDA cores for M <= FMA_MAX_M tokens
(no padding), "dot" on tensor cores (tokens padded to 16 in registers: the kernels load x's M rows themselves, so no
padded copy of x is made before a launch).

Formats:
  bf16    W bf16 [N, K].
  fp8     W float8_e4m3fn [N, K] with one fp32 multiplier per 128x128 block: BN divides 128 and BK divides 128,
          so a tile sits in one block and its partial dot is scaled by one scalar, in fp32.
  nvfp4   W uint8 [N, K/2] (two E2M1 codes per byte, low nibble = even column), E4M3 scale per 16 values
          [N, K/16], fp32 global per row [N]. x is split into its even and odd columns outside the kernel (a
          copy of the activations only), so the low and high nibbles each meet a contiguous x tile: no
          interleave in registers. Codes become fp32 with integer ops (no FP4 hardware on Hopper).

Tiles must divide the dims (the wrapper checks; every released shape has such tiles), so no load is masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fnx.pallas import kernel_math, stacked
from fnx.pallas.dot_acc import dot_acc

F32 = jnp.float32
BF16 = jnp.bfloat16
_dot = kernel_math.dot


@dataclasses.dataclass(frozen=True)
class Tiles:
    bn: int            # output rows per program
    bk: int            # K columns per inner step (packed bytes * 2 for nvfp4, i.e. always logical columns)
    split: int         # S, K slices (programs along grid axis 1)
    num_warps: int = 4
    num_stages: int = 3
    dec: str = "f32"   # nvfp4 decode: "f32" (scales expanded by reshape, fp32 multiply), "f32g" (scales loaded
                       # already expanded by a gather from L1), "bf16" (codes placed as bf16 bits, gathered
                       # scales, bf16 multiply: e2m1 x e4m3 is exact in bf16)
    mode: str = "loop"  # "loop": walk K in BK steps (fori_loop, split-K); "dot" / "fma": one program owns BN rows
                        # and the whole K axis, unrolled in BK chunks whose weight loads are all issued first (no
                        # loop-carried load latency, no split-K partials); "dot" multiplies on tensor cores
                        # (tokens padded to 16), "fma" in fp32 on the CUDA cores (M <= FMA_MAX_M, no padding)
    acc: int = 0       # "fma" at one token: 0 = each chunk's products summed across the row at once (a cross-thread
                       # reduction per chunk); 1 = kept as a [BN, BK] fp32 tile over the chunks and summed once (the
                       # MoE decode kernels' `acc`, 4-10% faster there on the H200); more tokens always use 0
    rows: int = 1      # whole-K modes: row tiles of BN per program, walked in turn, the next tile's loads issued
                       # before the current tile's arithmetic (registers hold two tiles), so a program's loads and
                       # arithmetic overlap instead of alternating; N / (BN * rows) programs
    tr: int = 0        # tensor-core modes ("loop", "dot"): 1 = each product as W . x^T ([BN, Mp]: the weight tile is
                       # the MMA's left operand with BN >= 64 rows, the padded token tile its 16 columns), transposed
                       # once before the store; 0 = x . W^T ([Mp, BN]: the 16 token rows on the left). The same
                       # products; which operand is which decides how Triton feeds the MMA (on Hopper a left operand
                       # of 64+ rows converted in registers can go to a warpgroup MMA without a shared-memory copy)
    mma: str = "bf16"  # FP8 / NVFP4 in the tensor-core modes: the MMA's operand type. "bf16": the dequantized tile
                       # in bf16 against the bf16 activations; "f16": FP8's E4M3 tile converted to fp16 (one
                       # instruction per two weights on Hopper, where E4M3 -> bf16 goes through fp32), NVFP4's code *
                       # group scale formed in fp16 (`_nvfp4_f16_mm`: exact, no fp32 step), each token row of the
                       # activation chunk scaled by a power of two into fp16's range first (max |x'| in [2^14, 2^15):
                       # `kernel_math.hfma_prescale`) and the partial scaled back: the weights are exact in fp16 and
                       # x' rounds to fp16's 11 bits instead of bf16's 8 (values below max|x| * 2^-28 of a chunk
                       # lose bits)
    xfirst: int = 0    # whole-K modes ("fma", "dot"): 1 = every chunk's activations loaded before the first chunk's
                       # arithmetic. As first written (each chunk's x read in its own step) the stock sm_90 build
                       # issued a chunk's x load only after the previous chunk's reductions and layout barriers
                       # (FP8 "fma" at one token, gdn.out_proj 2560 x 6144: 12 such rounds), one L2 round trip per
                       # chunk on the program's critical path; with it every load comes before the first barrier.
                       # The same bits. The tile choice (`api.tiles_for`) sets it on every whole-K tile set since
                       # it was measured (H200, d9f4565: the 4-layer round at 8K -15.6 us of kernel time, the step
                       # -19.0; `FNX_GEMV_XFIRST=0` for the A/B)
    sahead: int = 0    # FP8 "loop" mode: 1 = each K step's 128 x 128 block scale(s) loaded a step ahead and carried.
                       # In the stock sm_90 TTGIR the scale is a plain scalar load inside the K loop (no cp.async for
                       # 4 bytes), which the step's partial waits on after its products (ptxas issues it before the
                       # MMAs, ~70 instructions ahead: short of an L2 round trip); ahead, it has the whole step. The
                       # same bits. Other formats and modes ignore it. Built 2026-12-07; level in the 4-layer round
                       # on an H100 (715b89e), so off: FNX_GEMV_MANY_TILES="fp8:sahead=1" (the several-token tiles)
# `split` in the whole-K modes: grid (N / (BN * rows), S), program (n, s) takes the s-th K / S columns, unrolled as
# above (more, shorter programs for layers with few rows); fp32 partials [S, Mp, N], summed by XLA in split order


DECODES = ("f32", "f32g", "bf16")
MODES = ("loop", "dot", "fma")
WIDE_FORMATS = ("bf16", "fp8")
FMA_MAX_M = 8


def _e2m1_bf16(codes):
    """uint8 E2M1 codes (0..15) -> their exact value as bfloat16, with integer ops and a bitcast.

    The magnitude m3 = code & 7 is ee<<1 | m; shifted left by 6 it lands as bf16 exponent ee, mantissa top bit
    m. Adding 126 to the exponent gives 2^(ee-1) * (1 + m/2), the E2M1 value for ee > 0; code 1 (0.5) becomes
    exponent 126 with no mantissa, and code 0 stays 0."""
    c = codes.astype(jnp.int32)
    mag = c & 7
    bits = (mag << 6) + jnp.where(mag > 1, 126 << 7, jnp.where(mag == 1, (126 << 7) - 64, 0))
    bits = bits | ((c & 8) << 12)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), BF16)


def _store(acc, outs, n, s, row0, bn, out_dtype, argmax: bool, fin=None):
    """A program's [Mp, BN] fp32 result: its rows of the output (split s), or with `argmax` its tile's best column
    per token (max, index; ties -> lowest column). `fin` (`finish_tile`'s): then the last of the tile's split
    programs to store sums the splits into the final output."""
    if argmax:
        mx_ref, ix_ref = outs
        best = jnp.max(acc, axis=1)
        cols = lax.broadcasted_iota(jnp.int32, acc.shape, 1) + row0
        ix_ref[n, :] = jnp.min(jnp.where(acc == best[:, None], cols, jnp.int32(2**31 - 1)), axis=1)
        mx_ref[n, :] = best
    else:
        outs[0][s, :, pl.ds(row0, bn)] = acc.astype(out_dtype)
        if fin is not None:
            finish_tile(outs[0], fin, n, row0, bn)


# Split-K without a sum kernel after it ("finish"): each program stores its split's partial [Mp, BN] as before, then
# adds 1 to its row tile's counter (an acquire-release atomic at GPU scope, after a CTA barrier so that all its
# threads' stores come first); the program that sees the count reach a multiple of S is the tile's last, and sums
# the S partials in split order into the output [Mp, N] (its plain loads come after its acquire, which in the stock
# sm_90 build invalidates the SM's L1: `fnx.pallas.grid_sync`). Counters come from a per-program pool
# (`grid_sync.CounterPool`): each call adds exactly S to each of its tiles' counters, so they stay multiples of S.
# The same arithmetic as the XLA sum it replaces, in split order (XLA's reduce may add in another order).

def finish_tile(part_ref, fin, tile, col0, width):
    """The split-K finish for row tile `tile` (columns [col0, col0 + width) of the output): fin = (counters ref,
    output ref [Mp, N], the call's first counter, S, interpret)."""
    ctr_ref, y_ref, base, split, interpret = fin
    if not interpret:
        pltriton.debug_barrier()
    old = pltriton.atomic_add(ctr_ref, (jnp.int32(base) + tile,), jnp.int32(1))

    @pl.when(old % split == split - 1)
    def _():
        acc = part_ref[0, :, pl.ds(col0, width)]
        for i in range(1, split):
            acc = acc + part_ref[i, :, pl.ds(col0, width)]
        y_ref[:, pl.ds(col0, width)] = acc.astype(y_ref.dtype)


def _finish_refs(rest, argmax: bool, finish):
    """(the kernel's other refs, its outputs, `finish_tile`'s fin or None) from the refs after x and w: with
    `finish` = (first counter, S, interpret) the counters come before the outputs and the summed output after the
    partials."""
    if finish is None:
        outs = rest[-2:] if argmax else rest[-1:]
        return rest[:len(rest) - len(outs)], outs, None
    return rest[:-3], rest[-2:-1], (rest[-3], rest[-1], *finish)


MMA_TYPES = ("bf16", "f16")


def _f16_rows(xs, tr: int):
    """Activation chunks xs ([Mp, n] each, one token per row) for fp16 MMAs: each token row scaled by one power of
    two into fp16's range over all the chunks (`kernel_math.hfma_prescale`), and the factor [Mp] scaling a product's
    partial back, shaped for `_mm`'s output ([Mp, 1], or [1, Mp] with tr)."""
    xs = [x.astype(F32) for x in xs]
    mx = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x), axis=1) for x in xs])
    up, down = kernel_math.hfma_prescale(mx)
    return [(x * up[:, None]).astype(jnp.float16) for x in xs], (down[None, :] if tr else down[:, None])


def _fp8_mm(xk, wq, t: Tiles):
    """An FP8 tile's product with the activation chunk xk [Mp, cw] (before its block scale): `_mm` on bf16
    operands, or with `Tiles.mma` "f16" on fp16 ones (`_f16_rows`: exact rescaling by powers of two)."""
    if t.mma != "f16":
        return _mm(xk, wq.astype(BF16), t.tr)
    (xh,), back = _f16_rows([xk], t.tr)
    return _mm(xh, wq.astype(jnp.float16), t.tr) * back


def _nvfp4_scales(sc_ref, row0, kb, t: Tiles, f):
    """A step's E4M3 group scales, `f` applied (a conversion, a factor), spread to its [BN, BK/2] packed bytes (each
    byte's two codes share a group): f on the [BN, BK/16] block, then a reshape (dec "f32"), or gathered in the
    tile's shape, then f (the other decodes: no reshape in registers)."""
    half, ng = t.bk // 2, t.bk // 16
    if t.dec == "f32":
        return kernel_math.group_bytes(f(sc_ref[pl.ds(row0, t.bn), pl.ds(kb * ng, ng)]))
    rows = lax.broadcasted_iota(jnp.int32, (t.bn, half), 0) + row0
    cols = lax.broadcasted_iota(jnp.int32, (t.bn, half), 1) // 8 + kb * ng
    return f(sc_ref[rows, cols])


def _nvfp4_f16_mm(xe, xo, packed, sc, t: Tiles):
    """An NVFP4 step on fp16 MMAs (`Tiles.mma` "f16"): code * 2^-14 (`kernel_math.e2m1_f16`) times its E4M3 group
    scale in fp16 is exact (at most 11 significant bits, every value a multiple of 2^-24, at most 6 * 448 * 2^-14), the
    even and odd activation columns prescaled per token row by one power of two (`_f16_rows`), the partial scaled
    back with 2^14 (before the row's global scale). sc: the step's scales in fp16 (`_nvfp4_scales`)."""
    (he, ho), back = _f16_rows([xe, xo], t.tr)
    part = _mm(he, kernel_math.e2m1_f16(packed & 0xF) * sc, t.tr) + _mm(ho, kernel_math.e2m1_f16(packed >> 4) * sc,
                                                                        t.tr)
    return part * (back * kernel_math.E2M1_F16_SCALE)


def _mm(xk, wk, tr: int):
    """x [Mp, BK] times w [BN, BK] on the tensor cores, fp32: x . w^T [Mp, BN], or with tr w . x^T [BN, Mp]."""
    return _dot(wk, xk, trans_b=True) if tr else _dot(xk, wk, trans_b=True)


def _mm_acc(acc, xk, wk, tr: int):
    """acc + `_mm(xk, wk, tr)`, the accumulator into the product (`dot_acc`; FNX_DOT_ACC=1)."""
    a, b = (wk, xk) if tr else (xk, wk)
    return dot_acc(acc, a, b, trans_b=True, precision=None)        # `_dot`'s (pl.dot's) default precision


def _padded_m(m: int, mode: str) -> int:
    """The token rows a program computes: M rounded up to a power of two ("fma"), and to at least 16 for the
    tensor-core modes (tl.dot's minimum)."""
    return 1 << (m - 1).bit_length() if mode == "fma" else max(16, 1 << (m - 1).bit_length())


def _xrows(x_ref, mp: int, c0, width: int):
    """x[:, c0:c0+width] as [mp, width] when x has m <= mp rows: rows past m repeat row m - 1 (their products are
    never stored to a kept row: row i of x @ W.T depends on row i of x alone). Loading them in the kernel replaces
    the zero-padded copy of x that XLA would make before every launch (one scatter kernel per product at M = 5)."""
    m = x_ref.shape[0]
    if m == mp:
        return x_ref[:, pl.ds(c0, width)]
    rows = jnp.minimum(lax.broadcasted_iota(jnp.int32, (mp, width), 0), m - 1)
    cols = lax.broadcasted_iota(jnp.int32, (mp, width), 1) + c0
    return x_ref[rows, cols]


def _kernel(x_ref, w_ref, *rest, fmt: str, t: Tiles, k: int, out_dtype, argmax: bool, mp: int, n=None, s=None,
            finish=None):
    rest, outs, fin = _finish_refs(rest, argmax, finish)
    if fmt == "fp8":
        (s_ref,) = rest
    elif fmt == "nvfp4":
        x2_ref, sc_ref, g_ref = rest
    # n, s given: a caller that read the program ids outside a branch (gemv_pair_many)
    n = pl.program_id(0) if n is None else n
    s = pl.program_id(1) if s is None else s
    steps = k // t.bk // t.split
    row0 = n * t.bn
    # FP8: a step's 128-column pieces (several 128-column blocks per step when BK > 128, each scaled on its own
    # partial), and with `Tiles.sahead` their block scales loaded a step ahead and carried
    pieces = [(j * 128, 128) for j in range(t.bk // 128)] if t.bk > 128 else [(0, t.bk)]
    ahead = fmt == "fp8" and bool(t.sahead)

    def fp8_scales(i):          # step i's scales, one per piece (the last step's again past the end)
        col0 = (s * steps + jnp.minimum(i, steps - 1)) * t.bk
        return tuple(s_ref[row0 // 128, (col0 + c) // 128] for c, _ in pieces)

    def body(i, carry):
        acc, sc = carry if ahead else (carry, None)
        kb = s * steps + i
        col0 = kb * t.bk
        if fmt == "nvfp4":
            half = t.bk // 2
            xe = _xrows(x_ref, mp, kb * half, half)                     # even columns [Mp, BK/2]
            xo = _xrows(x2_ref, mp, kb * half, half)                    # odd columns
            packed = w_ref[pl.ds(row0, t.bn), pl.ds(kb * half, half)]    # [BN, BK/2] uint8
            if t.mma == "f16":
                sc = _nvfp4_scales(sc_ref, row0, kb, t, lambda v: v.astype(jnp.float16))
                return acc + _nvfp4_f16_mm(xe, xo, packed, sc, t)
            if t.dec == "bf16":
                sc = _nvfp4_scales(sc_ref, row0, kb, t, lambda v: v.astype(BF16))
                lo = _e2m1_bf16(packed & 0xF) * sc
                hi = _e2m1_bf16(packed >> 4) * sc
            else:   # code * 2^-14 from the fp16 bits: 2^14 folded into the scale
                sc = _nvfp4_scales(sc_ref, row0, kb, t, lambda v: v.astype(F32) * kernel_math.E2M1_F16_SCALE)
                lo = (kernel_math.e2m1_f16(packed & 0xF).astype(F32) * sc).astype(BF16)
                hi = (kernel_math.e2m1_f16(packed >> 4).astype(F32) * sc).astype(BF16)
            return _mm_acc(_mm_acc(acc, xe, lo, t.tr), xo, hi, t.tr)
        if fmt == "fp8":
            nxt = fp8_scales(i + 1) if ahead else None          # in flight during this step's products
            for j, (c, w) in enumerate(pieces):
                xk = _xrows(x_ref, mp, col0 + c, w)                     # [Mp, w] bf16
                wq = w_ref[pl.ds(row0, t.bn), pl.ds(col0 + c, w)]       # [BN, w]
                acc = acc + _fp8_mm(xk, wq, t) * (sc[j] if ahead else s_ref[row0 // 128, (col0 + c) // 128])
            return (acc, nxt) if ahead else acc
        xk = _xrows(x_ref, mp, col0, t.bk)                               # [Mp, BK] bf16
        wq = w_ref[pl.ds(row0, t.bn), pl.ds(col0, t.bk)]                # [BN, BK]
        return _mm_acc(acc, xk, wq.astype(BF16), t.tr)                     # [Mp, BN] ([BN, Mp]: tr)

    zero = jnp.zeros((t.bn, mp) if t.tr else (mp, t.bn), F32)
    acc = lax.fori_loop(0, steps, body, (zero, fp8_scales(0)) if ahead else zero)
    acc = acc[0] if ahead else acc
    if t.tr:
        acc = acc.T
    if fmt == "nvfp4":
        acc = acc * g_ref[pl.ds(row0, t.bn)][None, :]
    _store(acc, outs, n, s, row0, t.bn, out_dtype, argmax, fin)


def _chunk_width(fmt: str, t: Tiles) -> int:
    """Columns per unrolled load of the whole-K modes: BK, except that "dot" on FP8 loads 128-column pieces (one
    block scale each: register tiles cannot be sliced)."""
    return 128 if fmt == "fp8" and t.mode == "dot" and t.bk > 128 else t.bk


def _wide_kernel(x_ref, w_ref, *rest, fmt: str, t: Tiles, k: int, m: int, out_dtype, argmax: bool, n=None,
                 ks=None, finish=None):
    """One program: `t.rows` row tiles of BN output rows, each over the whole K axis. A tile's K/BK chunk loads are
    unrolled and all issued before its arithmetic (a looped program waits one DRAM latency per step); with
    several row tiles the next tile's loads are issued before the current tile's arithmetic. FP8: a tile's rows
    sit in one 128-row block, so "fma" folds the block scales into the activation (x * s per column, fp32) and
    "dot" scales each 128-column partial. x has its M rows: `_xrows` loads the padded tile "dot"
    needs; "fma" reads the M rows alone."""
    rest, outs, fin = _finish_refs(rest, argmax, finish)
    s_ref = rest[0] if fmt == "fp8" else None
    prog = pl.program_id(0) if n is None else n   # given: a caller that read it outside a branch (gemv_pair)
    if ks is None:
        ks = pl.program_id(1) if t.split > 1 else 0   # the K slice (split-K over whole-K programs)
    mp = _padded_m(m, t.mode)
    cw = _chunk_width(fmt, t)
    nk = k // t.split // cw
    k0 = ks * (k // t.split)

    def load(tile):
        row0 = tile * t.bn
        ws = [w_ref[pl.ds(row0, t.bn), pl.ds(k0 + j * cw, cw)] for j in range(nk)]
        ss = None
        if fmt == "fp8":   # the tile's block scales: a vector of cw / 128 per chunk, or one scalar
            ss = [s_ref[row0 // 128, pl.ds((k0 + j * cw) // 128, cw // 128)] if cw > 128
                  else s_ref[row0 // 128, (k0 + j * cw) // 128] for j in range(nk)]
        return ws, ss

    pending = load(prog * t.rows)
    for r in range(t.rows):
        ws, ss = pending
        if r + 1 < t.rows:
            pending = load(prog * t.rows + r + 1)       # in flight during this tile's arithmetic
        tile_id = prog * t.rows + r
        acc = _wide_tile(x_ref, ws, ss, fmt=fmt, t=t, m=m, mp=mp, cw=cw, nk=nk, k0=k0)
        _store(acc, outs, tile_id, ks, tile_id * t.bn, t.bn, out_dtype, argmax, fin)


def _wide_tile(x_ref, ws, ss, *, fmt: str, t: Tiles, m: int, mp: int, cw: int, nk: int, k0=0):
    """One row tile's [Mp, BN] fp32 products from its loaded chunks `ws` (and FP8 block scales `ss`)."""
    acc = jnp.zeros((mp, t.bn), F32)
    if t.mode == "fma":
        rows = lax.broadcasted_iota(jnp.int32, (mp, t.bn), 0)
        accs = [jnp.zeros((t.bn,), F32) for _ in range(m)]
        tile = None
        xs = [[x_ref[i, pl.ds(k0 + j * cw, cw)] for i in range(m)] for j in range(nk)] if t.xfirst else None
        for j in range(nk):
            wf = ws[j].astype(F32)                                                    # [BN, CW]
            if fmt == "fp8":   # per column: its block's scale (fp32), folded into the activation
                sx = kernel_math.block_cols(ss[j], cw)
            for i in range(m):
                xv = (xs[j][i] if xs is not None else x_ref[i, pl.ds(k0 + j * cw, cw)]).astype(F32)  # [CW]
                if fmt == "fp8":
                    xv = xv * sx
                if t.acc and m == 1:    # the products kept as a tile, one row reduction after the last chunk
                    tile = wf * xv[None, :] if tile is None else tile + wf * xv[None, :]
                else:
                    accs[i] = accs[i] + jnp.sum(wf * xv[None, :], axis=1)
        if tile is not None:
            accs[0] = jnp.sum(tile, axis=1)
        for i in range(m):
            acc = jnp.where(rows == i, accs[i][None, :], acc)
    else:
        acc = jnp.zeros((t.bn, mp), F32) if t.tr else acc
        xks = [_xrows(x_ref, mp, k0 + j * cw, cw) for j in range(nk)] if t.xfirst else None
        for j in range(nk):
            xk = xks[j] if xks is not None else _xrows(x_ref, mp, k0 + j * cw, cw)
            if fmt == "fp8":                                                                 # [Mp, BN] / [BN, Mp]
                acc = acc + _fp8_mm(xk, ws[j], t) * ss[j]
            else:
                acc = _mm_acc(acc, xk, ws[j].astype(BF16), t.tr)
        acc = acc.T if t.tr else acc
    return acc


def check_tiles(fmt: str, n: int, k: int, t: Tiles) -> str | None:
    """None when `t` fits (n, k) exactly, else why not."""
    for name, v in (("bn", t.bn), ("bk", t.bk), ("split", t.split)):
        if v <= 0 or v & (v - 1) and name != "split":
            return f"{name}={v} is not a power of two"
    if t.mode not in MODES:
        return f"unknown mode {t.mode!r} (one of {MODES})"
    if t.sahead not in (0, 1):
        return f"sahead={t.sahead}: 0 or 1"
    if t.tr not in (0, 1) or (t.tr and t.mode == "fma"):
        return f"tr={t.tr}: 0, or 1 with a tensor-core mode ('loop' or 'dot'; 'fma' has no operand order)"
    if t.mma not in MMA_TYPES or (t.mma != "bf16" and (fmt not in ("fp8", "nvfp4") or t.mode == "fma"
                                                        or (fmt == "nvfp4" and t.dec == "bf16"))):
        return f"mma={t.mma!r}: one of {MMA_TYPES}; 'f16' takes FP8 or NVFP4 weights (decode 'f32' / 'f32g') in a " \
               "tensor-core mode ('loop' or 'dot')"
    if t.mode != "loop":
        return _check_wide(fmt, n, k, t)
    if t.acc:
        return f"acc={t.acc} keeps the products of mode 'fma' as a tile: not for mode 'loop'"
    if t.rows != 1:
        return f"rows={t.rows} row tiles per program are for the whole-K modes, not mode 'loop'"
    if t.bn < 16 or t.bk < 32:
        return f"tiles bn={t.bn} bk={t.bk} are below the 16 x 32 minimum"
    if n % t.bn:
        return f"bn={t.bn} does not divide N={n}"
    if k % (t.bk * t.split):
        return f"bk*split={t.bk * t.split} does not divide K={k}"
    if fmt == "fp8" and (128 % t.bn or (128 % t.bk and t.bk % 128)):
        return "fp8 128x128 blocks need bn to divide 128 and bk to divide 128 or be a multiple of it"
    if t.dec not in DECODES:
        return f"unknown nvfp4 decode {t.dec!r} (one of {DECODES})"
    if fmt == "nvfp4" and t.bk % 32:
        return "nvfp4 needs bk to be a multiple of 32"
    return None


def _check_wide(fmt: str, n: int, k: int, t: Tiles) -> str | None:
    if fmt not in WIDE_FORMATS:
        return f"mode {t.mode!r} streams {WIDE_FORMATS} weights, not {fmt}"
    if t.split < 1 or k % t.split or (k // t.split) % _chunk_width(fmt, t):
        return f"split={t.split}: K={k} must split into slices of whole {_chunk_width(fmt, t)}-column chunks"
    if t.acc not in (0, 1) or (t.acc and t.mode != "fma"):
        return f"acc={t.acc}: 0, or 1 with mode 'fma' (the products kept as a tile)"
    if t.bn < (16 if t.mode == "dot" else 1) or t.bk < 16:
        return f"tiles bn={t.bn} bk={t.bk} are below the {t.mode} minimum ({16 if t.mode == 'dot' else 1} x 16)"
    if n % t.bn or k % t.bk:
        return f"bn={t.bn} / bk={t.bk} do not divide N={n} / K={k}"
    cw = _chunk_width(fmt, t)
    if k // t.split // cw > 64:
        return f"{k // t.split // cw} K chunks of {cw} columns per program is too many to unroll (at most 64)"
    if t.rows < 1 or n % (t.bn * t.rows):
        return f"rows={t.rows} row tiles of bn={t.bn} per program do not divide N={n}"
    if fmt == "fp8" and (128 % t.bn or (128 % t.bk and t.bk % 128)):
        return "fp8 128x128 blocks need bn to divide 128 and bk to divide 128 or be a multiple of it"
    return None


@functools.partial(jax.jit, static_argnames=("fmt", "tiles", "interpret", "argmax", "k", "finish_base"))
def gemv(x, w, scale=None, scale_2=None, *, fmt: str, tiles: Tiles, interpret: bool = False,
         argmax: bool = False, k: int | None = None, counters=None, finish_base: int | None = None):
    """x [M, K] bf16/f32 with M <= 32; w per `fmt`; returns y [M, N] in x.dtype, or with `argmax` the greedy
    ids [M] int32 of the fp32 logits (never written out: each program keeps its tile's best column).
    k: the product's K when x is wider (bf16 / FP8 weights): x [M, W >= k], its first k columns read in place (a
    window of a wider buffer, with no slice kernel before the launch).
    finish_base (split-K tiles): the split sum in the kernel (`finish_tile`), the row tiles' counters
    counters[finish_base:finish_base + N / BN] (int32, multiples of the split: `grid_sync.CounterPool`)."""
    m, wx = x.shape
    if k is None:
        k = wx
    elif not 0 < k <= wx or fmt == "nvfp4":
        raise ValueError(f"gemv: k={k} columns of x [{m}, {wx}] (bf16 / FP8 weights; NVFP4 splits x's columns)")
    n = w.shape[0]
    t = tiles
    why = check_tiles(fmt, n, k, t)
    if why:
        raise ValueError(f"gemv {fmt} N={n} K={k}: {why}")
    if t.mode == "fma" and m > FMA_MAX_M:
        raise ValueError(f"gemv mode 'fma' serves M <= {FMA_MAX_M} tokens, not {m}")
    mp = _padded_m(m, t.mode)
    xb = x.astype(BF16)     # M rows: the kernels load the padded tile themselves (`_xrows`)
    if argmax and t.split != 1:
        raise ValueError("the fused argmax needs split == 1 (each program must see whole dot products)")
    out_dtype = x.dtype if t.split == 1 else F32
    if fmt == "nvfp4":
        args = (xb[:, 0::2], w, xb[:, 1::2], scale, stacked.astype(scale_2, F32))
    elif fmt == "fp8":
        args = (xb, w, stacked.astype(scale, F32))
    else:
        args = (xb, w)
    if t.mode == "loop":
        kern = functools.partial(_kernel, fmt=fmt, t=t, k=k, out_dtype=out_dtype, argmax=argmax, mp=mp)
    else:
        kern = functools.partial(_wide_kernel, fmt=fmt, t=t, k=k, m=m, out_dtype=out_dtype, argmax=argmax)
    if argmax:
        out_shape = (jax.ShapeDtypeStruct((n // t.bn, mp), F32), jax.ShapeDtypeStruct((n // t.bn, mp), jnp.int32))
    else:
        out_shape = jax.ShapeDtypeStruct((t.split, mp, n), out_dtype)
    if finish_base is not None:
        _check_finish(t, argmax, counters, finish_base, n // t.bn)
        kern = functools.partial(kern, finish=(finish_base, t.split, interpret))
        args = args + (counters,)
        out_shape = (out_shape, jax.ShapeDtypeStruct((mp, n), x.dtype))
    out = stacked.call(
        kern, args,
        out_shape=out_shape,
        grid=(n // (t.bn * t.rows),) + ((t.split,) if t.mode == "loop" or t.split > 1 else ()),
        compiler_params=pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name=f"fnx_gemv_{fmt}" if t.mode == "loop" else f"fnx_gemv_{fmt}_{t.mode}",
    )
    if argmax:
        mx, ix = out
        best = jnp.argmax(mx[:, :m], axis=0)            # first (lowest-column) tile among equal maxima
        return jnp.take_along_axis(ix[:, :m], best[None], axis=0)[0]
    if finish_base is not None:
        return out[1][:m]
    if t.split == 1:
        return out[0, :m]
    return jnp.sum(out[:, :m], axis=0).astype(x.dtype)


def _check_finish(t: Tiles, argmax: bool, counters, base: int, tiles: int):
    if argmax or t.split < 2:
        raise ValueError(f"gemv: the in-kernel split sum needs split-K tiles without the argmax (split={t.split}, "
                         f"argmax={argmax})")
    if counters is None or counters.dtype != jnp.int32 or counters.ndim != 1 or not 0 <= base <= \
            counters.shape[0] - tiles:
        raise ValueError(f"gemv: the in-kernel split sum needs int32 counters [{base} + {tiles}] (grid_sync."
                         f"CounterPool), got {None if counters is None else (counters.dtype, counters.shape)}")


# ---- a pair of products of one activation in one launch -----------------------------------------------------------
#
# At one token a layer's input projections are often two products of the same x: a wide FP8 one (the fused GDN
# qkv + z, the shared expert's gate / up) and a narrow bf16 one kept out of FP8 (the GDN b / a gates: 96 rows; the
# MoE router with the shared expert's gate logit: 513 rows). Apart they are two launches, the narrow one an XLA
# reduction of ~2 us that mostly waits. `gemv_pair` runs both in one grid: the first ceil(N2 / BN2) programs each
# multiply BN2 rows of the bf16 weight by x in fp32 on the CUDA cores (all their K chunks loaded first; the rows past
# N2 masked), the next N1 / BN programs are the whole-K FP8 kernel above ("fma" or "dot" tiles).

PAIR_SIDE_MAX_N = 1024      # the narrow product's rows at most (it runs on few programs; wide ones take their own)


def _pair_kernel(x_ref, w1_ref, s1_ref, w2_ref, y1_ref, y2_ref, *, t: Tiles, k: int, m: int, n2_prog: int,
                 n2: int, bn2: int, cw2: int, out_dtype):
    pid = pl.program_id(0)

    @pl.when(pid >= n2_prog)
    def _():
        _wide_kernel(x_ref, w1_ref, s1_ref, y1_ref, fmt="fp8", t=t, k=k, m=m, out_dtype=out_dtype, argmax=False,
                     n=pid - n2_prog)

    @pl.when(pid < n2_prog)
    def _():
        rows = pid * bn2 + jnp.arange(bn2, dtype=jnp.int32)
        ok = rows < n2
        cols = jnp.arange(cw2, dtype=jnp.int32)
        nk = k // cw2
        mask = jnp.broadcast_to(ok[:, None], (bn2, cw2))
        ws = [pltriton.load(w2_ref.at[rows[:, None] * k + (j * cw2 + cols)[None, :]], mask=mask, other=0.0)
              for j in range(nk)]                                                    # weights first: [BN2, CW2]
        for i in range(m):
            acc = jnp.zeros((bn2,), F32)
            for j in range(nk):
                xv = x_ref[i, pl.ds(j * cw2, cw2)].astype(F32)
                acc = acc + jnp.sum(ws[j].astype(F32) * xv[None, :], axis=1)
            pltriton.store(y2_ref.at[i * n2 + rows], acc.astype(out_dtype), mask=ok)


def pair_side_tiles(n2: int, k: int) -> tuple[int, int] | None:
    """(BN2, CW2) for the narrow product: 4 rows per program, K in chunks of up to 512 columns (at most 16)."""
    cw2 = next((c for c in (512, 256, 128, 64, 32, 16) if k % c == 0), None)
    if cw2 is None or k // cw2 > 16 or n2 > PAIR_SIDE_MAX_N:
        return None
    return 4, cw2


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def gemv_pair(x, w1, scale1, w2, *, tiles: Tiles, interpret: bool = False):
    """(x @ dequant(W1).T, x @ W2.T) in one launch: x [M, K] (M <= FMA_MAX_M for "fma" tiles), W1 float8_e4m3fn
    [N1, K] with its 128x128 block scales, `tiles` a whole-K mode ("fma" / "dot") that fits (N1, K); W2 bf16
    [N2, K] with N2 <= PAIR_SIDE_MAX_N. Returns y1 [M, N1], y2 [M, N2] in x.dtype."""
    m, k = x.shape
    n1, n2 = w1.shape[0], w2.shape[0]
    t = tiles
    why = check_tiles("fp8", n1, k, t)
    if why or t.mode == "loop" or t.split != 1:
        raise ValueError(f"gemv_pair: the FP8 product N={n1} K={k} needs whole-K tiles without split-K: "
                         f"{why or t}")
    if t.mode == "fma" and m > FMA_MAX_M:
        raise ValueError(f"gemv_pair: mode 'fma' serves M <= {FMA_MAX_M} tokens, not {m}")
    side = pair_side_tiles(n2, k)
    if side is None or w2.shape[1] != k or w2.dtype != BF16 or w1.shape[1] != k:
        raise ValueError(f"gemv_pair: the narrow product must be bf16 [N2 <= {PAIR_SIDE_MAX_N}, K={k}] with K in "
                         f"at most 16 chunks of a power of two; got {w2.dtype} {tuple(w2.shape)}")
    bn2, cw2 = side
    mp = _padded_m(m, t.mode)
    xb = x.astype(BF16)     # M rows: the kernels load the padded tile themselves (`_xrows`)
    n1_prog = n1 // (t.bn * t.rows)
    n2_prog = -(-n2 // bn2)     # the narrow programs first: they start with the first wave, not in the grid's tail
    y1, y2 = stacked.call(
        functools.partial(_pair_kernel, t=t, k=k, m=m, n2_prog=n2_prog, n2=n2, bn2=bn2, cw2=cw2, out_dtype=x.dtype),
        (xb, w1, stacked.astype(scale1, F32), stacked.flatten(w2)),
        out_shape=(jax.ShapeDtypeStruct((1, mp, n1), x.dtype), jax.ShapeDtypeStruct((m * n2,), x.dtype)),
        grid=(n2_prog + n1_prog,),
        compiler_params=pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name=f"fnx_gemv_pair_fp8_{t.mode}",
    )
    return y1[0, :m], y2.reshape(m, n2)


# ---- the pair at several tokens (an MTP verify window) ------------------------------------------------------------
#
# At M > 1 the FP8 products' tuned tiles run on the tensor cores and mostly loop over K with split-K (grid (N1 / BN,
# S), fp32 partials summed by one XLA fusion), which `gemv_pair`'s one-axis grid cannot hold; apart, the narrow
# product is an XLA split-K product plus its own sum (two launches of ~2-3.5 us per layer at five tokens, H200).
# `gemv_pair_many` puts the narrow rows into the FP8 kernel's own grid: the first ceil(N2 / 16) program rows each
# multiply 16 rows of the bf16 weight by the tokens in fp32 (a loop over their K slice's chunks), over the same K
# slice s as the FP8 programs beside them, into the same output:
# columns [N1, N1 + N2) of one product [S, Mp, N1 + N2p] (N2p: N2 rounded up to 16; the columns past N2 are never
# read). So the FP8 product's split sum (one XLA fusion) sums both, and the two products reach their consumers as
# windows of one buffer (the kernels read them in place).

PAIR_MANY_BN2 = 16          # narrow rows per program
PAIR_MANY_MAX_M = 32


def pair_many_side(n2: int, k: int, split: int) -> int | None:
    """The narrow product's chunk width in the several-token pair (each program: 16 rows of one K slice of
    K / split columns, walked in chunks of up to 256 columns, at most 64 of them), or None when none fits."""
    if split < 1 or k % split or n2 > PAIR_SIDE_MAX_N or n2 < 1:
        return None
    ks = k // split
    return next((c for c in (256, 128, 64, 32, 16) if ks % c == 0 and ks // c <= 64), None)


def _pair_many_kernel(x_ref, w1_ref, s1_ref, w2_ref, *outs, t: Tiles, k: int, m: int, mp: int, n1: int,
                      n2: int, n2_prog: int, cw2: int, out_dtype, finish=None):
    out_ref = outs[-1] if finish is None else outs[-2]    # finish: (counters, partials, the summed product)
    pid = pl.program_id(0)          # the program ids are read here, outside the branches
    s = pl.program_id(1) if t.mode == "loop" or t.split > 1 else 0

    @pl.when(pid >= n2_prog)
    def _():
        if t.mode == "loop":
            _kernel(x_ref, w1_ref, s1_ref, *outs, fmt="fp8", t=t, k=k, out_dtype=out_dtype, argmax=False, mp=mp,
                    n=pid - n2_prog, s=s, finish=finish)
        else:
            _wide_kernel(x_ref, w1_ref, s1_ref, *outs, fmt="fp8", t=t, k=k, m=m, out_dtype=out_dtype,
                         argmax=False, n=pid - n2_prog, ks=s, finish=finish)

    @pl.when(pid < n2_prog)
    def _():
        bn2 = PAIR_MANY_BN2
        ks = k // t.split
        k0 = s * ks
        # rows past N2 repeat row N2 - 1 (in bounds, no masked loads): their columns are padding, never read
        rows = jnp.minimum(lax.broadcasted_iota(jnp.int32, (bn2, cw2), 0) + pid * bn2, n2 - 1)
        cols = lax.broadcasted_iota(jnp.int32, (bn2, cw2), 1) + k0

        trow = lax.broadcasted_iota(jnp.int32, (mp, bn2), 0)

        # a loop over the chunks, each token's products in fp32 on the CUDA cores: the branch then needs no more
        # registers than the FP8 programs beside it (124 at the GDN pair's tiles, stock Triton 3.5 for sm_90; the
        # same loop on MMAs took 132, a whole slice's loads issued first more: one program fewer per SM for all)
        def chunk(j, acc):
            w = w2_ref[rows, cols + j * cw2].astype(F32)                          # [16, CW2]
            for i in range(m):
                xv = x_ref[i, pl.ds(k0 + j * cw2, cw2)].astype(F32)
                acc = acc + jnp.where(trow == i, jnp.sum(w * xv[None, :], axis=1)[None, :], 0.0)
            return acc
        acc = lax.fori_loop(0, ks // cw2, chunk, jnp.zeros((mp, bn2), F32))
        out_ref[s, :, pl.ds(n1 + pid * bn2, bn2)] = acc.astype(out_dtype)
        if finish is not None:      # the narrow rows' tiles after the FP8 product's
            finish_tile(out_ref, (outs[0], outs[-1], *finish), n1 // t.bn + pid, n1 + pid * bn2, bn2)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "partials", "finish_base"))
def gemv_pair_many(x, w1, scale1, w2, *, tiles: Tiles, interpret: bool = False, partials: bool = False,
                   counters=None, finish_base: int | None = None):
    """x @ [dequant(W1); W2].T in one launch for 2..32 tokens: x [M, K], W1 float8_e4m3fn [N1, K] with its 128x128
    block scales under tensor-core tiles ("loop" or "dot", any split), W2 bf16 [N2, K] with N2 <= PAIR_SIDE_MAX_N.
    Returns one product [M, N1 + N2p] in x.dtype: columns [0, N1) the FP8 product, [N1, N1 + N2) the narrow one
    (N2p = N2 rounded up to 16; the rest padding). `partials` with split-K tiles: the kernel's fp32 partials
    [S, Mp, N1 + N2p] as they are (for a consumer that sums them where it reads them: `kernel_math.Partials`).
    finish_base (split-K tiles): the split sum in the kernel (`finish_tile`), counters[finish_base:finish_base +
    N1 / BN + ceil(N2 / 16)] (the FP8 product's row tiles, then the narrow product's)."""
    m, k = x.shape
    n1, n2 = w1.shape[0], w2.shape[0]
    t = tiles
    why = check_tiles("fp8", n1, k, t)
    if why or t.mode == "fma":
        raise ValueError(f"gemv_pair_many: the FP8 product N={n1} K={k} needs tensor-core tiles ('loop' or "
                         f"'dot'): {why or t}")
    if not 1 <= m <= PAIR_MANY_MAX_M:
        raise ValueError(f"gemv_pair_many serves 1..{PAIR_MANY_MAX_M} tokens, not {m}")
    cw2 = pair_many_side(n2, k, t.split)
    if cw2 is None or w2.shape[1] != k or w2.dtype != BF16 or w1.shape[1] != k:
        raise ValueError(f"gemv_pair_many: the narrow product must be bf16 [N2 <= {PAIR_SIDE_MAX_N}, K={k}] with "
                         f"K / split={t.split} in at most 64 power-of-two chunks; got {w2.dtype} {tuple(w2.shape)}")
    mp = _padded_m(m, t.mode)
    n2_prog = -(-n2 // PAIR_MANY_BN2)   # first in the grid: they start with the first wave
    width = n1 + n2_prog * PAIR_MANY_BN2
    out_dtype = x.dtype if t.split == 1 else F32
    two_axes = t.mode == "loop" or t.split > 1
    args = (x.astype(BF16), w1, stacked.astype(scale1, F32), w2)
    out_shape = jax.ShapeDtypeStruct((t.split, mp, width), out_dtype)
    finish = None
    if finish_base is not None:
        if partials:
            raise ValueError("gemv_pair_many: partials or the in-kernel split sum, not both")
        _check_finish(t, False, counters, finish_base, n1 // t.bn + n2_prog)
        finish = (finish_base, t.split, interpret)
        args, out_shape = args + (counters,), (out_shape, jax.ShapeDtypeStruct((mp, width), x.dtype))
    out = stacked.call(
        functools.partial(_pair_many_kernel, t=t, k=k, m=m, mp=mp, n1=n1, n2=n2, n2_prog=n2_prog, cw2=cw2,
                          out_dtype=out_dtype, finish=finish),
        args,
        out_shape=out_shape,
        grid=(n2_prog + n1 // (t.bn * t.rows),) + ((t.split,) if two_axes else ()),
        compiler_params=pltriton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages),
        interpret=interpret,
        name=f"fnx_gemv_pair_many_fp8_{t.mode}",
    )
    if finish is not None:
        return out[1][:m]
    if t.split == 1:
        return out[0, :m]
    if partials:
        return out
    return jnp.sum(out[:, :m], axis=0).astype(x.dtype)
