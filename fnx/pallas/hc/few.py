"""The hyper-connection boundary for a few tokens (2..8: the MTP verify window).

Why a third design. The one-token kernels (`pallas.hc_boundary_m1`) fold the combine and the norm into every
program: at one token that is the cheapest place for them, but over M tokens each of the 5 x 648 programs renormalises
a whole stream, and the five-token pair took ~31 us (grid) or ~33 us (loop) against ~22 us for XLA's boundary
(H200). XLA's boundary spends ~8 us streaming the two FP8 weights through the GEMV kernels and the rest on a cuBLAS
product with its split-K reduce for the 4-row Winj (6.8 us) and six small fusions. Here:

  pre  (XLA, the reference's own jnp; or `hc_pre_few`, TilesFew.pre "pallas", grid (M, S)): H' = H + inj_prev * y
        and Hn = GroupedRMSNorm(H') [M, S*D], once per token.
  down (Pallas, `hc_down_few`): grid (R / bn, ks). Program (n, c) multiplies Hn's columns of split c (tokens padded
        to 16 MMA rows, the padding masked off: no memory read) by rows [n*bn, (n+1)*bn) of [Wdown; Winj] (the
        programs past Wdown's rows read Winj's S rows): one [16, bk] x [bk, bn] MMA per K chunk (`chunks` per
        program, their loads issued first); FP8 weights go to bf16 exactly and the 128x128 block scale multiplies
        each chunk's fp32 product (the one-token kernels' `wround=0` arithmetic). The real tokens' fp32 partials
        [ks, M, r + S]. Winj rides in the same launch as Wdown: no cuBLAS product, no second split-K reduce.
  mid  (XLA, the reference's ops; or `hc_mid_few`, TilesFew.mid "pallas"): the splits' sum, rounded as the
        product's output, / S, silu -> u [M, r]; inj.
  up   "gemv" (the default): the gates sigmoid(u @ Wup.T) through `fnx.pallas.gemv.api.linear` (its own dispatch)
        and the reference's mix. "mma" (`hc_up_few`): grid (D / bd,); program i loads its [bd, r] rows of Wup for
        every stream and u, runs the gate MMAs (r in power-of-two pieces, one scale per FP8 piece), and writes
        x = round(mean_j round(m_j * Hn_j)) for its columns.

bf16 or FP8 Wdown / Wup (Winj and hc_norm dense). Each MMA row is one token's products; the norm is XLA's, as on the
reference path, so a token's bits may differ with the window's length (XLA's reductions at another shape)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import dispatch, stacked
from fnx.pallas.hc import pallas as kernel
from fnx.pallas.hc import reference
from fnx.pallas.kernel_math import rnd

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST   # fp32 operands (the tests' fp32 runs): IEEE products; bf16: no effect
MP = 16                               # token rows of every MMA (the real tokens first, the rest masked)
MAX_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class TilesFew:
    bn: int = 64            # rows of [Wdown; Winj] per down program (the MMA's N: >= 16, divides 128)
    bk: int = 128           # columns per MMA (down): a power of two <= 128, so a chunk lies in one FP8 block
    chunks: int = 1         # K chunks per down program: S*D / (bk * chunks) splits (H200, 2026-12-03: 10 chunks per
                            # program with their loads issued first ran 26.6 us per down call; the GEMV kernels at
                            # M = 5 take one chunk per program, 80 splits, and stream Wdown in ~4 us)
    up: str = "gemv"        # "gemv": the gates through fnx.pallas.gemv (Wup at M tokens) and the mix in XLA;
                            # "mma": one kernel for the gate MMAs and the mix (u from XLA); in the 4-layer verify
                            # program at 8K (H200, e6d2934) 15.9 us per boundary against ~5.4 for "gemv"'s two
    bd: int = 16            # up "mma": columns of each stream per program (the MMA's N: >= 16, divides D and 128)
    # The glue around the down kernel: "xla" (the default) the reference's jnp, "pallas" a kernel. In the 4-layer
    # verify program at 8K (H200, eb7f627; compiled tests passed) both kernels took the program from 181 to 172
    # launches, but its kernel time rose (1.0078 -> 1.0139-1.0191 ms; HC + other XLA families 0.212 -> 0.220 ms):
    # hc_pre_few ~3.0 us per boundary (XLA's combine + norm ~3.5), hc_mid_few 2.8 us at mid_bc 8 (3.9 at 128, 15
    # programs; XLA's reduce + silu ~2.9); XLA had fused most combines into the previous sublayer's epilogue (PLE add,
    # GDN out_proj split sum, MoE convert), which split off again as fusions of their own. pre alone: 188 launches.
    pre: str = "xla"        # the combine and the grouped norm: "pallas" one kernel (`hc_pre_few`), "xla" the
                            # reference's jnp (two XLA fusions on the H200: the combine, then the norm), "fold"
                            # no norm pass: the combine as "xla" (XLA fuses it into the previous sublayer's
                            # epilogue), the down kernel multiplies round(H' (1 + w)) and sums each split's H'^2,
                            # the mid scales each stream's partial sum by its 1/rms (rstd) and Hn for the mix is
                            # formed from H' and rstd where it is used (built 2026-12-05, not yet measured)
    mid: str = "xla"        # the splits' sum, / S, silu and inj's logits: "pallas" one kernel (`hc_mid_few`), "xla"
                            # the reference's jnp (a reduce fusion and a silu fusion), "xla1" the same ops as one
                            # elementwise pass over the whole sum (silu on u's columns, inj's sigmoid on the rest: a
                            # single consumer XLA can fuse into the reduce), the up GEMV reading u's columns of it
                            # in place (no slice kernel; up "gemv" only)
    mid_bc: int = 8         # mid kernel: columns of [Wdown; Winj]'s output per program (a power of two, 8..128);
                            # grid (M, ceil((r + S) / mid_bc)); 8, 16, 32, 128 measured 2.8, 2.8, 2.9, 3.9 us
    num_warps: int = 4
    num_stages: int = 1


def check(s: int, d: int, r: int, t: TilesFew) -> str | None:
    """None when the tiles fit (S streams of D, rank r), else why not."""
    sd = s * d
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    if not (pow2(t.bn) and 16 <= t.bn <= 128):
        return f"bn={t.bn}: a power of two in 16..128"
    if not (pow2(t.bk) and 16 <= t.bk <= 128):
        return f"bk={t.bk}: a power of two in 16..128"
    if t.chunks < 1 or sd % (t.chunks * t.bk):
        return f"chunks={t.chunks}, bk={t.bk}: S*D={sd} is not a whole number of splits of chunks x bk"
    if t.up not in ("gemv", "mma"):
        return f"up={t.up!r}: 'gemv' or 'mma'"
    if not (pow2(t.mid_bc) and 8 <= t.mid_bc <= 128):
        return f"mid_bc={t.mid_bc}: a power of two in 8..128"
    if t.pre not in ("pallas", "xla", "fold"):
        return f"pre={t.pre!r}: 'pallas', 'xla' or 'fold'"
    if t.pre == "fold" and d % (t.chunks * t.bk):
        return f"pre='fold': a split (chunks={t.chunks} x bk={t.bk} columns) must lie in one stream of D={d}"
    if t.mid not in ("pallas", "xla", "xla1") or (t.mid == "xla1" and t.up != "gemv"):
        return f"mid={t.mid!r}: 'pallas', 'xla' or 'xla1' (with up 'gemv')"
    if t.up == "mma" and (not (pow2(t.bd) and 16 <= t.bd <= 128) or d % t.bd or r < 16 or r % 16):
        return f"up 'mma': bd={t.bd} a power of two in 16..128 dividing D={d}, r={r} a multiple of 16"
    return None


TILES_ENV = "FNX_HC_FEW_TILES"


def tiles_override(spec: str) -> dict:
    """"field=value,..." (TilesFew fields; `up` a name, the others integers) -> the fields to replace. A benchmark
    knob: `FNX_HC_FEW_TILES` (read when a program is traced) changes the defaults of every few-token boundary."""
    return dispatch.fields_override(spec, TilesFew, TILES_ENV, ("up", "pre", "mid"))


def default_tiles(s: int, d: int, r: int, gemv_up: bool = True) -> TilesFew | None:
    """TilesFew's defaults where they fit (S streams of D, rank r), else with a smaller K chunk, else None.
    `gemv_up` False (the GEMV kernels take no Wup of this shape): the up kernel ("mma") where it fits.
    `FNX_HC_FEW_TILES` replaces fields first (a tile set that then does not fit is an error, not a fallback)."""
    over = tiles_override(os.environ[TILES_ENV]) if os.environ.get(TILES_ENV) else {}
    if over:
        t = dataclasses.replace(TilesFew(up="gemv" if gemv_up else "mma"), **over)
        if over.get("up") == "gemv" and not gemv_up:
            raise ValueError(f"{TILES_ENV}: up=gemv, but the GEMV kernels take no Wup [{s * d}, {r}] here")
        why = check(s, d, r, t)
        if why:
            raise ValueError(f"{TILES_ENV}: {t} does not fit S={s} D={d} r={r}: {why}")
        return t
    for bk in (128, 64, 32, 16):
        t = TilesFew(bk=bk, up="gemv" if gemv_up else "mma")
        if check(s, d, r, t) is None:
            return t
    return None


def gemv_takes_up(m: int, s: int, d: int, r: int, dtype, w_up_dtype, fp8: bool) -> bool:
    """Whether the GEMV kernels take Wup [S*D, r] at m tokens (else its product would run on XLA's dot)."""
    from fnx.pallas.gemv import api as gemv
    return gemv.kernel_applies((m, r), dtype, "fp8" if fp8 else "bf16", (s * d, r), w_dtype=w_up_dtype) is None


def _pre_kernel(*refs, s, d, eps, has_y):
    """Program (t, j): token t's stream j, [D] in power-of-two pieces: H' = H + round(inj_prev_j * y) (rounded as
    the reference's bf16 add), the stream's 1/rms in fp32 and Hn = round(H' * rstd * (1 + w)); stores H' and Hn."""
    it = iter(refs)
    h_ref = next(it)
    y_ref, inj_ref = (next(it), next(it)) if has_y else (None, None)
    wn_ref = next(it)
    hp_ref = next(it) if has_y else None        # without a combine H' is H: only Hn is stored
    hn_ref = next(it)
    t, j = pl.program_id(0), pl.program_id(1)
    dt = h_ref.dtype
    sd = s * d
    pieces = []
    for c0, p in kernel._pieces(d, 1024):
        col = c0 + jnp.arange(p, dtype=jnp.int32)
        hc = plt.load(h_ref.at[t * sd + j * d + col]).astype(F32)
        if has_y:
            inj = plt.load(inj_ref.at[jnp.full((1,), t * s + j, jnp.int32)]).astype(F32)        # [1]
            yv = plt.load(y_ref.at[t * d + col]).astype(F32)
            hc = rnd(hc + rnd(yv * inj, dt), dt)
        pieces.append((col, hc))
    ss = None
    for _, hc in pieces:
        piece = jnp.sum(hc * hc, axis=0, keepdims=True)                                         # [1]
        ss = piece if ss is None else ss + piece
    rstd = jax.lax.rsqrt(ss / d + eps)
    for col, hc in pieces:
        w = plt.load(wn_ref.at[j * d + col]).astype(F32)
        if has_y:
            plt.store(hp_ref.at[t * sd + j * d + col], hc.astype(hp_ref.dtype))
        plt.store(hn_ref.at[t * sd + j * d + col], (hc * rstd * (1.0 + w)).astype(hn_ref.dtype))


def _split_sum(part_ref, k_lo, k_hi, m, t, rows, col, ok):
    """Splits [k_lo, k_hi) of part [ks, M, rows] at token t's columns `col`, summed in split order (every split's
    load issued first, in power-of-two pieces)."""
    a = None
    for k0, p in kernel._pieces(k_hi - k_lo, 16):
        kk = k_lo + k0 + jnp.arange(p, dtype=jnp.int32)
        v = plt.load(part_ref.at[(kk[:, None] * m + t) * rows + col[None, :]], mask=ok[None, :], other=0.0)
        v = jnp.sum(v, axis=0)
        a = v if a is None else a + v
    return a


def _mid_kernel(part_ref, *refs, ks, m, r, s, rows, bc, fold=None):
    """Program (t, c): token t's columns [c*bc, (c+1)*bc) of the splits' partials [ks, M, rows]: their sum (the
    splits in order), rounded as the product's output, / S rounded; silu for Wdown's r columns (u), the logits'
    2 sigmoid for Winj's S columns after them (inj). fold = (D, eps) (pre "fold"): refs start with the splits'
    sums of H'^2 [ks, M]; each stream's splits are summed apart and scaled by its rstd = 1/rms (from its splits'
    H'^2), and program (t, 0) also writes token t's rstd [M, S] (fp32) for the mix."""
    it = iter(refs)
    ss_ref = next(it) if fold else None
    u_ref = next(it)
    inj_ref = next(it) if rows > r else None
    rstd_ref = next(it) if fold else None
    t, c = pl.program_id(0), pl.program_id(1)
    dt = u_ref.dtype
    col = c * bc + jnp.arange(bc, dtype=jnp.int32)
    ok = col < rows
    if fold:
        d, eps = fold
        kps = ks // s                                      # splits per stream
        a = None
        for j in range(s):
            q = None
            for k0, p in kernel._pieces(kps, 16):
                kk = j * kps + k0 + jnp.arange(p, dtype=jnp.int32)
                v = jnp.sum(plt.load(ss_ref.at[kk * m + t]), axis=0, keepdims=True)          # [1]
                q = v if q is None else q + v
            rstd = jax.lax.rsqrt(q / d + eps)                                                # [1]
            plt.store(rstd_ref.at[jnp.full((1,), t * s + j, jnp.int32)], rstd, mask=jnp.full((1,), c == 0))
            v = _split_sum(part_ref, j * kps, (j + 1) * kps, m, t, rows, col, ok) * rstd
            a = v if a is None else a + v
    else:
        a = _split_sum(part_ref, 0, ks, m, t, rows, col, ok)
    z = rnd(rnd(a, dt) / s, dt)
    plt.store(u_ref.at[t * r + col], (z * jax.nn.sigmoid(z)).astype(dt), mask=col < r)
    if inj_ref is not None:
        plt.store(inj_ref.at[t * s + (col - r)], (2 * jax.nn.sigmoid(z)).astype(dt), mask=ok & (col >= r))


def _down_kernel(*refs, m, sd, r, s, bn, bk, n_chunks, n_down, fp8, has_inj, fold=False):
    """fold (pre "fold"): the first input is H' (not Hn) and the second hc_norm's w: each chunk multiplies
    round(H' * (1 + w)) (the norm's 1/rms left to the mid), and the programs of row block 0 also store their
    split's sums of H'^2 per token, [ks, M] fp32 (a split lies in one stream)."""
    it = iter(refs)
    hn_ref = next(it)
    wn_ref = next(it) if fold else None
    wd_ref = next(it)
    sd_ref = next(it) if fp8 else None
    wi_ref = next(it) if has_inj else None
    part_ref = next(it)
    ss_ref = next(it) if fold else None
    n, c = pl.program_id(0), pl.program_id(1)
    dt = hn_ref.dtype
    is_down = n < n_down
    rows = jnp.arange(bn, dtype=jnp.int32)
    tok = jnp.arange(MP, dtype=jnp.int32)
    kk = jnp.arange(bk, dtype=jnp.int32)
    ncb = (sd + 127) // 128
    drow = n * bn + rows                                   # rows of Wdown (programs n < n_down)
    irow = (n - n_down) * bn + rows                        # rows of Winj (the programs after them)
    dok = (drow < r) & is_down
    iok = (irow < s) & jnp.logical_not(is_down)
    tiles = []
    for k in range(n_chunks):                              # every load first: the chunks' DRAM reads overlap
        col = (c * n_chunks + k) * bk + kk                 # [bk]
        w = plt.load(wd_ref.at[drow[:, None] * sd + col[None, :]], mask=dok[:, None], other=0.0).astype(dt)
        if has_inj:
            w = w + plt.load(wi_ref.at[irow[:, None] * sd + col[None, :]], mask=iok[:, None],
                             other=0.0).astype(dt)        # one of the two loads touches no memory
        sc = None
        if fp8:     # the program's rows lie in one 128-row block, the chunk in one 128-column block
            sidx = (n * bn) // 128 * ncb + ((c * n_chunks + k) * bk) // 128
            sc = plt.load(sd_ref.at[jnp.full((1, 1), sidx, jnp.int32)], mask=jnp.full((1, 1), is_down),
                          other=1.0)                       # [1, 1]; Winj programs: 1
        x = plt.load(hn_ref.at[tok[:, None] * sd + col[None, :]], mask=(tok < m)[:, None], other=0.0)
        wn = plt.load(wn_ref.at[col]) if fold else None
        tiles.append((x, w, sc, wn))
    acc = None
    ss = None
    for x, w, sc, wn in tiles:
        if fold:
            x32 = x.astype(F32)
            v = jnp.sum(x32 * x32, axis=1)                                        # [MP]
            ss = v if ss is None else ss + v
            x = (x32 * (1.0 + wn.astype(F32))[None, :]).astype(dt)
        p = jnp.dot(x, w.T, precision=HIGHEST, preferred_element_type=F32)       # [MP, bn]
        if sc is not None:
            p = p * sc
        acc = p if acc is None else acc + p
    # the real tokens' rows of part [ks, M, r + S]: Wdown's rows, then Winj's
    row = jnp.where(is_down, drow, r + irow)
    ok = (tok < m)[:, None] & (dok | iok)[None, :]
    plt.store(part_ref.at[(c * m + tok[:, None]) * (r + s * has_inj) + row[None, :]], acc, mask=ok)
    if fold:    # every program sums its split's H'^2 (a branch around it kept more registers live: 128 against
        # 104 in the stock sm_90 compile); row block 0's programs store them
        plt.store(ss_ref.at[c * m + tok], ss, mask=(tok < m) & (n == 0))


def _up_kernel(u_ref, hn_ref, wu_ref, *rest, m, s, d, r, bd, fp8):
    su_ref = rest[0] if fp8 else None
    x_ref = rest[-1]
    i = pl.program_id(0)
    dt = hn_ref.dtype
    tok = jnp.arange(MP, dtype=jnp.int32)
    tmask = (tok < m)[:, None]
    cols = i * bd + jnp.arange(bd, dtype=jnp.int32)
    ncb = (r + 127) // 128
    pieces = kernel._pieces(r, 128)
    wt = {}
    for j in range(s):                                     # the weight tiles first: in flight early
        for k0, p in pieces:
            k = k0 + jnp.arange(p, dtype=jnp.int32)
            w = plt.load(wu_ref.at[(j * d + cols)[:, None] * r + k[None, :]]).astype(dt)         # [bd, p]
            sc = None
            if fp8:     # bd divides 128 and D: the program's rows of stream j lie in one 128-row block
                sc = plt.load(su_ref.at[jnp.full((1, 1), ((j * d + i * bd) // 128) * ncb + k0 // 128, jnp.int32)])
            wt[j, k0] = (w, sc)
    us = {k0: plt.load(u_ref.at[tok[:, None] * r + (k0 + jnp.arange(p, dtype=jnp.int32))[None, :]], mask=tmask,
                       other=0.0) for k0, p in pieces}                                           # [MP, p]
    acc = gates_and_mix(us, pieces, s, dt, lambda j, k0: wt[j, k0],
                        lambda j: plt.load(hn_ref.at[tok[:, None] * (s * d) + (j * d + cols)[None, :]], mask=tmask,
                                           other=0.0).astype(F32))
    plt.store(x_ref.at[tok[:, None] * d + cols[None, :]], (acc / s).astype(x_ref.dtype), mask=tmask)


def gates_and_mix(us, pieces, s, dt, weight, hn_of):
    """The up kernels' arithmetic: sum over the streams j of round(m_j Hn_j), m_j = round(sigmoid(round(u @
    Wup_j.T))), in fp32 ([rows, bd]). us: u's [rows, p] piece per first column k0 of `pieces`; weight(j, k0) ->
    (Wup_j's [bd, p] tile, its FP8 block scale or None), each piece's product scaled apart; hn_of(j) -> Hn_j's
    [rows, bd] values (fp32), called after the stream's gates."""
    acc = None
    for j in range(s):
        z = None
        for k0, _ in pieces:
            w, sc = weight(j, k0)
            q = jnp.dot(us[k0], w.T, precision=HIGHEST, preferred_element_type=F32)             # [rows, bd]
            if sc is not None:
                q = q * sc
            z = q if z is None else z + q
        mg = rnd(jax.nn.sigmoid(rnd(z, dt)), dt)
        v = rnd(mg * hn_of(j), dt)
        acc = v if acc is None else acc + v
    return acc


def _xla_sum(part, ss, ks: int, m: int, rows: int, s: int, d: int, eps: float, dtype):
    """The XLA mids' sum of the down kernel's splits [ks * M * rows] -> ([M, rows] rounded to dtype, rstd). With the
    splits' sums of H'^2 (pre "fold"), each stream's splits are summed apart and scaled by its 1/rms, rstd [M, S]
    fp32; else rstd is None."""
    if ss is None:
        return jnp.sum(part.reshape(ks, m, rows), axis=0).astype(dtype), None
    per = jnp.sum(part.reshape(s, ks // s, m, rows), axis=1)                               # [S, M, rows]
    rstd = jax.lax.rsqrt(jnp.sum(ss.reshape(s, ks // s, m), axis=1) / d + eps)              # [S, M]
    return jnp.sum(per * rstd[:, :, None], axis=0).astype(dtype), rstd.T


def hc_boundary_few(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, *, streams: int, eps: float,
                    interpret: bool = False, tiles: TilesFew | None = None, w_down_scale=None, w_up_scale=None):
    """`reference.hc_boundary` for 2..MAX_TOKENS tokens (h [..., S*D]); bf16 or FP8 Wdown / Wup (float8_e4m3fn with
    one fp32 scale per 128x128 block, `w_down_scale` / `w_up_scale`); dense weights are rounded to h.dtype as the
    reference's products do. Returns (H', x, inj or None)."""
    lead, sd, s, d, r, m = kernel.boundary_dims(h, w_down, streams, MAX_TOKENS, "hc_boundary_few")
    fp8 = kernel.check_fp8_scales("hc_boundary_few", r, sd, w_down_scale, w_up_scale)
    t = tiles or default_tiles(s, d, r, gemv_takes_up(m, s, d, r, h.dtype, w_up.dtype, fp8)) or TilesFew()
    why = check(s, d, r, t)
    if why:
        raise ValueError(f"hc_boundary_few: S={s} D={d} r={r} do not fit {t}: {why}")
    has_inj = w_inj is not None
    fold = t.pre == "fold"
    params = {}
    if not interpret:
        params["compiler_params"] = plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
    flat = stacked.flatten
    f32 = lambda a: stacked.astype(a, F32)  # noqa: E731
    whole = pl.BlockSpec(memory_space=pl.ANY)
    if t.pre == "pallas":   # the combine and the grouped norm in one launch
        args = (h.reshape(m * sd),) + ((y.reshape(m * d), inj_prev.reshape(m * s)) if y is not None else ()) + \
            (flat(hc_norm),)
        vec = jax.ShapeDtypeStruct((m * sd,), h.dtype)
        res = stacked.call(
            functools.partial(_pre_kernel, s=s, d=d, eps=eps, has_y=y is not None),
            args, grid=(m, s), in_specs=[whole] * len(args), out_shape=(vec, vec) if y is not None else (vec,),
            interpret=interpret, name="hc_pre_few", **params,
        )
        hp, hn = (res[0].reshape(h.shape), res[1]) if y is not None else (h, res[0])
    else:   # the reference's own combine (and, but for "fold", grouped norm): XLA fusions
        hp = reference.combine(h, y, inj_prev) if y is not None else h
        hn = None if fold else reference.grouped_rms_norm(hp, stacked.materialize(hc_norm), eps, d).reshape(m * sd)
    n_down = -(-r // t.bn)
    n_prog = n_down + (-(-s // t.bn) if has_inj else 0)
    ks = sd // (t.chunks * t.bk)
    rows = r + (s if has_inj else 0)
    first = (hp.reshape(m * sd), flat(hc_norm)) if fold else (hn,)
    args = first + (flat(w_down),) + ((flat(f32(w_down_scale)),) if fp8 else ()) + \
        ((flat(w_inj),) if has_inj else ())
    part_shape = jax.ShapeDtypeStruct((ks * m * rows,), F32)
    part = stacked.call(
        functools.partial(_down_kernel, m=m, sd=sd, r=r, s=s, bn=t.bn, bk=t.bk, n_chunks=t.chunks, n_down=n_down,
                          fp8=fp8, has_inj=has_inj, fold=fold),
        args, grid=(n_prog, ks), in_specs=[whole] * len(args),
        out_shape=(part_shape, jax.ShapeDtypeStruct((ks * m,), F32)) if fold else part_shape,
        interpret=interpret, name="hc_down_few_fp8" if fp8 else "hc_down_few", **params,
    )
    ss = None
    if fold:
        part, ss = part
    rstd = None             # fold: [M, S] fp32, each stream's 1/rms (the mix forms Hn from it)
    if t.mid == "pallas":   # the splits' sum, / S, silu and inj in one launch
        bc = t.mid_bc
        outs = (jax.ShapeDtypeStruct((m * r,), h.dtype),) + ((jax.ShapeDtypeStruct((m * s,), h.dtype),)
                                                             if has_inj else ()) + \
            ((jax.ShapeDtypeStruct((m * s,), F32),) if fold else ())
        res = stacked.call(
            functools.partial(_mid_kernel, ks=ks, m=m, r=r, s=s, rows=rows, bc=bc, fold=(d, eps) if fold else None),
            (part, ss) if fold else (part,), grid=(m, -(-rows // bc)), in_specs=[whole] * (1 + fold),
            out_shape=outs, interpret=interpret, name="hc_mid_few", **params,
        )
        u = res[0].reshape(m, r)
        inj = res[1].reshape(*lead, s) if has_inj else None
        rstd = res[-1].reshape(m, s) if fold else None
    elif t.mid == "xla1":   # the same ops, one elementwise pass over the sum: u's columns and inj's in one buffer
        a, rstd = _xla_sum(part, ss, ks, m, rows, s, d, eps, h.dtype)                     # [M, r (+ S)]
        v = reference._div(a, s)
        col = jax.lax.broadcasted_iota(jnp.int32, v.shape, 1)
        u = jnp.where(col < r, jax.nn.silu(v), 2 * jax.nn.sigmoid(v)) if has_inj else jax.nn.silu(v)
        inj = u[:, r:].reshape(*lead, s) if has_inj else None
    else:   # the reference's own ops (XLA): the splits' sum rounded as the product's output, / S, silu; inj
        a, rstd = _xla_sum(part, ss, ks, m, rows, s, d, eps, h.dtype)                     # [M, r (+ S)]
        u = jax.nn.silu(reference._div(a[:, :r], s))
        inj = (2 * jax.nn.sigmoid(reference._div(a[:, r:], s))).reshape(*lead, s) if has_inj else None
    if fold:    # Hn as the reference's norm forms it (the same expression), with the kernels' 1/rms
        w32 = stacked.materialize(hc_norm).astype(F32).reshape(s, d)
        hn = ((hp.reshape(m, s, d).astype(F32) * rstd[:, :, None]) * (1.0 + w32)).astype(h.dtype).reshape(m * sd)
    if t.up == "gemv":      # the gates through the GEMV kernels, the mix as the reference's
        from fnx.pallas.gemv import api as gemv
        gate = jax.nn.sigmoid(gemv.linear(u, w_up, fmt="fp8" if fp8 else "bf16", scale=w_up_scale,
                                          x_cols=r if t.mid == "xla1" else None))
        hn4 = hn.reshape(m, s, d)
        x = jnp.mean(gate.reshape(m, s, d) * hn4, axis=-2)
    else:
        args = (u.reshape(-1), hn, flat(w_up)) + ((flat(f32(w_up_scale)),) if fp8 else ())
        x = stacked.call(
            functools.partial(_up_kernel, m=m, s=s, d=d, r=r, bd=t.bd, fp8=fp8),
            args, grid=(d // t.bd,), in_specs=[whole] * len(args),
            out_shape=jax.ShapeDtypeStruct((m * d,), h.dtype),
            interpret=interpret, name="hc_up_few_fp8" if fp8 else "hc_up_few", **params,
        )
    return hp, x.reshape(*lead, d), inj
