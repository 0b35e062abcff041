"""Hyper-connections (MODEL_SPEC.md section 4): the gated residual before each sublayer, the combine after it,
and the final mixer. H [..., S*D] holds S streams, stream-major (stream j is H[..., j*D:(j+1)*D])."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fnx.model.ops import linear, rms_norm, div


def gated_residual(p: dict, h: jax.Array, streams: int, eps: float, inject: bool = True):
    """Returns the mixed sublayer input x [..., D] and, with `inject`, the injection weights [..., S]."""
    d = h.shape[-1] // streams
    hn = rms_norm(h, p["hc_norm"], eps, group=d)
    u = jax.nn.silu(div(linear(hn, p["input_mix_weight_down"]), streams))
    m = jax.nn.sigmoid(linear(u, p["input_mix_weight_up"]))
    split = h.shape[:-1] + (streams, d)
    x = jnp.mean(m.reshape(split) * hn.reshape(split), axis=-2)
    if not inject:
        return x
    inj = 2 * jax.nn.sigmoid(div(linear(hn, p["block_inject_weight"]), streams))
    return x, inj


def combine(h: jax.Array, y: jax.Array, inj: jax.Array) -> jax.Array:
    """H_j + inj_j * y for every stream j, rounding after the product and after the add."""
    streams = inj.shape[-1]
    return h + (y[..., None, :] * inj[..., :, None]).reshape(*y.shape[:-1], streams * y.shape[-1])
