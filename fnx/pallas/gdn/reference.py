"""Gated delta rule, token by token, in plain jnp: the numerical ground truth of `gdn_recurrent` and its fallback.

Shapes (the glossary's letters): B batch, T tokens of this call, HK key heads, HV value heads (a multiple of HK;
value head h reads key head h // (HV // HK), `jnp.repeat` order, as the HF model's `repeat_interleave`),
dk / dv key / value head dims. The state is fp32 [B, HV, dk, dv]."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
L2NORM_EPS = 1e-6


def softplus(x: jax.Array) -> jax.Array:
    """torch's softplus (beta 1, threshold 20)."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


CONV_SHIFTS_ENV = "FNX_CONV_SHIFTS"


def conv_shifts() -> bool:
    """Whether `causal_conv` reads each tap's window as its own concatenation of the state's tail and x's head
    (`FNX_CONV_SHIFTS`, read when a program is traced; on by default, `=0` turns it off) rather than as a slice
    of one concatenation cat(state, x): each such window has one reader, the conv, which XLA can then fuse it
    into, where the one concatenation with K readers is written out first (an H100 table of a 2,048-token prefill
    chunk: [1, 2,051, 10,240] at ~100 us a GDN or PLE layer, ~4x its bytes). The same values, summed in the same
    order; the concatenation is still returned (built only if a caller uses it: rollback's conv_x). Measured on
    the H200 (4 layers, 2026-12-06): a 512-token chunk 5,735 against 5,816 us of kernels, a 2,048-token chunk
    18,025 against 18,398."""
    v = os.environ.get(CONV_SHIFTS_ENV, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{CONV_SHIFTS_ENV}={v!r}: use 1 (a window per tap) or 0 (one concatenation)")
    return v == "1"


def causal_conv(x: jax.Array, state: jax.Array, w: jax.Array, dilation: int = 1):
    """Depthwise causal conv over cat(state, x) along time. x [B, L, C], state [B, S, C] with S = (K-1)*dilation,
    w [C, K] (w[:, K-1] multiplies the current token). Returns (conv out [B, L, C] rounded once, xcat
    [B, S+L, C]); the state after the first n tokens is `window_after(xcat, n, S)`."""
    length, taps = x.shape[1], w.shape[1]
    state = state.astype(x.dtype)
    xcat = jnp.concatenate([state, x], axis=1)
    shifts = conv_shifts()
    width = state.shape[1]
    acc = jnp.zeros(x.shape, F32)
    for j in range(taps):
        start = j * dilation
        if not shifts:
            win = xcat[:, start:start + length]
        elif start >= width:                    # the current token's tap: x itself
            win = x[:, start - width:start - width + length]
        else:                                   # the state's rows from `start`, then x's first rows
            win = jnp.concatenate([state[:, start:], x[:, :max(length - (width - start), 0)]], axis=1)[:, :length]
        acc = acc + win.astype(F32) * w[:, j].astype(F32)
    return acc.astype(x.dtype), xcat


def window_after(xcat: jax.Array, n: jax.Array, width: int) -> jax.Array:
    """The `width` rows of xcat [B, width+L, C] that end after n [B] new tokens: the state left by those tokens.
    One sequence (a prefill chunk, a decode or verify call of one slot): a dynamic slice; several: a gather (vmap).
    (An H100 prefill table of 2,048-token chunks had the vmap's gather of the 3-row conv window at ~100 us a GDN
    layer, for 61 KB.)"""
    if xcat.shape[0] == 1:
        return lax.dynamic_slice_in_dim(xcat, n[0], width, axis=1)
    return jax.vmap(lambda xc, k: lax.dynamic_slice_in_dim(xc, k, width, axis=0))(xcat, n)


def window_of(state: jax.Array, x: jax.Array, n: jax.Array, width: int) -> jax.Array:
    """`window_after(cat(state, x), n, width)` without the whole concatenation: state [B, width, C] (the window
    before the call), x [B, L, C] (this call's inputs), n [B] new tokens kept. One sequence with L >= width takes
    the window from x alone (n >= width) or from the first 2 width rows of the concatenation; the same rows, bit
    for bit. In a prefill chunk the concatenation's only other reader is then the conv, which XLA fuses it into
    (an H100 prefill table had the [1, 2,051, 10,240] concatenation written out: ~100 us a GDN layer and chunk)."""
    state = state.astype(x.dtype)
    if x.shape[0] != 1 or x.shape[1] < width:
        return window_after(jnp.concatenate([state, x], axis=1), n, width)
    n0 = n[0]
    late = lax.dynamic_slice_in_dim(x, jnp.maximum(n0 - width, 0), width, axis=1)
    head = jnp.concatenate([state, x[:, :width]], axis=1)
    early = lax.dynamic_slice_in_dim(head, jnp.minimum(n0, width), width, axis=1)
    return jnp.where(n0 >= width, late, early)


def l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis (the HF `l2norm`)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def delta_rule_recurrent(q, k, v, g, beta, state, keep_steps: bool = False):
    """Token by token. q, k [B, L, H, dk] (l2-normed, q scaled), v [B, L, H, dv], g, beta [B, L, H]; fp32.
    Returns (o [B, L, H, dv], final state [B, H, dk, dv]); with keep_steps also the state after every token
    [B, L, H, dk, dv] (what a speculative verify window rolls back to)."""
    def step(s, inp):
        qt, kt, vt, gt, bt = inp
        s = s * jnp.exp(gt)[..., None, None]
        kv = jnp.sum(s * kt[..., None], axis=-2)
        delta = (vt - kv) * bt[..., None]
        s = s + kt[..., None] * delta[..., None, :]
        o = jnp.sum(s * qt[..., None], axis=-2)
        return s, ((o, s) if keep_steps else o)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    state, out = lax.scan(step, state, xs)
    if keep_steps:
        return jnp.moveaxis(out[0], 0, 1), state, jnp.moveaxis(out[1], 0, 1)
    return jnp.moveaxis(out, 0, 1), state


def rms_norm_gated(x: jax.Array, gate: jax.Array, w: jax.Array, eps: float, act: str) -> jax.Array:
    """The GDN output norm (standard scale, not zero-centred) over the last axis, rounding to x.dtype after the
    norm, after the weight and after the gate; the model uses this one (`fnx.model.ops` re-exports it)."""
    dt = x.dtype
    x32 = x.astype(F32)
    h = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(dt)
    h = w.astype(dt) * h
    g32 = gate.astype(F32)
    g = jax.nn.sigmoid(g32) if act == "sigmoid" else jax.nn.silu(g32)
    return (h.astype(F32) * g).astype(dt)


def gdn_recurrent(q, k, v, g, beta, state, keep_steps: bool = False, *, scale: float | None = None,
                  qk_l2norm: bool = False, steps_with_initial: bool = False, out_dtype=F32, norm=None):
    """The `api.gdn_recurrent` contract in jnp (see there): key heads are repeated to the value heads, q/k cast to
    fp32, optionally l2-normed, q multiplied by `scale`, then `delta_rule_recurrent`; norm = (z, weight, eps, act)
    applies `rms_norm_gated` to the output rounded to out_dtype."""
    hk, hv = k.shape[2], v.shape[2]
    q, k, v = (t.astype(F32) for t in (q, k, v))
    if hv != hk:
        q, k = (jnp.repeat(t, hv // hk, axis=2) for t in (q, k))
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if scale is not None:
        q = q * scale
    res = delta_rule_recurrent(q, k, v, g.astype(F32), beta.astype(F32), state, keep_steps)
    o = res[0].astype(out_dtype)
    if norm is not None:
        o = rms_norm_gated(o, norm[0], norm[1], norm[2], norm[3])
    if not keep_steps:
        return o, res[1]
    steps = res[2]
    if steps_with_initial:
        steps = jnp.concatenate([state[:, None], steps], axis=1)
    return o, res[1], steps


def conv_and_gates(qkv, b, a, conv_state, conv_w, a_log, dt_bias, n_valid, *, key_heads: int, key_head_dim: int,
                   value_heads: int, split: bool = True):
    """The GDN layer's ops between its input projections and the recurrence, for L tokens: the causal conv and
    silu, split into q, k [B, L, HK, dk] and v [B, L, HV, dv], beta = sigmoid(b) and the log decay
    g = -exp(A_log) softplus(a + dt_bias) (fp32; both 0 on padding tokens past n_valid [B]).
    Returns (q, k, v, g, beta, conv_state after n_valid tokens, conv_x [B, K-1+L, C]); with split=False
    (conv [B, L, C], g, beta, conv_state, conv_x): the conv output whole, for a reader of its columns in place."""
    bsz, length, _ = qkv.shape
    conv, conv_x = causal_conv(qkv, conv_state, conv_w)
    conv_state = window_of(conv_state, qkv, n_valid, conv_state.shape[1])     # not from conv_x (see window_of)
    conv = jax.nn.silu(conv)
    beta = jax.nn.sigmoid(b)
    g = -jnp.exp(a_log.astype(F32)) * softplus(a.astype(F32) + dt_bias.astype(F32))
    valid = (jnp.arange(length)[None, :] < n_valid[:, None])[..., None]          # [B, L, 1]
    g = jnp.where(valid, g, 0.0)                                                   # padding: no decay, no write
    beta = jnp.where(valid, beta.astype(F32), 0.0)
    if not split:
        return conv, g, beta, conv_state, conv_x
    dk = key_head_dim                                      # C = 2 HK dk + HV dv
    q, k, v = jnp.split(conv, [key_heads * dk, 2 * key_heads * dk], axis=-1)
    q = q.reshape(bsz, length, key_heads, dk)
    k = k.reshape(bsz, length, key_heads, dk)
    v = v.reshape(bsz, length, value_heads, -1)
    return q, k, v, g, beta, conv_state, conv_x


def gdn_step(qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec, n_valid, *, key_heads: int, eps: float,
             act: str, recurrent=None):
    """One token per sequence through a GDN layer's core, between its input projections and out_proj:
    `conv_and_gates`, the gated delta rule (q, k l2-normed, q scaled by dk^-1/2) and the gated output norm. This
    is the model's decode path (`fnx.model.gdn.gdn_layer`).

    qkv [B, 1, C] (C = 2 HK dk + HV dv, before the conv), z [B, 1, HV, dv], b, a [B, 1, HV] (the projections'
    outputs, activation dtype); conv_state [B, K-1, C]; conv_w [C, K]; a_log, dt_bias [HV]; norm_w [dv];
    rec [B, HV, dk, dv] fp32; n_valid [B] (0: the slot's token is padding, both states stay as they are).
    recurrent: the gated-delta-rule function (`api.gdn_recurrent`, so its own dispatch applies; default this
    module's). Returns (o [B, 1, HV, dv] in qkv.dtype, conv_state, rec)."""
    recurrent = recurrent or gdn_recurrent
    hv, dv = z.shape[2], z.shape[3]
    q, k, v, g, beta, conv_state, _ = conv_and_gates(qkv, b, a, conv_state, conv_w, a_log, dt_bias, n_valid,
                                                     key_heads=key_heads,
                                                     key_head_dim=(qkv.shape[-1] - hv * dv) // (2 * key_heads),
                                                     value_heads=hv)
    o, rec = recurrent(q, k, v, g, beta, rec, scale=q.shape[-1] ** -0.5, qk_l2norm=True, out_dtype=qkv.dtype,
                       norm=(z, norm_w, eps, act))
    return o, conv_state, rec


def unit_lower_inverse(a: jax.Array, precision=lax.Precision.HIGHEST) -> jax.Array:
    """(I + L)^-1 for L the strictly lower triangle of a [..., C, C] (the diagonal and above are ignored), by
    matmuls only: recursive 2 x 2 block inversion, [[A, 0], [X, B]]^-1 = [[A^-1, 0], [-B^-1 X A^-1, B^-1]], from
    1 x 1 blocks up to C x C in ceil(log2 C) levels of batched matmuls. Every intermediate is a block of the
    inverse itself, so nothing grows beyond the inverse's own entries (a Neumann-series product, also matmuls
    only, lost 6x the tolerance on the trained fnx-mini model: the powers of L grow large and cancel).
    Why not LAPACK's triangular solve: on the CPU it is a custom call that waits on XLA's intra-op pool from inside
    it, and two devices of one process running it at once on a 2-core host deadlocked the pool (the 2-process
    jax.distributed forward)."""
    c = a.shape[-1]
    size = 1 << max(c - 1, 0).bit_length()                     # the next power of two (1 for c = 1)
    m = jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), a, 0)
    if size != c:                                              # pad with identity rows: no coupling, unit diagonal
        m = jnp.pad(m, [(0, 0)] * (m.ndim - 2) + [(0, size - c), (0, size - c)])
    batch = m.shape[:-2]
    mm = lambda x, y: jnp.matmul(x, y, precision=precision)     # noqa: E731
    blocks = jnp.ones((*batch, size, 1, 1), a.dtype)            # the inverse's diagonal blocks, s x s each
    s = 1
    while s < size:
        nb = size // (2 * s)
        pairs = blocks.reshape(*batch, nb, 2, s, s)
        inv_a, inv_b = pairs[..., 0, :, :], pairs[..., 1, :, :]
        # the coupling block of each pair: rows of its second half, columns of its first half
        diag = jnp.diagonal(m.reshape(*batch, nb, 2 * s, nb, 2 * s), axis1=-4, axis2=-2)   # [..., 2s, 2s, nb]
        x = jnp.moveaxis(diag, -1, -3)[..., s:, :s]                                      # [..., nb, s, s]
        low = -mm(mm(inv_b, x), inv_a)
        top = jnp.concatenate([inv_a, jnp.zeros_like(inv_a)], axis=-1)
        bottom = jnp.concatenate([low, inv_b], axis=-1)
        blocks = jnp.concatenate([top, bottom], axis=-2)                                 # [..., nb, 2s, 2s]
        s *= 2
    return blocks[..., 0, :c, :c]


def chunk_prep(q, k, v, g, beta, chunk: int, precision=lax.Precision.HIGHEST, apart=lambda a: a):
    """The per-chunk part of the chunked (WY / UT) gated delta rule, batched over the chunks (XLA's products): q
    [B, L, H, dk] (already scaled), k [B, L, H, dk], v [B, L, H, dv], g (log decay) and beta [B, L, H], L padded to
    N chunks of `chunk` tokens with zeros. Returns `chunk_scan`'s operands: new_values [B, H, N, C, dv], k_cumdecay
    [B, H, N, C, dk] (inv (k_beta decay)), q decayed [B, H, N, C, dk], intra [B, H, N, C, C] (q k^T with the pair
    decays), k decayed to the chunk's end [B, H, N, C, dk], chunk_decay [B, H, N]; all fp32. `precision`: the
    products'; `apart`: what the second product of a pair sharing an operand reads it through (the model's
    optimization barrier keeps XLA from merging the pair)."""
    b, length, h, dk = k.shape
    pad = (-length) % chunk
    tr = lambda a: jnp.moveaxis(a, 1, 2)                    # [B, H, L, ...]  # noqa: E731
    q, k, v, g, beta = (tr(a) for a in (q, k, v, g, beta))
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, 0), (0, pad))) for a in (g, beta))
    n = (length + pad) // chunk
    split = lambda a: a.reshape(b, h, n, chunk, *a.shape[3:])     # noqa: E731
    v_beta, k_beta = split(v * beta[..., None]), split(k * beta[..., None])
    q, k = split(q), split(k)
    cum = jnp.cumsum(split(g), axis=-1)                     # [B, H, N, C]
    upper = jnp.triu(jnp.ones((chunk, chunk), bool), 1)
    pair = jnp.exp(jnp.where(upper, -jnp.inf, cum[..., :, None] - cum[..., None, :]))
    mm = lambda a, c: jnp.matmul(a, c, precision=precision)     # noqa: E731
    k_t = jnp.swapaxes(k, -1, -2)
    ut = mm(k_beta, k_t) * pair
    intra = mm(q, apart(k_t)) * pair
    decayed_k_beta = k_beta * jnp.exp(cum)[..., None]
    inv = unit_lower_inverse(ut, precision)
    new_values, k_cumdecay = mm(inv, v_beta), mm(apart(inv), decayed_k_beta)
    q = q * jnp.exp(cum)[..., None]
    k = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])                     # [B, H, N]
    return new_values, k_cumdecay, q, intra, k, chunk_decay


