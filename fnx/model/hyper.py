"""Hyper-connections (MODEL_SPEC.md section 4): the gated residual before each sublayer, the combine after it,
and the final mixer. H [..., S*D] holds S streams, stream-major (stream j is H[..., j*D:(j+1)*D])."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp

from fnx.model.ops import linear, linear_stacked, rms_norm, div
from fnx.pallas.hc import api as hc_api


def _fp8_ok(w) -> bool:
    from fnx.model import quant
    return (isinstance(w, quant.Fp8Block) and tuple(w.block) == (128, 128) and w.w.ndim == 2
            and w.w.dtype == jnp.float8_e4m3fn)


def _kernel_ok(p: dict, h: jax.Array, inject: bool, impl: str | None, streams: int) -> bool:
    """Whether this call goes through fnx.pallas.hc: decode-sized (M <= 32 tokens), dense weights (or, for up to
    8 tokens, FP8 128x128-block Wdown and Wup), and a kernel backend resolved for "hc_boundary_m1" (one token),
    "hc_boundary_few" (2..8 tokens) or "hc_boundary" (2..32 tokens, dense weights); or a prefill chunk (more than
    32 tokens, dense or FP8 Wdown / Wup) where "hc_boundary_prefill" resolves to a kernel (only where named)."""
    from fnx.model import quant
    m = _tokens(h)
    why = None
    fp8 = [_fp8_ok(p[k]) for k in ("input_mix_weight_down", "input_mix_weight_up")]
    dense = [not quant.is_quantized(p[k]) for k in ("input_mix_weight_down", "input_mix_weight_up")]
    if inject and quant.is_quantized(p["block_inject_weight"]):
        why = "quantized block_inject_weight (the kernels take it dense)"
    elif not (all(dense) or all(fp8)):
        why = ("hyper-connection weights in a format the kernels do not take (dense, or FP8 128x128 blocks for "
               "Wdown and Wup together)")
    if m > hc_api.MAX_DECODE_TOKENS:         # a prefill chunk: op "hc_boundary_prefill" (only where named)
        if why is None:
            from fnx.pallas.hc import prefill
            d = h.shape[-1] // streams
            why = prefill.why_not(streams, d, p["input_mix_weight_down"].shape[0], prefill.default_tiles(d, m))
        return hc_api.backend(impl, why, tokens=m, fp8=all(fp8)) != "reference"
    if why is None and all(fp8) and m > hc_api.MAX_FEW_TOKENS:
        why = (f"FP8 hyper-connection weights at {m} tokens (the one- and few-token kernels take them, up to "
               f"{hc_api.MAX_FEW_TOKENS})")
    elif why is None and m == 1 and streams & (streams - 1):
        why = f"{streams} streams (the one-token kernels need a power of two)"
    return hc_api.backend(impl, why, tokens=m, fp8=all(fp8),
                          pow2_streams=streams & (streams - 1) == 0) != "reference"


def _kernel_call(p, h, y, inj, streams, eps, inject, impl):
    wd, wu = p["input_mix_weight_down"], p["input_mix_weight_up"]
    scales = {}
    if _fp8_ok(wd):
        scales = {"w_down_scale": wd.scale_inv, "w_up_scale": wu.scale_inv}
        wd, wu = wd.w, wu.w
    return hc_api.hc_boundary(h, y, inj, p["hc_norm"], wd, wu, p["block_inject_weight"] if inject else None,
                              streams=streams, eps=eps, impl=impl, **scales)


def boundary(p: dict, h: jax.Array, y: jax.Array, inj: jax.Array, streams: int, eps: float, inject: bool = True,
             impl: str | None = None):
    """combine(h, y, inj) then gated_residual on the result, fused into one kernel call at decode.
    Returns (h' [..., S*D], x [..., D], inj' [..., S] or None without `inject`)."""
    if _kernel_ok(p, h, inject, impl, streams):
        return _kernel_call(p, h, y, inj, streams, eps, inject, impl)
    normed = _norm_prefill(p, h, y, inj, streams, eps, impl)
    h, hn = normed if normed is not None else (combine(h, y, inj), None)
    out = gated_residual(p, h, streams, eps, inject, impl=impl, kernel_checked=True, hn=hn)
    return (h,) + (out if inject else (out, None))


def gated_residual(p: dict, h: jax.Array, streams: int, eps: float, inject: bool = True, impl: str | None = None,
                   kernel_checked: bool = False, hn: jax.Array | None = None):
    """Returns the mixed sublayer input x [..., D] and, with `inject`, the injection weights [..., S].
    Decode-sized calls whose `impl` (fnx.pallas.dispatch, ops "hc_boundary_m1" / "hc_boundary") resolves to a kernel run
    fnx.pallas.hc; otherwise the jnp below, which is the reference, except that over a prefill chunk the gates and
    the mix may run as one kernel (op "hc_mix_prefill", `_mix_prefill`) and the norm as another (op
    "hc_norm_prefill", `_norm_prefill`); there the Wdown and Winj products run as one (`joint_down_on`, on by
    default). kernel_checked: the caller found that no boundary kernel takes this call;
    hn: the caller's normalized streams (`_norm_prefill`'s)."""
    if not kernel_checked and _kernel_ok(p, h, inject, impl, streams):
        _, x, inj = _kernel_call(p, h, None, None, streams, eps, inject, impl)
        return (x, inj) if inject else x
    d = h.shape[-1] // streams
    if hn is None:
        normed = _norm_prefill(p, h, None, None, streams, eps, impl)
        hn = normed[1] if normed is not None else rms_norm(h, p["hc_norm"], eps, group=d)
    joint = inject and _tokens(h) > hc_api.MAX_DECODE_TOKENS and joint_down_on()
    if joint:       # the Wdown and Winj products as one (Hn read once)
        a, b = linear_stacked(hn, p["input_mix_weight_down"], p["block_inject_weight"])
    else:
        a = linear(hn, p["input_mix_weight_down"])
    u = jax.nn.silu(div(a, streams))
    x = _mix_prefill(p, u, hn, streams, impl)
    if x is None:
        m = jax.nn.sigmoid(linear(u, p["input_mix_weight_up"]))
        split = h.shape[:-1] + (streams, d)
        x = jnp.mean(m.reshape(split) * hn.reshape(split), axis=-2)
    if not inject:
        return x
    inj = 2 * jax.nn.sigmoid(div(b if joint else linear(hn, p["block_inject_weight"]), streams))
    return x, inj


JOINT_DOWN_ENV = "FNX_HC_JOINT_DOWN"


def joint_down_on() -> bool:
    """Whether a gated residual over a prefill chunk (more than 32 tokens, with the injection) runs its Wdown and
    Winj products as one product of the weights stacked [r + S, S*D] (`FNX_HC_JOINT_DOWN`, read when a program is
    traced; on by default, `=0` turns it off): XLA's path reads Hn once for both instead of twice. Measured on an
    H100 (87d332b, 2026-12-07, the 4-layer 2,048-token chunk at 8K): 11,676.7 against 11,767.2 us of kernels (-90.5,
    8 launches fewer: the Winj products' 116.8 us gone, the joint product an XLA GEMM of 34 us a boundary where the
    library's took 24.6). The same dequantized weights and fp32 sums per column; another GEMM algorithm for r + S
    columns, so not the two products' bits (within their rounding: tests)."""
    v = os.environ.get(JOINT_DOWN_ENV, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{JOINT_DOWN_ENV}={v!r}: use 1 (Wdown and Winj as one product) or 0 (two)")
    return v == "1"


def _tokens(x: jax.Array) -> int:
    """The tokens of a call: x's leading dims multiplied."""
    return math.prod(x.shape[:-1])


def _norm_prefill(p: dict, h: jax.Array, y, inj, streams: int, eps: float, impl: str | None):
    """(H', Hn) through `fnx.pallas.hc.prefill.hc_norm_prefill` (the combine, when y is given, and the grouped norm
    in one pass) for a prefill chunk (more than 32 tokens) where op "hc_norm_prefill" resolves to a kernel; None
    where it does not (the caller's jnp runs)."""
    from fnx.pallas import dispatch
    from fnx.pallas.hc import prefill
    if _tokens(h) <= hc_api.MAX_DECODE_TOKENS:
        return None
    d = h.shape[-1] // streams
    which = dispatch.resolve(prefill.NORM_OP, impl, not_applicable=prefill.norm_why_not(d, prefill.norm_tiles(d)))
    if which == "reference":
        return None
    return prefill.hc_norm_prefill(h, y, inj, p["hc_norm"], streams=streams, eps=eps,
                                   interpret=dispatch.interpret_flag(which))


def _mix_prefill(p: dict, u: jax.Array, hn: jax.Array, streams: int, impl: str | None):
    """x from u and Hn through `fnx.pallas.hc.prefill.hc_mix_prefill` (the gates' product and the mix in one launch,
    no [M, S*D] gate array) for a prefill chunk (more than 32 tokens) where op "hc_mix_prefill" resolves to a
    kernel; None where it does not (the caller's jnp runs). Wup dense or FP8 128x128 blocks."""
    from fnx.model import quant
    from fnx.pallas import dispatch
    from fnx.pallas.hc import prefill
    m = _tokens(hn)
    if m <= hc_api.MAX_DECODE_TOKENS:
        return None
    wu = p["input_mix_weight_up"]
    d = hn.shape[-1] // streams
    t = prefill.mix_tiles(d, m)
    if not (_fp8_ok(wu) or not quant.is_quantized(wu)) or len(wu.shape) != 2:
        why = "Wup in a format the mix kernel does not take (dense, or FP8 128x128 blocks)"
    else:
        why = prefill.mix_why_not(streams, d, u.shape[-1], t)
    which = dispatch.resolve(prefill.MIX_OP, impl, not_applicable=why)
    if which == "reference":
        return None
    w, scale = (wu.w, wu.scale_inv) if _fp8_ok(wu) else (wu, None)
    return prefill.hc_mix_prefill(u, hn, w, streams=streams, interpret=dispatch.interpret_flag(which),
                                  w_up_scale=scale, tiles=t)


def combine(h: jax.Array, y: jax.Array, inj: jax.Array) -> jax.Array:
    """H_j + inj_j * y for every stream j, rounding after the product and after the add."""
    streams = inj.shape[-1]
    return h + (y[..., None, :] * inj[..., :, None]).reshape(*y.shape[:-1], streams * y.shape[-1])
