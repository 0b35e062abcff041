"""FP8 128x128-block weights dequantized to the activation dtype by one Pallas kernel (op "dequant_fp8").

Prefill-sized products (more tokens than the GEMV kernels take) run the model's reference arithmetic: the weight
dequantized in fp32, rounded once to the activation dtype, then the library's product (`reference.linear`). XLA's
fusion for that dequantization reads the FP8 weight far below the memory's speed: an H100 table of a 4-layer
2,048-token prefill chunk (BENCHMARKS.md, fifty-first session) has ~45 us for each hyper-connection weight
(320 x 10240, 3.3 MB of FP8) and 156 us for the GDN input projection (16384 x 2560), ~1.9 ms of the chunk's 11.9
across the dense layers. This kernel writes the same values (each weight times its block's fp32 scale, rounded
once to the output dtype: the same bits as `reference.dequantize(...).astype(dtype)`) with tiles that read the
weight in 16-byte vectors.

Program (i, j): rows [i bn, (i+1) bn) and `cols` column tiles of bk from column j cols bk, each tile inside one
scale block (bn divides the block's rows and bk its columns), its scale one scalar. Weights may be layers of stacks
(`fnx.pallas.stacked.LayerRef`): read in place, no slice copied first.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from fnx.pallas import stacked

F32 = jnp.float32
OP = "dequant_fp8"


@dataclasses.dataclass(frozen=True)
class DequantTiles:
    bn: int            # rows per program (divides the block's rows and N)
    bk: int            # columns per tile (divides the block's columns and K)
    cols: int          # column tiles per program
    num_warps: int = 4


def choose_tiles(n: int, k: int, block=(128, 128)) -> DequantTiles | None:
    """The largest power-of-two tiles (rows up to 64, columns up to 128, up to 4 column tiles a program: ~32K
    weights) that divide the weight and its scale blocks; None where none of at least 8 x 16 does."""
    bo, bi = block
    bn = next((b for b in (64, 32, 16, 8) if n % b == 0 and bo % b == 0), None)
    bk = next((b for b in (128, 64, 32, 16) if k % b == 0 and bi % b == 0), None)
    if bn is None or bk is None:
        return None
    cols = next(c for c in (4, 2, 1) if (k // bk) % c == 0)
    return DequantTiles(bn=bn, bk=bk, cols=cols)


def why_not(shape, block=(128, 128), w_dtype=None) -> str | None:
    """None when the kernel dequantizes a weight of this shape and block, else why not."""
    if len(shape) != 2:
        return f"dequant_fp8: a weight of shape {tuple(shape)} (the kernel takes [N, K])"
    if w_dtype is not None and jnp.dtype(w_dtype) != jnp.float8_e4m3fn:
        return f"dequant_fp8: {jnp.dtype(w_dtype).name} codes (the kernel takes float8_e4m3fn)"
    if choose_tiles(*shape, block) is None:
        return f"dequant_fp8: no tile of at least 8 x 16 divides the weight {tuple(shape)} and its blocks {block}"
    return None


def _kernel(w_ref, s_ref, o_ref, *, t: DequantTiles, block):
    i, j = pl.program_id(0), pl.program_id(1)
    bo, bi = block
    r0 = pl.multiple_of(i * t.bn, t.bn)
    for c in range(t.cols):
        c0 = pl.multiple_of((j * t.cols + c) * t.bk, t.bk)
        q = w_ref[pl.ds(r0, t.bn), pl.ds(c0, t.bk)].astype(F32)
        s = s_ref[r0 // bo, c0 // bi]
        o_ref[pl.ds(r0, t.bn), pl.ds(c0, t.bk)] = (q * s).astype(o_ref.dtype)


def dequantize_fp8(w, scale, block=(128, 128), dtype=jnp.bfloat16, *, interpret: bool = False,
                   tiles: DequantTiles | None = None) -> jax.Array:
    """w float8_e4m3fn [N, K] (or a LayerRef of one), scale fp32 [ceil(N/bo), ceil(K/bi)] -> [N, K] `dtype`:
    round(fp32(w) * scale of its block), the bits of `reference.dequantize("fp8", ...).astype(dtype)`."""
    block = tuple(block)
    why = why_not(w.shape, block, w.dtype)
    if why:
        raise NotImplementedError(why)
    n, k = w.shape
    t = tiles or choose_tiles(n, k, block)
    if n % t.bn or k % (t.bk * t.cols) or block[0] % t.bn or block[1] % t.bk:
        raise ValueError(f"dequant_fp8: tiles {t} do not divide the weight {(n, k)} and its blocks {block}")
    return stacked.call(
        functools.partial(_kernel, t=t, block=block),
        (w, stacked.astype(scale, F32)),
        out_shape=jax.ShapeDtypeStruct((n, k), dtype),
        grid=(n // t.bn, k // (t.bk * t.cols)),
        compiler_params=pltriton.CompilerParams(num_warps=t.num_warps, num_stages=1),
        interpret=interpret,
        name="fnx_dequant_fp8",
    )
