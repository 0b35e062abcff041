"""Plain-jnp ground truth for the weight-streaming linear layers: y = x @ dequant(w).T in fp32.

The kernels accumulate in fp32 and apply each block's scale to the fp32 partial dot (they never round a
dequantized weight to bf16), so their ground truth is the exact-fp32 product below, not `fnx.model.ops.linear`
(which rounds the dequantized weight to the activation dtype first, as the transformers reference does). The two
differ by one bf16 rounding of each weight; tests state their tolerance against this function."""

from __future__ import annotations

import math
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


AUTO_X_ROWS = 64     # "auto" asks for the product in x's dtype on a GPU from this many rows (prefill-sized)


def out_in_x_dtype(dtype, rows: int | None = None) -> bool:
    """Whether `linear`'s product is asked for in x's dtype itself rather than in fp32 and rounded by a separate
    conversion (`FNX_GEMM_OUT`, read when a program is traced): "f32" never, "x" always (bf16 / fp16 inputs),
    "auto" (the default) on a GPU for products of at least `AUTO_X_ROWS` rows. On a GPU the library's product
    accumulates in fp32 and rounds once either way, and the conversion is a kernel of its own: measured on an H100
    (2026-12-06, BENCHMARKS.md "Forty-sixth session") the same bits at 5 to 2,048 rows and the model's projection
    shapes, and a 4-layer prefill chunk 1.2-1.6% faster (512 and 2,048 tokens); at one row the bf16 product took
    another kernel with other bits (half the outputs differed), hence the row threshold. XLA on the CPU does not
    promise the same bits for a bf16 product, so "auto" keeps fp32 there."""
    v = os.environ.get(OUT_ENV, "auto").strip()
    if v not in ("auto", "f32", "x"):
        raise ValueError(f"{OUT_ENV}={v!r}: use auto (x on a GPU from {AUTO_X_ROWS} rows), f32 (the product in fp32, "
                         f"rounded after) or x (in the input dtype)")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or v == "f32":
        return False
    if v == "x":
        return True
    return jax.default_backend() == "gpu" and rows is not None and rows >= AUTO_X_ROWS


def linear(x: jax.Array, wf: jax.Array) -> jax.Array:
    """The model's reference linear (MODEL_SPEC.md section 13): the fp32 weight rounded once to x.dtype, then
    an fp32-accumulated dot rounded once to x.dtype. This is what `impl="reference"` runs."""
    w = wf.astype(x.dtype)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if out_in_x_dtype(x.dtype, math.prod(x.shape[:-1])):
        return lax.dot_general(x, w, dims, precision=lax.Precision.HIGHEST, preferred_element_type=x.dtype)
    y = lax.dot_general(x, w, dims, precision=lax.Precision.HIGHEST, preferred_element_type=F32)
    return y.astype(x.dtype)


def argmax_rows(logits: jax.Array) -> jax.Array:
    """Greedy ids [M] of logits [M, N]; ties go to the lowest column (jnp.argmax's rule)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
