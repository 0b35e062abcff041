"""The PLE ring's two GPU kernels in Pallas (Triton lowering). They talk to a host thread through a page-locked
control block (`layout.py`) that the kernels reach at its host address (unified virtual addressing), with
inline PTX for the system-scope loads and stores.

`post` (grid ceil(N / BP)): every lane reads DONE and ABANDONED, takes seq = max(...) + 1 and writes its row
id as the pair (seq, id) with one `st.relaxed.sys.v2.u32`; lane 0 of program 0 also writes the header (seq, N).
Its output is seq per lane: the ticket `wait` takes.

`wait` (grid ceil(N / BR)): each program spins on DONE (`ld.acquire.sys`, a `nanosleep` between polls) until
it equals seq or the deadline passes (`%globaltimer`, timeout in microseconds), then loads its rows' words from
the ring with system-scope loads that take the spin's result as an operand (so they cannot be issued before
it). A program whose deadline passed returns zeros, ok = 0, and writes seq to ABANDONED (the host reports it).

In interpret mode (the CPU tests) a stand-in array `mem` plays the control block: byte address a is word a // 4
of it; `post` returns the pairs it would store, and `wait` reads DONE once (nothing else can write it there)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fnx.pallas import pdl
from fnx.pallas.ple_ring import layout

I32 = jnp.int32          # Triton tensors are signless: addresses and words travel as int32 bit patterns
BP = 128                 # row ids per `post` program
BR = 16                  # rows per `wait` program

# $0 = seq (passed through); if $6: *(v2.u32 *)((hi:lo) + off) = {$4, $5}, a system-scope store to host memory
_STORE_PAIR_ASM = """{
.reg .b64 a, o;
.reg .pred p;
mov.b64 a, {$1, $2};
cvt.u64.u32 o, $3;
add.u64 a, a, o;
setp.ne.s32 p, $6, 0;
@p st.relaxed.sys.global.v2.u32 [a], {$4, $5};
mov.b32 $0, $4;
}"""

# $0 = *(u32 *)((hi:lo) + off), system scope (the host writes these words). The row loads pass the spin's result
# as a fourth operand the text does not read: an ordering dependency only (they cannot be issued before it)
_LOAD_SYS_ASM = """{
.reg .b64 a, o;
mov.b64 a, {$1, $2};
cvt.u64.u32 o, $3;
add.u64 a, a, o;
ld.relaxed.sys.global.u32 $0, [a];
}"""

# $0 = DONE once it equals seq ($3) or once $4 microseconds have passed (then whatever DONE held)
_SPIN_ASM = """{
.reg .b64 a, t, d;
.reg .b32 v, x;
.reg .pred p;
mov.b64 a, {$1, $2};
add.u64 a, a, %d;
mov.u64 d, %%globaltimer;
cvt.u64.u32 t, $4;
mul.lo.u64 t, t, 1000;
add.u64 d, d, t;
FNX_RING_WAIT:
ld.acquire.sys.global.u32 v, [a];
sub.s32 x, v, $3;
setp.eq.s32 p, x, 0;
@p bra FNX_RING_DONE;
mov.u64 t, %%globaltimer;
setp.lt.u64 p, t, d;
@!p bra FNX_RING_DONE;
nanosleep.u32 100;
bra FNX_RING_WAIT;
FNX_RING_DONE:
mov.b32 $0, v;
}""" % layout.DONE


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _asm(text, args, shape):
    return plgpu.elementwise_inline_asm(text, args=args, constraints="=r" + ",r" * len(args), pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, I32)])[0]


def _newer(a, b):
    """The later of two seqs (wrap-safe: a - b as int32)."""
    return jnp.where(a - b > 0, a, b)


def _post_kernel(ids_ref, lo_ref, hi_ref, *rest, n: int, emulate: bool):
    if emulate:
        mem_ref, seq_ref, pairs_ref = rest
    else:
        seq_ref, = rest
    pid = pl.program_id(0)
    i = pid * BP + lax.broadcasted_iota(I32, (BP,), 0)
    ids = ids_ref[jnp.minimum(i, n - 1)]
    lo, hi = jnp.full((BP,), lo_ref[0], I32), jnp.full((BP,), hi_ref[0], I32)
    if emulate:
        done = mem_ref[lax.shift_right_logical(lo + layout.DONE, I32(2))]
        aband = mem_ref[lax.shift_right_logical(lo + layout.ABANDONED, I32(2))]
    else:
        done = _asm(_LOAD_SYS_ASM, [lo, hi, jnp.full((BP,), layout.DONE, I32)], (BP,))
        aband = _asm(_LOAD_SYS_ASM, [lo, hi, jnp.full((BP,), layout.ABANDONED, I32)], (BP,))
    seq = _newer(done, aband) + 1
    live = (i < n).astype(I32)
    head = ((i == 0) & (pid == 0)).astype(I32)
    if emulate:
        pairs_ref[pl.ds(pid * BP, BP), :] = jnp.stack([seq, ids], axis=1)
        seq_ref[pl.ds(pid * BP, BP)] = seq
        return
    seq = _asm(_STORE_PAIR_ASM, [lo, hi, layout.PAIRS + i * 8, seq, ids, live], (BP,))
    seq = _asm(_STORE_PAIR_ASM, [lo, hi, jnp.full((BP,), layout.HEADER, I32), seq, jnp.full((BP,), n, I32), head],
               (BP,))
    seq_ref[pl.ds(pid * BP, BP)] = seq


def _wait_kernel(seq_ref, lo_ref, hi_ref, tmo_ref, dep_ref, *rest, n: int, row_bytes: int, rows_off: int,
                 emulate: bool):
    del dep_ref                                   # an ordering dependency: the wait runs after its producer
    if emulate:
        mem_ref, out_ref, ok_ref = rest
    else:
        out_ref, ok_ref = rest
    words = row_bytes // 4
    wp = _pow2(words)
    pid = pl.program_id(0)
    r = pid * BR + lax.broadcasted_iota(I32, (BR,), 0)
    seq = jnp.full((BR,), seq_ref[0], I32)
    lo, hi = jnp.full((BR,), lo_ref[0], I32), jnp.full((BR,), hi_ref[0], I32)
    if emulate:
        seen = mem_ref[lax.shift_right_logical(lo + layout.DONE, I32(2))]
    else:
        seen = _asm(_SPIN_ASM, [lo, hi, seq, jnp.full((BR,), tmo_ref[0], I32)], (BR,))
    ok = seen == seq
    col = jnp.minimum(lax.broadcasted_iota(I32, (BR, wp), 1), words - 1)
    off = rows_off + jnp.minimum(r, n - 1)[:, None] * I32(row_bytes) + col * I32(4)
    shape = (BR, wp)
    if emulate:
        val = mem_ref[lax.shift_right_logical(lo[:, None] + off, I32(2))]
    else:
        b = lambda a: jnp.broadcast_to(a[:, None], shape)                      # noqa: E731
        val = _asm(_LOAD_SYS_ASM, [b(lo), b(hi), off, b(seen)], shape)
        # a program that gave up says so: lane 0 writes seq to ABANDONED (the asm passes seq through)
        gave_up = ((~ok) & (lax.broadcasted_iota(I32, (BR,), 0) == 0)).astype(I32)
        mark = _asm(_STORE_PAIR_ASM, [lo, hi, jnp.full((BR,), layout.ABANDONED, I32), seq, seq, gave_up], (BR,))
        ok = ok & (mark == seq)                   # always true; keeps the store (its result is used)
    out_ref[pl.ds(pid * BR, BR), :] = jnp.where(ok[:, None], val, 0)
    ok_ref[pl.ds(pid * BR, BR)] = ok.astype(I32)


def _bits(a):
    return lax.bitcast_convert_type(a.astype(jnp.uint32), I32)


def post(ids, lo, hi, *, mem=None, interpret: bool = False):
    """ids [N] int32 row ids; lo / hi [1] uint32 halves of the control block's address -> seq [>= N] int32 (the
    ticket: every element is the request's seq). With `mem` (interpret mode): (seq, pairs [>= N, 2]) where pairs
    are what the kernel stores at PAIRS."""
    n = ids.shape[0]
    steps = -(-n // BP)
    emulate = mem is not None
    out_shape = [jax.ShapeDtypeStruct((steps * BP,), I32)]
    if emulate:
        out_shape.append(jax.ShapeDtypeStruct((steps * BP, 2), I32))
    out = pdl.pallas_call(
        functools.partial(_post_kernel, n=n, emulate=emulate), out_shape=out_shape, grid=(steps,),
        interpret=interpret, name="ple_ring_post",
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(ids.astype(I32), _bits(lo), _bits(hi), *(() if mem is None else (lax.bitcast_convert_type(mem, I32),)))
    return tuple(out) if emulate else out[0]


def wait(seq, lo, hi, timeout_us, dep, n: int, row_bytes: int, max_ids: int, *, mem=None, interpret: bool = False):
    """seq: `post`'s ticket; timeout_us [1] int32; dep: any array this wait must follow (not read); n the request's
    row count, row_bytes a multiple of 4, max_ids the ring's capacity -> (words [N, row_bytes // 4] uint32, ok [>= N]
    int32: 1 where the rows were read, 0 where the deadline passed first and the words are zero)."""
    if row_bytes % 4:
        raise ValueError(f"ple_ring reads 4-byte words: row_bytes={row_bytes} is not a multiple of 4")
    if n > max_ids:
        raise ValueError(f"ple_ring: a request of {n} row ids exceeds the ring's {max_ids}")
    words, wp = row_bytes // 4, _pow2(row_bytes // 4)
    steps = -(-n // BR)
    out, ok = pdl.pallas_call(
        functools.partial(_wait_kernel, n=n, row_bytes=row_bytes, rows_off=layout.rows_offset(max_ids),
                          emulate=mem is not None),
        out_shape=[jax.ShapeDtypeStruct((steps * BR, wp), I32), jax.ShapeDtypeStruct((steps * BR,), I32)],
        grid=(steps,), interpret=interpret, name="ple_ring_wait",
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(seq.astype(I32), _bits(lo), _bits(hi), timeout_us.astype(I32), dep,
      *(() if mem is None else (lax.bitcast_convert_type(mem, I32),)))
    return lax.bitcast_convert_type(out[:n, :words], jnp.uint32), ok
