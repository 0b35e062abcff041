"""Plain-jnp ground truth for the weight-streaming linear layers: y = x @ dequant(w).T in fp32.

The kernels accumulate in fp32 and apply each block's scale to the fp32 partial dot (they never round a
dequantized weight to bf16), so their ground truth is the exact-fp32 product below, not `fnx.model.ops.linear`
(which rounds the dequantized weight to the activation dtype first, as the transformers reference does). The two
differ by one bf16 rounding of each weight; tests state their tolerance against this function."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def e2m1_to_f32(codes: jax.Array) -> jax.Array:
    """E2M1 codes (0..15) -> fp32 from the bit fields s|ee|m: e = 0 is 0 or 0.5, else 2^(e-1) * (1 + m/2)."""
    c = codes.astype(jnp.uint32)
    sign, exp, man = (c >> 3) & 1, (c >> 1) & 3, c & 1
    normal = ((exp + 126) << 23) | (man << 22)
    sub = jnp.where(man == 1, jnp.uint32(0x3F000000), jnp.uint32(0))
    return lax.bitcast_convert_type(jnp.where(exp == 0, sub, normal) | (sign << 31), F32)


def dequantize(fmt: str, w, scale=None, scale_2=None, block=(128, 128), group: int = 16) -> jax.Array:
    """The dense fp32 weight [N, K] of one format (the same arithmetic as fnx.model.quant.dequantize).
    bf16: w itself. fp8: w e4m3 [N, K] * scale [ceil(N/bo), ceil(K/bi)] per block. nvfp4: w uint8 [N, K/2]
    (low nibble = even column) * E4M3 scale [N, K/group] * fp32 global [N]."""
    if fmt == "bf16":
        return jnp.asarray(w).astype(F32)
    if fmt == "fp8":
        n, k = w.shape[-2:]
        s = jnp.repeat(jnp.repeat(scale.astype(F32), block[0], axis=-2), block[1], axis=-1)[..., :n, :k]
        return w.astype(F32) * s
    if fmt == "nvfp4":
        codes = jnp.stack([w & 0xF, w >> 4], axis=-1).reshape(*w.shape[:-1], 2 * w.shape[-1])
        s = jnp.repeat(scale.astype(F32), group, axis=-1)
        return e2m1_to_f32(codes) * s * scale_2.astype(F32)[..., None]
    raise ValueError(f"unknown weight format {fmt!r}")


def linear_f32(x: jax.Array, wf: jax.Array) -> jax.Array:
    """x [M, K] @ wf [N, K].T -> fp32 [M, N], every product and sum in fp32 (the kernels' ground truth)."""
    return lax.dot_general(x.astype(F32), wf.astype(F32), (((x.ndim - 1,), (1,)), ((), ())),
                           precision=lax.Precision.HIGHEST, preferred_element_type=F32)


OUT_ENV = "FNX_GEMM_OUT"


def out_in_x_dtype(dtype) -> bool:
    """Whether `linear`'s product is asked for in x's dtype itself (FNX_GEMM_OUT=x, read when a program is traced; a
    GPU benchmark knob, off until measured) rather than in fp32 and rounded by a separate conversion (the default):
    on a GPU the library's product accumulates in fp32 and rounds once either way, and the conversion is a kernel
    of its own (a 2,048-token prefill chunk's GDN input projection: ~64 us for its [2,048, 16,384] product, H100).
    XLA on the CPU does not promise the same bits for a bf16 product, so the CPU keeps the default."""
    v = os.environ.get(OUT_ENV, "f32").strip()
    if v not in ("f32", "x"):
        raise ValueError(f"{OUT_ENV}={v!r}: use f32 (the product in fp32, rounded after) or x (in the input dtype)")
    return v == "x" and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def linear(x: jax.Array, wf: jax.Array) -> jax.Array:
    """The model's reference linear (MODEL_SPEC.md section 13): the fp32 weight rounded once to x.dtype, then
    an fp32-accumulated dot rounded once to x.dtype. This is what `impl="reference"` runs."""
    w = wf.astype(x.dtype)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if out_in_x_dtype(x.dtype):
        return lax.dot_general(x, w, dims, precision=lax.Precision.HIGHEST, preferred_element_type=x.dtype)
    y = lax.dot_general(x, w, dims, precision=lax.Precision.HIGHEST, preferred_element_type=F32)
    return y.astype(x.dtype)


def argmax_rows(logits: jax.Array) -> jax.Array:
    """Greedy ids [M] of logits [M, N]; ties go to the lowest column (jnp.argmax's rule)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
