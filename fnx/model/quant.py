"""Quantized weights that stay quantized in memory, with plain-jnp reference dequantizers.

Two layouts, both small registered pytrees so they stack, scan and slice like arrays:

- `Fp8Block`: FP8 E4M3 values with one fp32 multiplier per (bo x bi) block, the layout of the official FP8
  release (`weight` + `weight_scale_inv`, 128 x 128 blocks). w ~= q * scale_inv, block-wise.
- `Nvfp4`: ModelOpt NVFP4. Two E2M1 values per byte (element 2i in the low nibble, 2i+1 in the high one), one
  FP8 E4M3 scale per 16 values along the input axis, and a global fp32 `weight_scale_2`. It is kept per output row
  here, so the gate and up halves of a fused expert may carry different globals. w = e2m1 * scale * scale_2.

The reference matmul dequantizes in fp32, rounds the weight once to the activation dtype (so a quantized model is
exactly the bf16/f32 model whose weights are the dequantized values) and then runs the same dot as `ops.linear`.
Kernels that keep the weight packed through the dot are a separate piece of work; this is their ground truth.

Leading axes (experts, scanned layers) are allowed on every field."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fnx.pallas.gemv.reference import dequantize as _dequantize
from fnx.pallas.gemv.reference import e2m1_to_f32  # noqa: F401  (E2M1 codes -> fp32 from the bit fields)

F32 = jnp.float32
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
NVFP4_GROUP = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Fp8Block:
    w: jax.Array            # float8_e4m3fn [..., out, in]
    scale_inv: jax.Array    # f32 [..., ceil(out/bo), ceil(in/bi)]; w ~= q * scale_inv per block
    block: tuple[int, int] = field(default=(128, 128))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def nbytes(self) -> int:
        return int(self.w.nbytes) + int(self.scale_inv.nbytes)


@dataclass(frozen=True)
class Nvfp4:
    w: jax.Array            # uint8 [..., out, in/2], two E2M1 codes per byte, low nibble first
    scale: jax.Array        # float8_e4m3fn [..., out, in/16]
    scale_2: jax.Array      # f32 [..., out], the global scale (per row, see the module docstring)
    input_scale: jax.Array  # f32 [...], the activation scale for W4A4 kernels; the weight-only reference ignores it
    group: int = field(default=NVFP4_GROUP)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape[:-1]) + (2 * self.w.shape[-1],)

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.w, self.scale, self.scale_2, self.input_scale))


jax.tree_util.register_dataclass(Fp8Block, data_fields=["w", "scale_inv"], meta_fields=["block"])
jax.tree_util.register_dataclass(Nvfp4, data_fields=["w", "scale", "scale_2", "input_scale"], meta_fields=["group"])

QUANTIZED = (Fp8Block, Nvfp4)


def abstract_weight(shape: tuple[int, ...], fmt: str, dtype=jnp.bfloat16):
    """A weight [..., out, in] of a format as shapes only (jax.ShapeDtypeStruct leaves), for tracing and lowering
    without arrays: "bf16" (a plain `dtype` array), "fp8" (`Fp8Block`, 128 x 128 blocks) or "nvfp4" (`Nvfp4`)."""
    S = jax.ShapeDtypeStruct
    shape = tuple(shape)
    if fmt == "bf16":
        return S(shape, dtype)
    if fmt == "nvfp4":
        return Nvfp4(S(shape[:-1] + (shape[-1] // 2,), jnp.uint8), S(shape[:-1] + (shape[-1] // NVFP4_GROUP,),
                     jnp.float8_e4m3fn), S(shape[:-1], jnp.float32), S(shape[:-2], jnp.float32))
    if fmt in ("fp8", "fp8_block"):
        return Fp8Block(S(shape, jnp.float8_e4m3fn),
                        S(shape[:-2] + (_cdiv(shape[-2], 128), _cdiv(shape[-1], 128)), jnp.float32))
    raise ValueError(f"abstract_weight: unknown format {fmt!r} (bf16, fp8 or nvfp4)")


def is_quantized(w) -> bool:
    return isinstance(w, QUANTIZED)


def _expand_blocks(scale: jax.Array, out: int, inp: int, block: tuple[int, int]) -> jax.Array:
    """[..., nbo, nbi] -> [..., out, in], each block's value repeated over its rows and columns."""
    s = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return s[..., :out, :inp]


def dequantize(w, dtype=F32) -> jax.Array:
    """The weight as a dense array of `dtype` (fp32 arithmetic, one rounding). Plain arrays are just cast.
    The arithmetic is `fnx.pallas.gemv.reference.dequantize`, the kernels' ground truth."""
    if isinstance(w, Fp8Block):
        return _dequantize("fp8", w.w, w.scale_inv, block=w.block).astype(dtype)
    if isinstance(w, Nvfp4):
        return _dequantize("nvfp4", w.w, w.scale, w.scale_2, group=w.group).astype(dtype)
    return jnp.asarray(w).astype(dtype)


