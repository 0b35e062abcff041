"""Dispatch for the hyper-connection layer boundary (op name "hc_boundary")."""

from __future__ import annotations

from fnx.pallas import dispatch
from fnx.pallas.hc import reference

OP = "hc_boundary"
MAX_DECODE_TOKENS = 32       # the model routes calls with at most this many tokens through the api


def backend(impl: str | None = None, not_applicable: str | None = None) -> str:
    """The backend `hc_boundary(..., impl)` would run ("reference", "pallas", "pallas_interpret");
    not_applicable: why the kernel does not serve this call (see `fnx.pallas.dispatch.resolve`)."""
    return dispatch.resolve(OP, impl, not_applicable=not_applicable)


def hc_boundary(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, *, streams: int, eps: float,
                impl: str | None = None, tiles=None):
    """One hyper-connection boundary: combine the previous sublayer's output, then the gated residual.

    h [..., S*D] (stream-major); y [..., D] and inj_prev [..., S] (or both None: no combine); hc_norm [S*D];
    w_down [r, S*D]; w_up [S*D, r]; w_inj [S, S*D] or None (the final mixer). Weights in the checkpoint layout.
    Returns (H' = h + inj_prev * y [..., S*D], x [..., D] the next sublayer's input, inj [..., S] or None)."""
    which = dispatch.resolve(OP, impl)
    if which == "reference":
        return reference.hc_boundary(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps)
    from fnx.pallas.hc import pallas as kernel
    return kernel.hc_boundary(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps,
                              interpret=dispatch.interpret_flag(which), tiles=tiles)
