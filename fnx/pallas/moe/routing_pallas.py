"""Top-k softmax routing in one Pallas (Triton lowering) launch: logits [M, E] -> weights [M, K], ids [M, K].
Decode-sized calls (M <= MAX_TOKENS, op "moe_route") and prefill chunks (op "moe_route_prefill", programs of
`prefill_block_m()` rows: where XLA runs a softmax fusion and a full sort of each row for lax.top_k).

Each program holds a [block_m, E] block of rows (E <= 1024, rounded up to a power of two): fp32 softmax
(max, exp, sum, divide, as jax.nn.softmax), then K rounds of "take the maximum, lowest id among equals, knock
it out", then the optional renormalisation (the K weights summed in k order) and one rounding."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fnx.pallas import kernel_math, pdl

F32 = jnp.float32
MAX_TOKENS = 64
MAX_EXPERTS = 1024
# Rows per program. The kernel's K rounds of max / argmin are reductions along each row, so a program's latency
# grows with its rows while rows in separate programs run side by side: in the 48-layer MTP round on the H200
# (1e3722f) a five-token call in one program of 8 rows took 10.5 us, a one-token call (one row) 3.7 us. One row
# per program gives five tokens five one-row programs (not yet timed on its own).
BLOCK_M = 1
WARPS_ENV = "FNX_MOE_ROUTE_WARPS"   # the router kernel's warps (1, 2, 4, 8; default 4), read when a program is traced:
                                    # at one row its softmax and K max / argmin passes are block reductions, each a
                                    # shared-memory exchange and barrier at 4 warps, shuffles alone at 1 (a benchmark
                                    # knob; at 1 level with 4 in the 4-layer step and round on an H100, 2026-12-06)


PREFILL_BLOCK_ENV = "FNX_MOE_ROUTE_PREFILL_BLOCK"   # rows per program of the prefill router (op
                                    # "moe_route_prefill"; 1..64, a power of two; default PREFILL_BLOCK_M), read when a
                                    # program is traced: a benchmark knob
PREFILL_BLOCK_M = 8                 # a prefill chunk's 2,048 rows as 256 programs of [8, 512]: the 4-layer 2,048-token
                                    # chunk (H100, 715b89e) -160 us against XLA's routing, -82 at 1 row a program


def prefill_block_m() -> int:
    """Rows per program of the prefill router: FNX_MOE_ROUTE_PREFILL_BLOCK where set, else PREFILL_BLOCK_M."""
    import os
    spec = os.environ.get(PREFILL_BLOCK_ENV, "").strip()
    if not spec:
        return PREFILL_BLOCK_M
    if not spec.isdigit() or int(spec) not in (1, 2, 4, 8, 16, 32, 64):
        raise ValueError(f"{PREFILL_BLOCK_ENV}={spec!r}: a power of two from 1 to 64 (rows per program)")
    return int(spec)


def default_warps() -> int:
    """The router kernel's num_warps: FNX_MOE_ROUTE_WARPS where set, else 4."""
    import os
    spec = os.environ.get(WARPS_ENV, "").strip()
    if not spec:
        return 4
    if spec not in ("1", "2", "4", "8"):
        raise ValueError(f"{WARPS_ENV}={spec!r}: 1, 2, 4 or 8")
    return int(spec)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _acts_row(x_ref, acts_ref, r, d: int, cw: int):
    """Row r of `decode_pallas.mma_activations(x)` (the MoE's e2m1 "mma" activation operand): x' = x * 2^s
    (`kernel_math.hfma_prescale` of the row's max |x|) as fp16 pairs {x'[2p], x'[2p + 1]} in uint32 words, and the
    fp32 bits of 2^-s in the last column. x read in chunks of cw columns (even and odd ones as two strided loads)."""
    mx = None
    for c in range(d // cw):
        t = jnp.max(jnp.abs(x_ref[r, pl.ds(c * cw, cw)].astype(F32)))
        mx = t if mx is None else jnp.maximum(mx, t)
    up, down = kernel_math.hfma_prescale(mx)
    to16 = lambda v: (v.astype(F32) * up).astype(jnp.float16).astype(F32)  # noqa: E731
    for c in range(d // cw):
        even, odd = (to16(x_ref[r, pl.ds(c * cw + h, cw // 2, stride=2)]) for h in (0, 1))
        acts_ref[r, pl.ds(c * cw // 2, cw // 2)] = kernel_math.hfma_pairs(even, odd)
    # the scale's word: a 16-wide store masked to its one column (the row's last)
    col = d // 2 + jnp.arange(16, dtype=jnp.int32)
    word = jnp.full((16,), lax.bitcast_convert_type(down, jnp.uint32), jnp.uint32)
    plgpu.store(acts_ref.at[r, col], word, mask=col == d // 2)


def _route_kernel(logits_ref, *refs, m, e, c0, k, norm, bm, be, bk, acts=None):
    if acts is not None:
        x_ref, w_ref, ids_ref, acts_ref = refs
    else:
        w_ref, ids_ref = refs
    r0 = pl.program_id(0) * bm
    if acts is not None:        # one row per program (bm = 1): the activation operand of the row's token
        _acts_row(x_ref, acts_ref, r0, *acts)
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


def acts_chunk(d: int) -> int | None:
    """The columns per chunk the router's programs read a token's activations in (`_acts_row`): the largest power
    of two up to 512 dividing D (at least 32), or None."""
    return next((c for c in (512, 256, 128, 64, 32) if d % c == 0), None)


@functools.partial(jax.jit, static_argnames=("top_k", "norm_topk_prob", "dtype", "interpret", "block_m",
                                             "num_warps", "cols", "max_tokens"))
def route(logits: jax.Array, top_k: int, norm_topk_prob: bool, dtype=None, interpret: bool = False,
          block_m: int = BLOCK_M, num_warps: int = 4, cols: tuple[int, int] | None = None, acts_of=None,
          max_tokens: int | None = MAX_TOKENS):
    """logits [M, E] -> (weights [M, K] `dtype`, ids [M, K] int32), as reference.route; programs of `block_m`
    rows (a power of two), one launch. `cols` (start, E): the logits are those columns of a wider product
    [M, W], read in place. `acts_of`: x [M, D] (one row per program): the programs also write
    `decode_pallas.mma_activations(x)` [M, D / 2 + 1] uint32 (the decode kernels' e2m1 "mma" operand), returned
    third, in place of an XLA fusion of its own. `max_tokens` None: any M (the prefill router, op
    "moe_route_prefill": programs of `block_m` rows, the grid over M)."""
    m, w_cols = logits.shape
    c0, e = cols if cols is not None else (0, w_cols)
    if c0 < 0 or e <= 0 or c0 + e > w_cols:
        raise ValueError(f"router columns [{c0}, {c0 + e}) are outside the product's {w_cols} columns")
    if (max_tokens is not None and m > max_tokens) or e > MAX_EXPERTS or top_k > e:
        raise NotImplementedError(f"the Pallas router handles M <= {max_tokens} tokens, E <= {MAX_EXPERTS} "
                                  f"experts and top_k <= E; got M={m}, E={e}, top_k={top_k}; use the reference")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"route: block_m {block_m} must be a power of two")
    dtype = jnp.dtype(dtype or logits.dtype)
    bm, be, bk = min(_pow2(m), _pow2(block_m)), _pow2(e), _pow2(top_k)
    out_shape = [jax.ShapeDtypeStruct((m, top_k), dtype), jax.ShapeDtypeStruct((m, top_k), jnp.int32)]
    acts, args = None, (logits,)
    if acts_of is not None:
        d = acts_of.shape[-1]
        if acts_of.shape != (m, d) or bm != 1 or acts_chunk(d) is None:
            raise ValueError(f"route: acts_of {tuple(acts_of.shape)} must be [M={m}, D] with D a multiple of 32, one "
                             f"row per program (block_m 1, got {block_m})")
        acts, args = (d, acts_chunk(d)), (logits, acts_of)
        out_shape.append(jax.ShapeDtypeStruct((m, d // 2 + 1), jnp.uint32))
    kernel = functools.partial(_route_kernel, m=m, e=e, c0=c0, k=top_k, norm=norm_topk_prob, bm=bm, be=be, bk=bk,
                               acts=acts)
    return pdl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(pl.cdiv(m, bm),),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="moe_route",
    )(*args)
