"""MoE kernels behind fnx.pallas.dispatch: `route` (op "moe_route"), `experts` (op "moe_experts"), the fused
decode layer `decode` (op "moe_decode") and the prefill blocks `experts_blocks` (op "moe_grouped").

Backends: "reference" (plain jnp), "pallas" (Triton lowering, CUDA), "pallas_interpret" (CPU tests). A Pallas
backend named explicitly raises NotImplementedError for what its kernel does not cover (M above the decode
limit, tiles that do not fit the quantization blocks); under impl=None/"auto" those cases run the reference."""

from __future__ import annotations

import logging

import jax

from fnx.pallas import dispatch, kernel_math, stacked
from fnx.pallas.moe import decode_pallas, experts_pallas, reference, routing_pallas

log = logging.getLogger("fnx.pallas")

MAX_ROUTE_TOKENS = routing_pallas.MAX_TOKENS
MAX_DECODE_TOKENS = experts_pallas.MAX_TOKENS
MAX_FUSED_TOKENS = decode_pallas.MAX_TOKENS


ROUTE_ACTS_OP = "moe_route_acts"


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool, dtype=None, impl: str | None = None,
          cols: tuple[int, int] | None = None, acts_of: jax.Array | None = None):
    """Router logits [T, E] -> (weights [T, K] `dtype` (default logits.dtype), expert ids [T, K] int32):
    fp32 softmax, top-k with ties to the lowest id, optional renormalisation. `cols` (start, E): the logits are
    those columns of a wider product [T, W] (the kernel reads them in place; the reference slices).
    acts_of: x [T, D] (the MoE's input): also returns, third, `decode_pallas.mma_activations(x)` (the decode
    kernels' e2m1 "mma" operand). Op "moe_route_acts" (with the router kernel on a Pallas backend) has the router's
    programs write it; otherwise it is an XLA fusion of its own, as when the decode launch computes it."""
    t, e = logits.shape[0], (cols[1] if cols is not None else logits.shape[1])
    why = None
    if t > routing_pallas.MAX_TOKENS or e > routing_pallas.MAX_EXPERTS:
        why = f"the Pallas router takes T <= {routing_pallas.MAX_TOKENS} and E <= {routing_pallas.MAX_EXPERTS}; " \
              f"got T={t}, E={e}"
    backend = dispatch.resolve("moe_route", impl, not_applicable=why)
    fold = False
    if acts_of is not None:
        if acts_of.ndim != 2 or acts_of.shape[0] != t:
            raise ValueError(f"route: acts_of {tuple(acts_of.shape)} must be [T={t}, D]")
        d = acts_of.shape[1]
        not_here = ("the router runs the reference (op moe_route)" if backend == "reference" else
                    f"D={d} is not a multiple of 32" if routing_pallas.acts_chunk(d) is None else None)
        fold = dispatch.resolve(ROUTE_ACTS_OP, None, not_applicable=not_here) != "reference"
    after = () if acts_of is None or fold else (decode_pallas.mma_activations(acts_of),)
    if backend == "reference":
        if cols is not None:
            logits = kernel_math.take_window(logits, cols[0], cols[1])
        return reference.route(logits, top_k, norm_topk_prob, dtype) + after
    return routing_pallas.route(logits, top_k, norm_topk_prob, dtype, interpret=dispatch.interpret_flag(backend),
                                cols=None if cols is None else tuple(cols), acts_of=acts_of if fold else None,
                                num_warps=routing_pallas.default_warps()) + after


PREFILL_ROUTE_OP = "moe_route_prefill"


def route_prefill(logits: jax.Array, top_k: int, norm_topk_prob: bool, dtype=None, impl: str | None = None,
                  cols: tuple[int, int] | None = None):
    """`route` for calls of any number of rows, op "moe_route_prefill": the router kernel over programs of
    `routing_pallas.prefill_block_m()` rows, or the reference (XLA's softmax and lax.top_k, whose sort of every
    row is a kernel of its own). The same contract as `route` without `acts_of`; `cols` read in place."""
    e = cols[1] if cols is not None else logits.shape[1]
    why = None if e <= routing_pallas.MAX_EXPERTS else \
        f"the Pallas router takes E <= {routing_pallas.MAX_EXPERTS}; got E={e}"
    backend = dispatch.resolve(PREFILL_ROUTE_OP, impl, not_applicable=why)
    if backend == "reference":
        if cols is not None:
            logits = kernel_math.take_window(logits, cols[0], cols[1])
        return reference.route(logits, top_k, norm_topk_prob, dtype)
    return routing_pallas.route(logits, top_k, norm_topk_prob, dtype, interpret=dispatch.interpret_flag(backend),
                                cols=None if cols is None else tuple(cols), block_m=routing_pallas.prefill_block_m(),
                                num_warps=routing_pallas.default_warps(), max_tokens=None)


