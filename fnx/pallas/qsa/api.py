"""Dispatch for QSA sparse decode attention (op names "qsa_decode_attention", "qsa_index_scores", "qsa_block_topk",
"qsa_select" and the others below)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fnx.pallas import dispatch
from fnx.pallas.kernel_math import take_window, window_operand
from fnx.pallas.qsa import reference

OP = "qsa_decode_attention"
MAX_DECODE_TOKENS = 8        # the model routes calls with L <= this through the api (decode, MTP verify)


# "auto" and the attention kernel, by measurement on the H200: in the whole bf16 step at 1K context (KV capacity
# ~1.5K) the kernel path was slower than the masked dense path, 1.450 against 1.170 ms per 4-layer step (BENCHMARKS.md,
# fourth session); at 32K capacity it took 23.8 us per layer against the dense path's 50.1 us (isolated, B = 1,
# 2051 selected tokens; BENCHMARKS.md "Kernels, one at a time"). The dense path reads the whole cache capacity,
# the kernel only the selected tokens, so "auto" takes the kernel from this capacity up; between 1.5K and 32K
# nothing is measured and the reference stays.
KERNEL_MIN_CAPACITY = 8192   # the 4-layer FP8 step at 8K context (capacity 8,448), nineteenth session (12b8018):
# kernel time 0.733 ms with the kernel against 0.746 with the masked dense path, the MTP round 3.455 against 3.533


def auto_reason(capacity: int) -> str | None:
    """Why "auto" keeps the masked dense path for a cache of `capacity` tokens (None: it takes the kernel)."""
    if capacity >= KERNEL_MIN_CAPACITY:
        return None
    return (f"KV capacity {capacity} < {KERNEL_MIN_CAPACITY}: the masked dense path measured faster at 1K context in "
            f"the whole step; the kernel wins from 8K context (BENCHMARKS.md)")


def backend(impl: str | None = None, not_applicable: str | None = None, prefer_reference: str | None = None) -> str:
    """The backend `qsa_decode_attention(..., impl)` would run ("reference", "pallas", "pallas_interpret");
    not_applicable: why the kernel does not serve this call; prefer_reference: why "auto" keeps the reference for
    it (`auto_reason`; see `fnx.pallas.dispatch.resolve`)."""
    return dispatch.resolve(OP, impl, not_applicable=not_applicable, prefer_reference=prefer_reference)


COMBINE_OP = "qsa_combine"


def qsa_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, idx: jax.Array,
                         impl: str | None = None, tiles=None, gate=None) -> jax.Array:
    """Softmax attention of each query over its selected tokens only.

    q [B, L, Hq, hd]; k_cache, v_cache [B, Hkv, S, hd] (the QSA state layout); idx [B, L, N] int32 token positions
    into S, -1 for unused slots (no position twice in one row). Query head h uses KV head h // (Hq // Hkv).
    Returns o [B, L, Hq, hd] in q.dtype; a row with no valid slot gives zeros. gate: None (o before the output gate)
    or the q_proj product holding each head's query then its gate, as (buffer [B, L, W], start column) or an array
    [B, L, Hq * 2hd]: o becomes o * sigmoid(gate) with the model's roundings. The kernel path merges its splits and
    applies the gate in one more launch (op "qsa_combine"), or in XLA where that op resolves to the reference."""
    bsz, length, hq, hd = q.shape
    which = dispatch.resolve(OP, impl)
    if which == "reference":
        return _gated(reference.qsa_decode_attention(q, k_cache, v_cache, idx), gate)
    from fnx.pallas.qsa import pallas as kernel
    fused = dispatch.resolve(COMBINE_OP, None if impl in (None, "auto") else impl) != "reference"
    win = None
    if gate is not None and fused:
        buf, start = window_operand(gate, hq * 2 * hd, (bsz, length), "qsa output gate")
        win = (buf.reshape(bsz * length, -1), start)
    o = kernel.qsa_decode_attention(q, k_cache, v_cache, idx, interpret=dispatch.interpret_flag(which), tiles=tiles,
                                    gate=win, fused_combine=fused)
    return o if fused else _gated(o, gate)


def _gated(o, gate):
    """o [B, L, Hq, hd] times sigmoid of the heads' gates in `gate` (see qsa_decode_attention), as the model's
    `o.reshape(B, L, Hq * hd) * jax.nn.sigmoid(gate)`."""
    if gate is None:
        return o
    bsz, length, hq, hd = o.shape
    buf, start = window_operand(gate, hq * 2 * hd, (bsz, length), "qsa output gate")
    g = take_window(buf, start, hq * 2 * hd).reshape(bsz, length, hq, 2 * hd)[..., hd:].reshape(bsz, length, hq * hd)
    return (o.reshape(bsz, length, hq * hd) * jax.nn.sigmoid(g)).reshape(o.shape)


SCORES_OP = "qsa_index_scores"


def qsa_index_scores(q_idx: jax.Array, blocks: jax.Array, positions: jax.Array, cr: int,
                     impl: str | None = None) -> jax.Array:
    """Indexer block scores [B, L, NB] fp32, -inf for blocks not complete at the query (see
    reference.qsa_index_scores). q_idx [B, L, Hi, di]; blocks [B, NB, di]; positions [B, L]."""
    which = dispatch.resolve(SCORES_OP, impl)
    if which == "reference":
        return reference.qsa_index_scores(q_idx, blocks, positions, cr)
    from fnx.pallas.qsa import pallas as kernel
    return kernel.qsa_index_scores(q_idx, blocks, positions, cr, interpret=dispatch.interpret_flag(which))


TOPK_OP = "qsa_block_topk"
TOPK_LONG_OP = "qsa_block_topk_long"


def qsa_block_topk(scores: jax.Array, k: int, impl: str | None = None) -> jax.Array:
    """The k blocks of the largest indexer scores per row, [..., k] int32 from scores [..., NB]: the set lax.top_k
    picks (among equal scores the lower blocks). The reference lists them by descending score (lax.top_k, a sort in
    XLA), the kernel in ascending block order (fnx.pallas.qsa.pallas.qsa_block_topk): callers use the set. The
    kernel keeps a row in one program's registers, NB <= its TOPK_MAX_BLOCKS (64K tokens of context); longer rows
    (op "qsa_block_topk_long": 128K and 256K context) run in two launches, segments of TOPK_MAX_BLOCKS and then
    their candidates, where that op is on (else the reference: lax.top_k's sort)."""
    from fnx.pallas.qsa import pallas as kernel
    nb = scores.shape[-1]
    op, why = TOPK_OP, None
    if nb > kernel.TOPK_MAX_BLOCKS:
        op, why = TOPK_LONG_OP, kernel.long_rows(nb, k)
    which = dispatch.resolve(op, impl, not_applicable=why)
    if which == "reference":
        return jax.lax.top_k(scores, k)[1].astype(jnp.int32)
    return kernel.qsa_block_topk(scores, k, interpret=dispatch.interpret_flag(which))


SELECT_OP = "qsa_select"
SELECT_LONG_OP = "qsa_select_long"


def select_backend(impl: str | None, not_applicable: str | None = None, n_blocks: int = 0) -> str:
    """The backend op "qsa_select" (the indexer's scores, top-k and token list in one launch) runs with for a call
    of `n_blocks` blocks (`fnx.pallas.qsa.select.applies` gives `not_applicable`); rows past one program's
    TOPK_MAX_BLOCKS (more than 64K tokens of context), in segments, are op "qsa_select_long"."""
    from fnx.pallas.qsa import select
    op = SELECT_LONG_OP if select.segmented(n_blocks) else SELECT_OP
    return dispatch.resolve(op, impl, not_applicable=not_applicable)


def qsa_select(q_idx: jax.Array, blocks: jax.Array, positions: jax.Array, capacity: int, cr: int, k: int,
               impl: str | None = None) -> jax.Array:
    """Token positions [B, L, k * cr + cr - 1] (-1 unused): the selected complete blocks' tokens, then the
    incomplete tail, as `fnx.model.qsa.select_token_indices` lists them from the separate ops; on the reference
    backend exactly those ops (qsa_index_scores and qsa_block_topk, each on its reference)."""
    from fnx.pallas.qsa import select
    nb = blocks.shape[1]
    which = select_backend(impl, select.applies(nb, k, cr, q_idx.shape[2], q_idx.shape[3]), nb)
    if which == "reference":
        from fnx.model.qsa import token_positions
        s = reference.qsa_index_scores(q_idx, blocks, positions, cr)
        top = jax.lax.top_k(s, k)[1].astype(jnp.int32)
        return token_positions(top, positions, blocks.shape[1], capacity, cr)
    return select.qsa_select(q_idx, blocks, positions, capacity, cr, k, interpret=dispatch.interpret_flag(which))


PREP_OP = "qsa_prep"


def prep_backend(impl: str | None = None, not_applicable: str | None = None) -> str:
    """The backend of a QSA layer's prep (fnx.model.qsa.prep: norms, RoPE, the state's writes) for this call:
    "reference" (the model's jnp) or a Pallas backend (fnx.pallas.qsa.prep, one launch); not_applicable: why the
    kernel does not serve the call's shapes (`prep.why_not`)."""
    return dispatch.resolve(PREP_OP, impl, not_applicable=not_applicable)


def qsa_prep(qk, qg, kp, vp, norms, cos, sin, bcos, bsin, pos0, n_valid, state, cfg, backend: str):
    """`fnx.pallas.qsa.prep.qsa_prep` for a model config, on a Pallas backend from `prep_backend`: the projections
    as (buffer, start) windows of their products, read in place."""
    from fnx.pallas.qsa import prep
    return prep.qsa_prep(qk, qg, kp, vp, norms, cos, sin, bcos, bsin, pos0, n_valid, state,
                         heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                         idx_heads=cfg.indexer_n_heads, idx_dim=cfg.indexer_head_dim,
                         cr=cfg.indexer_compress_ratio, eps=cfg.rms_norm_eps,
                         interpret=dispatch.interpret_flag(backend))


PREFILL_OP = "qsa_prefill_attention"


def prefill_backend(impl: str | None, head_dim: int, capacity: int, group: int | None = None) -> str:
    """The backend of a prefill-sized call's masked attention (more than MAX_DECODE_TOKENS tokens): "reference"
    (fnx.model.qsa's masked dense path, by key chunks past KEY_CHUNK) or a Pallas backend
    (`fnx.pallas.qsa.prefill`: one launch, online softmax over the key tiles up to each query tile's position)."""
    from fnx.pallas.qsa import prefill
    return dispatch.resolve(PREFILL_OP, impl, not_applicable=prefill.why_not(head_dim, capacity,
                                                                             prefill.choose_tiles(group), group))


def qsa_prefill_attention(qh, kc, vc, mask, positions, backend: str):
    """`fnx.pallas.qsa.prefill.qsa_prefill_attention` on a Pallas backend from `prefill_backend`."""
    from fnx.pallas.qsa import prefill
    return prefill.qsa_prefill_attention(qh, kc, vc, mask, positions, interpret=dispatch.interpret_flag(backend))
