"""The GDN layer's gated output norm over a prefill chunk, read from the chunk scan's own layout (op
"gdn_out_norm").

After the chunked recurrence (`api.gdn_chunk_scan`, o [B, H, N, C, dv] fp32, chunk-major per head) the model
rearranges o to its tokens [B, L, H, dv] in the activation dtype and applies `reference.rms_norm_gated` with the
gate z, a window of the fused input projection. XLA fuses the two (transposes, the norm's reduction, the gate) into
one kernel that an H100 table of a 4-layer 2,048-token chunk (BENCHMARKS.md, fifty-first session, `fusion_698`)
has at ~160 us a GDN layer for ~100 MB of traffic (o read in fp32, z read, the output written): about five times
its bytes' time. Here one program takes TOKENS (32) tokens of one head: o's rows are contiguous in the scan's
layout, z's and the output's rows are 128-column runs at the token stride. The arithmetic is the reference's: o
rounded to the activation dtype, its fp32 mean square over dv, rsqrt, rounded, times the weight in the activation
dtype, times sigmoid (or silu) of z in fp32, rounded once; the exp, rsqrt and the mean's summation order are the
kernel's own (within one bf16 step of the model's ops).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fnx.pallas import dispatch
from fnx.pallas.gdn import reference
from fnx.pallas.gdn.api import scan_tokens
from fnx.pallas.kernel_math import take_window, window_operand

F32 = jnp.float32
OP = "gdn_out_norm"
TOKENS = 32             # tokens a program (the chunk length, 64, is a multiple: no program crosses the last row)


def why_not(o_shape, dv: int, act: str) -> str | None:
    """None when the kernel serves o [B, H, N, C, dv] (the scan's layout), else why not."""
    if len(o_shape) != 5 or o_shape[-1] != dv:
        return f"gdn_out_norm: o {tuple(o_shape)} is not the chunk scan's [B, H, N, C, {dv}]"
    if dv & (dv - 1) or dv < 16:
        return f"gdn_out_norm: the head width {dv} must be a power of two >= 16"
    if (o_shape[2] * o_shape[3]) % TOKENS:
        return f"gdn_out_norm: {o_shape[2]} chunks of {o_shape[3]} rows are not a multiple of {TOKENS} tokens"
    if act not in ("sigmoid", "silu"):
        return f"gdn_out_norm: gate activation {act!r} (the kernel takes sigmoid or silu)"
    return None


def _kernel(o_ref, z_ref, w_ref, out_ref, *, length, z_start, dv, eps, act):
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t0 = pl.multiple_of(i * TOKENS, TOKENS)
    rows = t0 + jnp.arange(TOKENS, dtype=jnp.int32)
    ok = (rows < length)[:, None]
    dt = out_ref.dtype
    x = o_ref[b, h, pl.ds(t0, TOKENS), :].astype(dt).astype(F32)           # [TOKENS, dv]: o as the model rounds it
    hn = (x * jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)).astype(dt)
    hn = w_ref[...].astype(dt)[None, :] * hn
    c0 = z_start + h * dv
    whole = length % TOKENS == 0        # every program's rows are tokens: no masks
    zt = z_ref[b, pl.ds(t0, TOKENS), pl.ds(c0, dv)] if whole else \
        pltriton.load(z_ref.at[b, pl.ds(t0, TOKENS), pl.ds(c0, dv)], mask=ok, other=0.0)
    g32 = zt.astype(F32)
    sig = 1.0 / (1.0 + jnp.exp(-g32))
    g = sig if act == "sigmoid" else g32 * sig
    y = (hn.astype(F32) * g).astype(dt)
    if whole:
        out_ref[b, pl.ds(t0, TOKENS), h, :] = y
    else:
        pltriton.store(out_ref.at[b, pl.ds(t0, TOKENS), h, :], y, mask=ok)


def out_norm_tokens(o, z, w, eps: float, act: str, length: int, dtype, *, interpret: bool = False):
    """o [B, H, N, C, dv] fp32 (the chunk scan's layout), z [B, L, H dv] or a window (buffer [B, L, W], start) of the
    fused input projection, w [dv] -> [B, L, H, dv] in `dtype`: `reference.rms_norm_gated` of o's first L tokens
    rearranged to [B, L, H, dv] and rounded to `dtype`, gated by z."""
    bsz, h, n, c, dv = o.shape
    why = why_not(o.shape, dv, act)
    if why:
        raise NotImplementedError(why)
    if not 0 < length <= n * c:
        raise ValueError(f"gdn_out_norm: {length} tokens from {n} chunks of {c}")
    zbuf, z_start = window_operand(z, h * dv, (bsz, length), "gdn_out_norm z")
    return pl.pallas_call(
        functools.partial(_kernel, length=length, z_start=z_start, dv=dv, eps=float(eps), act=act),
        out_shape=jax.ShapeDtypeStruct((bsz, length, h, dv), dtype),
        grid=(bsz, h, pl.cdiv(length, TOKENS)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gdn_out_norm",
    )(o.reshape(bsz, h, n * c, dv), zbuf, w)


def out_norm_reference(o, z, w, eps: float, act: str, length: int, dtype):
    """The model's ops: o rearranged to its tokens and rounded to `dtype`, then `reference.rms_norm_gated`."""
    bsz, h, _, _, dv = o.shape
    zbuf, z_start = window_operand(z, h * dv, (bsz, length), "gdn_out_norm z")
    zz = take_window(zbuf, z_start, h * dv).reshape(bsz, length, h, dv)
    return reference.rms_norm_gated(scan_tokens(o, length, dtype), zz, w, eps, act)


def out_norm(o, z, w, eps: float, act: str, length: int, dtype, impl: str | None = None):
    """`out_norm_tokens` through dispatch (op "gdn_out_norm"): the kernel, or the reference's ops."""
    backend = dispatch.resolve(OP, impl, not_applicable=why_not(o.shape, o.shape[-1], act))
    if backend == "reference":
        return out_norm_reference(o, z, w, eps, act, length, dtype)
    return out_norm_tokens(o, z, w, eps, act, length, dtype, interpret=dispatch.interpret_flag(backend))