def decode_takes_activations(x, top_k: int, gate_up, down, shared_down,
                             tiles: decode_pallas.DecodeTiles | None = None) -> bool:
    """Whether the decode kernels for this call take their activations as `mma_activations` (e2m1 "mma"), which
    `route(..., acts_of=x)` can make."""
    m, d = x.shape
    t = tiles or decode_pallas.default_tiles(d, down.shape[-1], shared_down.shape[-1],
                                             reference.weight_format(gate_up), m)
    return t.e2m1 in decode_pallas.MMA_DECODES


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
        return reference.experts(*stacked.materialize_tree((gate_up, down)), x, idx)
    return experts_pallas.experts(gate_up, down, x, idx, interpret=dispatch.interpret_flag(backend), tiles=tiles)


def decode_not_applicable(x, top_k: int, gate_up, down, shared_down,
                          tiles: decode_pallas.DecodeTiles | None = None):
    """None when the fused decode kernels cover these shapes and formats, else why not (for dispatch)."""
    m, d = x.shape
    t = tiles or decode_pallas.default_tiles(d, down.shape[-1], shared_down.shape[-1],
                                             reference.weight_format(gate_up), m)
    return decode_pallas.check(gate_up, down, shared_down, m, top_k, t, x.dtype)


def _scanned_reason() -> str | None:
    """Why "auto" keeps the expert kernels off inside a scanned layer group (None outside one)."""
    if not dispatch.scanned_layers():
        return None
    return ("inside a scanned layer group the kernel's expert weights are a slice of the stacked params, which the "
            "loop would copy whole each step (every expert, where decode reads 10 of 512); load with "
            "layers='stacked' (the default on a GPU) or 'unrolled' to run the kernels")


# Token counts up to here run the fused decode kernels under "auto", per expert format, by measurement on the H200
# (released shapes, random router, the layer after XLA's router product; BENCHMARKS.md ninth to eleventh
# sessions), against the gather path: one token FP8 51.8 us vs 82.0 (and the 4-layer FP8 step's kernel time 0.697
# vs 0.727 ms), bf16 58.1 vs 76.6, NVFP4 60.5 vs 94.2; five tokens NVFP4 249.6 vs 268.7 us (the gather path
# dequantizes 50 expert copies), but FP8 244 vs 178 us and bf16 280 vs 181 (commit a616029): slower. With flat
# slots (twenty-fourth session, 6abfc64) five tokens take NVFP4 111.1 vs 276.3 us, FP8 140.0 vs 167.2 us and bf16
# 168.1 vs 180.1 us: every format up to 5 tokens. Eight tokens (twenty-fifth session, 2ac5df2): NVFP4 151.6-162.8
# vs 416.6 us, FP8 193.7 vs 253.2, bf16 238.3-253.3 vs 247.3 (a tie): every format up to the kernels' 8 tokens
# (6 and 7 lie between two measured wins; bf16 at 8 is even).
DECODE_AUTO_MAX_TOKENS = {"dense": 8, "fp8_block": 8, "nvfp4": 8}


def decode_backend(x, top_k: int, gate_up, down, shared_down, impl: str | None = None,
                   tiles: decode_pallas.DecodeTiles | None = None) -> str:
    """The backend op "moe_decode" runs with for this call: dispatch's choice, the reference where the kernels do
    not cover the call, and under "auto" also where they were measured slower (more tokens than
    DECODE_AUTO_MAX_TOKENS gives the expert format) or would read a copy of the layer's stacked experts (a scanned
    layer group)."""
    m = x.shape[0]
    slower = _scanned_reason()
    fmt = reference.weight_format(gate_up)
    limit = DECODE_AUTO_MAX_TOKENS.get(fmt, 1)
    if m > limit:
        slower = (f"{m} tokens of {fmt} experts: the fused kernels are measured faster than the gather path up to "
                  f"{limit} token(s) in this format, and not measured beyond (BENCHMARKS.md)")
    return dispatch.resolve("moe_decode", impl, prefer_reference=slower,
                            not_applicable=decode_not_applicable(x, top_k, gate_up, down, shared_down, tiles))


