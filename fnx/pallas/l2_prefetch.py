"""A kernel's programs read the NEXT kernel's weights into L2 while they do their own work (decode: a later kernel
then reads them from L2, not from DRAM).

Why: at decode every kernel streams a few MB of weights and costs ~3 us beyond its bytes on the H200
(BENCHMARKS.md, "Forty-seventh session"): its programs' first loads wait a DRAM round trip after the kernel before
has ended, and XLA's PDL wait sits at each kernel's very start (`fnx/pallas/pdl.py`), so no kernel can fetch its own
weights early. A kernel that knows which weights come next can: `issue` loads one slice of them per program (an
ordinary load kept in L2 with the `evict_last` policy), and `sink` consumes the loaded values at the end of the
program in a side-effecting inline asm that emits no instruction of its own (only a register move), so neither the
loads nor the asm are removed, and nothing the kernel writes depends on them. The kernel's results are the same
bits; it only reads more bytes (and waits for them before it exits).

Hopper and later in practice (any CUDA device lowers it); interpret mode never traces it (the callers skip it)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plt

from fnx.pallas import triton_rules

try:        # the public home of Primitive in newer JAX
    from jax.extend.core import Primitive
except ImportError:     # pragma: no cover - older JAX
    from jax.core import Primitive

SINK_ASM = "mov.b32 $0, $1;"

sink_p = Primitive("fnx_l2_prefetch_sink")
sink_p.multiple_results = True


@sink_p.def_effectful_abstract_eval
def _abstract(vals, *, pack):
    del vals, pack
    return (), {triton_rules.kernel_effect("l2_prefetch")}


def _triton_rule(ctx, vals, *, pack):
    triton_rules.side_effect_asm(vals, SINK_ASM, pack)
    return []


TRITON_REGISTERED = triton_rules.register(sink_p, _triton_rule)


def block_for(total: int, programs: int, cap: int = 1 << 14) -> int:
    """Elements of the prefetched array each program loads: the smallest power of two that lets `programs`
    programs cover `total` elements, at most `cap` (then the programs cover the first programs * cap)."""
    per = -(-total // max(1, programs))
    b = 16
    while b < per and b < cap:
        b *= 2
    return b


def issue(ref, total: int, pid, block: int):
    """Loads elements [pid * block, (pid + 1) * block) of the flat `ref` (masked past `total`), kept in L2
    (evict_last); returns them for `sink`."""
    idx = pid * block + jnp.arange(block, dtype=jnp.int32)
    return plt.load(ref.at[idx], mask=idx < total, other=jnp.zeros((), ref.dtype), eviction_policy="evict_last")


def sink(vals):
    """Consumes `issue`'s values (one register move per 32 bits, the values as loaded: 4 one-byte or 2 two-byte ones
    a register) in a side-effecting asm: put it after the program's last store, so the program waits for the
    prefetch only at its end."""
    if not TRITON_REGISTERED:       # pragma: no cover
        raise NotImplementedError("l2_prefetch: this JAX has no Pallas Triton lowering to register the sink with")
    size = jnp.dtype(vals.dtype).itemsize
    ints = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32}.get(size)
    if ints is None:
        raise ValueError(f"l2_prefetch.sink: {vals.dtype} values (1, 2 or 4 bytes)")
    if jnp.dtype(vals.dtype) != jnp.dtype(ints):
        vals = lax.bitcast_convert_type(vals, ints)
    sink_p.bind(vals, pack=4 // size)


__all__ = ["block_for", "issue", "sink"]
