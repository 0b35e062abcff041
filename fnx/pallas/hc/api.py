"""Dispatch for the hyper-connection layer boundary (op name "hc_boundary")."""

from __future__ import annotations

from fnx.pallas import dispatch
from fnx.pallas.hc import reference

OP = "hc_boundary"            # 2..32 tokens: pallas.hc_boundary (padded MMA tiles, two kernels + two XLA steps)
OP_M1 = "hc_boundary_m1"      # one token: pallas.hc_boundary_m1 (two kernels, nothing between them)
OP_FEW = "hc_boundary_few"    # 2..FEW tokens (an MTP verify window): few.hc_boundary_few (MMA tiles, XLA norm);
                              # Tiles1 name the earlier design (the one-token kernels over each token)
OP_ONE = "hc_boundary_one"    # one token in one launch: one.hc_boundary_one (the two kernels' tasks, a grid barrier
                              # between); only where FNX_KERNELS names it (not measured on a GPU yet)
OP_FEW_ONE = "hc_boundary_few_one"   # 2..FEW tokens in one launch: one.hc_boundary_one_few (tensor-core down tasks,
                                     # hc_up1's tasks over the tokens); only where FNX_KERNELS names it
OP_PREFILL = "hc_boundary_prefill"   # more than MAX_DECODE_TOKENS tokens (a prefill chunk): prefill.hc_boundary_prefill
                                     # (two launches and XLA's mid; bf16 or FP8 Wdown / Wup); only where named until
                                     # its compiled tests pass and it is measured
MAX_DECODE_TOKENS = 32       # the decode designs take at most this many tokens; longer calls are OP_PREFILL's
MAX_FEW_TOKENS = 8           # = pallas.FEW_MAX_TOKENS


def op_for(tokens: int) -> str:
    """The dispatch op name of a boundary over `tokens` tokens (FNX_KERNELS names them separately: the
    one-token kernels are on under auto, the multi-token ones measured slower than XLA and are not). 2..8 tokens
    try OP_FEW first (see `choose`)."""
    return OP_M1 if tokens == 1 else OP


def choose(impl: str | None, not_applicable: str | None, tokens: int, fp8: bool = False,
           pow2_streams: bool = True) -> tuple[str, str]:
    """(op, backend) for a boundary over `tokens` tokens. Up to MAX_FEW_TOKENS tokens: the one-launch op (OP_ONE,
    OP_FEW_ONE) where FNX_KERNELS names it by name and impl names no backend (`one_launch`). Else one token: OP_M1;
    2..MAX_FEW_TOKENS tokens: the few-token kernels
    (OP_FEW, bf16 or FP8 weights, streams a power of two) when that op resolves to a kernel (named by impl or
    FNX_KERNELS; not under auto: slower in the MTP round, see dispatch.AUTO_KEEPS_REFERENCE), else the
    multi-token design (OP, dense weights only)."""
    if tokens > MAX_DECODE_TOKENS:
        return OP_PREFILL, dispatch.resolve(OP_PREFILL, impl, not_applicable=not_applicable)
    if impl in (None, "auto") and not_applicable is None and pow2_streams and one_launch(tokens):
        return one_launch_op(tokens), one_launch_backend(tokens)
    if tokens == 1:
        return OP_M1, dispatch.resolve(OP_M1, impl, not_applicable=not_applicable)
    if tokens <= MAX_FEW_TOKENS and not_applicable is None and pow2_streams:
        b = dispatch.resolve(OP_FEW, impl)
        if b != "reference":
            return OP_FEW, b
    why = not_applicable or ("FP8 weights (the multi-token design takes dense ones; the few-token kernels take "
                             f"FP8 for up to {MAX_FEW_TOKENS} tokens)" if fp8 else None)
    return OP, dispatch.resolve(OP, impl, not_applicable=why)


def one_launch_op(tokens: int) -> str | None:
    """The one-launch op for a boundary over `tokens` tokens (None past MAX_FEW_TOKENS)."""
    return OP_ONE if tokens == 1 else OP_FEW_ONE if 2 <= tokens <= MAX_FEW_TOKENS else None


def one_launch_backend(tokens: int = 1) -> str | None:
    """The backend of the one-launch boundary over `tokens` tokens where FNX_KERNELS names its op by name
    ("hc_boundary_one=pallas", "hc_boundary_few_one=pallas"; checked that it can run here), else None: `auto`, one
    backend for every op and `dispatch.force` keep the other designs (one token: measured slower on the H200,
    dispatch.AUTO_KEEPS_REFERENCE; a few: not yet measured)."""
    op = one_launch_op(tokens)
    if op is None or dispatch.active_mesh() is not None:     # (params on a mesh: the boundaries' other designs)
        return None
    named = dispatch.named_choice(op)
    return None if named is None else dispatch.resolve(op, named)


def one_launch(tokens: int = 1) -> bool:
    """Whether boundaries over `tokens` tokens run in one launch (`one_launch_backend`). The model's decode programs
    then hold a counter pool for their barriers (`transformer.make_meta`)."""
    return one_launch_backend(tokens) not in (None, "reference")


def backend(impl: str | None = None, not_applicable: str | None = None, tokens: int = 1, fp8: bool = False,
            pow2_streams: bool = True) -> str:
    """The backend `hc_boundary(..., impl)` would run for `tokens` tokens ("reference", "pallas",
    "pallas_interpret"); not_applicable: why no kernel serves this call (`fnx.pallas.dispatch.resolve`)."""
    return choose(impl, not_applicable, tokens, fp8, pow2_streams)[1]


