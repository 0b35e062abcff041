"""Dispatch for the hyper-connection layer boundary (op name "hc_boundary")."""

from __future__ import annotations

from fnx.pallas import dispatch
from fnx.pallas.hc import reference

OP = "hc_boundary"            # 2..32 tokens: pallas.hc_boundary (padded MMA tiles, two kernels + two XLA steps)
OP_M1 = "hc_boundary_m1"      # one token: pallas.hc_boundary_m1 (two kernels, nothing between them)
MAX_DECODE_TOKENS = 32       # the model routes calls with at most this many tokens through the api


def op_for(tokens: int) -> str:
    """The dispatch op name of a boundary over `tokens` tokens (FNX_KERNELS names them separately: the
    one-token kernels are on under auto, the multi-token ones measured slower than XLA and are not)."""
    return OP_M1 if tokens == 1 else OP


def backend(impl: str | None = None, not_applicable: str | None = None, tokens: int = 1) -> str:
    """The backend `hc_boundary(..., impl)` would run for `tokens` tokens ("reference", "pallas",
    "pallas_interpret"); not_applicable: why the kernel does not serve this call (`fnx.pallas.dispatch.resolve`)."""
    return dispatch.resolve(op_for(tokens), impl, not_applicable=not_applicable)


def hc_boundary(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, *, streams: int, eps: float,
                impl: str | None = None, tiles=None, w_down_scale=None, w_up_scale=None):
    """One hyper-connection boundary: combine the previous sublayer's output, then the gated residual.

    h [..., S*D] (stream-major); y [..., D] and inj_prev [..., S] (or both None: no combine); hc_norm [S*D];
    w_down [r, S*D]; w_up [S*D, r]; w_inj [S, S*D] or None (the final mixer). Weights in the checkpoint layout;
    Wdown and Wup may be FP8 (float8_e4m3fn with `w_down_scale` / `w_up_scale`, one fp32 multiplier per 128x128
    block): the one-token kernel dequantizes them in registers; other token counts have no FP8 kernel (a named
    kernel raises; the reference dequantizes to h.dtype first, as the model does).
    Returns (H' = h + inj_prev * y [..., S*D], x [..., D] the next sublayer's input, inj [..., S] or None)."""
    tokens = 1
    for n in h.shape[:-1]:
        tokens *= n
    fp8 = w_down_scale is not None or w_up_scale is not None
    why = "FP8 weights (only the one-token kernel takes them)" if fp8 and tokens != 1 else None
    which = dispatch.resolve(op_for(tokens), impl, not_applicable=why)
    if which == "reference":
        if fp8:
            from fnx.pallas.gemv.reference import dequantize
            w_down = dequantize("fp8", w_down, w_down_scale).astype(h.dtype)
            w_up = dequantize("fp8", w_up, w_up_scale).astype(h.dtype)
        return reference.hc_boundary(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps)
    from fnx.pallas.hc import pallas as kernel
    if fp8 and isinstance(tiles, kernel.Tiles):
        raise ValueError("hc_boundary: FP8 weights run the one-token kernels (Tiles1), not the multi-token "
                         "design's Tiles")
    if tokens == 1 and not isinstance(tiles, kernel.Tiles):
        return kernel.hc_boundary_m1(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps,
                                     interpret=dispatch.interpret_flag(which), tiles=tiles,
                                     w_down_scale=w_down_scale, w_up_scale=w_up_scale)
    return kernel.hc_boundary(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps,
                              interpret=dispatch.interpret_flag(which), tiles=tiles)
