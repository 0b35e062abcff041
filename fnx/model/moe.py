"""Sparse MoE block (MODEL_SPEC.md section 7): softmax top-k routing, routed experts, sigmoid-gated shared expert.

Reference paths with the same arithmetic: `gather` (each token reads its k experts' weights; small token
counts), `grouped` (block-sparse grouped matmul; large token counts) and `ragged` (`lax.ragged_dot`). `pallas`
(`pallas_interpret` on CPU) runs the fnx.pallas.moe decode kernels: fused routing and a weight-major expert
pipeline that reads each distinct expert once; "auto" picks it for T <= 32 tokens where Pallas runs (a GPU)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

from fnx.model import quant
from fnx.model.fuse import linear_windows
from fnx.model.ops import F32, HIGHEST, linear


def route(p: dict, x: jax.Array, top_k: int, norm_topk_prob: bool):
    """x [T, D] -> router logits [T, E] (x.dtype), weights [T, K] (x.dtype), expert ids [T, K] (int32).
    Ties go to the lower expert id."""
    return route_logits(linear(x, p["gate"]), top_k, norm_topk_prob, x.dtype)


def route_logits(logits: jax.Array, top_k: int, norm_topk_prob: bool, dtype):
    """`route` from the router logits [T, E]."""
    probs = jax.nn.softmax(logits.astype(F32), axis=-1)
    w, idx = lax.top_k(probs, top_k)
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return logits, w.astype(dtype), idx


def _route_rows(lw, logits: jax.Array, top_k: int, norm_topk_prob: bool, dtype):
    """The routing of a call on the non-decode paths: past the decode sizes (more than the router kernel's
    MAX_TOKENS rows: prefill chunks) through op "moe_route_prefill" (`api.route_prefill`: the router kernel reading
    the logits in place in the fused product, `lw` their window, where that op resolves to a kernel, else the
    reference's softmax and lax.top_k, `route_logits`' arithmetic); smaller calls `route_logits`. Returns
    (weights, ids)."""
    from fnx.pallas.moe import api as moe_kernels
    if logits.shape[0] > moe_kernels.MAX_ROUTE_TOKENS:
        return moe_kernels.route_prefill(lw.buf, top_k, norm_topk_prob, dtype, cols=(lw.start, lw.size))
    _, w, idx = route_logits(logits, top_k, norm_topk_prob, dtype)
    return w, idx


def _expert_gather(gate_up, down, x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [T, D], idx [T, K] -> per-(token, k) expert outputs [T, K, D]. The expert weights are arrays or
    quantized (`quant.Fp8Block` / `quant.Nvfp4`); only the K chosen experts per token are dequantized."""
    inter = down.shape[-1]
    gu = quant.dequantize(quant.take(gate_up, idx), x.dtype)  # [T, K, 2I, D]
    h = jnp.einsum("td,tkid->tki", x, gu, precision=HIGHEST, preferred_element_type=F32).astype(x.dtype)
    a = jax.nn.silu(h[..., :inter]) * h[..., inter:]
    dn = quant.dequantize(quant.take(down, idx), x.dtype)  # [T, K, D, I]
    return jnp.einsum("tki,tkdi->tkd", a, dn, precision=HIGHEST, preferred_element_type=F32).astype(x.dtype)


