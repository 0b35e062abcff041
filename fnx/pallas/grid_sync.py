"""Counters shared by the programs of one launch, for Pallas kernels on the Triton lowering: a grid-wide barrier (one
launch doing work that needs all of an earlier phase's results: the hyper-connection boundary's gates need every row
of its down projection, where otherwise two launches would), and per-tile counts by which the last of a tile's
programs finishes a sum the others wrote (split-K GEMVs, the MoE combine: `CounterPool`).

The counter. `counter(interpret)` makes an int32[1] zero with a one-program kernel: a buffer of its own (an XLA
constant could be folded into, or shared with, another zero); a decode program's launches take theirs from its
`CounterPool` instead (one counter per call site). Kernels take it as an input and add to it with
atomics, which XLA does not see: each launch adds exactly its program count P per barrier, so between launches the
value is a multiple of P whatever ran before, and one counter serves every launch of a program in turn (launches
on one stream never overlap). A copy XLA might make of it keeps that property.

The barrier. Each program waits for its own threads (a CTA barrier, so their stores come before its arrival), adds 1
with acquire-release semantics at GPU scope, polls with volatile loads until the counter reaches the next multiple of
P, reads it once more with an acquire-release atomic (the acquire: the others' stores before their arrivals are
visible to what follows; in the stock sm_90 build the atomic is followed by `CCTL.IVALL`, invalidating the SM's L1),
and its threads wait for each other again. Every one of the P programs must be resident at once:
P must not exceed what the GPU runs concurrently (the callers take two programs per SM by default, at most five when
named, and check it). A
program that polls `max_polls` times without seeing the others gives up and reports it (`barrier` returns False):
callers write NaN then, so a broken assumption shows in the results instead of hanging the device.

The Pallas interpreter runs programs one after another, so a barrier with P > 1 would wait forever there: with one
program the barrier is the atomic add alone (nothing to wait for), which the interpreter runs; callers split their
phases into separate launches to test P > 1 programs on the CPU."""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from fnx.pallas import pdl

MAX_POLLS = 1 << 20          # ~0.5-1 s of polling (a wait is tens of us) before a program gives up: a co-residency
                             # failure costs about that per launch, then shows as NaN


ZERO_BLOCK = 1024


def _zero_kernel(o_ref):
    o_ref[...] = jnp.zeros(o_ref.shape, jnp.int32)


def counter(interpret: bool = False, size: int = 1) -> jax.Array:
    """A fresh int32[size] zero for `barrier` (size 1) or a `CounterPool`, from its own launch (one program per
    ZERO_BLOCK counters)."""
    if size != 1 and (size % ZERO_BLOCK or size & (size - 1)):
        raise ValueError(f"grid_sync.counter: size={size} (1, or a power of two multiple of {ZERO_BLOCK})")
    block = min(size, ZERO_BLOCK)
    params = {} if interpret else {"compiler_params": plt.CompilerParams(num_warps=1 if size == 1 else 4,
                                                                         num_stages=1)}
    return pdl.pallas_call(_zero_kernel, out_shape=jax.ShapeDtypeStruct((size,), jnp.int32), interpret=interpret,
                          grid=(size // block,), out_specs=pl.BlockSpec((block,), lambda i: (i,)),
                          name="fnx_grid_sync_init", **params)()


POOL_SIZE = 1 << 16


class CounterPool:
    """int32 counters for kernels that finish a split-K sum in place (`fnx.pallas.gemv.pallas.finish_tile`): one
    zeroed buffer per decode program (`counter(size=POOL_SIZE)`) and, at trace time, a region of it for each call
    (`take`). A call adds its split count S to each counter of its region, so the region stays a multiple of S for
    the same call site's next run (a scanned layer's call runs once per layer on one region); distinct call sites
    never share counters, so two launches that XLA might run side by side cannot mix counts."""

    def __init__(self, buf: jax.Array):
        self.buf, self.used = buf, 0

    def take(self, n: int) -> int:
        """The first of n fresh counters."""
        if self.used + n > self.buf.shape[0]:
            raise ValueError(f"counter pool exhausted: {self.used} + {n} of {self.buf.shape[0]} counters (a program "
                             "with more split-K calls than POOL_SIZE provides for)")
        base, self.used = self.used, self.used + n
        return base


_POOL: contextvars.ContextVar = contextvars.ContextVar("fnx_counter_pool", default=None)


@contextlib.contextmanager
def counter_pool(pool: CounterPool | None):
    """Within the block, the kernels traced take their counters from `pool` (None: none)."""
    token = _POOL.set(pool)
    try:
        yield pool
    finally:
        _POOL.reset(token)


def current_pool() -> CounterPool | None:
    """The counter pool of the program being traced (`counter_pool`), or None."""
    return _POOL.get()


def counters(n: int, interpret: bool = False) -> tuple[jax.Array, int]:
    """n counters for one call of a kernel that counts its programs: (buffer, first counter). A region of the
    program's pool where one is in scope (`counter_pool`), else a zeroed buffer of its own (`counter`: the
    power-of-two multiple of ZERO_BLOCK that holds n; one more launch)."""
    pool = current_pool()
    if pool is not None:
        return pool.buf, pool.take(n)
    size = ZERO_BLOCK
    while size < n:
        size *= 2
    return counter(interpret, size), 0


def knob(env: str, default: bool = False) -> bool:
    """Whether the 0/1 knob `env` (read when a program is traced) is on (unset or empty: `default`); another value
    raises."""
    import os
    flag = os.environ.get(env, "").strip() or ("1" if default else "0")
    if flag not in ("0", "1"):
        raise ValueError(f"{env}={flag!r}: 0 or 1")
    return flag == "1"


def pool_if(env: str) -> CounterPool | None:
    """The program's counter pool where the knob `env` is on (the finish knobs), else None."""
    return current_pool() if knob(env) else None


def barrier(ctr_ref, programs: int, max_polls: int = MAX_POLLS, interpret: bool = False, index: int = 0):
    """Wait until all `programs` programs of this launch have arrived (see the module's note), counting on
    ctr_ref[index]. Returns a bool scalar: True, or False where this program gave up after `max_polls` polls.
    `interpret`: the kernel runs under the Pallas interpreter (one program; no thread barriers there)."""
    if interpret and programs != 1:
        raise ValueError(f"grid barrier over {programs} programs under the Pallas interpreter, which runs them one "
                         "after another: it would wait forever (one program, or the phases as separate launches)")
    if not interpret:
        plt.debug_barrier()                     # the program's threads: their earlier stores before the arrival
    zero, at = jnp.int32(0), jnp.int32(index)
    old = plt.atomic_add(ctr_ref, (at,), jnp.int32(1))
    if programs == 1:
        return old >= 0                         # nothing to wait for (and the interpreter runs no spin loop)
    target = (old // programs + 1) * programs

    def waiting(c):
        return (c[0] < target) & (c[1] < max_polls)

    def poll(c):    # a volatile load (no L1, no fence): polls do not queue behind the arrivals' atomics
        return plt.load(ctr_ref.at[at], volatile=True), c[1] + 1
    polled, _ = lax.while_loop(waiting, poll, (old + 1, zero))
    seen = plt.atomic_add(ctr_ref, (at,), zero)     # the acquire: what the others stored before arriving, visible
    plt.debug_barrier()                         # every thread of the program past the arrival of the others
    return (polled >= target) & (seen >= target)    # (the loop's result used: it is not dead code)
