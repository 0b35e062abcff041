"""Dispatch for QSA sparse decode attention (op name "qsa_decode_attention")."""

from __future__ import annotations

import jax

from fnx.pallas import dispatch
from fnx.pallas.qsa import reference

OP = "qsa_decode_attention"
MAX_DECODE_TOKENS = 8        # the model routes calls with L <= this through the api (decode, MTP verify)


def backend(impl: str | None = None, not_applicable: str | None = None) -> str:
    """The backend `qsa_decode_attention(..., impl)` would run ("reference", "pallas", "pallas_interpret");
    not_applicable: why the kernel does not serve this call (see `fnx.pallas.dispatch.resolve`)."""
    return dispatch.resolve(OP, impl, not_applicable=not_applicable)


def qsa_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, idx: jax.Array,
                         impl: str | None = None, tiles=None) -> jax.Array:
    """Softmax attention of each query over its selected tokens only.

    q [B, L, Hq, hd]; k_cache, v_cache [B, Hkv, S, hd] (the QSA state layout); idx [B, L, N] int32 token positions
    into S, -1 for unused slots (no position twice in one row). Query head h uses KV head h // (Hq // Hkv).
    Returns o [B, L, Hq, hd] in q.dtype, before the output gate; a row with no valid slot gives zeros."""
    which = dispatch.resolve(OP, impl)
    if which == "reference":
        return reference.qsa_decode_attention(q, k_cache, v_cache, idx)
    from fnx.pallas.qsa import pallas as kernel
    return kernel.qsa_decode_attention(q, k_cache, v_cache, idx, interpret=dispatch.interpret_flag(which),
                                       tiles=tiles)


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
