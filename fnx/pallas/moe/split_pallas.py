"""The one-token MoE experts in one launch, split over the intermediate axis (`DecodeTiles.fuse`, op "moe_decode").

`decode_pallas.moe_decode` runs a one-token layer as two launches and an XLA sum: kernel 1 writes every slot's
activation row act = silu(x @ gate.T) * (x @ up.T) [I], kernel 2 reads it back for the down products. Here program
(s, j) takes slot s's expert and the intermediate columns [j*bi, (j+1)*bi): it computes those bi activations from
the expert's gate and up rows (the same arithmetic and roundings as kernel 1, so the same values), keeps them in
registers, and multiplies them by the same bi columns of the expert's down rows, every output row: a partial of
the down product over its bi columns, fp32 [D], stored as y[s, j]. One more row of programs does the shared
expert's down product the same way from the router's shared gate / up columns. One XLA fusion then sums each
slot's I/bi partials, rounds, weights and adds the terms in slot order as the two-launch path's combine does
(`_combine`): one launch and the act round trip fewer a layer, for a [rows, I/bi, D] fp32 buffer (in L2).

NVFP4 down weights pack two intermediate columns a byte (the low nibble the even one), so a program computes its
even and its odd activation columns as two halves (the gate / up rows j*bi + 2t and j*bi + 2t + 1, strided row
loads) and multiplies them with the low and the high nibbles; with FP8 and dense down weights its activations are
one vector against [rows, bi] tiles. Results: each slot's down product summed in another fp32 order (by column
slices, then over the slices) than kernel 2's, so within an fp32 ulp of the sum before its bf16 rounding; the
activations and every rounding are the two-launch path's.

One token per slot: M = 1, or flat slots (`DecodeTiles.flat`) at several tokens. Tiles: `fuse` = bi (a power of
two dividing I and I_shared; >= 16 with NVFP4 down weights, a divisor of 128 with FP8), `fuse_rd` output rows per
down chunk (FP8 down weights: at most 128), `cw` the gate / up chunk width, `fuse_ahead` chunks whose loads are issued
ahead of the one computed (0: every chunk's first), `gsum`, `e2m1` ("mma" / "hfma" decodes here "asm"),
`num_warps`.

Measured (H100, e84b3d3, the 4-layer step at 8K; BENCHMARKS.md, fifty-sixth session): 74.1 us a layer at bi 16 and
37.2 at bi 32 (8 warps) against 22.6 for the two launches, so it is off. A program's down slice is bi/2 bytes of a
320-byte row: each 32-byte sector is shared by several programs and fetched by each; bi 64 was not measured."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fnx.pallas import kernel_math, stacked
from fnx.pallas.kernel_math import rnd
from fnx.pallas.moe import decode_pallas as dp
from fnx.pallas.moe import reference

F32 = jnp.float32


def _rows_raw(fmt, refs, lead, r0, rows, stride, c0, cw):
    """`decode_pallas._raw` of rows r0, r0 + stride, ... (`rows` of them) x columns [c0, c0+cw), as stored: a
    half's gate or up rows. FP8: every row in one 128-row block (the caller's tiles make it so)."""
    rs = pl.ds(r0, rows, stride=stride)
    if fmt == "nvfp4":
        return (refs[0][(*lead, rs, pl.ds(c0 // 2, cw // 2))], refs[1][(*lead, rs, pl.ds(c0 // 16, cw // 16))],
                refs[2][(*lead, rs)])
    q = refs[0][(*lead, rs, pl.ds(c0, cw))]
    if fmt != "fp8_block":
        return (q,)
    if cw <= 128:
        return q, refs[1][(*lead, r0 // 128, c0 // 128)]
    return q, refs[1][(*lead, r0 // 128, pl.ds(c0 // 128, cw // 128))]


def _down_raw(fmt, refs, lead, r0, rd, j, bi):
    """The down rows [r0, r0+rd) at the intermediate columns [j*bi, (j+1)*bi), as stored: NVFP4 the packed bytes
    (low nibble = even column), their group scales and the rows' globals; FP8 / dense the [rd, bi] tile and FP8's
    block scale (the chunk inside one 128 x 128 block). The column offsets are j times a constant (never a traced
    division), so Triton sees their alignment and loads each row's bytes as one vector."""
    rows = pl.ds(r0, rd)
    if fmt == "nvfp4":
        return (refs[0][(*lead, rows, pl.ds(j * (bi // 2), bi // 2))],
                refs[1][(*lead, rows, pl.ds(j * (bi // 16), bi // 16))], refs[2][(*lead, rows)])
    q = refs[0][(*lead, rows, pl.ds(j * bi, bi))]
    if fmt == "fp8_block":
        return q, refs[1][(*lead, r0 // 128, j // (128 // bi))]
    return (q,)


def _down_sums(fmt, raw, rd, bi, dt, e2m1, gsum, acts):
    """[rd] fp32: sum over the chunk's bi columns of down[r, c] * act[c], times the rows' scales (NVFP4: group
    scales on the codes or their group sums, the rows' global on the sum, the activations as (even, odd) halves;
    FP8: the block's scale)."""
    if fmt == "nvfp4":
        ws = dp._deq(fmt, raw, rd, bi, dt, e2m1, False, gsum)
        return dp._rowdot(ws, list(acts)) * raw[2]
    acc = dp._rowdot([raw[0].astype(F32)], list(acts))
    return acc * raw[1].astype(F32) if fmt == "fp8_block" else acc


def _gate_up_acts(fmt, w_refs, e, x_ref, xr, *, j, bi, inter, d, cw, dt, e2m1, gsum, ahead, halves):
    """Slot expert e's activations at the intermediate columns [j*bi, (j+1)*bi), silu(round(x @ gate.T)) *
    round(x @ up.T) rounded as kernel 1 rounds them, fp32 vectors holding dt values: with `halves` (NVFP4 down
    weights) the even columns j*bi + 2t and the odd ones j*bi + 2t + 1 as two [bi/2] vectors (strided row loads),
    else one [bi] vector."""
    nk = d // cw
    if halves:
        h, stride = bi // 2, 2
        bases = [j * bi, j * bi + 1, inter + j * bi, inter + j * bi + 1]     # gate even, odd; up even, odd
    else:
        h, stride = bi, 1
        bases = [j * bi, inter + j * bi]
    n = len(bases)
    chunks = dp._Chunks(lambda c: [_rows_raw(fmt, w_refs, (e,), r0, h, stride, c * cw, cw) for r0 in bases], nk,
                        ahead)
    deq = functools.partial(dp._deq, fmt, rows=h, cw=cw, dt=dt, e2m1=e2m1, wround=False, gsum=gsum)
    tiles = [None] * n
    for c in range(nk):
        raws = chunks[c]
        xv = dp._xs(x_ref, (xr,), c * cw, cw, fmt == "nvfp4")
        for i in range(n):
            tiles[i] = dp._tile_fma(tiles[i], deq(raws[i]), dp._scaled(xv, dp._col_scale(fmt, raws[i], cw, False)))
    first = chunks[0]
    sums = [rnd(dp._rows(dp._tiles_sum(tiles[i]), dp._row_scale(fmt, first[i], False)), dt) for i in range(n)]
    return tuple(dp._silu_mul(sums[i], sums[i + n // 2], dt) for i in range(n // 2))


def _split_kernel(ids_ref, x_ref, sg_ref, su_ref, *rest, fmt1, fmt2, sfmt, n1, n2, k, n_slots, d, inter, inter_s,
                  bi, cw, rd, e2m1, gsum, offs, flat_slots, ahead):
    w1, w2, w3, y_ref = rest[:n1], rest[n1:n1 + n2], rest[n1 + n2:-1], rest[-1]
    s, j = pl.program_id(0), pl.program_id(1)
    dt = sg_ref.dtype
    nr = d // rd

    def down(fmt, refs, lead, acts):
        fr = min(rd, 128) if fmt == "fp8_block" else rd       # FP8: a chunk's rows in one 128-row block
        chunks = dp._Chunks(lambda r: _down_raw(fmt, refs, lead, r * fr, fr, j, bi), d // fr, ahead)
        for r in range(d // fr):
            y_ref[s, j, pl.ds(r * fr, fr)] = _down_sums(fmt, chunks[r], fr, bi, dt, e2m1, gsum, acts)

    def zeros():
        for r in range(nr):
            y_ref[s, j, pl.ds(r * rd, rd)] = jnp.zeros((rd,), F32)

    def routed():
        e = ids_ref[s]
        xr = s // k if flat_slots else 0
        acts = _gate_up_acts(fmt1, w1, e, x_ref, xr, j=j, bi=bi, inter=inter, d=d, cw=cw, dt=dt, e2m1=e2m1,
                             gsum=gsum, ahead=ahead, halves=fmt2 == "nvfp4")
        down(fmt2, w2, (e,), acts)

    def shared():
        t = s - n_slots
        if sfmt == "nvfp4":     # the even and the odd columns (strided loads of the router's products)
            ld = lambda ref, o, hh: ref[t, pl.ds(o + j * bi + hh, bi // 2, stride=2)].astype(F32)  # noqa: E731
            acts = tuple(dp._silu_mul(ld(sg_ref, offs[0], hh), ld(su_ref, offs[1], hh), dt) for hh in (0, 1))
        else:
            ld = lambda ref, o: ref[t, pl.ds(o + j * bi, bi)].astype(F32)  # noqa: E731
            acts = (dp._silu_mul(ld(sg_ref, offs[0]), ld(su_ref, offs[1]), dt),)
        down(sfmt, w3, (), acts)

    n_j, n_js = inter // bi, inter_s // bi
    pl.when((s < n_slots) & (j < n_j))(routed)
    pl.when((s >= n_slots) & (j < n_js))(shared)
    pl.when(((s < n_slots) & (j >= n_j)) | ((s >= n_slots) & (j >= n_js)))(zeros)


def check(gate_up, down, shared_down, m: int, tiles) -> str | None:
    """None when the split kernel covers these weights and tiles (`tiles.fuse` > 0), else why not."""
    t = tiles
    inter, inter_s, d = down.shape[-1], shared_down.shape[-1], down.shape[-2]
    fmts = {reference.weight_format(w) for w in (gate_up, down, shared_down)}
    bi, rd = t.fuse, t.fuse_rd
    if bi & (bi - 1) or rd <= 0 or rd & (rd - 1):
        return f"tiles {t}: fuse {bi} and fuse_rd {rd} must be powers of two"
    if not (m == 1 or t.flat):
        return f"tiles {t}: fuse {bi} (the experts in one launch) computes one token per slot: M = 1 or flat 1 " \
               f"(got M = {m})"
    if inter % bi or inter_s % bi or d % rd or bi < 2:
        return f"tiles {t}: fuse {bi} must divide I = {inter} and I_shared = {inter_s}, fuse_rd {rd} D = {d}"
    if "nvfp4" in fmts and bi < 16:
        return f"tiles {t}: fuse {bi}: NVFP4 weights need slices of at least one 16-column group"
    if "fp8_block" in fmts and 128 % bi:
        return f"tiles {t}: fuse {bi} must divide 128 with FP8 weights (a slice in one block; FP8 down chunks take " \
               "at most 128 rows whatever fuse_rd is)"
    if t.meta or t.tok or t.dot or t.persist or t.persist2 or t.x2d or t.mma2 or t.hoist:
        return f"tiles {t}: fuse {bi} takes none of meta, tok, dot, persist, persist2, x2d, mma2, hoist"
    if t.wround and fmts - {"dense"}:
        return f"tiles {t}: fuse {bi} leaves the dequantized FP8 / NVFP4 weights unrounded: it needs wround 0, " \
               "as the one-token defaults of those formats have"
    if t.fuse_ahead < 0:
        return f"tiles {t}: fuse_ahead {t.fuse_ahead} < 0"
    return None


def moe_decode_split(x, w, ids, gate_up, down, s_gate, s_up, s_sig, shared_down, *, tiles, interpret=False):
    """`decode_pallas.moe_decode` with `tiles.fuse` > 0, after its `check` (which runs this module's): the experts
    in one launch split over I (module doc), then the combine. Arguments as there."""
    m, d = x.shape
    k = ids.shape[1]
    inter, inter_s = down.shape[-1], shared_down.shape[-1]
    dt = x.dtype
    e2m1 = dp._decode_only(tiles.e2m1)
    if interpret and e2m1 in ("asm", "asmq", "asmi"):     # the interpreter runs no PTX: the same values
        e2m1 = "f16"
    (sg, og), (su, ou), (ss, os_) = (kernel_math.window_operand(a, n, (m,), "moe_decode")
                                     for a, n in ((s_gate, inter_s), (s_up, inter_s), (s_sig, 1)))
    fmt1, w1, _ = reference.kernel_operands(gate_up)
    fmt2, w2, _ = reference.kernel_operands(down)
    fmt3, w3, _ = reference.kernel_operands(shared_down)
    flat = bool(tiles.flat) and m > 1
    n_slots, n_shared = m * k, (m if flat else 1)
    bi = tiles.fuse
    cw = min(tiles.cw, d)
    while d % cw:       # a power of two: for FP8 it divides 128 or is a multiple of it (`_rows_raw`'s scales)
        cw //= 2
    n_j = max(inter, inter_s) // bi
    y = stacked.call(
        functools.partial(_split_kernel, fmt1=fmt1, fmt2=fmt2, sfmt=fmt3, n1=len(w1), n2=len(w2), k=k,
                          n_slots=n_slots, d=d, inter=inter, inter_s=inter_s, bi=bi, cw=cw, rd=tiles.fuse_rd,
                          e2m1=e2m1, gsum=bool(tiles.gsum), offs=(og, ou), flat_slots=flat, ahead=tiles.fuse_ahead),
        (ids.reshape(-1).astype(jnp.int32), x, sg.astype(dt), su.astype(dt), *w1, *w2, *w3),
        out_shape=jax.ShapeDtypeStruct((n_slots + n_shared, n_j, d), F32), grid=(n_slots + n_shared, n_j),
        interpret=interpret, name="moe_decode_split",
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1))
    gate = reference.round_to(jax.nn.sigmoid(ss[:, os_].astype(F32)), dt)
    return _combine(y, w.reshape(-1), gate, m, k, flat, dt)


def _combine(y, rw, gate, m, k, flat, dt):
    """The layer's output from the split partials y [slots + shared rows, I/bi, D]: each row's down product summed
    over its slices and rounded, times its weight (routed: the routing weight; shared: round(sigmoid(gate logit)))
    and rounded; the routed terms summed in slot order per token, rounded, plus the shared term, rounded: the
    two-launch path's combine. XLA code, so its roundings are `reference.round_to` (kept under jit, where a convert
    pair may be elided as excess precision)."""
    n_slots, rows = m * k, (m if flat else 1)
    r = functools.partial(reference.round_to, dtype=dt)
    coef = jnp.concatenate([rw.astype(F32), gate.reshape(-1)])
    terms = r(r(jnp.sum(y, axis=1)) * coef[:, None])
    routed = jnp.sum(terms[:n_slots].reshape(rows, n_slots // rows, -1), axis=1)
    return (r(routed) + terms[n_slots:]).astype(dt)
