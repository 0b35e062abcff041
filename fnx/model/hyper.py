"""Hyper-connections (MODEL_SPEC.md section 4): the gated residual before each sublayer, the combine after it,
and the final mixer. H [..., S*D] holds S streams, stream-major (stream j is H[..., j*D:(j+1)*D])."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fnx.model.ops import linear, rms_norm, div
from fnx.pallas.hc import api as hc_api


def _kernel_ok(p: dict, h: jax.Array, inject: bool, impl: str | None, streams: int) -> bool:
    """Whether this call goes through fnx.pallas.hc: decode-sized (M <= 32 tokens), unquantized weights, and a
    kernel backend resolved for "hc_boundary_m1" (one token) or "hc_boundary" (2..32 tokens)."""
    from fnx.model import quant
    m = 1
    for n in h.shape[:-1]:
        m *= n
    names = ("input_mix_weight_down", "input_mix_weight_up") + (("block_inject_weight",) if inject else ())
    why = None
    if m > hc_api.MAX_DECODE_TOKENS:
        why = f"{m} tokens > {hc_api.MAX_DECODE_TOKENS}"
    elif any(quant.is_quantized(p[k]) for k in names):
        why = "quantized hyper-connection weights (the kernel takes dense ones)"
    elif m == 1 and streams & (streams - 1):
        why = f"{streams} streams (the one-token kernels need a power of two)"
    return hc_api.backend(impl, why, tokens=m) != "reference"


def _kernel_call(p, h, y, inj, streams, eps, inject, impl):
    return hc_api.hc_boundary(h, y, inj, p["hc_norm"], p["input_mix_weight_down"], p["input_mix_weight_up"],
                              p["block_inject_weight"] if inject else None, streams=streams, eps=eps, impl=impl)


def boundary(p: dict, h: jax.Array, y: jax.Array, inj: jax.Array, streams: int, eps: float, inject: bool = True,
             impl: str | None = None):
    """combine(h, y, inj) then gated_residual on the result, fused into one kernel call at decode.
    Returns (h' [..., S*D], x [..., D], inj' [..., S] or None without `inject`)."""
    if _kernel_ok(p, h, inject, impl, streams):
        return _kernel_call(p, h, y, inj, streams, eps, inject, impl)
    h = combine(h, y, inj)
    out = gated_residual(p, h, streams, eps, inject, impl="reference")
    return (h,) + (out if inject else (out, None))


def gated_residual(p: dict, h: jax.Array, streams: int, eps: float, inject: bool = True, impl: str | None = None):
    """Returns the mixed sublayer input x [..., D] and, with `inject`, the injection weights [..., S].
    Decode-sized calls whose `impl` (fnx.pallas.dispatch, ops "hc_boundary_m1" / "hc_boundary") resolves to a kernel run
    fnx.pallas.hc; otherwise the jnp below, which is the reference."""
    if _kernel_ok(p, h, inject, impl, streams):
        _, x, inj = _kernel_call(p, h, None, None, streams, eps, inject, impl)
        return (x, inj) if inject else x
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