def hc_boundary(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, *, streams: int, eps: float,
                impl: str | None = None, tiles=None, w_down_scale=None, w_up_scale=None):
    """One hyper-connection boundary: combine the previous sublayer's output, then the gated residual.

    h [..., S*D] (stream-major); y [..., D] and inj_prev [..., S] (or both None: no combine); hc_norm [S*D];
    w_down [r, S*D]; w_up [S*D, r]; w_inj [S, S*D] or None (the final mixer). Weights in the checkpoint layout;
    Wdown and Wup may be FP8 (float8_e4m3fn with `w_down_scale` / `w_up_scale`, one fp32 multiplier per 128x128
    block): the one-token, few-token and prefill kernels dequantize them in registers; MAX_FEW_TOKENS to
    MAX_DECODE_TOKENS tokens have no FP8 kernel (a named kernel raises; the reference dequantizes to h.dtype first,
    as the model does). More than MAX_DECODE_TOKENS tokens (a prefill chunk) run `prefill.hc_boundary_prefill`
    where op "hc_boundary_prefill" resolves to a kernel (tiles a `prefill.TilesPrefill` or None).
    One token runs in one launch where op "hc_boundary_one" resolves to a kernel (`one.hc_boundary_one`, tiles a
    `pallas.Tiles1` or None), 2..MAX_FEW_TOKENS tokens where "hc_boundary_few_one" does (`one.hc_boundary_one_few`,
    tiles a `one.TilesFewOne` or None): their barrier's counter one of the program's `grid_sync.CounterPool`
    (in scope while the model traces a decode program), or a counter of its own (one launch more).
    2..MAX_FEW_TOKENS tokens run the few-token kernels when op "hc_boundary_few" resolves to a kernel (`choose`):
    `few.hc_boundary_few` (tiles None or `few.TilesFew`), or with `pallas.Tiles1` the one-token kernels per token
    (also what tiles None runs where no TilesFew fits the shapes, `few.default_tiles`).
    Returns (H' = h + inj_prev * y [..., S*D], x [..., D] the next sublayer's input, inj [..., S] or None)."""
    tokens = 1
    for n in h.shape[:-1]:
        tokens *= n
    fp8 = w_down_scale is not None or w_up_scale is not None
    from fnx.pallas.hc import pallas as kernel
    if isinstance(tiles, kernel.Tiles) and tokens <= MAX_DECODE_TOKENS:     # the multi-token design's tiles
        why = "FP8 weights (only the one-token kernel takes them)" if fp8 and tokens != 1 else None
        op, which = OP, dispatch.resolve(op_for(tokens), impl, not_applicable=why)
        if fp8 and which != "reference":
            raise ValueError("hc_boundary: FP8 weights run the one-token kernels (Tiles1), not the multi-token "
                             "design's Tiles")
    else:
        op, which = choose(impl, None, tokens, fp8, streams & (streams - 1) == 0)
    if which == "reference" or op not in (OP_M1, OP_FEW):   # these take arrays: a layer of a stack is sliced
        from fnx.pallas.stacked import materialize
        hc_norm, w_down, w_up, w_inj, w_down_scale, w_up_scale = (
            materialize(a) for a in (hc_norm, w_down, w_up, w_inj, w_down_scale, w_up_scale))
    if which == "reference":
        if fp8:
            from fnx.pallas.gemv.reference import dequantize
            w_down = dequantize("fp8", w_down, w_down_scale).astype(h.dtype)
            w_up = dequantize("fp8", w_up, w_up_scale).astype(h.dtype)
        return reference.hc_boundary(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps)
    if op == OP_PREFILL:
        from fnx.pallas.hc import prefill
        return prefill.hc_boundary_prefill(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps,
                                           interpret=dispatch.interpret_flag(which),
                                           tiles=tiles if isinstance(tiles, prefill.TilesPrefill) else None,
                                           w_down_scale=w_down_scale, w_up_scale=w_up_scale)
    if op in (OP_ONE, OP_FEW_ONE):
        from fnx.pallas import grid_sync
        from fnx.pallas.hc import one
        pool = grid_sync.current_pool()
        sync = {} if pool is None else {"sync": pool.buf, "sync_index": pool.take(1)}
        if op == OP_ONE:
            return one.hc_boundary_one(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps,
                                       interpret=dispatch.interpret_flag(which), tiles1=tiles,
                                       w_down_scale=w_down_scale, w_up_scale=w_up_scale, **sync)
        return one.hc_boundary_one_few(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps,
                                       interpret=dispatch.interpret_flag(which),
                                       tiles=tiles if isinstance(tiles, one.TilesFewOne) else None,
                                       w_down_scale=w_down_scale, w_up_scale=w_up_scale, **sync)
    from fnx.pallas.hc import few
    if op == OP_FEW and tiles is None:      # the MMA design's tiles, or the per-token kernels' where none fits
        d, r = h.shape[-1] // streams, w_down.shape[0]
        tiles = few.default_tiles(streams, d, r, few.gemv_takes_up(tokens, streams, d, r, h.dtype, w_up.dtype, fp8)
                                  ) or kernel.choose_tiles1(streams, d, r)
    if op == OP_FEW and not isinstance(tiles, kernel.Tiles1):
        return few.hc_boundary_few(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps,
                                   interpret=dispatch.interpret_flag(which), tiles=tiles,
                                   w_down_scale=w_down_scale, w_up_scale=w_up_scale)
    if op in (OP_M1, OP_FEW):
        return kernel.hc_boundary_m1(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps,
                                     interpret=dispatch.interpret_flag(which), tiles=tiles,
                                     w_down_scale=w_down_scale, w_up_scale=w_up_scale)
    return kernel.hc_boundary(h, y, inj_prev, hc_norm, w_down, w_up, w_inj, streams=streams, eps=eps,
                              interpret=dispatch.interpret_flag(which), tiles=tiles)
