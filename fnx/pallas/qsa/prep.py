"""The QSA layer's work between its projections and the block choice, in one launch (op "qsa_prep").

At decode the model's jnp for it (`fnx.model.qsa.prep`, the reference) is a dozen small XLA kernels per QSA layer
and call: the RMS norms and RoPE of q, k, the indexer's queries and its pooled block keys, the scatters of the new
K/V rows and blocks into the state, the ring of raw indexer keys. Here one Pallas (Triton) kernel does all of it,
reading the projections in place in their (fused) product and writing the K/V rows and blocks into the state's
own buffers (`input_output_aliases`: a caller that donates the state pays no copy).

Grid (B, H + Hkv + 1). Program (b, j): j < H: query head j of row b's L tokens (norm, RoPE); H <= j < H + Hkv:
KV head j - H (k norm and RoPE, v as is, both stored at the tokens' positions); the last: the indexer (its query
heads' norm and RoPE; the raw keys after the ring, each touched block's mean, norm and RoPE, stored at its block;
the new ring). Each value is a row of head_dim (a power of two) computed as the reference does: fp32 inside, one
rounding per op where the model rounds (RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w); RoPE: round(round(x cos) +
round(rot(x) sin)), the rotate-half partner read by a second, permuted load). The reductions run in another order
than XLA's, so a value may differ from the reference by an ulp of its rounding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import grid_sync
from fnx.pallas.qsa.api import MAX_DECODE_TOKENS as MAX_TOKENS     # decode and the MTP verify window

F32 = jnp.float32
EARLY_ENV = "FNX_QSA_PREP_EARLY"
RING_ENV = "FNX_QSA_PREP_RING_INPLACE"     # 1: the new ring over the old one's buffer (needs early 1), see qsa_prep



def nbuf_rows(length: int, cr: int) -> int:
    """Rows of the indexer's raw-key buffer for a call of `length` tokens (fnx.model.qsa.indexer_blocks): the ring
    and the new keys at pos0 % cr fit whatever the phase, in whole blocks."""
    return cr * (-(-(2 * cr + length) // cr))


def why_not(hd: int, di: int, rot: int, length: int, cr: int) -> str | None:
    """Why the kernel does not serve these shapes (None when it does)."""
    for name, n in (("head_dim", hd), ("indexer_head_dim", di)):
        if n & (n - 1) or n < 16:
            return f"{name} {n} is not a power of two >= 16 (one row is one Triton tile)"
    if rot % 2 or not 0 < rot <= min(hd, di):
        return f"rotary dim {rot} must be even and at most head_dim and indexer_head_dim"
    if not 0 < length <= MAX_TOKENS:
        return f"{length} tokens: the kernel serves 1..{MAX_TOKENS} (decode and the MTP verify window)"
    if cr < 1:
        return f"compress ratio {cr} < 1"
    return None


def _partner(n, rot):
    """A row's columns and each one's rotate-half partner (itself past rot)."""
    cols = jnp.arange(n, dtype=jnp.int32)
    half = rot // 2
    return cols, jnp.where(cols < half, cols + half, jnp.where(cols < rot, cols - half, cols))


def _load_cos_sin(cos_ref, sin_ref, cs_base, cols, rot, inrot):
    at = cs_base + jnp.minimum(cols, rot - 1)
    return (plt.load(cos_ref.at[at], mask=inrot, other=0.0).astype(F32),
            plt.load(sin_ref.at[at], mask=inrot, other=0.0).astype(F32))


def _norm_rope_operands(row, w_ref, cos_ref, sin_ref, cs_base, *, n, rot):
    """Everything `_norm_rope` reads, loaded now (the `early` path: every load of a program before its arithmetic):
    (x, x at the partners, w, w at the partners, cos, sin)."""
    cols, partner = _partner(n, rot)
    return (row(cols), row(partner), w_ref[cols].astype(F32), w_ref[partner].astype(F32)) + \
        _load_cos_sin(cos_ref, sin_ref, cs_base, cols, rot, cols < rot)


def _norm_rope(row, w_ref, cos_ref, sin_ref, cs_base, *, n, rot, eps, dt, ops=None):
    """One row of n values: RMSNorm with (1 + w), then RoPE (rotate-half on the first rot columns, cos / sin at
    cs_base + column of a [.., rot] table), each op rounded to dt as the model does. row(cols) -> the row's values at
    `cols` (fp32 holding dt values). ops: `_norm_rope_operands`' values, loaded earlier (then the refs go unread)."""
    cols, partner = _partner(n, rot)
    half = rot // 2
    x, xp = (ops[0], ops[1]) if ops else (row(cols), row(partner))
    rstd = jax.lax.rsqrt(jnp.sum(x * x) / n + eps)
    y = ((x * rstd) * (1.0 + (ops[2] if ops else w_ref[cols].astype(F32)))).astype(dt).astype(F32)
    yp = ((xp * rstd) * (1.0 + (ops[3] if ops else w_ref[partner].astype(F32)))).astype(dt).astype(F32)
    inrot = cols < rot
    c, s = ops[4:] if ops else _load_cos_sin(cos_ref, sin_ref, cs_base, cols, rot, inrot)
    yp = jnp.where(cols < half, -yp, yp)
    r = ((y * c).astype(dt).astype(F32) + (yp * s).astype(dt).astype(F32)).astype(dt)
    return jnp.where(inrot, r, y.astype(dt))


