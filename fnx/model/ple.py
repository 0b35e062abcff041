"""PLE layer (MODEL_SPEC.md section 8.5): hashed n-gram embeddings gate a value into every hyper-connection stream,
then a dilated causal depthwise conv adds local context. The n-gram ids come from `fnx.ple` (host, int64).

State: ple_conv [B, (K-1)*ngram_size, S*D], the last normed gated values (activation dtype)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fnx.model.gdn import causal_conv, window_of
from fnx.model.fuse import linears
from fnx.model.ops import rms_norm, div


def ple_layer(p: dict, h: jax.Array, rows: jax.Array, conv_state: jax.Array, cfg, n_valid: jax.Array):
    """h [B, L, S*D]; rows [B, L, ple_embed_dim] the concatenated n-gram table rows; n_valid [B] real tokens.
    Returns (out [B, L, S*D], new conv state, conv_x [B, S_conv+L, S*D] for rollback)."""
    s, d = cfg.hc_count, cfg.hidden_size
    eps = cfg.rms_norm_eps
    split = h.shape[:-1] + (s, d)
    e = rows.astype(h.dtype)
    key, value = linears(e, p, ("key_proj", "value_proj"))                  # fused or not
    key = rms_norm(key, p["norm_key"], eps, group=d).reshape(split)
    query = rms_norm(h, p["norm_query"], eps, group=d).reshape(split)
    gate = div(jnp.sum(key * query, axis=-1), d ** 0.5)             # [B, L, S]
    gate = jnp.sqrt(jnp.maximum(jnp.abs(gate), jnp.asarray(1e-6, h.dtype))) * jnp.sign(gate)
    gated = (jax.nn.sigmoid(gate)[..., None] * value[..., None, :]).reshape(h.shape)
    normed = rms_norm(gated, p["norm_conv"], eps, group=d)
    conv, conv_x = causal_conv(normed, conv_state, p["conv1d"], dilation=cfg.ngram_size)
    return gated + jax.nn.silu(conv), window_of(conv_state, normed, n_valid, conv_state.shape[1]), conv_x


def gather_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table [rows, width], ids [B, L, heads] -> [B, L, heads*width] in head order. A table handle with its own
    gather (`fnx.ple.store.UvaTable`: rows read by the GPU from pinned host memory) gathers itself."""
    if hasattr(table, "gather"):
        return table.gather(ids)
    r = jnp.take(table, ids, axis=0)
    return r.reshape(*ids.shape[:-1], ids.shape[-1] * table.shape[-1])
