"""Hyper-connection layer boundary, plain jnp (MODEL_SPEC.md section 4; fnx/model/hyper.py is the model's copy):

    H'   = H + inj_prev * y                    (combine after the previous sublayer; skipped when y is None)
    Hn   = GroupedRMSNorm(H'; hc_norm)         (per stream of D, zero-centred, fp32 inside, one rounding)
    u    = silu(round(Hn @ Wdown.T) / S)        [r]
    m    = sigmoid(round(u @ Wup.T))            [S*D]
    x    = mean_j(m_j * Hn_j)                   [D]
    inj  = 2 * sigmoid(round(Hn @ Winj.T) / S)  [S]   (when Winj is given)

Each step rounds to the input dtype where the model rounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def _linear(x, w):
    return lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                           preferred_element_type=F32).astype(x.dtype)


def _div(x, d):
    return (x.astype(F32) / d).astype(x.dtype)


def grouped_rms_norm(h, w, eps, group):
    x32 = h.astype(F32).reshape(*h.shape[:-1], -1, group)
    y = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).reshape(h.shape)
    return (y * (1.0 + w.astype(F32))).astype(h.dtype)


def combine(h, y, inj):
    streams = inj.shape[-1]
    return h + (y[..., None, :] * inj[..., :, None]).reshape(*y.shape[:-1], streams * y.shape[-1])


def hc_boundary(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, *, streams: int, eps: float):
    """h [..., S*D]; y [..., D] or None; inj_prev [..., S] or None; hc_norm [S*D]; w_down [r, S*D];
    w_up [S*D, r]; w_inj [S, S*D] or None. Returns (H' [..., S*D], x [..., D], inj [..., S] or None)."""
    if y is not None:
        h = combine(h, y, inj_prev)
    d = h.shape[-1] // streams
    hn = grouped_rms_norm(h, hc_norm, eps, d)
    u = jax.nn.silu(_div(_linear(hn, w_down), streams))
    m = jax.nn.sigmoid(_linear(u, w_up))
    split = h.shape[:-1] + (streams, d)
    x = jnp.mean(m.reshape(split) * hn.reshape(split), axis=-2)
    inj = None if w_inj is None else 2 * jax.nn.sigmoid(_div(_linear(hn, w_inj), streams))
    return h, x, inj
