"""Hyper-connection layer boundary in Pallas (Triton lowering), for decode (M <= 32 tokens).

Four steps, two of them Pallas kernels (the two weight streams need a grid-wide reduction between them):
  pre  (XLA, one fusion): H' = H + inj_prev * y and each stream's 1 / rms, rstd [M, S] fp32.
  down (Pallas): grid (R / BR + 1, S, KS). Program (n, j, ks) normalises its K range of stream j on the fly
        (Hn = round(H' * rstd * (1 + w))) and multiplies it by rows [n*BR, (n+1)*BR) of Wdown (the last n reads
        the S rows of Winj instead); fp32 split-K partials [S*KS, M, R+BR].
  mid  (XLA, one fusion): sum the partials, round, / S, silu -> u [M, r]; inj = 2 sigmoid(round(.) / S).
  up   (Pallas): grid (D / BD,). Program i computes m_j = sigmoid(round(u @ Wup_j[i*BD:(i+1)*BD].T)) for every
        stream j, renormalises Hn_j for the same columns and writes x = round(mean_j round(m_j * Hn_j)).
Tokens are padded to Mp = max(16, pow2(M)) rows so every dot is MMA-shaped."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import dispatch, l2_prefetch, pdl, stacked
from fnx.pallas.dot_acc import dot_acc
from fnx.pallas.kernel_math import rnd

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST   # fp32 operands: IEEE, not TF32; bf16 operands: no effect


@dataclasses.dataclass(frozen=True)
class Tiles:
    br: int = 16            # rows of Wdown per program (down)
    bk: int = 128           # K chunk (down)
    ks: int = 4             # K splits per stream (down)
    bd: int = 32            # output columns per program (up)
    bkr: int = 64           # low-rank chunk (up)
    num_warps: int = 4
    num_stages: int = 2


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _largest_pow2_divisor(n: int, cap: int) -> int:
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def choose_tiles(d: int, r: int) -> Tiles:
    bk = _largest_pow2_divisor(d, 128)
    chunks = d // bk
    ks = max(k for k in (1, 2, 4, 5, 8) if chunks % k == 0)
    bd = _largest_pow2_divisor(d, 32)
    bkr = min(64, max(16, _pow2(r)))
    return Tiles(bk=bk, ks=ks, bd=bd, bkr=bkr)


def _down_kernel(h_ref, rstd_ref, wn_ref, wd_ref, wi_ref, out_ref, *, d, r, s, br, bk, n_chunks, n_down):
    n, j, ks = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rstd = rstd_ref[:, pl.dslice(j, 1)]                               # [Mp, 1]
    mp = rstd.shape[0]
    dt = h_ref.dtype
    rows = jnp.arange(br, dtype=jnp.int32)

    def hn_chunk(c):
        col = j * d + (ks * n_chunks + c) * bk
        hc = h_ref[:, pl.dslice(col, bk)].astype(F32)
        w = wn_ref[pl.dslice(col, bk)].astype(F32)
        return (hc * rstd * (1.0 + w[None, :])).astype(dt), col

    def run(w_ref, row0, n_rows):
        wrows = row0 + rows
        ok = jnp.broadcast_to((wrows < n_rows)[:, None], (br, bk))
        safe = jnp.where(wrows < n_rows, wrows, 0)

        def body(c, acc):
            hn, col = hn_chunk(c)
            cols = col + jnp.arange(bk, dtype=jnp.int32)
            w = plt.load(w_ref.at[safe[:, None], cols[None, :]], mask=ok, other=0.0).astype(dt)   # [br, bk]
            return dot_acc(acc, hn, w, trans_b=True)
        acc = lax.fori_loop(0, n_chunks, body, jnp.zeros((mp, br), F32))
        out_ref[...] = acc

    @pl.when(n < n_down)
    def _():
        run(wd_ref, n * br, r)

    @pl.when(n == n_down)
    def _():
        run(wi_ref, 0, s)


def _up_kernel(u_ref, h_ref, rstd_ref, wn_ref, wu_ref, x_ref, *, d, r, s, bd, bkr, n_rchunks):
    i = pl.program_id(0)
    dt = h_ref.dtype
    mp = u_ref.shape[0]
    dcols = i * bd + jnp.arange(bd, dtype=jnp.int32)
    acc = jnp.zeros((mp, bd), F32)
    for j in range(s):                                                # S = 4 streams, unrolled
        wrows = j * d + dcols

        def body(c, z):
            kc = c * bkr + jnp.arange(bkr, dtype=jnp.int32)
            ok = jnp.broadcast_to((kc < r)[None, :], (bd, bkr))
            w = plt.load(wu_ref.at[wrows[:, None], jnp.where(kc < r, kc, 0)[None, :]], mask=ok,
                         other=0.0).astype(dt)                        # [bd, bkr]
            u = u_ref[:, pl.dslice(c * bkr, bkr)]                     # [Mp, bkr]
            return dot_acc(z, u, w, trans_b=True)
        z = lax.fori_loop(0, n_rchunks, body, jnp.zeros((mp, bd), F32))
        m = jax.nn.sigmoid(z.astype(dt).astype(F32)).astype(dt)
        col = j * d + i * bd
        hc = h_ref[:, pl.dslice(col, bd)].astype(F32)
        w = wn_ref[pl.dslice(col, bd)].astype(F32)
        hn = (hc * rstd_ref[:, pl.dslice(j, 1)] * (1.0 + w[None, :])).astype(dt)
        acc = acc + (m.astype(F32) * hn.astype(F32)).astype(dt).astype(F32)
    x_ref[...] = (acc / s).astype(dt)


# ---- one token (M = 1): two kernels, no XLA step between them, no loops -------------------------------------------
#
# The multi-token design above pads the token to 16 MMA rows and runs two XLA fusions beside its kernels: four
# launches per boundary. At M = 1 (the plain decode step) the dots are GEMVs, so these kernels do them with vector
# multiplies and sums, and fold the combine, the norm, silu, the gates and the mix into the two weight streams.
# Each program issues all its loads at once (no loop): a first version that looped over K chunks took ~12 us per
# kernel on the H200, bound by one DRAM latency per iteration.
#   down1: grid ((r + S) / bn, S). Program (n, j) loads stream j of H (and y, inj_prev) as [q, ch] tiles (D = q * ch,
#          ch <= 128 a power of two), builds H' = H + round(inj_prev_j * y), its rstd and
#          Hn_j = round(H'_j * rstd * (1 + w_j)), and multiplies Hn_j by its bn rows of [Wdown; Winj] (the stream's
#          D columns of each): fp32 partial sums [S, r + S], one per stream; rstd [.., S].
#   up1:   grid (D / bd,). Program i sums the S partials of every row, u = silu(round(round(a) / S)) [r], the gates
#          m = sigmoid(round(u @ Wup[cols].T)) for its columns [i*bd, (i+1)*bd) of every stream ([S, bd, k] tiles),
#          Hn for the same columns, x = round(mean_j round(m_j * Hn_j)), and those columns of H'; program 0
#          also finishes inj = 2 sigmoid(round(round(a_inj) / S)).
# (One kernel is not possible without a grid-wide barrier: every gate needs all r values of u.)
#
# Tile shapes must be powers of two. `pieces=True` (the default) covers a non-power-of-two axis with several
# unmasked power-of-two pieces (D = 2560 = 20 chunks of 128 -> 16 + 4 chunks; r = 320 -> 128 + 128 + 64), so no
# register or lane holds padding, and every FP8 piece lies in one 128-column block: its scale is one value per row
# block, loaded once, not once per weight. `pieces=False` is the earlier layout (one masked tile padded to the next
# power of two, 37.5% padding at the released shapes, one scale load per weight), kept for the A/B.


@dataclasses.dataclass(frozen=True)
class Tiles1:
    bn: int = 2             # rows of [Wdown; Winj] per program (down1); divides r and S
    bd: int = 8             # columns of each stream per program (up1); divides D
    num_warps: int = 4      # H200: in the whole step 4 warps beat 2 (down1 + up1 6.5 + 5.6 us against 6.5 + 7.0),
                            # although the isolated sweep (FNX_HC_SWEEP=1) had 2 warps ahead (28.1 vs 33.8 us)
    num_stages: int = 1
    pieces: bool = True     # unmasked power-of-two pieces (see above); False: one padded, masked tile
    tokens: str = "grid"    # 2..FEW_MAX_TOKENS tokens: "grid" = one program per token (a grid axis; a token's
                            # programs read the same weight tiles, the later ones mostly from L2); "loop" = each
                            # program loads its tiles once and walks the tokens in turn (H200: ~33 us per five-token
                            # boundary for "loop" at 2b161d1, ~31 us for "grid" at 0400fd0, against 19.5-22.6 for XLA's;
                            # the few-token MMA design (few.py) serves the verify window instead)
    fold: int = 0           # down1: 1 = the products take round(H' (1 + w)) and the stream's 1/rms multiplies each
                            # row's sum at the end (rstd is a scalar per stream), so no product waits on the norm's
                            # reductions (the stock sm_90 build put the weight loads after the first of them);
                            # not the reference's rounding of Hn (one bf16 rounding of another value). The
                            # choice (`choose_tiles1`) takes it with `early` since measured (see there)
    early: int = 0          # up1: 1 = the mix's operands (H, y, inj_prev, rstd, hc_norm) and every piece's partials
                            # loaded before any arithmetic (the same bits; the stock sm_90 build issues them after
                            # the gates otherwise). On in `choose_tiles1` with `fold` (measured together)
    wround: int = 1         # FP8 weights: 1 = each weight dequantized and rounded to the activation dtype, as the
                            # reference; 0 = each 128-column piece's products summed first and its block scale
                            # applied to the fp32 sum (no weight rounded, one multiply per piece instead of one per
                            # weight, as the GEMV kernels do): within the weights' bf16 rounding of the reference
    ssum: int = 0           # up1: 1 = each piece's stream partials read as S loads of [p] and summed elementwise in
                            # stream order (a sum over S in another order: fp32 rounding apart), where 0 loads them as
                            # [S, p] and reduces over S, which Triton spreads over the warps (shared memory and CTA
                            # barriers: 32 in the stock sm_90 build). Off until measured
    prefetch: int = 0       # one token: 1 = down1's programs also read Wup (and its scales) into L2, one slice each,
                            # so up1 reads it from L2 (`fnx.pallas.l2_prefetch`; the same bits). Off: up1 no faster
                            # (H100, 87878be: 4.62 against 4.64 us a call; its time is its own arithmetic)


FEW_MAX_TOKENS = 8          # the one-token kernels also take up to this many tokens (Tiles1.tokens: how)


M1_TILES_ENV = "FNX_HC_M1_TILES"


def choose_tiles1(s: int, d: int, r: int) -> Tiles1:
    """The one-token kernels' tiles; `FNX_HC_M1_TILES` ("field=value,...", read when a program is traced: a
    benchmark knob) replaces fields of them."""
    t = _choose_tiles1(s, d, r)
    spec = os.environ.get(M1_TILES_ENV, "").strip()
    if spec:
        t = dataclasses.replace(t, **dispatch.fields_override(spec, Tiles1, M1_TILES_ENV, ("tokens",)))
    return t


def _choose_tiles1(s: int, d: int, r: int) -> Tiles1:
    bn = 2 if (r % 2 == 0 and s % 2 == 0) else 1
    # wround 0: the MoE decode kernels, bound like these by their instructions per weight, ran 12-20% faster
    # without the per-weight scale and rounding (H200, 89aa848); whether the boundary gains is measured in the step
    # bd 8. The seventeenth session (H200) isolated the pair at one token: bf16 weights 26.6 us at bd 4 against 41.5
    # at bd 8 (9a1f780), FP8 weights 31.4 against 33.1, bd 2 27.4 (ac51c89). In the 48-layer step bd 4 gave HC
    # 0.992 ms against 0.965 at bd 8 the session before (noise-level), so bd 8, chosen in the step, stays
    # fold and early 1: the 4-layer round at 8K (H200, commit d9f4565, 2026-12-05) -7.0 us of kernel time, the step
    # -10.7 (nine boundaries at one token), against both 0; early alone +0.8 / -3.5 (noise-level): the gain is fold's
    return Tiles1(bn=bn, bd=_largest_pow2_divisor(d, 8), wround=0, fold=1, early=1)


def _pieces(n: int, cap: int) -> list[tuple[int, int]]:
    """[start, start + size) pieces covering range(n): powers of two, largest first, none above `cap` (a power of
    two). Each piece starts at a multiple of its size, so a piece of at most 128 lies in one 128-block."""
    out, start = [], 0
    size = min(cap, 1 << (max(1, n).bit_length() - 1))
    while start < n:
        while size > n - start:
            size //= 2
        out.append((start, size))
        start += size
    return out


def _down_pieces(q: int, pieces: bool) -> list[tuple[int, int]]:
    """Pieces of the q chunks of a stream: unmasked powers of two, or one padded tile (masked past q)."""
    return _pieces(q, 1 << 30) if pieces else [(0, _pow2(q))]


def _up_pieces(r: int, pieces: bool) -> list[tuple[int, int]]:
    return _pieces(r, 128) if pieces else [(0, _pow2(r))]


def _dequant_rows(wt, sc, dt):
    """FP8 weights times their 128x128 block scales (fp32), rounded to the activation dtype: the model's
    dequantize-then-matmul arithmetic (fnx.pallas.gemv.reference.dequantize), exactly."""
    return rnd(wt.astype(F32) * sc, dt)


def _tok(t, stride: int, idx):
    """idx shifted to token t's row of a [M, stride] operand (t an int, or the program's token index on a token
    grid axis; token 0 as an int: idx itself, so one token's kernel is the same code as before tokens were
    added)."""
    return idx if isinstance(t, int) and t == 0 else t * stride + idx


def _rows_of(vals, mp: int, shape):
    """Per-token values [shape] stacked into [mp, *shape] (rows past len(vals) zero): one store per program."""
    tok = jnp.arange(mp, dtype=jnp.int32).reshape((mp,) + (1,) * len(shape))
    out = jnp.zeros((mp,) + tuple(shape), F32)
    for t, v in enumerate(vals):
        out = jnp.where(tok == t, jnp.broadcast_to(v.astype(F32), shape)[None], out)
    return out


def _down1_kernel(*refs, s, d, r, bn, ch, q, eps, has_y, has_inj, fp8, pieces, m=1, tok_grid=False, wround=True,
                  fold=False, prefetch=None):
    it = iter(refs)
    ins = _down1_inputs(it, has_y, has_inj, fp8)
    pf_refs = [next(it) for _ in prefetch] if prefetch else []
    part_ref, rstd_ref = next(it), next(it)
    one = m == 1 or tok_grid                # one token per program (on a token grid axis: the program's token)
    pf = []
    if prefetch:        # the next kernel's weights into L2: one slice of each per program, issued first
        pid = pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)
        pf = [l2_prefetch.issue(ref, total, pid, block) for ref, (total, block) in zip(pf_refs, prefetch)]

    def store_rstd(rstd):                   # (where the one-token kernel always stored it)
        rstd_ref[...] = rstd
    rstds, accs = _down1_task(*ins, pl.program_id(0), pl.program_id(1),
                              [pl.program_id(2)] if tok_grid else range(m), store_rstd if one else None,
                              s=s, d=d, r=r, bn=bn, ch=ch, q=q, eps=eps, has_y=has_y, has_inj=has_inj, fp8=fp8,
                              pieces=pieces, wround=wround, fold=fold)
    if one:
        part_ref[...] = accs[0]
    else:                                   # blocks [1, 1, Mp] and [Mp, bn] (Mp: tokens padded to a power of two)
        mp = rstd_ref.shape[-1]
        rstd_ref[...] = _rows_of([v.reshape(()) for v in rstds], mp, ()).reshape(1, 1, mp)
        part_ref[...] = _rows_of(accs, mp, (bn,))
    for vals in pf:     # the program waits for its prefetched slices only here, after its stores
        l2_prefetch.sink(vals)


def _down1_inputs(it, has_y: bool, has_inj: bool, fp8: bool) -> tuple:
    """down1's input refs (h, y, inj_prev, hc_norm, Wdown, its scales, Winj; None where absent) from `it`."""
    h_ref = next(it)
    y_ref, inj_ref = (next(it), next(it)) if has_y else (None, None)
    wn_ref, wd_ref = next(it), next(it)
    sd_ref = next(it) if fp8 else None
    wi_ref = next(it) if has_inj else None
    return h_ref, y_ref, inj_ref, wn_ref, wd_ref, sd_ref, wi_ref


