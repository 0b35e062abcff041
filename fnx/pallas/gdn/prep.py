"""Op "gdn_chunk_prep": the per-chunk part of the chunked gated delta rule (prefill) in one launch, one program
per (sequence, value head, chunk of C tokens), where XLA runs it as ~30 kernels a layer (the cumulative decay, the
pair decays, the batched intra-chunk products, the unit-lower inverse's levels, the scalings, transposes and
pads). `reference.chunk_prep` is the arithmetic; the outputs are `chunk_scan`'s operands, in its layout.

A program reads its chunk's rows of q, k, v, g and beta straight from the model's [B, L, H, d] arrays (rows past
L read as zeros: the reference's padding; q and k per key head) and works on whole [C, C] tiles and [C, BD]
column blocks of the [C, d] ones (C a power of two, 64 in the model; BD `PrepTiles.block_d`), every product a
tensor-core dot:

- cum: the in-chunk cumulative log decay (a masked row sum of a [C, C] tile), pair_ij = exp(cum_i - cum_j) on the
  lower triangle;
- A = (k_beta k^T) * pair strictly lower, intra = (q k^T) * pair;
- X = (I + A)^-1 by the reference's doubling, with masks in place of slices: X holds the inverse's diagonal
  blocks of s x s; the coupling blocks of each 2s x 2s block (rows of its second half, columns of its first)
  are L_s = A masked there, and X - (X L_s) X is the inverse's diagonal blocks of 2s x 2s (1 -> C in log2 C
  levels, two [C, C, C] products each from s = 2; every intermediate a block of the inverse, as the reference);
- new_values = X v_beta, k_cumdecay = X (k_beta exp(cum)), q exp(cum), k exp(cum_last - cum), exp(cum_last).

The products' precision is the chunk scan's (`ScanTiles.precision`: "tf32" by default, "tf32x3", "ieee"); the
interpreter computes them at fp32. Column blocks, warps and stages: `PrepTiles`, FNX_GDN_PREP_TILES. H100, 2,048
tokens, 48 heads (fiftieth session): 284 us a layer with "tf32" products against XLA's 592, so "auto" runs it
there; with "tf32x3" 834 us (1,586 at 8 warps), so "auto" keeps XLA's (`api.chunk_prep_auto_reason`).

The first form (the forty-ninth session) worked on 16 x 16 blocks with a forward substitution over each diagonal
block's rows: ~100 small dots and 64 dependent row steps a program, 255 registers with spills under "tf32x3"; on an
H100 it took 7.0 ms a layer at 2,048 tokens ("tf32" 0.69 ms) against XLA's ~0.53 ms (BENCHMARKS, fiftieth
session)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import pdl

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class PrepTiles:
    block_d: int = 32       # BD: the head-dim columns of q, k, v a product reads at a time (a power of two >= 16;
                            # 64: 292 us against 284)
    num_warps: int = 4      # H100, 2,048 tokens: "tf32" 284 us a layer (422 at 8 warps), "tf32x3" 834 (1,586)
    num_stages: int = 1
    # 1: the model's prefill hands the kernel the conv output, which it reads q, k and v from in place, l2-norming q
    # and k itself (`api.gdn_chunk_prep_conv`): XLA's split, conversion and l2norm kernels go (~90 us a GDN layer at
    # 2,048 tokens on the H100); 0: XLA makes q, k and v first. Off: measured slower (H100, fifty-first session: the
    # kernel 1,103 against 746 us for three layers, the 4-layer 2,048-token chunk +3.2%)
    in_place: int = 0
    # 1: the column-block passes over q, k and v as loops in the kernel (one block's tiles live at a time), where 0
    # unrolls them and the build issues every block's loads at once: stock sm_90 build, "tf32", 2,048 tokens: 4,944
    # instructions and no spills against 5,856 and 85 (both near 255 registers). Off: the kernel 691 against 746 us
    # for three layers, the chunk -0.5% (inside the spread; H100, fifty-first session)
    loop: int = 0


PREP_TILES_ENV = "FNX_GDN_PREP_TILES"     # a benchmark knob: fields replaced in the chunk prep's default tiles


def prep_tiles() -> PrepTiles:
    """The chunk prep's tiles, with the fields FNX_GDN_PREP_TILES names replaced (e.g. "num_warps=4"; read when
    a program is traced)."""
    t = PrepTiles()
    spec = os.environ.get(PREP_TILES_ENV, "").strip()
    if spec:
        from fnx.pallas import dispatch
        t = dataclasses.replace(t, **dispatch.fields_override(spec, PrepTiles, PREP_TILES_ENV))
    return t


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, nv_ref, kcd_ref, qo_ref, ia_ref, ko_ref, cd_ref, *,
            length, heads, rep, chunk, dk, dv, bd, precision, conv=None, loop=0):
    b, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=F32)
    rr = jnp.arange(chunk, dtype=jnp.int32)
    ri, rj = rr[:, None], rr[None, :]
    lower, strict = ri >= rj, ri > rj
    t = n * chunk + rr
    ok = t < length
    tc = b * length + jnp.minimum(t, length - 1)
    grow = tc * heads + h                                   # g and beta: rows of (b, t, value head)
    if conv is None:        # q, k [B * L * HK, dk], v [B * L * H, dv]
        vrow, krow = grow, tc * (heads // rep) + h // rep
        qoff = koff = voff = 0
    else:                   # q, k and v the conv output's columns [B * L, 2 HK dk + H dv]
        vrow = krow = tc
        hk = heads // rep
        qoff, koff, voff = (h // rep) * dk, (hk + h // rep) * dk, 2 * hk * dk + h * dv

    def load_raw(ref, row, off, j):
        """Columns off + [j * bd, (j + 1) * bd) of the chunk's rows."""
        cols = off + j * bd + jnp.arange(bd, dtype=jnp.int32)
        return plt.load(ref.at[row[:, None], cols[None, :]], mask=jnp.broadcast_to(ok[:, None], (chunk, bd)),
                        other=0.0).astype(F32)

    def blocks(count, step, zeros):
        """step(j, carry) over the column blocks j < count, carrying sums: a loop in the kernel from `zeros`, or
        unrolled (`PrepTiles.loop`) from block 0's own terms (no sum with zeros: Pallas gives each product a zero
        accumulator, and an added one is one more FADD an element)."""
        if loop:
            return lax.fori_loop(0, count, step, zeros)
        acc = None
        for j in range(count):
            acc = step(j, acc)
        return acc

    def add(acc, *terms):
        return terms if acc is None else tuple(a + t for a, t in zip(acc, terms))

    if conv is None:
        rq = rk = None
    else:                   # the l2norm's row scales: a pass over the column blocks first
        def norm_step(j, acc):
            qj, kj = load_raw(q_ref, krow, qoff, j), load_raw(k_ref, krow, koff, j)
            return add(acc, jnp.sum(qj * qj, axis=1), jnp.sum(kj * kj, axis=1))

        zr = jnp.zeros((chunk,), F32)
        sq, sk = blocks(dk // bd, norm_step, (zr, zr))
        rq, rk = lax.rsqrt(sq + conv.eps), lax.rsqrt(sk + conv.eps)

    def load_q(j):          # column block j of the chunk's q rows (in place: l2-normed, then scaled)
        x = load_raw(q_ref, krow, qoff, j)
        return x if rq is None else (x * rq[:, None]) * conv.scale

    def load_k(j):          # ... of k (in place: l2-normed)
        x = load_raw(k_ref, krow, koff, j)
        return x if rk is None else x * rk[:, None]

    def load_v(j):
        return load_raw(v_ref, vrow, voff, j)

    def store(ref, j, val):
        ref[b, h, n, :, pl.ds(j * bd, bd)] = val

    g = plt.load(g_ref.at[grow], mask=ok, other=0.0).astype(F32)
    beta = plt.load(b_ref.at[grow], mask=ok, other=0.0).astype(F32)
    cum = jnp.sum(jnp.where(lower, g[None, :], 0.0), axis=1)             # in-chunk cumulative log decay
    last = jnp.sum(g)
    # k k^T and q k^T summed over column blocks of BD (a [C, BD] tile of each live at a time, not [C, dk])
    def kq_step(j, acc):
        kj, qj = load_k(j), load_q(j)
        store(qo_ref, j, qj * jnp.exp(cum)[:, None])
        store(ko_ref, j, kj * jnp.exp(last - cum)[:, None])
        return add(acc, dot(kj * beta[:, None], kj.T), dot(qj, kj.T))

    zero = jnp.zeros((chunk, chunk), F32)
    kk, qk = blocks(dk // bd, kq_step, (zero, zero))
    pair = jnp.exp(jnp.where(lower, cum[:, None] - cum[None, :], -jnp.inf))
    ia_ref[b, h, n] = qk * pair
    a = jnp.where(strict, kk * pair, 0.0)
    # X = (I + A)^-1: the pairs of 1 x 1 blocks need no product, then doubling with masked coupling blocks
    x = jnp.where(ri == rj, 1.0, 0.0) - jnp.where((ri // 2 == rj // 2) & strict, a, 0.0)
    s = 2
    while s < chunk:
        couple = (ri // (2 * s) == rj // (2 * s)) & (ri // s != rj // s)
        x = x - dot(dot(x, jnp.where(couple, a, 0.0)), x)
        s *= 2
    # v and k read again, a column block at a time (from L2)
    def nv_step(j, c):
        store(nv_ref, j, dot(x, load_v(j) * beta[:, None]))
        return c

    kscale = (beta * jnp.exp(cum))[:, None]

    def kcd_step(j, c):
        store(kcd_ref, j, dot(x, load_k(j) * kscale))
        return c

    blocks(dv // bd, nv_step, ())
    blocks(dk // bd, kcd_step, ())
    cd_ref[b, h, n] = jnp.exp(last)


@dataclasses.dataclass(frozen=True)
class ConvInput:
    """q, k and v read in place from the GDN conv output [B, L, 2 HK dk + H dv] (after its silu): q and k
    l2-normed in the kernel (x rsqrt(sum x^2 + eps), fp32), q then multiplied by `scale`."""
    key_heads: int
    key_dim: int
    scale: float
    eps: float


def chunk_prep(q, k, v, g, beta, chunk: int, *, precision, interpret: bool = False, tiles: PrepTiles | None = None,
               rep: int = 1, conv: ConvInput | None = None):
    """`reference.chunk_prep` in one launch (shapes checked by `api.gdn_chunk_prep`): q, k [B, L, H / rep, dk]
    (value head h reads key head h // rep), v [B, L, H, dv], g, beta [B, L, H] (any float dtype; computed in
    fp32); the outputs fp32 in `chunk_scan`'s layout, per value head. With `conv`: q is the conv output
    [B, L, 2 HK dk + H dv] (k and v None; H = HK x rep), read in place (`api.gdn_chunk_prep_conv`)."""
    flat = lambda a: a.reshape(-1, *a.shape[3:])     # noqa: E731  (free: rows of (b, t, head))
    if conv is None:
        bsz, length, h, dv = v.shape
        dk = k.shape[-1]
        q, k, v = flat(q), flat(k), flat(v)
    else:
        bsz, length, width = q.shape
        h, dk = conv.key_heads * rep, conv.key_dim
        dv = (width - 2 * conv.key_heads * dk) // h
        if dv <= 0 or 2 * conv.key_heads * dk + h * dv != width:
            raise ValueError(f"gdn_chunk_prep: a conv output of {width} columns is not 2 x {conv.key_heads} x {dk} "
                             f"+ {h} value heads")
        q = k = v = q.reshape(bsz * length, width)
    n = -(-length // chunk)
    shapes = [(bsz, h, n, chunk, dv), (bsz, h, n, chunk, dk), (bsz, h, n, chunk, dk), (bsz, h, n, chunk, chunk),
              (bsz, h, n, chunk, dk), (bsz, h, n)]
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"gdn_chunk_prep: the kernel's whole-chunk tiles need a power-of-two chunk >= 16, got {chunk}")
    t = prep_tiles() if tiles is None else tiles
    bd = min(t.block_d, dk, dv)
    if bd < 16 or bd & (bd - 1) or dk % bd or dv % bd:
        raise ValueError(f"gdn_chunk_prep: block_d {t.block_d} must be a power of two >= 16 dividing dk {dk} and "
                         f"dv {dv}")
    params = {} if interpret else {
        "compiler_params": plt.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)}
    return pdl.pallas_call(
        functools.partial(_kernel, length=length, heads=h, rep=rep, chunk=chunk, dk=dk, dv=dv, bd=bd,
                          precision=lax.Precision.HIGHEST if interpret else precision, conv=conv, loop=t.loop),
        grid=(bsz, h, n),
        out_shape=tuple(jax.ShapeDtypeStruct(s, F32) for s in shapes),
        interpret=interpret, name="gdn_chunk_prep", **params,
    )(q, k, v, flat(g), flat(beta))
