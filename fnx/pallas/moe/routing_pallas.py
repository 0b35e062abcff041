"""Top-k softmax routing in one Pallas (Triton lowering) launch: logits [M, E] -> weights [M, K], ids [M, K].

Each program holds a [block_m, E] block of rows (E <= 1024, rounded up to a power of two): fp32 softmax
(max, exp, sum, divide, as jax.nn.softmax), then K rounds of "take the maximum, lowest id among equals, knock
it out", then the optional renormalisation (the K weights summed in k order) and one rounding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
MAX_TOKENS = 64
MAX_EXPERTS = 1024
# Rows per program. The kernel's K rounds of max / argmin are reductions along each row, so a program's latency
# grows with its rows while rows in separate programs run side by side: in the 48-layer MTP round on the H200
# (1e3722f) a five-token call in one program of 8 rows took 10.5 us, a one-token call (one row) 3.7 us. One row
# per program gives five tokens five one-row programs (not yet timed on its own).
BLOCK_M = 1


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _route_kernel(logits_ref, w_ref, ids_ref, *, m, e, c0, k, norm, bm, be, bk):
    r0 = pl.program_id(0) * bm
    rows = r0 + jax.lax.broadcasted_iota(jnp.int32, (bm, be), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (bm, be), 1)
    valid = (rows < m) & (cols < e)
    x = plgpu.load(logits_ref.at[pl.ds(r0, bm), pl.ds(c0, be)], mask=valid, other=0.0).astype(F32)
    x = jnp.where(cols < e, x, -jnp.inf)
    x_max = jnp.max(x, axis=1, keepdims=True)
    un = jnp.exp(x - x_max)
    p = un / jnp.sum(un, axis=1, keepdims=True)
    p = jnp.where(cols < e, p, -1.0)                     # padded experts sort below every probability
    kcol = jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 1)
    w_out = jnp.zeros((bm, bk), F32)
    id_out = jnp.zeros((bm, bk), jnp.int32)
    total = jnp.zeros((bm, 1), F32)
    for j in range(k):
        top = jnp.max(p, axis=1, keepdims=True)                                          # [bm, 1]
        pick = jnp.min(jnp.where(p == top, cols, be), axis=1, keepdims=True)             # lowest id wins ties
        w_out = jnp.where(kcol == j, top, w_out)
        id_out = jnp.where(kcol == j, pick, id_out)
        total = total + top
        p = jnp.where(cols == pick, -2.0, p)
    if norm:
        w_out = w_out / total
    krows = r0 + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 0)
    out_mask = (krows < m) & (kcol < k)
    plgpu.store(w_ref.at[pl.ds(r0, bm), pl.ds(0, bk)], w_out.astype(w_ref.dtype), mask=out_mask)
    plgpu.store(ids_ref.at[pl.ds(r0, bm), pl.ds(0, bk)], id_out, mask=out_mask)


@functools.partial(jax.jit, static_argnames=("top_k", "norm_topk_prob", "dtype", "interpret", "block_m",
                                             "num_warps", "cols"))
def route(logits: jax.Array, top_k: int, norm_topk_prob: bool, dtype=None, interpret: bool = False,
          block_m: int = BLOCK_M, num_warps: int = 4, cols: tuple[int, int] | None = None):
    """logits [M, E] -> (weights [M, K] `dtype`, ids [M, K] int32), as reference.route; programs of `block_m`
    rows (a power of two), one launch. `cols` (start, E): the logits are those columns of a wider product
    [M, W], read in place."""
    m, w_cols = logits.shape
    c0, e = cols if cols is not None else (0, w_cols)
    if c0 < 0 or e <= 0 or c0 + e > w_cols:
        raise ValueError(f"router columns [{c0}, {c0 + e}) are outside the product's {w_cols} columns")
    if m > MAX_TOKENS or e > MAX_EXPERTS or top_k > e:
        raise NotImplementedError(f"the Pallas router handles M <= {MAX_TOKENS} tokens, E <= {MAX_EXPERTS} "
                                  f"experts and top_k <= E; got M={m}, E={e}, top_k={top_k}; use the reference")
    dtype = jnp.dtype(dtype or logits.dtype)
    bm, be, bk = min(_pow2(m), _pow2(block_m)), _pow2(e), _pow2(top_k)
    kernel = functools.partial(_route_kernel, m=m, e=e, c0=c0, k=top_k, norm=norm_topk_prob, bm=bm, be=be, bk=bk)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m, top_k), dtype), jax.ShapeDtypeStruct((m, top_k), jnp.int32)),
        grid=(pl.cdiv(m, bm),),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="moe_route",
    )(logits)