def take(w, idx: jax.Array):
    """w[idx] along the leading (expert) axis, for arrays and quantized weights alike."""
    if is_quantized(w):
        from fnx.pallas.stacked import tree_map     # fields may be layer views of stacks
        return tree_map(lambda a: a[idx], w)
    return w[idx]


# ---- online quantization ---------------------------------------------------------------------------------------

def quantize_fp8_block(w: jax.Array, block: tuple[int, int] = (128, 128)) -> Fp8Block:
    """Weight-only FP8 E4M3 with one fp32 scale per block: scale = amax * fp32(1/448), q = fp8(w / scale) (round
    to nearest even). An all-zero
    block gets scale 1. Partial edge blocks are scaled by their own amax."""
    w = jnp.asarray(w).astype(F32)
    *lead, out, inp = w.shape
    nbo, nbi = _cdiv(out, block[0]), _cdiv(inp, block[1])
    pad = [(0, 0)] * len(lead) + [(0, nbo * block[0] - out), (0, nbi * block[1] - inp)]
    blocks = jnp.pad(w, pad).reshape(*lead, nbo, block[0], nbi, block[1])
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))                            # [..., nbo, nbi]
    # amax * fp32(1/448): XLA turns a division by a constant into this product anyway, so spell it out
    scale = jnp.where(amax > 0, amax * jnp.float32(1.0 / FP8_MAX), 1.0).astype(F32)
    q = (w / _expand_blocks(scale, out, inp, block)).astype(FP8)
    return Fp8Block(q, scale, tuple(block))


def quantize_nvfp4(w: jax.Array, group: int = NVFP4_GROUP) -> Nvfp4:
    """Weight-only NVFP4 in the layout `Nvfp4` reads: a global scale per row (amax / (6 * 448)), an E4M3 scale per
    `group` values (group amax / 6, relative to the global scale), and E2M1 codes rounded to the nearest value
    (ties to the larger magnitude code)."""
    w = jnp.asarray(w).astype(F32)
    *lead, out, inp = w.shape
    if inp % group or inp % 2:
        raise ValueError(f"NVFP4 needs the input width ({inp}) to be a multiple of the group size {group}")
    amax_row = jnp.max(jnp.abs(w), axis=-1)
    scale_2 = jnp.where(amax_row > 0, amax_row / (6.0 * FP8_MAX), 1.0).astype(F32)           # [..., out]
    g = w.reshape(*lead, out, inp // group, group)
    amax_g = jnp.max(jnp.abs(g), axis=-1)
    s = jnp.clip(amax_g / 6.0 / scale_2[..., None], 0, FP8_MAX).astype(FP8)                 # [..., out, in/g]
    eff = s.astype(F32) * scale_2[..., None]
    x = g / jnp.where(eff > 0, eff, 1.0)[..., None]
    mags = jnp.asarray(E2M1_VALUES[:8])
    code = jnp.argmin(jnp.abs(jnp.abs(x)[..., None] - mags), axis=-1).astype(jnp.uint8)
    code = code | jnp.where(x < 0, jnp.uint8(8), jnp.uint8(0))
    code = code.reshape(*lead, out, inp)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(jnp.uint8)
    return Nvfp4(packed, s, scale_2, jnp.ones(tuple(lead), F32), group)


# ---- host (NumPy) references, used by the loader's checks and the tests ---------------------------------------

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def dequantize_np(w) -> np.ndarray:
    """NumPy twin of `dequantize` (fp32), written from the layout definitions with a lookup table."""
    if isinstance(w, Fp8Block):
        q = np.asarray(w.w).astype(np.float32)
        s = np.asarray(w.scale_inv, np.float32)
        out, inp = q.shape[-2:]
        s = np.repeat(np.repeat(s, w.block[0], axis=-2), w.block[1], axis=-1)[..., :out, :inp]
        return q * s
    if isinstance(w, Nvfp4):
        p = np.asarray(w.w)
        codes = np.empty(p.shape[:-1] + (2 * p.shape[-1],), np.uint8)
        codes[..., 0::2], codes[..., 1::2] = p & 0xF, p >> 4
        scale = np.repeat(np.asarray(w.scale).astype(np.float32), w.group, axis=-1)
        return E2M1_VALUES[codes] * scale * np.asarray(w.scale_2, np.float32)[..., None]
    raise TypeError(f"not a quantized weight: {type(w).__name__}")


FP8_NP = ml_dtypes.float8_e4m3fn
