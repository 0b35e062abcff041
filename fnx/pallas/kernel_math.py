"""Small arithmetic shared by the Pallas kernels (importable inside a kernel body: plain jnp on values), and the
one helper that turns a window into a wider product back into an array (`take_window`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
E2M1_F16_SCALE = 2.0 ** 14


def rnd(x, dt):
    """x rounded to dt and back to fp32: where the reference rounds an intermediate to the activation dtype, the
    kernels round at the same place and keep computing in fp32."""
    return x.astype(dt).astype(F32)


def block_cols(s, cw: int):
    """FP8 128x128 blocks: a K chunk's block scales s [cw / 128], one per 128 columns, spread to its cw columns
    ([cw]; a chunk inside one block keeps its scalar), for x * s per activation column."""
    return s if cw <= 128 else jnp.broadcast_to(s[:, None], (cw // 128, 128)).reshape(cw)


def e2m1_f16(codes):
    """E2M1 codes (integers 0..15) -> value * 2^-14 as float16, with two shifts, an or and a bitcast.

    Code s|ee|m placed as fp16 bits s<<15 | ee<<11 | m<<9 has exponent field ee and mantissa top bit m, so it
    reads 2^(ee-15) * (1 + m/2) for ee > 0 and the subnormal m * 2^-15 for ee = 0: exactly the E2M1 value times
    2^-14 in both cases (fp16 subnormals convert exactly on the GPU; no flush to zero). Callers fold
    E2M1_F16_SCALE into a scale: code * 2^-14 times (scale * 2^14) is code * scale exactly."""
    c = codes.astype(jnp.int32)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)


# Four packed bytes (one 32-bit register: Triton's `pack` = 4 for 8-bit elements) -> the fp32 values x 2^-14 of
# their low nibbles (SHIFTS 9, 12) or their high nibbles (SHIFTS 5, 8), $0-$3 in element order. prmt spreads two
# bytes into the two 16-bit halves of a word; per half, the code's magnitude bits land on fp16 bits 9-11 and its
# sign on bit 15 (the `e2m1_f16` placement, two codes per shift / and / or), and cvt.f32.f16 converts each half.
# One block per nibble: JAX's lowering of a multi-result inline-asm primitive returns one result (JAX 0.10.2).
_E2M1_ASM = """{{
.reg .b32 z, x01, x23, t1, t2, w;
.reg .b16 h0, h1;
mov.b32 z, 0;
prmt.b32 x01, $4, z, 0x4140;
prmt.b32 x23, $4, z, 0x4342;
shl.b32 t1, x01, {0}; and.b32 t1, t1, 0x0E000E00; shl.b32 t2, x01, {1}; and.b32 t2, t2, 0x80008000; or.b32 w, t1, t2;
mov.b32 {{h0, h1}}, w; cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1;
shl.b32 t1, x23, {0}; and.b32 t1, t1, 0x0E000E00; shl.b32 t2, x23, {1}; and.b32 t2, t2, 0x80008000; or.b32 w, t1, t2;
mov.b32 {{h0, h1}}, w; cvt.f32.f16 $2, h0; cvt.f32.f16 $3, h1;
}}"""
E2M1_ASM_SHIFTS = {"low": (9, 12), "high": (5, 8)}


def e2m1_pair_f32(packed, asm: bool = False):
    """Packed NVFP4 bytes (uint8, low nibble = even column) -> (low, high) nibble values x 2^-14 in fp32, the
    values of `e2m1_f16` (callers fold E2M1_F16_SCALE into a scale). asm=True (inside a Pallas Triton kernel on an
    NVIDIA GPU only) decodes four bytes per inline-PTX block (`_E2M1_ASM`); the jnp form is the same arithmetic, and
    what the interpreter runs (it cannot run PTX)."""
    if asm:
        from jax.experimental.pallas import triton as plt
        out = jax.ShapeDtypeStruct(packed.shape, F32)
        u8 = packed.astype(jnp.uint8)
        return tuple(plt.elementwise_inline_asm(_E2M1_ASM.format(*E2M1_ASM_SHIFTS[h]), args=[u8],
                                                constraints="=f,=f,=f,=f,r", pack=4, result_shape_dtypes=[out])[0]
                     for h in ("low", "high"))
    p = packed.astype(jnp.uint32)
    return e2m1_f16(p & 0xF).astype(F32), e2m1_f16(p >> 4).astype(F32)


def window_operand(a, size: int, lead: tuple, what: str = "operand"):
    """(buffer [*lead, W], start column) for a kernel operand of `size` columns given as an array (its trailing
    axes flattened: [*lead, ...]) or as a window (buffer, start) into a wider product (the fused projections), which
    the kernel reads in place. A buffer of rank len(lead) is one column. Raises for a window past its buffer."""
    buf, start = a if isinstance(a, tuple) else (a, 0)
    if buf.ndim == len(lead) or not isinstance(a, tuple):
        buf = buf.reshape(*lead, -1)
    start = int(start)
    if tuple(buf.shape[:-1]) != tuple(lead) or start < 0 or start + size > buf.shape[-1]:
        raise ValueError(f"{what}: window [{start}, {start + size}) is outside an operand of shape "
                         f"{tuple(buf.shape)} (leading axes {tuple(lead)})")
    return buf, start


def take_window(buf, start: int, size: int):
    """Columns [start, start + size) of buf [..., W] (the last axis): a projection's output inside a fused
    product, which the kernels read in place as (buffer, start) and the references take as an array. The buffer
    itself when the window is all of it (no slice op)."""
    start = int(start)
    if start == 0 and size == buf.shape[-1]:
        return buf
    return buf[..., start:start + size]