def _expert_ragged(gate_up, down, x: jax.Array, idx: jax.Array) -> jax.Array:
    """As `_expert_gather`, tokens grouped by expert. Quantized experts are dequantized whole (reference path)."""
    t, k = idx.shape
    n_exp, inter = gate_up.shape[0], down.shape[-1]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = x[order // k]                                      # [T*K, D], grouped by expert
    sizes = jnp.bincount(flat, length=n_exp).astype(jnp.int32)
    h = lax.ragged_dot(xs, jnp.swapaxes(quant.dequantize(gate_up, x.dtype), 1, 2), sizes,
                       precision=HIGHEST, preferred_element_type=F32).astype(x.dtype)
    a = jax.nn.silu(h[:, :inter]) * h[:, inter:]
    out = lax.ragged_dot(a, jnp.swapaxes(quant.dequantize(down, x.dtype), 1, 2), sizes,
                         precision=HIGHEST, preferred_element_type=F32).astype(x.dtype)
    unsorted = jnp.zeros_like(out).at[order].set(out)
    return unsorted.reshape(t, k, -1)


GROUPED_BLOCK = 64      # rows per block of the grouped matmul
GROUPED_BLOCK_ENV = "FNX_MOE_GROUPED_BLOCK"
ROWS_FIRST_ENV = "FNX_MOE_ROWS_FIRST"


def rows_first_on() -> bool:
    """Whether the grouped path hands the Pallas blocks the token rows and each block row's index
    (`FNX_MOE_ROWS_FIRST`, read when a program is traced; on by default, `=0` turns it off) instead of the rows
    gathered into blocks: the kernels' operand preparation (NVFP4's even / odd columns, the fp16 prescale's row
    maxima) then runs on T + 1 rows rather than on every padded block row, and the gather writes the prepared
    operands. The same values: each step is per row. Measured on the H200 (4 layers, 2026-12-06): a 512-token
    chunk 5,647 against 5,816 us of kernels, a 2,048-token chunk 18,182 against 18,398."""
    v = os.environ.get(ROWS_FIRST_ENV, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{ROWS_FIRST_ENV}={v!r}: use 1 (prepare the rows, then gather) or 0 (gather first)")
    return v == "1"


def grouped_block() -> int:
    """Rows per block of the grouped matmul (`FNX_MOE_GROUPED_BLOCK`, read when a program is traced; a GPU knob):
    GROUPED_BLOCK (64) by default, or a power of two in [16, 128]. Each block holds one expert's rows, padded (a
    512-token chunk of the released model, ~10 rows an expert, fills 64-row blocks to ~16%), and reads its
    expert's weights once. Smaller blocks measured slower on an H100 (4 layers, 2026-12-06): a 512-token chunk
    7,442 us at 16 rows and 6,695 at 32 against 6,175 at 64; a 2,048-token chunk 22,496 at 32 against 19,490."""
    v = os.environ.get(GROUPED_BLOCK_ENV, "").strip() or str(GROUPED_BLOCK)
    if not v.isdigit() or int(v) not in (16, 32, 64, 128):
        raise ValueError(f"{GROUPED_BLOCK_ENV}={v!r}: use 16, 32, 64 or 128")
    return int(v)


def _expert_grouped(gate_up, down, x: jax.Array, idx: jax.Array, block: int = GROUPED_BLOCK,
                    blocks_per_step: int = 8, kernel: str | None = None, tiles=None):
    """Block-sparse grouped matmul: (token, k) pairs sorted by expert, each expert's group padded to whole blocks
    of `block` rows, so every block reads one expert's weights once. Weight traffic ~ (T*K/block + E) experts,
    memory bounded; the prefill path for large token counts. `kernel` (a fnx.pallas backend name): the blocks go
    through the Pallas grouped kernels (op moe_grouped, one launch per stage over every block) instead of
    `blocks_per_step` blocks at a time under lax.map."""
    t, k = idx.shape
    n_exp, inter = down.shape[0], down.shape[-1]
    n = t * k
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)                      # pair ids sorted by expert
    sizes = jnp.bincount(flat, length=n_exp)
    padded = (sizes + block - 1) // block * block
    ends_padded = jnp.cumsum(padded)
    starts_padded, starts = ends_padded - padded, jnp.cumsum(sizes) - sizes
    e_sorted = flat[order]
    dest = starts_padded[e_sorted] + jnp.arange(n) - starts[e_sorted]
    # blocks in use: sum over experts of ceil(size / block) <= ceil(n / block) + (experts with a token), and at most
    # min(n, E) experts have one; the blocks past the used ones read expert E-1 and are never gathered back
    n_blocks = -(-n // block) + min(n, n_exp)
    if kernel is None:                                          # lax.map below takes blocks_per_step at a time
        n_blocks += (-n_blocks) % blocks_per_step
    src = jnp.full((n_blocks * block,), n, jnp.int32).at[dest].set(order.astype(jnp.int32))
    # each block's expert: how many padded group ends lie at or before its first row. One [blocks, E] comparison
    # (the default "scan" method is a 10-step loop whose carries XLA copies each step: in an H100 prefill table ~42
    # launches a MoE layer and chunk, 169 of a 4-layer chunk's 709)
    block_expert = jnp.minimum(jnp.searchsorted(ends_padded, jnp.arange(n_blocks) * block, side="right",
                                                method="compare_all"), n_exp - 1)
    xz = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    row_of = jnp.where(src < n, src // k, t)
    rows_first = kernel is not None and rows_first_on()
    xs = None if rows_first else xz[row_of]

    def run(args):
        xb, eb = args
        gu = quant.dequantize(quant.take(gate_up, eb), x.dtype)                # [bps, 2I, D]
        h = jnp.einsum("bnd,bid->bni", xb, gu, precision=HIGHEST, preferred_element_type=F32).astype(x.dtype)
        a = jax.nn.silu(h[..., :inter]) * h[..., inter:]
        dn = quant.dequantize(quant.take(down, eb), x.dtype)                   # [bps, D, I]
        return jnp.einsum("bni,bdi->bnd", a, dn, precision=HIGHEST, preferred_element_type=F32).astype(x.dtype)

    if kernel is not None:
        # the unused blocks hold expert E, which the kernels skip (no weight reads)
        from fnx.pallas.moe import api as moe_kernels
        unused = jnp.arange(n_blocks) * block >= ends_padded[-1]
        be = jnp.where(unused, n_exp, block_expert).astype(jnp.int32)
        if rows_first:      # the kernels' row-wise operand preparation on the T + 1 rows, then the gather
            out = moe_kernels.experts_blocks(gate_up, down, xz, be, impl=kernel, tiles=tiles,
                                             row_of=row_of.reshape(n_blocks, block).astype(jnp.int32))
        else:
            out = moe_kernels.experts_blocks(gate_up, down, xs.reshape(n_blocks, block, -1), be, impl=kernel,
                                             tiles=tiles)
        out = out.reshape(n_blocks * block, -1)
    else:
        out = lax.map(run, (xs.reshape(-1, blocks_per_step, block, x.shape[1]),
                            block_expert.reshape(-1, blocks_per_step))).reshape(n_blocks * block, -1)
    # where each (token, k) pair's output row lies in `out`: the inverse of `order` by a scatter (it is a
    # permutation: no second sort), then `dest` through it, materialized (the barrier) so that the gather below is
    # one indexed read per pair. Fused into the gather and the weighted sum after it (as `out[dest][argsort(order)]`
    # was: an H100 prefill table, 2,048 tokens, 4 layers), XLA recomputed the cumsums behind `dest` inside the
    # [T, D] loop: 386 us a layer for 105 MB of rows
    inv = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    rows = lax.optimization_barrier(dest.astype(jnp.int32)[inv])
    return out[rows].reshape(t, k, -1)


# Token counts up to here take the gather path under "auto": decode batches and MTP verify windows (slots x
# (k+1)). The grouped matmul reads whole blocks per expert and loops over them (a while loop the host drives on a
# GPU); at decode sizes nearly every pair has its own expert, so gather's T*K expert reads are about the distinct
# experts' bytes, fused into the dots, with no loop. On the H200 (4 layers, bf16) 8 engine slots took 30.8 ms
# per step on the grouped path, which read every expert (commit c74db63).
GATHER_MAX_TOKENS = 64


def _auto_impl(tokens: int, top_k: int, p: dict | None = None, x: jax.Array | None = None) -> str:
    """"decode" (the fused MoE decode kernels after the router: two launches) where fnx.pallas.dispatch runs op
    "moe_decode" on Pallas for this call (it covers M <= 8 tokens; "auto" takes it where it was measured faster:
    fnx.pallas.moe.api.decode_backend); else the older Pallas expert kernels for T <= 32 tokens where dispatch picks
    them; else gather up to GATHER_MAX_TOKENS tokens (or T*K <= 64); beyond, the grouped matmul, its blocks through
    the Pallas kernels where dispatch runs op "moe_grouped" on Pallas for them (api.grouped_backend)."""
    from fnx.pallas import dispatch
    from fnx.pallas.moe import api as moe_kernels
    if p is not None and x is not None and tokens <= moe_kernels.MAX_FUSED_TOKENS and \
            _decode_backend(p, x, top_k, None) != "reference":
        return "decode"
    if tokens <= moe_kernels.MAX_DECODE_TOKENS and dispatch.resolve("moe_experts", None) == "pallas":
        return "pallas"
    if tokens <= GATHER_MAX_TOKENS or tokens * top_k <= 64:
        return "gather"
    if p is not None and moe_kernels.grouped_backend(p["experts"]["gate_up_proj"], p["experts"]["down_proj"],
                                                     grouped_block()) == "pallas":
        return "grouped_pallas"
    return "grouped"


def _decode_backend(p: dict, x: jax.Array, top_k: int, impl: str | None) -> str:
    """The backend op "moe_decode" resolves to for this call (dispatch logs a reference choice once)."""
    from fnx.pallas.moe import api as moe_kernels
    ex = p["experts"]
    return moe_kernels.decode_backend(x, top_k, ex["gate_up_proj"], ex["down_proj"],
                                      p["shared_expert"]["down_proj"], impl)


def moe_block(p: dict, x: jax.Array, top_k: int, norm_topk_prob: bool, impl: str = "auto"):
    """x [..., D] -> (y [..., D], router logits [..., E], expert ids [..., K])."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    ex = p["experts"]
    if impl == "auto":
        impl = _auto_impl(xt.shape[0], top_k, p, xt)
    # the router and the shared expert's projections read the same input: one product when fused
    wins = linear_windows(xt, p, ("gate", "shared_expert/gate_proj", "shared_expert/up_proj", "shared_expert_gate"))
    if isinstance(impl, str) and impl in ("decode", "decode_interpret"):
        # routing, experts, combine and shared expert in three launches (route + the two decode kernels); the
        # router runs on the same backend as the experts. A reference choice runs the gather path below. The
        # kernels read the router logits and the shared expert's inputs in place in the fused products (no slice
        # kernels between the products and the launches).
        from fnx.pallas.moe import api as moe_kernels
        backend = _decode_backend(p, xt, top_k, None if impl == "decode" else "pallas_interpret")
        if backend != "reference":
            lw, gw, uw, sw = wins
            # where the decode kernels take their activations as fp16 pairs (e2m1 "mma"), the router makes them
            # (its programs write them where op "moe_route_acts" is on; else one XLA fusion, as before)
            takes = moe_kernels.decode_takes_activations(xt, top_k, ex["gate_up_proj"], ex["down_proj"],
                                                         p["shared_expert"]["down_proj"])
            w, idx, *acts = moe_kernels.route(lw.buf, top_k, norm_topk_prob, xt.dtype, impl=backend,
                                              cols=(lw.start, lw.size), acts_of=xt if takes else None)
            y = moe_kernels.decode(xt, w, idx, ex["gate_up_proj"], ex["down_proj"], (gw.buf, gw.start),
                                   (uw.buf, uw.start), (sw.buf, sw.start), p["shared_expert"]["down_proj"],
                                   impl=backend, x_acts=acts[0] if acts else None)
            return y.reshape(shape), lw.get().reshape(*shape[:-1], -1), idx.reshape(*shape[:-1], top_k)
        impl = "gather"
    logits, s_gate, s_up, s_sig = (w_.get() for w_ in wins)
    if isinstance(impl, str) and impl in ("pallas", "pallas_interpret"):
        from fnx.pallas.moe import api as moe_kernels
        w, idx = moe_kernels.route(logits, top_k, norm_topk_prob, xt.dtype, impl=impl)
    else:
        w, idx = _route_rows(wins[0], logits, top_k, norm_topk_prob, xt.dtype)
    if callable(impl):  # a mesh-aware expert runner (fnx.parallel.ExpertParallel): per-shard experts + one psum
        outs = impl(ex["gate_up_proj"], ex["down_proj"], xt, idx)
    elif impl == "gather":
        outs = _expert_gather(ex["gate_up_proj"], ex["down_proj"], xt, idx)
    elif impl == "grouped":
        outs = _expert_grouped(ex["gate_up_proj"], ex["down_proj"], xt, idx,
                               block=grouped_block())
    elif impl in ("grouped_pallas", "grouped_interpret"):     # the grouped matmul through the Pallas kernels
        outs = _expert_grouped(ex["gate_up_proj"], ex["down_proj"], xt, idx,
                               block=grouped_block(),
                               kernel="pallas" if impl == "grouped_pallas" else "pallas_interpret")
    elif impl == "ragged":
        outs = _expert_ragged(ex["gate_up_proj"], ex["down_proj"], xt, idx)
    elif impl in ("pallas", "pallas_interpret"):
        outs = moe_kernels.experts(ex["gate_up_proj"], ex["down_proj"], xt, idx, impl=impl)
    else:
        raise ValueError(f"unknown MoE implementation {impl!r}; expected 'auto', 'gather', 'grouped', 'ragged', "
                         "'pallas', 'pallas_interpret', 'decode', 'decode_interpret', 'grouped_pallas' or "
                         "'grouped_interpret'")
    # weight each expert output (rounded), then sum over k in fp32 and round once
    routed = jnp.sum((outs * w[..., None]).astype(F32), axis=1).astype(x.dtype)
    s = linear(jax.nn.silu(s_gate) * s_up, p["shared_expert"]["down_proj"])
    s = jax.nn.sigmoid(s_sig) * s
    y = routed + s
    return y.reshape(shape), logits.reshape(*shape[:-1], -1), idx.reshape(*shape[:-1], top_k)
