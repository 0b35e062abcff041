"""The hyper-connection boundary over a prefill chunk (more than MAX_DECODE_TOKENS tokens; op "hc_boundary_prefill").

XLA's boundary at prefill (the reference's jnp) makes about four passes over the [M, S*D] streams: H' = H + inj_prev
y written, Hn = GroupedRMSNorm(H') written, Hn read by the Wdown product and again by the Winj one, the gates
m = sigmoid(u @ Wup.T) written [M, S*D] and read back with Hn by the mix (an H100 table of a 2,048-token chunk: ~140
us a boundary, ~7% of the chunk). Here two launches and one small XLA step:

  down (`_down_kernel`, grid (M / bm, S)): program (i, j) walks stream j of its bm token rows twice in chunks of
        bk columns. First the combine, H' = round(H + round(inj_prev_j y)), stored (the new streams), and the
        stream's sum of squares; then H' again (recomputed from H and y, read back from L2), Hn = round(H' rstd
        (1 + w)) exactly as the reference rounds it, and its products with Wdown's rows (r in power-of-two pieces)
        and Winj's (padded to 16 rows) on the tensor cores. Out: each stream's fp32 partials [S, M, r] and
        [S, M, S], and rstd [M, S].
  mid   (XLA, the reference's ops): the streams' partials summed, rounded as the products' outputs, / S, silu -> u
        [M, r]; inj = 2 sigmoid(round / S).
  up    (`_up_kernel`, grid (M / bm, D / bd)): program (i, n) multiplies u by the bd rows of Wup of each stream for
        its columns, sigmoid, Hn for those columns from H' and rstd (the same rounding), and writes
        x = round(mean_j round(m_j Hn_j)).

So the streams are read twice and written once, where XLA reads them about five times and writes them three times;
no [M, S*D] gate or normalized array exists. FP8 (128x128-block) Wdown and Wup: their codes go to the activation
dtype exactly and each piece's block scale multiplies its fp32 product (the few-token kernels' arithmetic: within
the weights' bf16 rounding of the reference, which dequantizes and rounds each weight first). bf16 runs match the
reference within the tests' bound (sums in another order); fp32 runs to 1e-5; H' bit for bit."""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import pdl
from fnx.pallas.hc import few, reference
from fnx.pallas.hc import pallas as kernel
from fnx.pallas.kernel_math import rnd

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST     # fp32 operands (the tests' fp32 runs): IEEE products; bf16: no effect
INJ_ROWS = 16                           # Winj's S rows padded to one MMA's N (the padding masked: no memory read)


@dataclasses.dataclass(frozen=True)
class TilesPrefill:
    bm: int = 64            # token rows per program (the MMA's M: >= 16). Each row block reads all of Wdown and Wup
                            # (from L2 after the first): (M / bm) x 6.6 MB at the released shapes
    bk: int = 128           # columns per step of the down kernel (a power of two <= 128 dividing D: one FP8 block)
    bd: int = 128           # columns of each stream per up program (>= 16, divides D and 128): u is read D / bd times
    num_warps: int = 8
    num_stages: int = 2


TILES_ENV = "FNX_HC_PREFILL_TILES"      # "field=value,..." replaces fields of the chosen tiles (a benchmark knob,
                                        # read when a program is traced), e.g. "bm=32,num_warps=4"


def _overridden(t, env: str):
    """Tiles t with the fields the environment variable `env` names replaced ("field=value,..."; read when a program
    is traced: a benchmark knob)."""
    spec = os.environ.get(env, "").strip()
    if not spec:
        return t
    from fnx.pallas import dispatch
    return dataclasses.replace(t, **dispatch.fields_override(spec, type(t), env))


def _fit(v: int, d: int) -> int:
    """v halved until it divides d (or reaches 16): tiles for the small test models' dims."""
    while v > 16 and d % v:
        v //= 2
    return v


def default_tiles(d: int, m: int = 1 << 30) -> TilesPrefill:
    """Tiles for D columns a stream and M tokens: bm 64 on 8 warps from 1,024 tokens (128 down programs at 2,048:
    one wave), 32 on 4 warps from 256, else 16; bk and bd shrunk to powers of two that divide D (small test
    models). Not yet measured on a GPU; `FNX_HC_PREFILL_TILES` replaces fields."""
    t = TilesPrefill()
    if m < 1024:
        t = dataclasses.replace(t, bm=32 if m >= 256 else 16, num_warps=4)
    return _overridden(dataclasses.replace(t, bk=_fit(t.bk, d), bd=_fit(t.bd, d)), TILES_ENV)


