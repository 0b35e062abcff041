"""Small arithmetic shared by the Pallas kernels (importable inside a kernel body: plain jnp on values), and the
one helper that turns a window into a wider product back into an array (`take_window`)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
E2M1_F16_SCALE = 2.0 ** 14


def rnd(x, dt):
    """x rounded to dt and back to fp32: where the reference rounds an intermediate to the activation dtype, the
    kernels round at the same place and keep computing in fp32."""
    return x.astype(dt).astype(F32)


def e2m1_f16(codes):
    """E2M1 codes (integers 0..15) -> value * 2^-14 as float16, with two shifts, an or and a bitcast.

    Code s|ee|m placed as fp16 bits s<<15 | ee<<11 | m<<9 has exponent field ee and mantissa top bit m, so it
    reads 2^(ee-15) * (1 + m/2) for ee > 0 and the subnormal m * 2^-15 for ee = 0: exactly the E2M1 value times
    2^-14 in both cases (fp16 subnormals convert exactly on the GPU; no flush to zero). Callers fold
    E2M1_F16_SCALE into a scale: code * 2^-14 times (scale * 2^14) is code * scale exactly."""
    c = codes.astype(jnp.int32)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)


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
