"""Small arithmetic shared by the Pallas kernels (importable inside a kernel body: plain jnp on values)."""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32


def rnd(x, dt):
    """x rounded to dt and back to fp32: where the reference rounds an intermediate to the activation dtype, the
    kernels round at the same place and keep computing in fp32."""
    return x.astype(dt).astype(F32)
