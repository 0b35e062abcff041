"""Gated delta rule, token by token, in plain jnp: the numerical ground truth of `gdn_recurrent` and its fallback.

Shapes (the glossary's letters): B batch, T tokens of this call, HK key heads, HV value heads (a multiple of HK;
value head h reads key head h // (HV // HK), `jnp.repeat` order, as the HF model's `repeat_interleave`),
dk / dv key / value head dims. The state is fp32 [B, HV, dk, dv]."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
L2NORM_EPS = 1e-6


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
