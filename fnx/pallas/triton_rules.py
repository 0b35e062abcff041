"""fnx's own primitives on the Pallas Triton lowering: their rules registered with it, the kernel-local effect that
keeps a side-effecting primitive in a kernel's jaxpr, and an inline asm the compiler may neither remove nor move
across memory operations (`dot_acc`, `pdl`, `l2_prefetch` use them)."""

from __future__ import annotations


def register(primitive, rule) -> bool:
    """`rule` as `primitive`'s lowering on the Pallas Triton backend; False where this JAX has none."""
    try:
        from jax._src.pallas.triton import lowering as tl
    except ImportError:         # pragma: no cover - a JAX without the Pallas Triton lowering
        return False
    tl.triton_lowering_rules[primitive] = rule
    return True


def kernel_effect(who: str):
    """Pallas Triton's kernel-local barrier effect (what keeps `debug_barrier` in a kernel's jaxpr); `who` names the
    caller in the error of a JAX without it."""
    try:
        from jax._src.pallas.triton import primitives as tp
        return tp.barrier_effect
    except (ImportError, AttributeError) as err:     # pragma: no cover - a JAX without it
        raise NotImplementedError(f"{who}: this JAX's Pallas Triton module has no barrier effect to keep it in a "
                                  f"kernel ({err})") from err


def side_effect_asm(vals, asm: str, pack: int = 1) -> None:
    """`asm` over the Triton tensor `vals` (one 32-bit register in, one out, `pack` elements a register), marked
    not pure: kept even though its result is unused, and not moved across the kernel's memory operations."""
    from jax._src.lib.triton import dialect as tt_dialect
    tt_dialect.elementwise_inline_asm([vals.type], asm, constraints="=r,r", pure=False, packed_element=pack,
                                      args=[vals])
