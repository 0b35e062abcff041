"""The UVA row gather in Pallas (Triton lowering): a GPU kernel that reads the n-gram table's rows straight from
page-locked host memory through their host addresses (unified virtual addressing: a pinned_host buffer's host
pointer is also its device address), so a step's PLE rows need no host thread, no copy and no host round trip.

Grid (ceil(N / BR),): each program takes BR row requests; per request it finds the chunk (a compare and sum over
the C chunk starts), and loads the row's words (padded to WP, a power of two: the lanes past the row reload its
last word and are sliced off) with one inline-PTX `ld.global.u32` per word from the 64-bit address built in
registers (base lo/hi + the 32-bit offset in the chunk). In interpret mode (the CPU tests) the same addresses are
read from a stand-in array (byte address a = word a // 4), since an interpreter cannot read raw addresses."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fnx.pallas import pdl

I32 = jnp.int32         # Triton tensors are signless: addresses and words travel as int32 bit patterns (the
                        # arithmetic wraps as uint32's would; the PTX reads them unsigned)
BR = 16                 # row requests per program

# dst = *(u32 *)((hi:lo) + off): the address assembled from two 32-bit halves (x64 is off in JAX), the offset
# widened to 64 bits and added. A plain global load: host memory mapped into the device's address space.
_LOAD_ASM = """{
.reg .b64 a, o;
mov.b64 a, {$1, $2};
cvt.u64.u32 o, $3;
add.u64 a, a, o;
ld.global.u32 $0, [a];
}"""


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(ids_ref, starts_ref, lo_ref, hi_ref, *rest, n: int, c: int, row_bytes: int, emulate: bool):
    mem_ref, out_ref = rest if emulate else (None, rest[0])
    words = row_bytes // 4
    wp = _pow2(words)
    cp = _pow2(c)
    r = pl.program_id(0) * BR + lax.broadcasted_iota(jnp.int32, (BR,), 0)
    ids = ids_ref[jnp.minimum(r, n - 1)]
    cpos = lax.broadcasted_iota(jnp.int32, (cp,), 0)
    starts = starts_ref[jnp.minimum(cpos, c - 1)]
    starts = jnp.where(cpos < c, starts, jnp.int32(2**31 - 1))
    chunk = jnp.sum(jnp.where(starts[None, :] <= ids[:, None], 1, 0), axis=1) - 1          # [BR]
    first = jnp.sum(jnp.where(cpos[None, :] == chunk[:, None], starts[None, :], 0), axis=1)
    lo = lo_ref[chunk]
    hi = hi_ref[chunk]
    col = jnp.minimum(lax.broadcasted_iota(jnp.int32, (BR, wp), 1), words - 1)
    off = (ids - first)[:, None] * I32(row_bytes) + col * I32(4)       # [BR, WP], wraps past 2^31 like uint32
    shape = (BR, wp)
    lo2, hi2 = jnp.broadcast_to(lo[:, None], shape), jnp.broadcast_to(hi[:, None], shape)
    if emulate:
        val = mem_ref[lax.shift_right_logical(lo2 + off, I32(2))]      # emulated addresses stay below 2^31
    else:
        val = plgpu.elementwise_inline_asm(_LOAD_ASM, args=[lo2, hi2, off], constraints="=r,r,r,r", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(shape, I32)])[0]
    out_ref[pl.ds(pl.program_id(0) * BR, BR), :] = val


def gather_words(ids, starts, lo, hi, row_bytes: int, *, mem=None, interpret: bool = False):
    """ids [N] int32 (rows of the table), starts [C] int32, lo / hi [C] uint32 (the chunks' base addresses) ->
    [N, row_bytes // 4] uint32. mem: the stand-in memory (uint32 words) that interpret mode reads; on a GPU None
    (the addresses are real). row_bytes a multiple of 4, each chunk's rows * row_bytes < 2^32."""
    n, c = ids.shape[0], starts.shape[0]
    if row_bytes % 4:
        raise ValueError(f"uva_gather reads 4-byte words: row_bytes={row_bytes} is not a multiple of 4")
    if (mem is None) == interpret:
        raise ValueError("uva_gather: interpret mode reads a stand-in `mem` array, the GPU kernel real addresses "
                         f"(interpret={interpret}, mem given: {mem is not None})")
    words, wp = row_bytes // 4, _pow2(row_bytes // 4)
    steps = -(-n // BR)
    bits = lambda a: lax.bitcast_convert_type(a.astype(jnp.uint32), I32)                   # noqa: E731
    args = (ids.astype(I32), starts.astype(I32), bits(lo), bits(hi))
    out = pdl.pallas_call(
        functools.partial(_kernel, n=n, c=c, row_bytes=row_bytes, emulate=mem is not None),
        out_shape=jax.ShapeDtypeStruct((steps * BR, wp), I32), grid=(steps,), interpret=interpret,
        name="uva_gather", compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
    )(*args, *(() if mem is None else (lax.bitcast_convert_type(mem, I32),)))
    return lax.bitcast_convert_type(out[:n, :words], jnp.uint32)