def why_not(s: int, d: int, r: int, tiles: TilesPrefill) -> str | None:
    """None when the kernels take these dims and tiles, else why not."""
    t = tiles
    for name, v in (("bm", t.bm), ("bk", t.bk), ("bd", t.bd)):
        if v < 16 or v & (v - 1):
            return f"{name}={v} must be a power of two >= 16"
    if d % t.bk or t.bk > 128:
        return f"bk={t.bk} must divide D={d} and be at most 128 (one FP8 block)"
    if d % t.bd or 128 % t.bd:
        return f"bd={t.bd} must divide D={d} and 128"
    if r < 16 or r % 16:
        return f"r={r} must be a multiple of 16 (its power-of-two pieces are MMA tiles)"
    if s > INJ_ROWS:
        return f"{s} streams > {INJ_ROWS} (Winj's rows are one MMA tile)"
    return None


def _down_kernel(*refs, m, s, d, r, bm, bk, eps, has_y, has_inj, fp8):
    it = iter(refs)
    h_ref = next(it)
    y_ref, ip_ref = (next(it), next(it)) if has_y else (None, None)
    wn_ref, wd_ref = next(it), next(it)
    sd_ref = next(it) if fp8 else None
    wi_ref = next(it) if has_inj else None
    h2_ref, pd_ref, rstd_ref = next(it), next(it), next(it)
    pi_ref = next(it) if has_inj else None
    i, j = pl.program_id(0), pl.program_id(1)
    dt = h_ref.dtype
    sd = s * d
    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)
    rok = rows < m
    inj = plt.load(ip_ref.at[rows * s + j], mask=rok, other=0.0).astype(F32) if has_y else None   # [bm]

    def streams_at(c):
        """H' of the program's rows for columns [c bk, (c+1) bk) of stream j (fp32 values of dt), and offsets."""
        col = c * bk + jnp.arange(bk, dtype=jnp.int32)
        off = rows[:, None] * sd + (j * d + col)[None, :]
        hv = plt.load(h_ref.at[off], mask=rok[:, None], other=0.0).astype(F32)
        if has_y:       # the reference's combine: the product rounded, then the sum
            yv = plt.load(y_ref.at[rows[:, None] * d + col[None, :]], mask=rok[:, None], other=0.0).astype(F32)
            hv = rnd(hv + rnd(yv * inj[:, None], dt), dt)
        return col, off, hv

    def first(c, ss):
        _, off, hv = streams_at(c)
        plt.store(h2_ref.at[off], hv.astype(dt), mask=rok[:, None])
        return ss + jnp.sum(hv * hv, axis=1)

    ss = jax.lax.fori_loop(0, d // bk, first, jnp.zeros((bm,), F32))
    rstd = jax.lax.rsqrt(ss / d + eps)                                                     # [bm]
    plt.store(rstd_ref.at[rows * s + j], rstd, mask=rok)
    pieces = kernel._pieces(r, 256)
    ncb = (sd + 127) // 128                                     # 128-column blocks of a Wdown row (its scales)
    irow = jnp.arange(INJ_ROWS, dtype=jnp.int32)

    def second(c, accs):
        col, _, hv = streams_at(c)
        w = plt.load(wn_ref.at[j * d + col]).astype(F32)
        hn = ((hv * rstd[:, None]) * (1.0 + w)[None, :]).astype(dt)                       # the reference's Hn
        out = []
        for (p0, pn), acc in zip(pieces, accs):
            wr = p0 + jnp.arange(pn, dtype=jnp.int32)
            wt = plt.load(wd_ref.at[wr[:, None] * sd + (j * d + col)[None, :]]).astype(dt)     # [pn, bk]
            p = jnp.dot(hn, wt.T, precision=HIGHEST, preferred_element_type=F32)               # [bm, pn]
            if fp8:     # a chunk lies in one 128-column block; each row its row block's scale
                sc = plt.load(sd_ref.at[(wr // 128) * ncb + (j * d + c * bk) // 128])             # [pn]
                p = p * sc[None, :]
            out.append(acc + p)
        if has_inj:
            wi = plt.load(wi_ref.at[irow[:, None] * sd + (j * d + col)[None, :]], mask=(irow < s)[:, None],
                          other=0.0).astype(dt)                                                   # [16, bk]
            out.append(accs[-1] + jnp.dot(hn, wi.T, precision=HIGHEST, preferred_element_type=F32))
        return tuple(out)

    zero = tuple(jnp.zeros((bm, pn), F32) for _, pn in pieces) + \
        ((jnp.zeros((bm, INJ_ROWS), F32),) if has_inj else ())
    accs = jax.lax.fori_loop(0, d // bk, second, zero)
    for (p0, pn), acc in zip(pieces, accs):
        wr = p0 + jnp.arange(pn, dtype=jnp.int32)
        plt.store(pd_ref.at[(j * m + rows[:, None]) * r + wr[None, :]], acc, mask=rok[:, None])
    if has_inj:
        plt.store(pi_ref.at[(j * m + rows[:, None]) * s + irow[None, :]], accs[-1],
                  mask=rok[:, None] & (irow < s)[None, :])


def _up_kernel(u_ref, h2_ref, rstd_ref, wn_ref, wu_ref, *rest, m, s, d, r, bm, bd, fp8):
    su_ref = rest[0] if fp8 else None
    x_ref = rest[-1]
    i, n = pl.program_id(0), pl.program_id(1)
    dt = h2_ref.dtype
    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)
    rok = (rows < m)[:, None]
    cols = n * bd + jnp.arange(bd, dtype=jnp.int32)
    ncb = (r + 127) // 128
    pieces = kernel._pieces(r, 128)        # a piece lies in one 128-column block of Wup (its scale)
    us = {k0: plt.load(u_ref.at[rows[:, None] * r + (k0 + jnp.arange(p, dtype=jnp.int32))[None, :]], mask=rok,
                       other=0.0) for k0, p in pieces}                                            # [bm, p]
    width = dict(pieces)

    def weight(j, k0):      # loaded where used: a program's tiles of every stream would not fit its registers
        k = k0 + jnp.arange(width[k0], dtype=jnp.int32)
        w = plt.load(wu_ref.at[(j * d + cols)[:, None] * r + k[None, :]]).astype(dt)              # [bd, p]
        # bd divides 128 and D: the program's rows of stream j lie in one 128-row block
        sc = plt.load(su_ref.at[jnp.full((1, 1), ((j * d + n * bd) // 128) * ncb + k0 // 128, jnp.int32)]) \
            if fp8 else None
        return w, sc

    def hn_of(j):           # Hn_j of the program's columns from H' and rstd, rounded as the reference's norm
        hv = plt.load(h2_ref.at[rows[:, None] * (s * d) + (j * d + cols)[None, :]], mask=rok, other=0.0)
        rs = plt.load(rstd_ref.at[rows * s + j], mask=rows < m, other=0.0)                        # [bm]
        w = plt.load(wn_ref.at[j * d + cols]).astype(F32)
        return rnd((hv.astype(F32) * rs[:, None]) * (1.0 + w)[None, :], dt)

    acc = few.gates_and_mix(us, pieces, s, dt, weight, hn_of)
    plt.store(x_ref.at[rows[:, None] * d + cols[None, :]], (acc / s).astype(x_ref.dtype), mask=rok)


def hc_boundary_prefill(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, *, streams: int, eps: float,
                        interpret: bool = False, tiles: TilesPrefill | None = None, w_down_scale=None,
                        w_up_scale=None):
    """See `fnx.pallas.hc.api.hc_boundary`: h [..., S*D], y [..., D] and inj_prev [..., S] (or both None), the
    weights in the checkpoint layout (Wdown and Wup bf16, or FP8 with their 128x128 block scales), w_inj [S, S*D]
    or None. Returns (H' [..., S*D], x [..., D], inj [..., S] or None)."""
    lead = h.shape[:-1]
    m = math.prod(lead)
    t = tiles or default_tiles(h.shape[-1] // streams, m)
    s, sd = streams, h.shape[-1]
    d, r = sd // s, w_down.shape[0]
    fp8 = w_down_scale is not None
    if fp8 != (w_up_scale is not None):
        raise ValueError("hc_boundary_prefill: Wdown and Wup are FP8 together (both scales) or dense together")
    why = why_not(s, d, r, t)
    if why is not None:
        raise NotImplementedError(f"hc_boundary_prefill: {why}")
    dt = h.dtype
    has_y, has_inj = y is not None, w_inj is not None
    flat = lambda a: a.reshape(-1)  # noqa: E731
    params = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=t.num_warps,
                                                                         num_stages=t.num_stages)}
    args = [flat(h)]
    if has_y:
        args += [flat(y), flat(inj_prev)]
    args += [hc_norm, flat(w_down)] + ([flat(w_down_scale)] if fp8 else []) + ([flat(w_inj)] if has_inj else [])
    out_shape = [jax.ShapeDtypeStruct((m * sd,), dt), jax.ShapeDtypeStruct((s * m * r,), F32),
                 jax.ShapeDtypeStruct((m * s,), F32)] + \
        ([jax.ShapeDtypeStruct((s * m * s,), F32)] if has_inj else [])
    nb = -(-m // t.bm)
    outs = pdl.pallas_call(
        functools.partial(_down_kernel, m=m, s=s, d=d, r=r, bm=t.bm, bk=t.bk, eps=float(eps), has_y=has_y,
                          has_inj=has_inj, fp8=fp8),
        grid=(nb, s), out_shape=out_shape, interpret=interpret, name="hc_down_prefill", **params,
    )(*args)
    h2, pd, rstd = outs[:3]
    # mid: the few-token design's XLA mid on the streams' partials (each product's sum rounded once, as its output)
    u = jax.nn.silu(reference._div(few._xla_sum(pd, None, s, m, r, s, d, eps, dt)[0], s))
    inj = None
    if has_inj:
        zi = reference._div(few._xla_sum(outs[3], None, s, m, s, s, d, eps, dt)[0], s)
        inj = (2 * jax.nn.sigmoid(zi)).reshape(*lead, s)
    up_args = [flat(u), h2, rstd, hc_norm, flat(w_up)] + ([flat(w_up_scale)] if fp8 else [])
    x = pdl.pallas_call(
        functools.partial(_up_kernel, m=m, s=s, d=d, r=r, bm=t.bm, bd=t.bd, fp8=fp8),
        grid=(nb, d // t.bd), out_shape=jax.ShapeDtypeStruct((m * d,), dt), interpret=interpret,
        name="hc_up_prefill", **params,
    )(*up_args)
    return h2.reshape(h.shape), x.reshape(*lead, d), inj


# ---- The gates and the mix alone (op "hc_mix_prefill") ---------------------------------------------------------
#
# In XLA's boundary over a prefill chunk the gates m = sigmoid(round(u @ Wup.T)) are a product of their own
# ([M, S*D] written, 44 us a boundary for a 2,048-token chunk on an H100) and the mix x = mean_j round(m_j Hn_j)
# a fusion reading them back with Hn (41.5 us), where the bytes that must move (Hn in, x out) take ~16 us. Here one
# launch from XLA's u and Hn: program (n, i) owns bd columns of every stream and bm token rows; u's [bm, r] tile in
# pieces (from L2: [M, r] is 1.3 MB), every stream's Hn [bm, bd] tile, the four streams' [bd, r] Wup rows (from
# L2), the gates' products, sigmoid and the mix; XLA keeps the norm, the Wdown / Winj products and u
# (`fnx.model.hyper.gated_residual`). Measured level with XLA's two kernels at best (86.9 us a boundary at the
# default tiles, H100): the product [M, r] x [r, S*D] (13.4 GFLOP at 2,048 tokens) in programs of four [bm, bd]
# tiles runs far below cuBLAS's ~300 TFLOP/s. The first design (each program converting its Wup rows once and
# walking the row blocks in a loop) took 117 us.

MIX_OP = "hc_mix_prefill"
MIX_TILES_ENV = "FNX_HC_MIX_TILES"      # "field=value,..." replaces fields of the mix tiles (a benchmark knob)


@dataclasses.dataclass(frozen=True)
class TilesMix:
    bm: int = 128           # token rows a program (the MMA's M)
    bd: int = 32            # columns of each stream a program (>= 16, divides D and 128): its 4 x bd x r weights
                            # read from L2 in pieces (bd 32, r 320: 40 KB of FP8 codes a program). bm 128 / bd 32
                            # measured best of the tiles tried (H100, ac922a0, a 2,048-token chunk: 86.9 us a
                            # boundary; bm 64 with bd 64 94.0, bd 128 116.3, 4 warps 112.0)
    num_warps: int = 8
    num_stages: int = 1     # no loop: a program's loads are issued at once


def mix_tiles(d: int, m: int) -> TilesMix:
    """Tiles for D columns a stream and M tokens: bd shrunk to a power of two dividing D (small test models), bm 32
    on 4 warps under 512 tokens; `FNX_HC_MIX_TILES` replaces fields."""
    t = _overridden(TilesMix() if m >= 512 else TilesMix(bm=32, num_warps=4), MIX_TILES_ENV)
    return dataclasses.replace(t, bd=_fit(t.bd, d))


def mix_why_not(s: int, d: int, r: int, tiles: TilesMix) -> str | None:
    """None when the mix kernel takes these dims and tiles, else why not."""
    t = tiles
    for name, v in (("bm", t.bm), ("bd", t.bd)):
        if v < 16 or v & (v - 1):
            return f"{name}={v} must be a power of two >= 16"
    if d % t.bd or 128 % t.bd:
        return f"bd={t.bd} must divide D={d} and 128"
    if r < 16 or r % 16:
        return f"r={r} must be a multiple of 16 (its power-of-two pieces are MMA tiles)"
    return None


def _mix_kernel(u_ref, hn_ref, wu_ref, *rest, m, s, d, r, bm, bd, fp8):
    su_ref = rest[0] if fp8 else None
    x_ref = rest[-1]
    n, i = pl.program_id(0), pl.program_id(1)
    dt = hn_ref.dtype
    cols = n * bd + jnp.arange(bd, dtype=jnp.int32)
    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)       # a partial last row block: masked
    rok = (rows < m)[:, None]
    ncb = (r + 127) // 128
    pieces = kernel._pieces(r, 128)        # a piece lies in one 128-column block of Wup (its scale)
    us = {k0: plt.load(u_ref.at[rows[:, None] * r + (k0 + jnp.arange(p, dtype=jnp.int32))[None, :]], mask=rok,
                       other=0.0) for k0, p in pieces}                                              # [bm, p]
    # every stream's Hn tile issued before the products (loaded where the mix uses them, they would be loads the
    # program waits on after its MMAs)
    hns = [plt.load(hn_ref.at[rows[:, None] * (s * d) + (j * d + cols)[None, :]], mask=rok, other=0.0)
           for j in range(s)]

    def weight(j, k0):                     # Wup_j's [bd, p] piece (codes to the activation dtype) and its scale
        p = dict(pieces)[k0]
        k = k0 + jnp.arange(p, dtype=jnp.int32)
        w = plt.load(wu_ref.at[(j * d + cols)[:, None] * r + k[None, :]]).astype(dt)
        # bd divides 128 and D: the program's rows of stream j lie in one 128-row block
        sc = plt.load(su_ref.at[jnp.full((1, 1), ((j * d + n * bd) // 128) * ncb + k0 // 128, jnp.int32)]) \
            if fp8 else None
        return w, sc

    acc = few.gates_and_mix(us, pieces, s, dt, weight, lambda j: hns[j].astype(F32))
    plt.store(x_ref.at[rows[:, None] * d + cols[None, :]], (acc / s).astype(x_ref.dtype), mask=rok)


def hc_mix_prefill(u, hn, w_up, *, streams: int, interpret: bool = False, tiles: TilesMix | None = None,
                   w_up_scale=None):
    """x [..., D] = mean_j round(round(sigmoid(round(u @ Wup_j.T))) Hn_j) over the S streams, as
    `reference.hc_boundary` computes it from u [..., r] (silu of the scaled Wdown product) and the normalized
    streams Hn [..., S*D]; Wup [S*D, r] bf16, or FP8 with its 128x128 block scales `w_up_scale` (each piece's fp32
    product scaled, within the weights' bf16 rounding of the reference's dequantized product)."""
    lead = hn.shape[:-1]
    if u.shape[:-1] != lead:
        raise ValueError(f"hc_mix_prefill: u {u.shape} and Hn {hn.shape} do not agree on the tokens")
    m = math.prod(lead)
    s, sd, r = streams, hn.shape[-1], u.shape[-1]
    if sd % s or tuple(w_up.shape) != (sd, r):
        raise ValueError(f"hc_mix_prefill: Wup {tuple(w_up.shape)} is not [S*D, r] = [{sd}, {r}] for {s} streams")
    d = sd // s
    fp8 = w_up_scale is not None
    if fp8 and tuple(w_up_scale.shape) != (-(-sd // 128), -(-r // 128)):
        raise ValueError(f"hc_mix_prefill: Wup's block scales {tuple(w_up_scale.shape)} are not "
                         f"[{-(-sd // 128)}, {-(-r // 128)}]")
    t = tiles if tiles is not None else mix_tiles(d, m)
    why = mix_why_not(s, d, r, t)
    if why is not None:
        raise NotImplementedError(f"hc_mix_prefill: {why}")
    dt = hn.dtype
    params = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=t.num_warps,
                                                                         num_stages=t.num_stages)}
    args = [u.reshape(-1).astype(dt), hn.reshape(-1), w_up.reshape(-1)] + \
        ([w_up_scale.reshape(-1).astype(F32)] if fp8 else [])
    # the column tiles vary fastest: neighbouring programs share the row block's u (from L2)
    x = pdl.pallas_call(
        functools.partial(_mix_kernel, m=m, s=s, d=d, r=r, bm=t.bm, bd=t.bd, fp8=fp8),
        grid=(d // t.bd, math.ceil(m / t.bm)), out_shape=jax.ShapeDtypeStruct((m * d,), dt), interpret=interpret,
        name="hc_mix_prefill", **params,
    )(*args)
    return x.reshape(*lead, d)


# ---- The combine and the grouped norm over a prefill chunk in one pass (op "hc_norm_prefill") -------------------
#
# XLA writes H' = H + round(inj_prev y) in one fusion (`loop_add_fusion_5`, 31 us a boundary of a 2,048-token
# chunk on an H100) and reads it back for Hn in another (`fusion_542`, 33 us): the streams cross the memory four
# times (H read, H' written, H' read, Hn written) plus y. Here a program holds bm rows of one stream in registers
# (D / bk chunks of [bm, bk]): the combine, the stream's sum of squares, H' stored, then Hn = round(H' rstd (1 + w))
# stored from the same registers; three crossings. Without y (a gated residual without a combine) only Hn is
# written.

NORM_OP = "hc_norm_prefill"
NORM_TILES_ENV = "FNX_HC_NORM_TILES"    # "field=value,..." replaces fields of the norm tiles (a benchmark knob)
NORM_MAX_CHUNKS = 16                    # a program's row of D / bk chunks stays in registers


@dataclasses.dataclass(frozen=True)
class TilesNorm:
    bm: int = 4             # token rows per program (a power of two): bm x D fp32 values held (40 KB at 4 x 2,560)
    bk: int = 512           # columns per chunk (a power of two >= 16 dividing D; D / bk <= NORM_MAX_CHUNKS)
    num_warps: int = 4


def norm_tiles(d: int) -> TilesNorm:
    """Tiles for D columns a stream (bm 4 and bm 8 on 8 warps measured level on an H100, 2026-12-07): bk shrunk to
    a power of two dividing D; `FNX_HC_NORM_TILES` replaces fields."""
    t = _overridden(TilesNorm(), NORM_TILES_ENV)
    return dataclasses.replace(t, bk=_fit(t.bk, d))


def norm_why_not(d: int, tiles: TilesNorm) -> str | None:
    """None when the combine + norm kernel takes D and these tiles, else why not."""
    t = tiles
    if t.bm < 1 or t.bm & (t.bm - 1):
        return f"bm={t.bm} must be a power of two"
    if t.bk < 16 or t.bk & (t.bk - 1) or d % t.bk:
        return f"bk={t.bk} must be a power of two >= 16 dividing D={d}"
    if d // t.bk > NORM_MAX_CHUNKS:
        return f"D={d} is {d // t.bk} chunks of bk={t.bk} (at most {NORM_MAX_CHUNKS} held in registers)"
    return None


def _norm_kernel(*refs, m, s, d, bm, bk, eps, has_y):
    it = iter(refs)
    h_ref = next(it)
    y_ref, ip_ref = (next(it), next(it)) if has_y else (None, None)
    wn_ref = next(it)
    h2_ref = next(it) if has_y else None
    hn_ref = next(it)
    i, j = pl.program_id(0), pl.program_id(1)
    dt = h_ref.dtype
    rows = i * bm + jnp.arange(bm, dtype=jnp.int32)
    rok = (rows < m)[:, None]
    inj = plt.load(ip_ref.at[rows * s + j], mask=rows < m, other=0.0).astype(F32) if has_y else None
    held, sq = [], None     # the squares summed elementwise over the chunks, reduced once (no barrier a chunk)
    for c in range(d // bk):
        col = j * d + c * bk + jnp.arange(bk, dtype=jnp.int32)
        off = rows[:, None] * (s * d) + col[None, :]
        hv = plt.load(h_ref.at[off], mask=rok, other=0.0).astype(F32)
        if has_y:       # the reference's combine: the product rounded, then the sum
            yv = plt.load(y_ref.at[rows[:, None] * d + (col - j * d)[None, :]], mask=rok, other=0.0).astype(F32)
            hv = rnd(hv + rnd(yv * inj[:, None], dt), dt)
            plt.store(h2_ref.at[off], hv.astype(dt), mask=rok)
        sq = hv * hv if sq is None else sq + hv * hv
        held.append((off, col, hv))
    rstd = jax.lax.rsqrt(jnp.sum(sq, axis=1) / d + eps)
    for off, col, hv in held:
        w = plt.load(wn_ref.at[col]).astype(F32)
        plt.store(hn_ref.at[off], ((hv * rstd[:, None]) * (1.0 + w)[None, :]).astype(dt), mask=rok)


def hc_norm_prefill(h, y, inj_prev, hc_norm, *, streams: int, eps: float, interpret: bool = False,
                    tiles: TilesNorm | None = None):
    """(H', Hn): H' = H + round(inj_prev_j y) per stream (H itself when y and inj_prev are None) and Hn its
    grouped zero-centred RMSNorm (D per group, fp32 inside, one rounding), as `reference.combine` and
    `reference.grouped_rms_norm` compute them; h [..., S*D], y [..., D], inj_prev [..., S], hc_norm [S*D]. H' bit for
    bit; Hn up to the sum of squares' order (an ulp where it rounds the other way)."""
    if (y is None) != (inj_prev is None):
        raise ValueError("hc_norm_prefill: y and inj_prev come together (a combine) or not at all")
    lead = h.shape[:-1]
    m = math.prod(lead)
    s, sd = streams, h.shape[-1]
    if sd % s or tuple(hc_norm.shape) != (sd,):
        raise ValueError(f"hc_norm_prefill: H [..., {sd}] and hc_norm {tuple(hc_norm.shape)} do not make {s} streams")
    d = sd // s
    has_y = y is not None
    if has_y and (y.shape != lead + (d,) or inj_prev.shape != lead + (s,)):
        raise ValueError(f"hc_norm_prefill: y {y.shape} / inj_prev {inj_prev.shape} are not [..., {d}] / [..., {s}]")
    t = tiles or norm_tiles(d)
    why = norm_why_not(d, t)
    if why is not None:
        raise NotImplementedError(f"hc_norm_prefill: {why}")
    dt = h.dtype
    params = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=t.num_warps, num_stages=1)}
    args = [h.reshape(-1)] + ([y.reshape(-1).astype(dt), inj_prev.reshape(-1).astype(dt)] if has_y else []) + \
        [hc_norm]
    out_shape = ([jax.ShapeDtypeStruct((m * sd,), dt)] if has_y else []) + [jax.ShapeDtypeStruct((m * sd,), dt)]
    outs = pdl.pallas_call(
        functools.partial(_norm_kernel, m=m, s=s, d=d, bm=t.bm, bk=t.bk, eps=float(eps), has_y=has_y),
        grid=(-(-m // t.bm), s), out_shape=out_shape, interpret=interpret, name="hc_norm_prefill", **params,
    )(*args)
    h2 = outs[0].reshape(h.shape) if has_y else h
    return h2, outs[-1].reshape(h.shape)