def _down1_task(h_ref, y_ref, inj_ref, wn_ref, wd_ref, sd_ref, wi_ref, n, j, toks, store_rstd, *, s, d, r, bn, ch, q,
                eps, has_y, has_inj, fp8, pieces, wround=True, fold=False):
    """down1's work for rows block n of [Wdown; Winj] and stream j over tokens `toks` (ints, or the program's token
    index): (each token's rstd [1, 1], each token's bn row sums [bn]). store_rstd(rstd), where given, runs as soon as
    the token's rstd is known (the one-token kernel stores it there)."""
    dt = h_ref.dtype
    rows = jnp.arange(bn, dtype=jnp.int32)[:, None, None]
    n_down = r // bn
    is_down = n < n_down
    ncb = (s * d + 127) // 128              # 128-column blocks of a row of Wdown (scale row length)
    tiles = []
    # the weight tiles first, so their DRAM reads are in flight while the activations are loaded and normalised; a
    # Winj program reads Winj, the others Wdown (two masked loads, one of them touching no memory)
    for c0, p in pieces:
        chunk = c0 + jnp.arange(p, dtype=jnp.int32)                                     # [p]
        col = chunk[:, None] * ch + jnp.arange(ch, dtype=jnp.int32)[None, :]            # [p, ch]
        ok = jnp.broadcast_to((chunk < q)[:, None], (p, ch))   # all true unless padded (offsets stay affine: no
        off = j * d + col                                      # clamping where, so Triton vectorises the loads)
        m3 = jnp.broadcast_to(ok[None], (bn, p, ch))
        wt = plt.load(wd_ref.at[(n * bn + rows) * (s * d) + off[None]], mask=m3 & is_down, other=0.0)
        if fp8:   # the bn rows sit in one 128-row block (bn divides 128), a chunk in one 128-column block
            sc = plt.load(sd_ref.at[(n * bn) // 128 * ncb + (j * d + chunk * ch) // 128],
                          mask=(chunk < q) & is_down, other=0.0)                        # [p]
            if wround:
                wt = _dequant_rows(wt, sc[None, :, None], dt)
            else:       # the scale goes on each chunk's sum; a Winj program's chunks (q masked to 0) keep 1
                wt = wt.astype(F32)
                csc = jnp.where(is_down, sc, 1.0)
        if has_inj:
            wt = wt + plt.load(wi_ref.at[((n - n_down) * bn + rows) * (s * d) + off[None]],
                               mask=m3 & jnp.logical_not(is_down), other=0.0)            # [bn, p, ch]
        # fold: hc_norm's weights of the chunk now (the products use them before any reduction); else after the
        # norm's sums, as first written (with them here the stock sm_90 build put a barrier before the H loads)
        wn = plt.load(wn_ref.at[off], mask=ok, other=0.0).astype(F32) if fold else None
        tiles.append((col, ok, off, wt, csc if fp8 and not wround else None, wn))
    rstds, accs = [], []
    for t in toks:                          # tokens: shared weight tiles, each its own norm
        hcs, ss = [], None
        for col, ok, off, *_ in tiles:
            hc = plt.load(h_ref.at[_tok(t, s * d, off)], mask=ok, other=0.0).astype(F32)
            if has_y:
                yv = plt.load(y_ref.at[_tok(t, d, col)], mask=ok, other=0.0).astype(F32)
                hc = rnd(hc + rnd(yv * inj_ref[_tok(t, s, j)].astype(F32), dt), dt)
            hcs.append(hc)
            if not fold:        # (the sums of squares interleaved with the loads, as first written)
                piece = jnp.sum(jnp.sum(hc * hc, axis=1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
                ss = piece if ss is None else ss + piece

        def products(rstd):     # the rows' sums over the stream (rstd None: of round(H' (1 + w)), Tiles1.fold)
            acc = None
            for (col, ok, off, wt, csc, w), hc in zip(tiles, hcs):
                if w is None:
                    w = plt.load(wn_ref.at[off], mask=ok, other=0.0).astype(F32)
                hn = rnd((hc if rstd is None else hc * rstd) * (1.0 + w), dt)           # [p, ch]
                chunks = jnp.sum(wt.astype(F32) * hn[None], axis=2)                      # [bn, p]
                piece = jnp.sum(chunks if csc is None else chunks * csc[None, :], axis=1)  # [bn]
                acc = piece if acc is None else acc + piece
            return acc
        acc = None
        if fold:                # the products first: nothing in them waits on the norm
            acc = products(None)
            for hc in hcs:
                piece = jnp.sum(jnp.sum(hc * hc, axis=1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
                ss = piece if ss is None else ss + piece
        rstd = lax.rsqrt(ss / d + eps)
        if store_rstd is not None:
            store_rstd(rstd)
        acc = acc * rstd.reshape(()) if fold else products(rstd)
        rstds.append(rstd)
        accs.append(acc)
    return rstds, accs


def _up1_kernel(*refs, s, d, r, bd, n_rows, has_y, has_inj, fp8, pieces, m=1, tok_grid=False, n_prog=0,
                wround=True, early=False, ssum=False):
    it = iter(refs)
    part_ref, rstd_ref = next(it), next(it)
    ins = _up1_inputs(it, has_y, fp8)
    x_ref = next(it)
    ho_ref = next(it) if has_y else None
    injo_ref = next(it) if has_inj else None
    i = pl.program_id(0)
    sj = jnp.arange(s, dtype=jnp.int32)
    one = m == 1 or tok_grid
    mp = 1 if one else x_ref.shape[0]
    toks = []

    def get_toks():         # the program's tokens, made where the kernel first made them (after the weight loads)
        toks.extend([pl.program_id(1)] if tok_grid else range(m))
        return toks
    xs, hos = _up1_task(part_ref, rstd_ref, *ins, i, get_toks, mp, sj, s=s, d=d, r=r, bd=bd, n_rows=n_rows, has_y=has_y,
                        fp8=fp8, pieces=pieces, m=m, tok_grid=tok_grid, n_prog=n_prog, wround=wround, early=early,
                        ssum=ssum)
    dt = ins[0].dtype
    if one:
        x_ref[...] = xs[0].astype(dt)
        if has_y:
            ho_ref[...] = hos[0]
    else:                                   # blocks [Mp, bd] and [Mp, S, bd]
        x_ref[...] = _rows_of(xs, mp, (bd,)).astype(dt)
        if has_y:
            ho_ref[...] = _rows_of(hos, mp, (s, bd)).astype(dt)
    if has_inj:
        @pl.when(i == 0)
        def _():
            injs = _up1_inj(part_ref, toks, sj, s=s, n_rows=n_rows, r=r, dt=dt)
            injo_ref[...] = (injs[0] if one else _rows_of(injs, mp, (s,))).astype(dt)


def _up1_inputs(it, has_y: bool, fp8: bool) -> tuple:
    """up1's input refs after the partials and rstd (h, y, inj_prev, hc_norm, Wup, its scales; None where absent)."""
    h_ref = next(it)
    y_ref, inj_ref = (next(it), next(it)) if has_y else (None, None)
    wn_ref, wu_ref = next(it), next(it)
    su_ref = next(it) if fp8 else None
    return h_ref, y_ref, inj_ref, wn_ref, wu_ref, su_ref


def _up1_inj(part_ref, toks, sj, *, s, n_rows, r, dt) -> list:
    """The injection weights 2 sigmoid(round(round(sum of the S stream partials of Winj's rows) / S)) [S] per token
    (sj: arange(S))."""
    injs = []
    for t in toks:
        pi = plt.load(part_ref.at[_tok(t, s * n_rows, sj[:, None] * n_rows + r + sj[None, :])])  # [S, S]
        vi = rnd(rnd(jnp.sum(pi, axis=0), dt) / s, dt)
        injs.append(2.0 * rnd(jax.nn.sigmoid(vi), dt))
    return injs


def _up1_task(part_ref, rstd_ref, h_ref, y_ref, inj_ref, wn_ref, wu_ref, su_ref, i, get_toks, mp, sj, *, s, d, r, bd,
              n_rows, has_y, fp8, pieces, m=1, tok_grid=False, n_prog=0, wround=True, early=False, ssum=False):
    """up1's work for output columns [i*bd, (i+1)*bd) of every stream over the tokens get_toks() returns (ints, or
    the program's token index; sj: arange(S)): (each token's x [bd] in fp32, each token's H' [S, bd])."""
    dt = h_ref.dtype
    cols = i * bd + jnp.arange(bd, dtype=jnp.int32)
    rows = sj[:, None] * d + cols[None, :]                                               # [S, bd] rows of Wup
    ncb = (r + 127) // 128
    tiles = []
    for k0, p in pieces:                    # the weight tiles first: in flight early
        k = k0 + jnp.arange(p, dtype=jnp.int32)
        kok = jnp.broadcast_to((k < r)[None, :], (s, p))   # offsets below stay unclamped (affine), as in down1
        wt = plt.load(wu_ref.at[rows[:, :, None] * r + k[None, None, :]],
                      mask=jnp.broadcast_to(kok[:, None, :], (s, bd, p)), other=0.0)    # [S, bd, p]
        if fp8:   # each stream's bd rows sit in one 128-row block (bd divides 128 and D)
            rb = ((sj * d + i * bd) // 128) * ncb                                        # [S]
            if p <= 128 and k0 % p == 0:          # the piece lies in one 128-column block: one scale per stream
                sc = plt.load(su_ref.at[rb + k0 // 128])[:, None, None]                 # [S, 1, 1]
                if not wround:                    # on the piece's fp32 sums instead (Tiles1.wround)
                    tiles.append((k, kok, wt.astype(F32), sc[:, :, 0]))
                    continue
            else:                                 # the padded tile: one scale per weight
                sc = plt.load(su_ref.at[rb[:, None] + k[None, :] // 128], mask=kok, other=0.0)[:, None, :]
            wt = _dequant_rows(wt, sc, dt)
        tiles.append((k, kok, wt, None))
    toks = get_toks()

    def mix_operands(t):   # token t's H' (H, y, inj_prev combined), rstd and hc_norm's w for the program's columns
        # (rstd: program row 0 of [programs, S] (one token), [programs, S, Mp] (loop) or [M, programs, S] (grid))
        hc = plt.load(h_ref.at[_tok(t, s * d, rows)])                                    # [S, bd]
        if has_y:
            yv = plt.load(y_ref.at[_tok(t, d, cols)]).astype(F32)
            injp = plt.load(inj_ref.at[_tok(t, s, sj)]).astype(F32)
            hc = (hc.astype(F32) + rnd(injp[:, None] * yv[None, :], dt)).astype(dt)
        rstd = plt.load(rstd_ref.at[sj if m == 1 else (t * (n_prog * s) + sj if tok_grid else sj * mp + t)])
        return hc, rstd, plt.load(wn_ref.at[rows]).astype(F32)

    def part_load(t, k, kok):   # the down kernel's partials [S, p] of a piece of r (ssum: their sum over S [p])
        if ssum:    # S loads of [p] summed elementwise in stream order: no reduction across the warps
            acc = None
            for j in range(s):
                v = plt.load(part_ref.at[_tok(t, s * n_rows, j * n_rows + k)], mask=k < r, other=0.0)
                acc = v if acc is None else acc + v
            return acc
        return plt.load(part_ref.at[_tok(t, s * n_rows, sj[:, None] * n_rows + k[None, :])], mask=kok, other=0.0)
    # early (Tiles1.early): the mix's operands and every piece's partials loaded before any arithmetic. As first
    # written (after the gates, a piece's partials inside its arithmetic) the stock sm_90 build issued those loads
    # only once the gates were done: memory round trips on the program's critical path
    ahead = [(mix_operands(t), [part_load(t, k, kok) for k, kok, _, _ in tiles]) for t in toks] if early else \
        [(None, None)] * len(toks)
    xs, hos = [], []
    for t, (mix, tparts) in zip(toks, ahead):      # tokens: the weight tiles are shared
        z = None
        for pi_, (k, kok, wt, psc) in enumerate(tiles):     # (not `i`: the program's index, used below)
            parts = tparts[pi_] if tparts is not None else part_load(t, k, kok)    # [S, p] ([p]: ssum)
            v = rnd(rnd(parts if ssum else jnp.sum(parts, axis=0), dt) / s, dt)
            u = rnd(v * rnd(jax.nn.sigmoid(v), dt), dt)                                # silu, rounded like the model
            piece = jnp.sum(wt.astype(F32) * u[None, None, :], axis=2)                   # [S, bd]
            if psc is not None:
                piece = piece * psc
            z = piece if z is None else z + piece
        mg = rnd(jax.nn.sigmoid(rnd(z, dt)), dt)
        hc, rstd, wn = mix if mix is not None else mix_operands(t)
        hn = rnd(hc.astype(F32) * rstd[:, None] * (1.0 + wn), dt)
        xs.append(jnp.sum(rnd(mg * hn, dt), axis=0) / s)
        hos.append(hc)
    return xs, hos


def boundary_dims(h, w_down, streams: int, max_tokens: int, who: str):
    """(lead, S*D, S, D, r, M) of a boundary call: h [..., S*D] holds M tokens in its leading dims, 1..max_tokens."""
    lead, sd = h.shape[:-1], h.shape[-1]
    m = 1
    for n in lead:
        m *= n
    if not 1 <= m <= max_tokens:
        raise ValueError(f"{who} takes 1..{max_tokens} tokens, got {m}")
    return lead, sd, streams, sd // streams, w_down.shape[0], m


def check_fp8_scales(who: str, r: int, sd: int, w_down_scale, w_up_scale) -> bool:
    """Whether Wdown / Wup are FP8 (their scales given); raises unless both or neither are, each one fp32 scale per
    128x128 block of its weight (Wdown [r, S*D], Wup [S*D, r])."""
    fp8 = w_down_scale is not None
    if fp8 != (w_up_scale is not None):
        raise ValueError(f"{who}: FP8 needs both w_down_scale and w_up_scale")
    if fp8:
        want = {"w_down_scale": (-(-r // 128), -(-sd // 128)), "w_up_scale": (-(-sd // 128), -(-r // 128))}
        for name, a in (("w_down_scale", w_down_scale), ("w_up_scale", w_up_scale)):
            if tuple(a.shape) != want[name]:
                raise ValueError(f"{who}: {name} {tuple(a.shape)} is not one scale per 128x128 block {want[name]}")
    return fp8


def hc_boundary_m1(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, *, streams: int, eps: float,
                   interpret: bool = False, tiles: Tiles1 | None = None, w_down_scale=None, w_up_scale=None):
    """`hc_boundary` for one token (h [..., S*D] with one token in its leading dims): two kernels, see above.
    Up to FEW_MAX_TOKENS tokens (an MTP verify window) run the same two kernels, each program over every token
    with its weight tiles loaded once (op "hc_boundary_few"; one token is the same code as before tokens were
    added). S must be a power of two (the streams are one tile axis). FP8 Wdown and Wup: float8_e4m3fn weights with
    `w_down_scale` / `w_up_scale`, one fp32 multiplier per 128x128 block ([ceil(rows/128), ceil(cols/128)]);
    each weight is dequantized in registers and rounded to h.dtype, as the model's dequantize-then-matmul does
    (Winj stays dense)."""
    dt = h.dtype
    lead, sd, s, d, r, m = boundary_dims(h, w_down, streams, FEW_MAX_TOKENS, "hc_boundary_m1")
    mp = _pow2(m)
    t = tiles or choose_tiles1(s, d, r)
    if s != _pow2(s) or r % t.bn or s % t.bn or d % t.bd:
        raise ValueError(f"hc_boundary (M = 1): S={s} (a power of two), r={r}, D={d} do not fit the tiles {t}")
    fp8 = check_fp8_scales("hc_boundary (M = 1)", r, sd, w_down_scale, w_up_scale)
    if fp8:
        if 128 % t.bn or 128 % t.bd:
            raise ValueError(f"hc_boundary (M = 1) FP8: bn={t.bn} and bd={t.bd} must divide the 128-row blocks")
    params = {}
    if not interpret:
        params["compiler_params"] = plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
    has_y, has_inj = y is not None, w_inj is not None
    whole = pl.BlockSpec(memory_space=pl.ANY)
    flat = stacked.flatten                  # a weight may be a layer of a stack (fnx.pallas.stacked): read in place
    f32 = lambda a: stacked.astype(a, F32)  # noqa: E731
    acts = (flat(h),) + ((flat(y), flat(inj_prev)) if has_y else ())
    ch = _largest_pow2_divisor(d, 128)      # a chunk never crosses a 128-column block (one FP8 scale per chunk)
    q = d // ch
    n_down = r // t.bn
    n_prog = n_down + (s // t.bn if has_inj else 0)
    n_rows = n_prog * t.bn
    grid = m > 1 and t.tokens == "grid"     # one program per token on a grid axis (see Tiles1.tokens)
    if t.tokens not in ("grid", "loop"):
        raise ValueError(f"hc_boundary (M = 1): Tiles1.tokens {t.tokens!r}: 'grid' or 'loop'")
    if m == 1:
        down_specs = [pl.BlockSpec((None, t.bn), lambda n, j: (j, n)), pl.BlockSpec((1, 1), lambda n, j: (n, j))]
        down_shapes = [jax.ShapeDtypeStruct((s, n_rows), F32), jax.ShapeDtypeStruct((n_prog, s), F32)]
    elif grid:  # the M real tokens (no padding): part [M, S, rows], rstd [M, programs, S]
        down_specs = [pl.BlockSpec((None, None, t.bn), lambda n, j, i: (i, j, n)),
                      pl.BlockSpec((None, 1, 1), lambda n, j, i: (i, n, j))]
        down_shapes = [jax.ShapeDtypeStruct((m, s, n_rows), F32), jax.ShapeDtypeStruct((m, n_prog, s), F32)]
    else:   # tokens padded to Mp rows: part [Mp, S, rows], rstd [programs, S, Mp]
        down_specs = [pl.BlockSpec((mp, None, t.bn), lambda n, j: (0, j, n)),
                      pl.BlockSpec((1, 1, mp), lambda n, j: (n, j, 0))]
        down_shapes = [jax.ShapeDtypeStruct((mp, s, n_rows), F32), jax.ShapeDtypeStruct((n_prog, s, mp), F32)]
    tag = "" if m == 1 else "_few"
    # Tiles1.prefetch (one token, compiled): Wup and its scales read into L2 by down1's programs for up1
    pf_args = ((flat(w_up),) + ((flat(f32(w_up_scale)),) if fp8 else ())) if t.prefetch and m == 1 and not interpret \
        else ()
    pf_meta = tuple((int(a.size), l2_prefetch.block_for(int(a.size), n_prog * s)) for a in pf_args)
    part, rstd = stacked.call(
        functools.partial(_down1_kernel, s=s, d=d, r=r, bn=t.bn, ch=ch, q=q, eps=eps, has_y=has_y,
                          has_inj=has_inj, fp8=fp8, pieces=tuple(_down_pieces(q, t.pieces)), m=m, tok_grid=grid,
                          wround=bool(t.wround), fold=bool(t.fold), prefetch=pf_meta or None),
        (*acts, flat(hc_norm), flat(w_down), *((flat(f32(w_down_scale)),) if fp8 else ()),
         *((flat(w_inj),) if has_inj else ()), *pf_args),
        grid=(n_prog, s, m) if grid else (n_prog, s),
        in_specs=[whole] * (len(acts) + 2 + fp8 + has_inj + len(pf_args)),
        out_specs=down_specs, out_shape=down_shapes,
        interpret=interpret, name=("hc_down1_fp8" if fp8 else "hc_down1") + tag, **params,
    )
    if m == 1:
        outs = [jax.ShapeDtypeStruct((d,), dt)] + ([jax.ShapeDtypeStruct((s, d), dt)] if has_y else []) + (
            [jax.ShapeDtypeStruct((s,), dt)] if has_inj else [])
        specs = [pl.BlockSpec((t.bd,), lambda i: (i,))] + (
            [pl.BlockSpec((s, t.bd), lambda i: (0, i))] if has_y else []) + (
            [pl.BlockSpec((s,), lambda i: (0,))] if has_inj else [])
    elif grid:  # x [M, D], H' [M, S, D], inj [M, S]: program (i, token)
        outs = [jax.ShapeDtypeStruct((m, d), dt)] + ([jax.ShapeDtypeStruct((m, s, d), dt)] if has_y else []) + (
            [jax.ShapeDtypeStruct((m, s), dt)] if has_inj else [])
        specs = [pl.BlockSpec((None, t.bd), lambda i, k: (k, i))] + (
            [pl.BlockSpec((None, s, t.bd), lambda i, k: (k, 0, i))] if has_y else []) + (
            [pl.BlockSpec((None, s), lambda i, k: (k, 0))] if has_inj else [])
    else:   # x [Mp, D], H' [Mp, S, D], inj [Mp, S]
        outs = [jax.ShapeDtypeStruct((mp, d), dt)] + ([jax.ShapeDtypeStruct((mp, s, d), dt)] if has_y else []) + (
            [jax.ShapeDtypeStruct((mp, s), dt)] if has_inj else [])
        specs = [pl.BlockSpec((mp, t.bd), lambda i: (0, i))] + (
            [pl.BlockSpec((mp, s, t.bd), lambda i: (0, 0, i))] if has_y else []) + (
            [pl.BlockSpec((mp, s), lambda i: (0, 0))] if has_inj else [])
    up = stacked.call(
        functools.partial(_up1_kernel, s=s, d=d, r=r, bd=t.bd, n_rows=n_rows, has_y=has_y, has_inj=has_inj,
                          fp8=fp8, pieces=tuple(_up_pieces(r, t.pieces)), m=m, tok_grid=grid, n_prog=n_prog,
                          wround=bool(t.wround), early=bool(t.early), ssum=bool(t.ssum)),
        (flat(part), flat(rstd), *acts, flat(hc_norm), flat(w_up), *((flat(f32(w_up_scale)),) if fp8 else ())),
        grid=(d // t.bd, m) if grid else (d // t.bd,), in_specs=[whole] * (len(acts) + 4 + fp8), out_specs=specs,
        out_shape=outs, interpret=interpret, name=("hc_up1_fp8" if fp8 else "hc_up1") + tag, **params,
    )
    real = (lambda a: a) if m == 1 or grid else (lambda a: a[:m])  # noqa: E731  (the padded token rows dropped)
    x = real(up[0]).reshape(*lead, d)
    h_new = real(up[1]).reshape(h.shape) if has_y else h
    inj = real(up[-1]).reshape(*lead, s) if has_inj else None
    return h_new, x, inj


def hc_boundary(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, *, streams: int, eps: float,
                interpret: bool = False, tiles: Tiles | None = None):
    """Same contract as reference.hc_boundary (any token count up to 32; `hc_boundary_m1` is the one-token
    design the api picks for M = 1)."""
    dt = h.dtype
    lead = h.shape[:-1]
    sd = h.shape[-1]
    s = streams
    d = sd // s
    r = w_down.shape[0]
    m_tok = 1
    for n in lead:
        m_tok *= n
    t = tiles or choose_tiles(d, r)
    if d % (t.bk * t.ks) or d % t.bd:
        raise ValueError(f"hc_boundary: D={d} must be a multiple of bk*ks={t.bk * t.ks} and bd={t.bd}")
    mp = max(16, _pow2(m_tok))
    params = {}
    if not interpret:
        params["compiler_params"] = plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)

    # pre: combine and per-stream 1/rms (one XLA fusion over M x S*D values)
    h2 = h.reshape(m_tok, sd)
    if y is not None:
        h2 = h2 + (y.reshape(m_tok, 1, d) * inj_prev.reshape(m_tok, s, 1)).reshape(m_tok, sd)
    x32 = h2.astype(F32).reshape(m_tok, s, d)
    rstd = lax.rsqrt(jnp.mean(x32 * x32, axis=-1) + eps)               # [M, S]
    hp = jnp.pad(h2, ((0, mp - m_tok), (0, 0)))
    rstdp = jnp.pad(rstd, ((0, mp - m_tok), (0, 0)))

    # down: split-K partials of Hn @ [Wdown; Winj].T
    n_down = -(-r // t.br)
    n_prog = n_down + (1 if w_inj is not None else 0)
    wi = w_inj if w_inj is not None else w_down[:1]
    n_chunks = d // t.bk // t.ks
    whole = pl.BlockSpec(memory_space=pl.ANY)
    parts = pdl.pallas_call(
        functools.partial(_down_kernel, d=d, r=r, s=s, br=t.br, bk=t.bk, n_chunks=n_chunks, n_down=n_down),
        grid=(n_prog, s, t.ks),
        in_specs=[whole, whole, whole, whole, whole],
        out_specs=pl.BlockSpec((None, mp, t.br), lambda n, j, k: (j * t.ks + k, 0, n)),
        out_shape=jax.ShapeDtypeStruct((s * t.ks, mp, n_prog * t.br), F32),
        interpret=interpret, name="hc_down", **params,
    )(hp, rstdp, hc_norm, w_down, wi)

    # mid: reduce the splits, then the model's own bf16 ops
    a = jnp.sum(parts, axis=0)[:m_tok].astype(dt)
    u = jax.nn.silu((a[:, :r].astype(F32) / s).astype(dt))
    inj = None
    if w_inj is not None:
        ai = a[:, n_down * t.br: n_down * t.br + s]
        inj = (2 * jax.nn.sigmoid((ai.astype(F32) / s).astype(dt))).reshape(*lead, s)
    rp = -(-r // t.bkr) * t.bkr
    up = jnp.pad(u, ((0, mp - m_tok), (0, rp - r)))

    # up: sigmoid gates, renormalised streams, 4-stream mean
    x = pdl.pallas_call(
        functools.partial(_up_kernel, d=d, r=r, s=s, bd=t.bd, bkr=t.bkr, n_rchunks=rp // t.bkr),
        grid=(d // t.bd,),
        in_specs=[whole, whole, whole, whole, whole],
        out_specs=pl.BlockSpec((mp, t.bd), lambda i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((mp, d), dt),
        interpret=interpret, name="hc_up", **params,
    )(up, hp, rstdp, hc_norm, w_up)
    return h2.reshape(h.shape), x[:m_tok].reshape(*lead, d), inj
