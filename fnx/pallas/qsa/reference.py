"""QSA sparse decode attention, plain jnp: softmax attention of each query over only its selected KV tokens.

The numerics follow the model's masked dense path (fnx/model/qsa.py, MODEL_SPEC.md 6.3): scores accumulated in
fp32 and rounded to the input dtype, scaled by hd**-0.5 in fp32 and rounded again, softmax in fp32, probabilities
rounded to the input dtype before the PV product (fp32 accumulation, one rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def gather_tokens(cache: jax.Array, idx: jax.Array) -> jax.Array:
    """cache [B, Hkv, S, hd], idx [B, L, N] (non-negative) -> [B, Hkv, L, N, hd]."""
    return jax.vmap(lambda c, i: c[:, i])(cache, idx)


def qsa_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, idx: jax.Array) -> jax.Array:
    """q [B, L, Hq, hd]; k_cache, v_cache [B, Hkv, S, hd]; idx [B, L, N] int32 token positions, -1 = unused slot.
    Query head h reads KV head h // (Hq // Hkv). Returns o [B, L, Hq, hd] in q.dtype; a query with no valid slot
    gets zeros."""
    dt = q.dtype
    bsz, length, hq, hd = q.shape
    hkv = k_cache.shape[1]
    valid = idx >= 0
    safe = jnp.where(valid, idx, 0)
    kg = gather_tokens(k_cache, safe).astype(dt)
    vg = gather_tokens(v_cache, safe).astype(dt)
    qh = q.reshape(bsz, length, hkv, hq // hkv, hd)
    s = jnp.einsum("blgrd,bglnd->bgrln", qh, kg, precision=lax.Precision.HIGHEST,
                   preferred_element_type=F32).astype(dt)
    s = (s.astype(F32) * (hd ** -0.5)).astype(dt).astype(F32)
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)
    den = jnp.sum(e, axis=-1, keepdims=True)
    probs = (e / jnp.where(den > 0, den, 1.0)).astype(dt)
    o = jnp.einsum("bgrln,bglnd->blgrd", probs, vg, precision=lax.Precision.HIGHEST,
                   preferred_element_type=F32).astype(dt)
    return o.reshape(bsz, length, hq, hd)


def qsa_index_scores(q_idx: jax.Array, blocks: jax.Array, positions: jax.Array, cr: int) -> jax.Array:
    """Indexer block scores [B, L, NB] fp32: sum_h relu(q_h . k_b) / sqrt(di) (fp32 products of the bf16 values),
    -inf where block b is not complete at the query (b * cr + cr - 1 > position).
    q_idx [B, L, Hi, di] (normed, RoPE'd); blocks [B, NB, di] (pooled block keys); positions [B, L]."""
    s = jnp.einsum("blhd,bnd->blhn", q_idx.astype(F32), blocks.astype(F32), precision=lax.Precision.HIGHEST)
    s = jnp.sum(jax.nn.relu(s), axis=2) / jnp.sqrt(jnp.asarray(q_idx.shape[-1], F32))
    nb = jnp.arange(blocks.shape[1], dtype=jnp.int32)
    valid = (nb * cr + cr - 1)[None, None, :] <= positions[..., None]
    return jnp.where(valid, s, -jnp.inf)
