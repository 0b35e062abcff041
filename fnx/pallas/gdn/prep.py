"""Op "gdn_chunk_prep": the per-chunk part of the chunked gated delta rule (prefill) in one launch, one program
per (sequence, value head, chunk of C tokens), where XLA runs it as ~30 kernels a layer (the cumulative decay, the
pair decays, the batched intra-chunk products, the unit-lower inverse's levels, the scalings, transposes and
pads). `reference.chunk_prep` is the arithmetic; the outputs are `chunk_scan`'s operands, in its layout.

A program reads its chunk's rows of q, k, v, g and beta straight from the model's [B, L, H, d] arrays (rows past
L read as zeros: the reference's padding) in blocks of R = 16 rows, and works on 16 x 16 blocks throughout (the
Triton lowering cannot slice a register tile, so no tile is ever cut: every block is its own load or product):

- cum: the in-chunk cumulative log decay, per block (a masked row sum) plus the blocks before it;
- A_ij = (k_beta_i k_j^T) * exp(cum_i - cum_j) (strictly lower on the diagonal blocks), intra_ij = (q_i k_j^T) *
  exp(cum_i - cum_j) (lower with the diagonal; zero blocks above);
- X = (I + A)^-1 by blocks: X_ii by forward substitution over its 16 rows, X_ij = -X_ii sum_m A_im X_mj;
- new_values_i = sum_j X_ij v_beta_j, k_cumdecay_i = sum_j X_ij (k_beta_j exp(cum_j)), q_i exp(cum_i), k_i
  exp(cum_last - cum_i), exp(cum_last).

The products' precision is the chunk scan's (`ScanTiles.precision`: "tf32x3" by default, "ieee", "tf32"); the
interpreter computes them at fp32. Off by default (not measured yet): FNX_KERNELS=gdn_chunk_prep=pallas."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import pdl

F32 = jnp.float32
R = 16              # rows per block (the tensor cores' smallest M, N and K)


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, nv_ref, kcd_ref, qo_ref, ia_ref, ko_ref, cd_ref, *,
            length, heads, rep, chunk, dk, dv, precision):
    b, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nb = chunk // R
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=F32)
    rr = jnp.arange(R, dtype=jnp.int32)
    ck, cv = jnp.arange(dk, dtype=jnp.int32), jnp.arange(dv, dtype=jnp.int32)
    lower = rr[:, None] >= rr[None, :]
    strict = rr[:, None] > rr[None, :]

    def rows(i, key=False):
        """The block's tokens: in range, and their rows in a value-head array (or, `key`, a key-head one)."""
        t = n * chunk + i * R + rr
        tc = b * length + jnp.minimum(t, length - 1)
        return t < length, (tc * (heads // rep) + h // rep) if key else (tc * heads + h)

    def load(ref, i, d, cols, key=False):
        ok, row = rows(i, key)
        at = (row[:, None], cols[None, :])
        return plt.load(ref.at[at], mask=jnp.broadcast_to(ok[:, None], (R, d)), other=0.0).astype(F32)

    def load_vec(ref, i):
        ok, row = rows(i)
        return plt.load(ref.at[row], mask=ok, other=0.0).astype(F32)

    # the cumulative log decay: each block's own prefix sums plus the blocks before it
    cum, off = [], jnp.zeros((), F32)
    for i in range(nb):
        gi = load_vec(g_ref, i)
        cum.append(off + jnp.sum(jnp.where(lower, gi[None, :], 0.0), axis=1))
        off = off + jnp.sum(gi)
    last = off                                                   # the chunk's summed log decay
    beta = [load_vec(b_ref, i) for i in range(nb)]
    out = functools.partial(_store, n=n, b=b, h=h)
    a_blk = {}
    for i in range(nb):
        # a row block's q and k, and each earlier key block read again (L1 / L2) rather than all kept live
        qi, ki = load(q_ref, i, dk, ck, key=True), load(k_ref, i, dk, ck, key=True)
        kbi = ki * beta[i][:, None]
        for j in range(i + 1):
            kj = ki if j == i else load(k_ref, j, dk, ck, key=True)
            diff = cum[i][:, None] - cum[j][None, :]
            pair = jnp.exp(jnp.where(lower, diff, -jnp.inf)) if i == j else jnp.exp(diff)
            a = dot(kbi, kj.T) * pair
            a_blk[i, j] = jnp.where(strict, a, 0.0) if i == j else a
            out(ia_ref, i, j, dot(qi, kj.T) * pair)
        for j in range(i + 1, nb):
            out(ia_ref, i, j, jnp.zeros((R, R), F32))
        out(qo_ref, i, None, qi * jnp.exp(cum[i])[:, None])
        out(ko_ref, i, None, ki * jnp.exp(last - cum[i])[:, None])
    # X = (I + A)^-1, block lower triangular: the diagonal blocks by forward substitution over their rows
    x_blk = {}
    for i in range(nb):
        a = a_blk[i, i]
        x = jnp.zeros((R, R), F32)
        for r in range(R):
            ar = jnp.sum(jnp.where(rr[:, None] == r, a, 0.0), axis=0)               # row r of A_ii: [R] over c
            xr = (rr == r).astype(F32) - jnp.sum(ar[:, None] * x, axis=0)            # e_r - sum_c A_rc X_c
            x = jnp.where(rr[:, None] == r, xr[None, :], x)
        x_blk[i, i] = x
    for i in range(1, nb):
        for j in range(i - 1, -1, -1):
            acc = dot(a_blk[i, j], x_blk[j, j])
            for m in range(j + 1, i):
                acc = acc + dot(a_blk[i, m], x_blk[m, j])
            x_blk[i, j] = -dot(x_blk[i, i], acc)
    # the products with X, a row block at a time (v's and k's blocks read again for each, from L1 / L2, rather
    # than kept live in registers through the whole program)
    for i in range(nb):
        nv = kcd = None
        for j in range(i + 1):
            vb = load(v_ref, j, dv, cv) * beta[j][:, None]
            kbd = load(k_ref, j, dk, ck, key=True) * beta[j][:, None] * jnp.exp(cum[j])[:, None]
            pv, pk = dot(x_blk[i, j], vb), dot(x_blk[i, j], kbd)
            nv, kcd = (pv, pk) if nv is None else (nv + pv, kcd + pk)
        out(nv_ref, i, None, nv)
        out(kcd_ref, i, None, kcd)
    cd_ref[b, h, n] = jnp.exp(last)


def _store(ref, i, j, val, *, n, b, h):
    rows = pl.ds(i * R, R)
    if j is None:
        ref[b, h, n, rows, :] = val
    else:
        ref[b, h, n, rows, pl.ds(j * R, R)] = val


def chunk_prep(q, k, v, g, beta, chunk: int, *, precision, interpret: bool = False, num_warps: int = 4,
               rep: int = 1):
    """`reference.chunk_prep` in one launch (shapes checked by `api.gdn_chunk_prep`): q, k [B, L, H / rep, dk]
    (value head h reads key head h // rep), v [B, L, H, dv], g, beta [B, L, H] (any float dtype; computed in
    fp32); the outputs fp32 in `chunk_scan`'s layout, per value head."""
    bsz, length, h, dv = v.shape
    dk = k.shape[-1]
    n = -(-length // chunk)
    flat = lambda a: a.reshape(-1, *a.shape[3:])     # noqa: E731  (free: rows of (b, t, head))
    shapes = [(bsz, h, n, chunk, dv), (bsz, h, n, chunk, dk), (bsz, h, n, chunk, dk), (bsz, h, n, chunk, chunk),
              (bsz, h, n, chunk, dk), (bsz, h, n)]
    params = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=num_warps, num_stages=1)}
    return pdl.pallas_call(
        functools.partial(_kernel, length=length, heads=h, rep=rep, chunk=chunk, dk=dk, dv=dv,
                          precision=lax.Precision.HIGHEST if interpret else precision),
        grid=(bsz, h, n),
        out_shape=tuple(jax.ShapeDtypeStruct(s, F32) for s in shapes),
        interpret=interpret, name="gdn_chunk_prep", **params,
    )(flat(q), flat(k), flat(v), flat(g), flat(beta))