def _kernel(qk_ref, qg_ref, kp_ref, vp_ref, qln_ref, kln_ref, qn_ref, kn_ref, cos_ref, sin_ref, bcos_ref, bsin_ref,
            pos_ref, nv_ref, ring_ref, _k_in, _v_in, _blk_in,
            q_ref, qi_ref, buf_ref, ring_out, k_ref, v_ref, blk_ref, *,
            length, h, hkv, hd, hi, di, rot, cr, cap, nbt, nbuf, eps, dt,
            qk_w, qk_s, qg_w, qg_s, kp_w, kp_s, vp_w, vp_s, early=0, ring_sync=False):
    b, j = pl.program_id(0), pl.program_id(1)
    pos0 = pos_ref[b]
    norm_rope = functools.partial(_norm_rope, eps=eps, dt=dt, rot=rot)
    operands = functools.partial(_norm_rope_operands, rot=rot)

    def window(ref, width, start):                       # token l's columns of a projection product, in place
        return lambda l, col0: (lambda cols: ref[(b * length + l) * width + start + col0 + cols].astype(F32))

    @pl.when(j < h)
    def _query_head():
        cols = jnp.arange(hd, dtype=jnp.int32)
        row = window(qg_ref, qg_w, qg_s)
        ops = [operands(row(l, j * 2 * hd), qn_ref, cos_ref, sin_ref, (b * length + l) * rot, n=hd)
               for l in range(length)] if early else None
        for l in range(length):                          # head j's query is columns [2hd j, 2hd j + hd)
            o = norm_rope(row(l, j * 2 * hd), qn_ref, cos_ref, sin_ref, (b * length + l) * rot, n=hd,
                          ops=ops[l] if early else None)
            q_ref[((b * length + l) * h + j) * hd + cols] = o

    @pl.when((j >= h) & (j < h + hkv))
    def _kv_head():
        g = j - h
        cols = jnp.arange(hd, dtype=jnp.int32)
        krow, vrow = window(kp_ref, kp_w, kp_s), window(vp_ref, vp_w, vp_s)
        if early:
            kops = [operands(krow(l, g * hd), kn_ref, cos_ref, sin_ref, (b * length + l) * rot, n=hd)
                    for l in range(length)]
            vals = [vrow(l, g * hd)(cols) for l in range(length)]
        for l in range(length):                          # positions past the capacity are dropped (mode="drop")
            t = pos0 + l
            ok = jnp.broadcast_to(t < cap, (hd,))
            at = ((b * hkv + g) * cap + jnp.minimum(t, cap - 1)) * hd + cols
            kv = norm_rope(krow(l, g * hd), kn_ref, cos_ref, sin_ref, (b * length + l) * rot, n=hd,
                           ops=kops[l] if early else None)
            plt.store(k_ref.at[at], kv.astype(k_ref.dtype), mask=ok)
            plt.store(v_ref.at[at], (vals[l] if early else vrow(l, g * hd)(cols)).astype(v_ref.dtype), mask=ok)

    @pl.when(j == h + hkv)
    def _indexer():
        cols = jnp.arange(di, dtype=jnp.int32)
        qrow = window(qk_ref, qk_w, qk_s)
        nbb = nbuf // cr

        def buf_row(r):
            """Row r (dynamic) of [ring; the new raw keys at pos0 % cr; zeros], at columns `cs`."""
            jn = r - off
            new = (jn >= 0) & (jn < length)
            old = jnp.logical_not(new) & (r < cr)

            def at(cs):
                a = plt.load(qk_ref.at[(b * length + jnp.clip(jn, 0, length - 1)) * qk_w + qk_s + hi * di + cs],
                             mask=jnp.broadcast_to(new, cs.shape), other=0.0)
                z = plt.load(ring_ref.at[(b * cr + jnp.clip(r, 0, cr - 1)) * di + cs],
                             mask=jnp.broadcast_to(old, cs.shape), other=0.0)
                return jnp.where(jnp.broadcast_to(new, cs.shape), a.astype(dt), z.astype(dt)).astype(F32)
            return at

        def pooled(cs, m, rows=None):
            """Block m's pooled key at columns cs: the mean of its cr rows (rows: those rows, loaded), rounded."""
            acc = rows[0] if rows else buf_row(jnp.int32(m * cr))(cs)
            for i in range(1, cr):
                acc = acc + (rows[i] if rows else buf_row(jnp.int32(m * cr + i))(cs))
            return (acc / cr).astype(dt).astype(F32)

        if early:      # every row this program reads, before its first store (see qsa_prep's `early`)
            qops = [[operands(qrow(l, e * di), qln_ref, cos_ref, sin_ref, (b * length + l) * rot, n=di)
                     for e in range(hi)] for l in range(length)]
            off = pos0 % cr
            bufv = [buf_row(jnp.int32(r))(cols) for r in range(nbuf)]
            ro = ((pos0 + nv_ref[b]) // cr - pos0 // cr) * cr
            ringv = [buf_row(ro + i)(cols) for i in range(cr)]
            # each block's operands: its pooled row from the rows above, at the partner columns from its rows read
            # again, permuted (a register row cannot be gathered), the k norm's weights, its cos / sin
            _, partner = _partner(di, rot)
            kw = (kln_ref[cols].astype(F32), kln_ref[partner].astype(F32))
            bops = [(pooled(cols, m, bufv[m * cr:(m + 1) * cr]), pooled(partner, m)) + kw +
                    _load_cos_sin(bcos_ref, bsin_ref, (b * nbb + m) * rot, cols, rot, cols < rot)
                    for m in range(nbb)]
        for l in range(length):
            for e in range(hi):
                o = norm_rope(qrow(l, e * di), qln_ref, cos_ref, sin_ref, (b * length + l) * rot, n=di,
                              ops=qops[l][e] if early else None)
                qi_ref[((b * length + l) * hi + e) * di + cols] = o
        if not early:
            off = pos0 % cr
        for r in range(nbuf):
            buf_ref[(b * nbuf + r) * di + cols] = (bufv[r] if early else buf_row(jnp.int32(r))(cols)).astype(dt)
        if not early:
            ro = ((pos0 + nv_ref[b]) // cr - pos0 // cr) * cr
        if ring_sync:     # the ring in place: every thread's loads of the old ring (all above, `early`) done first
            plt.debug_barrier()
        for i in range(cr):
            ring_out[(b * cr + i) * di + cols] = (ringv[i] if early else buf_row(ro + i)(cols)).astype(dt)
        for m in range(nbb):                             # each touched block: mean of its cr rows, norm, RoPE
            o = norm_rope(functools.partial(pooled, m=m), kln_ref, bcos_ref, bsin_ref, (b * nbb + m) * rot, n=di,
                          ops=bops[m] if early else None)
            n = pos0 // cr + m
            plt.store(blk_ref.at[(b * nbt + jnp.minimum(n, nbt - 1)) * di + cols], o.astype(blk_ref.dtype),
                      mask=jnp.broadcast_to(n < nbt, (di,)))


def qsa_prep(qk, qg, kp, vp, norms, cos, sin, bcos, bsin, pos0, n_valid, state, *, heads: int, kv_heads: int,
             head_dim: int, idx_heads: int, idx_dim: int, cr: int, eps: float, interpret: bool = False,
             num_warps: int = 4, early: int | None = None, ring_inplace: int | None = None):
    """The reference's contract (`fnx.model.qsa.prep`) in one launch.

    qk, qg, kp, vp: the projections' outputs as (buffer [B, L, W], start column) windows or arrays [B, L, n]:
    index_qk_proj [hi*di + di], q_proj [H * 2hd] (each head's query then its gate), k_proj, v_proj [Hkv*hd].
    norms: (indexer q_layernorm [di], indexer k_layernorm [di], q_norm [hd], k_norm [hd]). cos, sin [B, L, rot]
    for the tokens; bcos, bsin [B, nbuf / cr, rot] for the touched blocks' first positions ((pos0 // cr + m) * cr).
    pos0, n_valid [B]. state: {"k", "v" [B, Hkv, T, hd], "idx_blocks" [B, T / cr, di], "idx_ring" [B, cr, di]}.
    Returns (q [B, L, H, hd], q_idx [B, L, hi, di], new state, buf [B, nbuf, di]).

    early 1: each program reads everything it uses before its first arithmetic or store (None: `FNX_QSA_PREP_EARLY`,
    read when a program is traced, default 1 since the forty-first session: with the ring in place -4.5 us a
    4-layer step and -37.5 us a round on an H100, BENCHMARKS.md). As first written (early 0), each token's and each
    row's loads come after the previous one's stores (a load is never moved above a store that may alias it), so
    the indexer's program, which writes the raw-key buffer row by row, the ring and each touched block, and the head
    programs over several tokens chain one memory round trip per row. The same bits.

    ring_inplace 1 (None: `FNX_QSA_PREP_RING_INPLACE`, default: early's value; needs early 1): the new ring is
    written over the state's (input_output_aliases), so no copy kernel follows the launch (with 0 it goes to a new
    buffer, which XLA copies into the donated state: one memcpy per QSA layer and step). Only the indexer program
    reads the ring, and with `early` it reads all of it before its first store; a CTA barrier before the ring's
    stores makes every thread's loads come first. The same bits."""
    from fnx.pallas import stacked
    from fnx.pallas.kernel_math import window_operand
    kc, vc, blocks, ring = state["k"], state["v"], state["idx_blocks"], state["idx_ring"]
    bsz, hkv, cap, hd = kc.shape
    h, hi, di, rot = heads, idx_heads, idx_dim, cos.shape[-1]
    length = cos.shape[1]
    why = why_not(hd, di, rot, length, cr)
    if why is not None:
        raise NotImplementedError(f"qsa_prep kernel: {why}")
    if (hkv, hd) != (kv_heads, head_dim) or blocks.shape[-1] != di or ring.shape[1:] != (cr, di):
        raise ValueError(f"qsa_prep: state k {kc.shape}, idx_blocks {blocks.shape}, idx_ring {ring.shape} do not "
                         f"match {kv_heads} KV heads x {head_dim}, indexer dim {di}, compress ratio {cr}")
    nbuf = nbuf_rows(length, cr)
    if bcos.shape[1] != nbuf // cr:
        raise ValueError(f"qsa_prep: block tables for {bcos.shape[1]} blocks, a call of {length} tokens touches "
                         f"{nbuf // cr}")
    wins = []
    for a, size, what in ((qk, hi * di + di, "index_qk_proj"), (qg, h * 2 * hd, "q_proj"), (kp, hkv * hd, "k_proj"),
                          (vp, hkv * hd, "v_proj")):
        buf, start = window_operand(a, size, (bsz, length), what)
        wins.append((buf.reshape(-1), buf.shape[-1], start))
    dt = wins[1][0].dtype
    if cos.dtype != dt or bcos.dtype != dt:
        raise ValueError(f"qsa_prep: RoPE tables in {cos.dtype} / {bcos.dtype}, projections in {dt}")
    flat = lambda a: a.reshape(-1)
    # the norms may be layers of stacked params (`stacked.LayerRef`): read in place, as the other kernels do
    args = [w[0] for w in wins] + [stacked.flatten(n) for n in norms]
    args += [flat(cos), flat(sin), flat(bcos), flat(bsin), pos0.astype(jnp.int32), n_valid.astype(jnp.int32),
             flat(ring), flat(kc), flat(vc), flat(blocks)]
    nbt = blocks.shape[1]
    out_shape = [jax.ShapeDtypeStruct((bsz * length * h * hd,), dt),
                 jax.ShapeDtypeStruct((bsz * length * hi * di,), dt),
                 jax.ShapeDtypeStruct((bsz * nbuf * di,), dt),
                 jax.ShapeDtypeStruct((bsz * cr * di,), dt),          # as the reference: a slice of buf
                 jax.ShapeDtypeStruct((kc.size,), kc.dtype), jax.ShapeDtypeStruct((vc.size,), vc.dtype),
                 jax.ShapeDtypeStruct((blocks.size,), blocks.dtype)]
    n_in = len(args)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    params = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=num_warps, num_stages=1)}
    if early is None:
        early = int(grid_sync.knob(EARLY_ENV, default=True))
    if ring_inplace is None:
        ring_inplace = int(grid_sync.knob(RING_ENV, default=bool(early)))
    if ring_inplace and not early:
        raise ValueError(f"qsa_prep: the ring in place ({RING_ENV}=1) needs the early loads ({EARLY_ENV}=1): "
                         "without them the indexer program reads ring rows after storing others")
    kern = functools.partial(
        _kernel, early=int(early), ring_sync=bool(ring_inplace) and not interpret, length=length, h=h, hkv=hkv, hd=hd, hi=hi, di=di, rot=rot, cr=cr, cap=cap, nbt=nbt, nbuf=nbuf,
        eps=float(eps), dt=dt, qk_w=wins[0][1], qk_s=wins[0][2], qg_w=wins[1][1], qg_s=wins[1][2],
        kp_w=wins[2][1], kp_s=wins[2][2], vp_w=wins[3][1], vp_s=wins[3][2])
    q, qi, buf, ring_new, kc2, vc2, blk2 = stacked.call(
        kern, args, grid=(bsz, h + hkv + 1), in_specs=[whole] * n_in, out_specs=[whole] * len(out_shape),
        out_shape=out_shape,
        input_output_aliases={n_in - 3: 4, n_in - 2: 5, n_in - 1: 6, **({n_in - 4: 3} if ring_inplace else {})},
        interpret=interpret, name="qsa_prep", **params)
    st = {"k": kc2.reshape(kc.shape), "v": vc2.reshape(vc.shape), "idx_blocks": blk2.reshape(blocks.shape),
          "idx_ring": ring_new.reshape(ring.shape)}
    return (q.reshape(bsz, length, h, hd), qi.reshape(bsz, length, hi, di), st, buf.reshape(bsz, nbuf, di))
