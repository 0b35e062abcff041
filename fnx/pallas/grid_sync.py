"""A grid-wide barrier for Pallas kernels on the Triton lowering: one launch doing work that needs all of an earlier
phase's results (the hyper-connection boundary's gates need every row of its down projection), where otherwise two
launches would.

The counter. `counter(interpret)` makes an int32[1] zero with a one-program kernel: a buffer of its own (an XLA
constant could be folded into, or shared with, another zero). Kernels take it as an input and add to it with
atomics, which XLA does not see: each launch adds exactly its program count P per barrier, so between launches the
value is a multiple of P whatever ran before, and one counter serves every launch of a program in turn (launches
on one stream never overlap). A copy XLA might make of it keeps that property.

The barrier. Each program waits for its own threads (a CTA barrier, so their stores come before its arrival), adds 1
with acquire-release semantics at GPU scope, polls with volatile loads until the counter reaches the next multiple of
P, reads it once more with an acquire-release atomic (the acquire: the others' stores before their arrivals are
visible to what follows; in the stock sm_90 build the atomic is followed by `CCTL.IVALL`, invalidating the SM's L1),
and its threads wait for each other again. Every one of the P programs must be resident at once:
P must not exceed what the GPU runs concurrently (the callers take at most two programs per SM and check it). A
program that polls `max_polls` times without seeing the others gives up and reports it (`barrier` returns False):
callers write NaN then, so a broken assumption shows in the results instead of hanging the device.

The Pallas interpreter runs programs one after another, so a barrier with P > 1 would wait forever there: with one
program the barrier is the atomic add alone (nothing to wait for), which the interpreter runs; callers split their
phases into separate launches to test P > 1 programs on the CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

MAX_POLLS = 1 << 20          # ~0.5-1 s of polling (a wait is tens of us) before a program gives up: a co-residency
                             # failure costs about that per launch, then shows as NaN


def _zero_kernel(o_ref):
    o_ref[...] = jnp.zeros((1,), jnp.int32)


def counter(interpret: bool = False) -> jax.Array:
    """A fresh int32[1] zero for `barrier`, from its own one-program launch."""
    params = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=1, num_stages=1)}
    return pl.pallas_call(_zero_kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32), interpret=interpret,
                          name="fnx_grid_sync_init", **params)()


def barrier(ctr_ref, programs: int, max_polls: int = MAX_POLLS, interpret: bool = False):
    """Wait until all `programs` programs of this launch have arrived (see the module's note). Returns a bool
    scalar: True, or False where this program gave up after `max_polls` polls. `interpret`: the kernel runs under
    the Pallas interpreter (one program; no thread barriers there)."""
    if interpret and programs != 1:
        raise ValueError(f"grid barrier over {programs} programs under the Pallas interpreter, which runs them one "
                         "after another: it would wait forever (one program, or the phases as separate launches)")
    if not interpret:
        plt.debug_barrier()                     # the program's threads: their earlier stores before the arrival
    zero = jnp.int32(0)
    old = plt.atomic_add(ctr_ref, (zero,), jnp.int32(1))
    if programs == 1:
        return old >= 0                         # nothing to wait for (and the interpreter runs no spin loop)
    target = (old // programs + 1) * programs

    def waiting(c):
        return (c[0] < target) & (c[1] < max_polls)

    def poll(c):    # a volatile load (no L1, no fence): polls do not queue behind the arrivals' atomics
        return plt.load(ctr_ref.at[zero], volatile=True), c[1] + 1
    polled, _ = lax.while_loop(waiting, poll, (old + 1, zero))
    seen = plt.atomic_add(ctr_ref, (zero,), zero)   # the acquire: what the others stored before arriving, visible
    plt.debug_barrier()                         # every thread of the program past the arrival of the others
    return (polled >= target) & (seen >= target)    # (the loop's result used: it is not dead code)
