"""Small numerics shared by the layers, each rounding where the reference rounds (MODEL_SPEC.md section 13)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fnx.pallas.gdn.reference import rms_norm_gated, softplus  # noqa: F401  (the GDN norm and gate, fused by kernels)

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


def unpack_weight(w) -> tuple[str, dict]:
    """A weight as (format, raw arrays) for `fnx.pallas.gemv.api`: "bf16" (any dense array), "fp8", "nvfp4"."""
    from fnx.model import quant
    if isinstance(w, quant.Fp8Block):
        return "fp8", {"w": w.w, "scale": w.scale_inv, "block": w.block}
    if isinstance(w, quant.Nvfp4):
        return "nvfp4", {"w": w.w, "scale": w.scale, "scale_2": w.scale_2, "group": w.group}
    return "bf16", {"w": w}


def linear(x: jax.Array, w, impl: str | None = None) -> jax.Array:
    """y = x @ w.T with w [out, in] (the checkpoint's layout); fp32 accumulation, rounded once to x.dtype.

    A quantized w (`fnx.model.quant.Fp8Block` / `Nvfp4`) goes through the reference dequantizer first: fp32
    dequantization rounded once to x.dtype, then the same dot. 2-D weights go through the kernel dispatch
    (`fnx.pallas.gemv.api`: the weight-streaming kernels at decode shapes on a GPU, this arithmetic
    otherwise; FNX_KERNELS=reference forces the reference everywhere)."""
    from fnx.model import quant
    if len(w.shape) == 2:
        from fnx.pallas.gemv import api as gemv
        fmt, raw = unpack_weight(w)
        return gemv.linear(x, raw.pop("w"), fmt=fmt, impl=impl, **raw)
    w = quant.dequantize(w, x.dtype) if quant.is_quantized(w) else w.astype(x.dtype)
    y = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())),
                        precision=HIGHEST, preferred_element_type=F32)
    return y.astype(x.dtype)


def linear_pair(x: jax.Array, w_a, w_b, windows: bool = False, partials: bool = False) -> tuple:
    """(linear(x, w_a), linear(x, w_b)). When one weight is FP8 (128x128 blocks) and the other a narrow bf16 array
    (a layer's two input products: the GDN qkv + z and its b / a gates; the shared expert's gate / up and the MoE
    router; the QSA q / k / v and the indexer's projection), `fnx.pallas.gemv.api.linear_pair` may run both in one
    launch (ops "gemv_pair", "gemv_pair_many"); any other pair runs apart. With `windows` each product comes as
    (buffer, start column): both may be windows of one buffer, and with `partials` that buffer may be split-K
    partials to be summed where they are read (`fnx.pallas.kernel_math.Partials`)."""
    if len(w_a.shape) == 2 and len(w_b.shape) == 2:
        (fa, ra), (fb, rb) = unpack_weight(w_a), unpack_weight(w_b)
        for (f1, r1), (f2, r2), swap in (((fa, ra), (fb, rb), False), ((fb, rb), (fa, ra), True)):
            if f1 == "fp8" and f2 == "bf16" and tuple(r1["block"]) == (128, 128):
                from fnx.pallas.gemv import api as gemv
                y1, y2 = gemv.linear_pair(x, r1["w"], r1["scale"], r2["w"], windows=windows, partials=partials)
                return (y2, y1) if swap else (y1, y2)
    ys = linear(x, w_a), linear(x, w_b)
    return tuple((y, 0) for y in ys) if windows else ys


def linear_stacked(x: jax.Array, *ws) -> tuple:
    """(linear(x, w) for w in ws) as one product: the weights dequantized to x.dtype as `linear` dequantizes each
    (fp32, one rounding), stacked along their outputs, one dot with fp32 sums, split. x is read once instead of once
    a weight; each column's sum is the same, though the library may run another algorithm for the wider product
    (so within the products' rounding, not their bits). For prefill-sized x, where the products are XLA's."""
    from fnx.model import quant
    w = jnp.concatenate([quant.dequantize(w, x.dtype) for w in ws], axis=0)
    y = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=HIGHEST, preferred_element_type=F32)
    y = y.astype(x.dtype)
    out, start = [], 0
    for w in ws:
        out.append(y[..., start:start + w.shape[0]])
        start += w.shape[0]
    return tuple(out)


def linear_argmax(x: jax.Array, w, impl: str | None = None) -> jax.Array:
    """argmax(x @ w.T) over the last axis, ids [...] int32, ties to the lowest id, for a 2-D (possibly quantized)
    head: on a GPU at decode shapes the logits are never written (`fnx.pallas.gemv.api.linear_argmax`)."""
    from fnx.pallas.gemv import api as gemv
    fmt, raw = unpack_weight(w)
    return gemv.linear_argmax(x, raw.pop("w"), fmt=fmt, impl=impl, **raw)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, group: int | None = None) -> jax.Array:
    """Zero-centred RMSNorm: fp32 inside, scale (1 + w), one rounding. `group` normalises each group separately."""
    x32 = x.astype(F32)
    if group is not None:
        x32 = x32.reshape(*x.shape[:-1], -1, group)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if group is not None:
        y = y.reshape(x.shape)
    return (y * (1.0 + w.astype(F32))).astype(x.dtype)


def scale(x: jax.Array, factor: float) -> jax.Array:
    """x * factor with the factor kept in fp32 and one rounding, as torch does for a bf16 tensor times a Python
    float (rounding the factor to bf16 first would be a different number)."""
    return (x.astype(F32) * factor).astype(x.dtype)


def div(x: jax.Array, divisor: float) -> jax.Array:
    """x / divisor, divided in fp32 and rounded once (torch's bf16 tensor / Python number)."""
    return (x.astype(F32) / divisor).astype(x.dtype)


def rope_tables(positions: jax.Array, rotary_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin [..., rotary_dim] for integer positions [...]; angles in fp32, then rounded to `dtype`.

    Text-only positions have t = h = w, so the interleaved M-RoPE recomposition reduces to this 1-D table.
    """
    inv_freq = 1.0 / (jnp.asarray(theta, F32) ** (jnp.arange(0, rotary_dim, 2, dtype=F32) / rotary_dim))
    freqs = positions.astype(F32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """NeoX rotate-half RoPE on the first cos.shape[-1] dims of x [..., heads, hd]; cos/sin [..., rot]."""
    rot = cos.shape[-1]
    cos, sin = cos[..., None, :], sin[..., None, :]
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    xr = xr * cos + rotated * sin
    return jnp.concatenate([xr, xp], axis=-1)
