"""MoE decode kernels behind fnx.pallas.dispatch: `route` (op "moe_route") and `experts` (op "moe_experts").

Backends: "reference" (plain jnp), "pallas" (Triton lowering, CUDA), "pallas_interpret" (CPU tests). A Pallas
backend named explicitly raises NotImplementedError for what its kernel does not cover (M above the decode
limit, tiles that do not fit the quantization blocks); under impl=None/"auto" those cases run the reference."""

from __future__ import annotations

import logging

import jax

from fnx.pallas import dispatch
from fnx.pallas.moe import decode_pallas, experts_pallas, reference, routing_pallas

log = logging.getLogger("fnx.pallas")

MAX_ROUTE_TOKENS = routing_pallas.MAX_TOKENS
MAX_DECODE_TOKENS = experts_pallas.MAX_TOKENS
MAX_FUSED_TOKENS = decode_pallas.MAX_TOKENS


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool, dtype=None, impl: str | None = None):
    """Router logits [T, E] -> (weights [T, K] `dtype` (default logits.dtype), expert ids [T, K] int32):
    fp32 softmax, top-k with ties to the lowest id, optional renormalisation."""
    t, e = logits.shape
    why = None
    if t > routing_pallas.MAX_TOKENS or e > routing_pallas.MAX_EXPERTS:
        why = f"the Pallas router takes T <= {routing_pallas.MAX_TOKENS} and E <= {routing_pallas.MAX_EXPERTS}; " \
              f"got T={t}, E={e}"
    backend = dispatch.resolve("moe_route", impl, not_applicable=why)
    if backend == "reference":
        return reference.route(logits, top_k, norm_topk_prob, dtype)
    return routing_pallas.route(logits, top_k, norm_topk_prob, dtype, interpret=dispatch.interpret_flag(backend))


def experts(gate_up, down, x: jax.Array, idx: jax.Array, impl: str | None = None,
            tiles: experts_pallas.Tiles | None = None) -> jax.Array:
    """x [T, D], idx [T, K] -> per-(token, k) expert outputs [T, K, D] (x.dtype). gate_up [E, 2I, D] (gate rows
    then up rows), down [E, D, I]; plain arrays, FP8 128x128-block or NVFP4 (fnx.model.quant layouts)."""
    why = None
    if x.shape[0] > MAX_DECODE_TOKENS:
        why = f"the Pallas decode kernel takes T <= {MAX_DECODE_TOKENS} tokens, got {x.shape[0]} (prefill runs " \
              "the model's 'grouped' path)"
    backend = dispatch.resolve("moe_experts", impl, not_applicable=why)
    if backend == "reference":
        return reference.experts(gate_up, down, x, idx)
    return experts_pallas.experts(gate_up, down, x, idx, interpret=dispatch.interpret_flag(backend), tiles=tiles)


def decode_not_applicable(x, top_k: int, gate_up, down, shared_down,
                          tiles: decode_pallas.DecodeTiles | None = None):
    """None when the fused decode kernels cover these shapes and formats, else why not (for dispatch)."""
    m, d = x.shape
    t = tiles or decode_pallas.default_tiles(d, down.shape[-1], shared_down.shape[-1],
                                             reference.weight_format(gate_up))
    return decode_pallas.check(gate_up, down, shared_down, m, top_k, t)


def decode(x, w, ids, gate_up, down, s_gate, s_up, s_sig, shared_down, impl: str | None = None,
           tiles: decode_pallas.DecodeTiles | None = None) -> jax.Array:
    """The MoE block after its router, op "moe_decode": x [M, D], routing weights w [M, K] and ids [M, K], the
    shared expert's gate / up projections [M, I_s] and gate logit [M, 1], expert weights gate_up [E, 2I, D] and
    down [E, D, I], shared_down [D, I_s] -> [M, D] (x.dtype). Pallas: two launches (fnx.pallas.moe.decode_pallas:
    M <= 8 tokens, bf16/fp32 or FP8-block weights); reference: reference.decode."""
    backend = dispatch.resolve("moe_decode", impl,
                               not_applicable=decode_not_applicable(x, ids.shape[1], gate_up, down, shared_down, tiles))
    if backend == "reference":
        return reference.decode(x, w, ids, gate_up, down, s_gate, s_up, s_sig, shared_down)
    return decode_pallas.moe_decode(x, w, ids, gate_up, down, s_gate, s_up, s_sig, shared_down,
                                    interpret=dispatch.interpret_flag(backend), tiles=tiles)


def experts_blocks(gate_up, down, xb: jax.Array, block_expert: jax.Array, impl: str | None = None,
                   tiles: experts_pallas.Tiles | None = None) -> jax.Array:
    """The prefill grouped matmul, op "moe_grouped": xb [n_blocks, B, D] rows sorted by expert and padded to
    blocks, block_expert [n_blocks] -> y [n_blocks, B, D]. Reference: each block through the gather arithmetic."""
    why = None
    if xb.shape[1] > experts_pallas.MAX_BLOCK_ROWS:
        why = f"blocks of up to {experts_pallas.MAX_BLOCK_ROWS} rows, got {xb.shape[1]}"
    backend = dispatch.resolve("moe_grouped", impl, not_applicable=why)
    if backend == "reference":
        return reference.experts_blocks(gate_up, down, xb, block_expert)
    return experts_pallas.experts_blocks(gate_up, down, xb, block_expert, interpret=dispatch.interpret_flag(backend),
                                         tiles=tiles)