def chunk_scan(new_values, k_cumdecay, q, intra, k, chunk_decay, state):
    """The sequential part of the chunked (WY / UT) form, over N chunks of C tokens, in fp32 at HIGHEST precision.
    Per chunk n: v_new = nv_n - kcd_n S; o_n = q_n S + intra_n v_new; S = S * decay_n + k_n^T v_new.

    new_values [B, H, N, C, dv]; k_cumdecay, q, k [B, H, N, C, dk]; intra [B, H, N, C, C]; chunk_decay [B, H, N]
    (exp of the chunk's summed log decay); state [B, H, dk, dv]. Returns (o [B, H, N, C, dv], the final state)."""
    mm = lambda a, c: jnp.matmul(a, c, precision=lax.Precision.HIGHEST)  # noqa: E731

    def step(s, inp):
        nv, kcd, qi, ia, ki, cd = inp
        v_new = nv - mm(kcd, s)
        out = mm(qi, s) + mm(ia, v_new)
        s = s * cd[..., None, None] + mm(jnp.swapaxes(ki, -1, -2), v_new)
        return s, out

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (new_values, k_cumdecay, q, intra, k, chunk_decay))
    state, o = lax.scan(step, state, xs)                     # o [N, B, H, C, dv]
    return jnp.moveaxis(o, 0, 2), state