def decode(x, w, ids, gate_up, down, s_gate, s_up, s_sig, shared_down, impl: str | None = None,
           tiles: decode_pallas.DecodeTiles | None = None, x_acts: jax.Array | None = None) -> jax.Array:
    """The MoE block after its router, op "moe_decode": x [M, D], routing weights w [M, K] and ids [M, K], the
    shared expert's gate / up projections [M, I_s] and gate logit [M, 1], expert weights gate_up [E, 2I, D] and
    down [E, D, I], shared_down [D, I_s] -> [M, D] (x.dtype). Pallas: two launches (fnx.pallas.moe.decode_pallas:
    M <= 8 tokens; bf16 / fp32, FP8-block or NVFP4 weights); reference: reference.decode. Each of s_gate, s_up,
    s_sig may be a window (buffer [M, W], start column) into a wider product, which the kernel reads in place.
    x_acts: `decode_pallas.mma_activations(x)` made already (by the router: `route(..., acts_of=x)`), used where
    the kernels take it (e2m1 "mma") instead of computing it again."""
    backend = decode_backend(x, ids.shape[1], gate_up, down, shared_down, impl, tiles)
    if backend == "reference":
        i_s = shared_down.shape[-1]
        s_gate, s_up, s_sig = (decode_pallas.window_array(a, n, x.shape[0])
                               for a, n in ((s_gate, i_s), (s_up, i_s), (s_sig, 1)))
        gate_up, down, shared_down = stacked.materialize_tree((gate_up, down, shared_down))
        return reference.decode(x, w, ids, gate_up, down, s_gate, s_up, s_sig, shared_down)
    fin = {}
    pool = finish_pool()
    if pool is not None:
        t = tiles or decode_pallas.default_tiles(x.shape[1], down.shape[-1], shared_down.shape[-1],
                                                 reference.weight_format(gate_up), x.shape[0])
        if t.group and not (t.flat and x.shape[0] > 1) and not t.tok and not t.persist2:
            fin = {"counters": pool.buf, "finish_base": pool.take(x.shape[1] // t.bn2)}
    return decode_pallas.moe_decode(x, w, ids, gate_up, down, s_gate, s_up, s_sig, shared_down,
                                    interpret=dispatch.interpret_flag(backend), tiles=tiles, x_acts=x_acts, **fin)


FINISH_ENV = "FNX_MOE_FINISH"


def finish_pool():
    """The counter pool the decode's down kernel takes its combine's counters from (`FNX_MOE_FINISH=1`, read when a
    program is traced: a benchmark knob; the model makes the pool once per decode program, `transformer.make_meta`),
    or None: the combine stays an XLA fusion after the kernel. Tiles whose down kernel has no group partials (group
    0, `tok`), flat slots at several tokens, or resident programs (`persist2`) combine as they do without it."""
    from fnx.pallas import grid_sync
    return grid_sync.pool_if(FINISH_ENV)


# Expert formats whose prefill blocks run the Pallas kernels under "auto", by measurement on the H200 (released
# shapes, blocks of 64 rows, BLOCK_TILES; BENCHMARKS.md tenth session), against XLA's grouped matmul: bf16 1,024
# tokens 2.55 vs 7.90 ms, 4,096 tokens 4.40 vs 14.16 ms; FP8 1,024 tokens 2.29 vs 8.07 ms (lax.ragged_dot: 87 ms);
# NVFP4 (fifteenth session, 95044db; XLA's grouped matmul dequantizes every expert each call) 1,024 tokens 4.40 vs
# 11.95 ms, 4,096 tokens 8.54 vs 20.96 ms (128-row tiles: 6.11 / 11.78 ms).
GROUPED_AUTO_FORMATS = ("dense", "fp8_block", "nvfp4")


def grouped_backend(gate_up, down, block_rows: int, impl: str | None = None,
                    tiles: experts_pallas.Tiles | None = None) -> str:
    """The backend op "moe_grouped" runs with for blocks of `block_rows` rows: dispatch's choice, the reference
    where the kernels do not cover the call, and under "auto" also for expert formats not measured
    (GROUPED_AUTO_FORMATS) and inside a scanned layer group (measured only unrolled; the loop would copy the
    layer's stacked experts out for the call)."""
    fmt = reference.weight_format(gate_up)
    slower = _scanned_reason()
    if fmt not in GROUPED_AUTO_FORMATS:
        slower = f"{fmt} experts: the Pallas prefill blocks are not measured against XLA's grouped matmul for them"
    return dispatch.resolve("moe_grouped", impl, prefer_reference=slower,
                            not_applicable=experts_pallas.blocks_not_applicable(gate_up, down, block_rows, tiles))


def experts_blocks(gate_up, down, xb: jax.Array, block_expert: jax.Array, impl: str | None = None,
                   tiles: experts_pallas.Tiles | None = None, row_of: jax.Array | None = None) -> jax.Array:
    """The prefill grouped matmul, op "moe_grouped": xb [n_blocks, B, D] rows sorted by expert and padded to
    blocks, block_expert [n_blocks] -> y [n_blocks, B, D]. Reference: each block through the gather arithmetic.
    With `row_of` [n_blocks, B] int32, xb is rows [R, D] and block row (b, t) is xb[row_of[b, t]]: the kernels
    prepare their operands on the R rows and gather the results (`experts_pallas.experts_slots`)."""
    backend = grouped_backend(gate_up, down, row_of.shape[1] if row_of is not None else xb.shape[1], impl, tiles)
    if backend == "reference":
        return reference.experts_blocks(*stacked.materialize_tree((gate_up, down)),
                                        xb if row_of is None else xb[row_of], block_expert)
    return experts_pallas.experts_blocks(gate_up, down, xb, block_expert, interpret=dispatch.interpret_flag(backend),
                                         tiles=tiles, row_of=row_of)
