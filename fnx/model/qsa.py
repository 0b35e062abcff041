"""QSA indexed attention (MODEL_SPEC.md section 6): an indexer scores mean-pooled 4-token key blocks and keeps the
top `indexer_budget / compress_ratio` complete blocks plus the incomplete tail; gated GQA attends to those tokens.

State per layer (capacity T tokens): k, v [B, Hkv, T, hd]; idx_blocks [B, T // cr, di] (pooled, normed, RoPE'd
block keys, final once their block is complete); idx_ring [B, cr, di] (raw keys of the incomplete block).
Below the budget every block is selected, which is plain causal attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fnx.model.fuse import linear_windows
from fnx.model.ops import F32, HIGHEST, apply_rope, linear, rms_norm, rope_tables, scale
from fnx.pallas.qsa import api as qsa_api
from fnx.pallas.qsa import prep as prep_kernel


def _scatter_time(cache: jax.Array, new: jax.Array, positions: jax.Array, axis: int) -> jax.Array:
    """cache[b, ..., positions[b, l], ...] = new[b, ..., l, ...] along `axis`; out-of-range positions are dropped."""
    def one(c, n, pos):
        c = jnp.moveaxis(c, axis - 1, 0)
        n = jnp.moveaxis(n, axis - 1, 0)
        return jnp.moveaxis(c.at[pos].set(n.astype(c.dtype), mode="drop"), 0, axis - 1)
    return jax.vmap(one)(cache, new, positions)


def ring_after(buf: jax.Array, pos0: jax.Array, n: jax.Array, cr: int) -> jax.Array:
    """Raw keys of the incomplete block after n [B] of the call's tokens; buf from `indexer_blocks`."""
    end = pos0 + n
    return jax.vmap(lambda bb, off: lax.dynamic_slice_in_dim(bb, off, cr, axis=0))(buf, (end // cr - pos0 // cr) * cr)


def indexer_blocks(p: dict, kraw: jax.Array, ring: jax.Array, pos0: jax.Array, rope_fn, cfg):
    """Pool the blocks touched by this call. kraw [B, L, di] raw keys of the new tokens; ring [B, cr, di].
    Returns (block ids [B, NB'], pooled keys [B, NB', di], buf [B, nbuf, di]: the ring followed by the new raw
    keys, aligned so that row j is token (pos0 // cr) * cr + j)."""
    cr = cfg.indexer_compress_ratio
    bsz, length, di = kraw.shape
    nbuf = prep_kernel.nbuf_rows(length, cr)
    buf = jnp.zeros((bsz, nbuf, di), kraw.dtype).at[:, :cr].set(ring)
    buf = jax.vmap(lambda bb, kk, off: lax.dynamic_update_slice(bb, kk, (off, 0)))(buf, kraw, pos0 % cr)
    first_block = pos0 // cr
    blocks = buf.reshape(bsz, nbuf // cr, cr, di)
    pooled = jnp.mean(blocks.astype(F32), axis=2).astype(kraw.dtype)
    pooled = rms_norm(pooled, p["k_layernorm"], cfg.rms_norm_eps)
    block_ids = first_block[:, None] + jnp.arange(nbuf // cr, dtype=jnp.int32)
    pooled = rope_fn(pooled[:, :, None, :], block_ids * cr)[:, :, 0, :]
    return block_ids, pooled, buf


def _block_scores(q_idx: jax.Array, blocks: jax.Array, cfg) -> jax.Array:
    """Indexer scores [B, L, NB] (fp32): sum over indexer heads of relu(q . k_block) / sqrt(di)."""
    s = jnp.einsum("blhd,bnd->blhn", q_idx.astype(F32), blocks.astype(F32), precision=HIGHEST)
    return jnp.sum(jax.nn.relu(s), axis=2) / jnp.sqrt(jnp.asarray(cfg.indexer_head_dim, F32))


def select_tokens(q_idx: jax.Array, blocks: jax.Array, positions: jax.Array, capacity: int, cfg,
                  topk_impl: str | None = "reference") -> jax.Array:
    """Token mask [B, L, T]: causal AND (in a selected complete block OR in the incomplete tail).
    q_idx [B, L, Hi, di] (normed, RoPE'd), blocks [B, NB, di], positions [B, L] of the queries. The top-k block set
    by lax.top_k (`topk_impl` "reference"), or through fnx.pallas.qsa.api.qsa_block_topk on that backend (None:
    its dispatch; the same set, ties to the lower blocks): the model's prefill-sized calls take the kernel where
    it is on (an H100 prefill table had XLA's sort for lax.top_k at 310 us a QSA layer and 2,048-token chunk)."""
    cr = cfg.indexer_compress_ratio
    n_blocks = blocks.shape[1]
    block_idx = jnp.arange(n_blocks, dtype=jnp.int32)
    valid = (block_idx * cr + cr - 1)[None, None, :] <= positions[..., None]          # [B, L, NB]
    if n_blocks > cfg.block_topk:
        s = jnp.where(valid, _block_scores(q_idx, blocks, cfg), -jnp.inf)
        if topk_impl == "reference":
            _, top = lax.top_k(s, cfg.block_topk)
        else:
            top = qsa_api.qsa_block_topk(s, cfg.block_topk, impl=topk_impl)
        chosen = jnp.zeros(s.shape, bool).at[
            jnp.arange(s.shape[0])[:, None, None], jnp.arange(s.shape[1])[None, :, None], top].set(True)
        valid = valid & chosen
    tok = jnp.arange(capacity, dtype=jnp.int32)
    tok_block = jnp.minimum(tok // cr, n_blocks - 1)
    in_block = jnp.take_along_axis(valid, jnp.broadcast_to(tok_block, valid.shape[:2] + (capacity,)), axis=-1)
    in_block = in_block & (tok // cr < n_blocks)
    tail = tok[None, None, :] >= ((positions + 1) // cr * cr)[..., None]
    causal = tok[None, None, :] <= positions[..., None]
    return causal & (in_block | tail)


def select_token_indices(q_idx: jax.Array, blocks: jax.Array, positions: jax.Array, capacity: int,
                         cfg, impl: str | None = None) -> jax.Array:
    """The tokens `select_tokens` marks, as positions [B, L, N] with -1 in unused slots: the selected complete
    blocks' tokens (N_b = min(NB, block_topk) blocks x cr), then the incomplete tail (cr - 1 slots). Same block
    choice as `select_tokens` (the top-k set of lax.top_k, ties to the lower blocks, through
    fnx.pallas.qsa.api.qsa_block_topk with `impl`: the kernel lists the blocks in ascending order, the reference by
    score); no position appears twice.
    The scores come from fnx.pallas.qsa.api.qsa_index_scores (`impl`); a kernel sums in another order than
    XLA, so scores within an ulp of each other may rank differently there. Where op "qsa_select" runs a kernel
    (`impl` or its dispatch; "qsa_select_long" past 64K tokens of context) and applies
    (`fnx.pallas.qsa.select.applies`), scores, top-k and this token list are one launch instead (the same set, up to
    near-equal scores)."""
    cr = cfg.indexer_compress_ratio
    n_blocks = blocks.shape[1]
    if n_blocks > cfg.block_topk:
        from fnx.pallas.qsa import select
        why = select.applies(n_blocks, cfg.block_topk, cr, q_idx.shape[2], q_idx.shape[3])
        if why is None and qsa_api.select_backend(impl, n_blocks=n_blocks) != "reference":     # one launch
            return qsa_api.qsa_select(q_idx, blocks, positions, capacity, cr, cfg.block_topk, impl=impl)
        s = qsa_api.qsa_index_scores(q_idx, blocks, positions, cr, impl=impl)          # [B, L, NB]
        top = qsa_api.qsa_block_topk(s, cfg.block_topk, impl=impl)                     # [B, L, K], a set
    else:
        top = jnp.broadcast_to(jnp.arange(n_blocks, dtype=jnp.int32), positions.shape + (n_blocks,))
    return token_positions(top, positions, n_blocks, capacity, cr)


def token_positions(top: jax.Array, positions: jax.Array, n_blocks: int, capacity: int, cr: int) -> jax.Array:
    """Blocks [B, L, K] (int32) -> their token positions [B, L, K * cr + cr - 1]: each block's cr tokens (-1 for a
    block not complete at the query), then the incomplete tail's cr - 1 slots (-1 where empty or past the cache)."""
    bsz, length = positions.shape
    valid = (jnp.arange(n_blocks, dtype=jnp.int32) * cr + cr - 1)[None, None, :] <= positions[..., None]
    ok = jnp.take_along_axis(valid, top, axis=-1)
    tok = top[..., None].astype(jnp.int32) * cr + jnp.arange(cr, dtype=jnp.int32)
    tok = jnp.where(ok[..., None], tok, -1).reshape(bsz, length, -1)
    tail = ((positions + 1) // cr * cr)[..., None] + jnp.arange(cr - 1, dtype=jnp.int32)
    tail = jnp.where((tail <= positions[..., None]) & (tail < capacity), tail, -1)
    return jnp.concatenate([tok, tail], axis=-1)


def _kv_whole(y, hkv: int):
    """With the GEMV kernels per shard (`dispatch.on_mesh`) and KV heads that tp does not divide (they are
    replicated, fnx/parallel): keep the k/v projection's output whole. Otherwise the partitioner pushes the query
    heads' split back through the GQA reshape as a split over part of the tp axis (2 KV heads over tp=4), which a
    per-shard kernel's partition rule cannot express. Outside a mesh: y unchanged."""
    from fnx.pallas import dispatch
    mesh = dispatch.active_mesh()
    if mesh is None or hkv % dict(mesh.shape).get("tp", 1) == 0:
        return y
    from jax.sharding import NamedSharding, PartitionSpec
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, PartitionSpec()))


def prep_norms(p: dict) -> tuple:
    """The four RMSNorm weights of a QSA layer's prep: indexer q, indexer k, q, k."""
    return p["indexer"]["q_layernorm"], p["indexer"]["k_layernorm"], p["q_norm"], p["k_norm"]


def block_rope_tables(pos0: jax.Array, length: int, cfg, dtype):
    """cos / sin [B, nbuf / cr, rot] at the first positions of the blocks a call of `length` tokens from pos0 touches
    (`indexer_blocks`' block_ids * cr), as the model's rope_fn computes them."""
    cr = cfg.indexer_compress_ratio
    nbuf = prep_kernel.nbuf_rows(length, cr)
    block_ids = (pos0 // cr)[:, None] + jnp.arange(nbuf // cr, dtype=jnp.int32)
    return rope_tables(block_ids * cr, cfg.rotary_dim, cfg.rope_theta, dtype)


def prep(p: dict, prods: list, st: dict, pos0: jax.Array, cos: jax.Array, sin: jax.Array, rope_fn, cfg,
         n_valid: jax.Array):
    """A QSA layer's work between its projections and the block choice (the reference of the `qsa_prep` kernel,
    fnx.pallas.qsa.prep): prods the outputs of index_qk_proj, q_proj, k_proj, v_proj [B, L, n]. The queries and
    indexer queries normed and RoPE'd, the new K/V rows and touched blocks written into the state, the new ring.
    Returns (q [B, L, H, hd], q_idx [B, L, hi, di], new state, buf [B, nbuf, di] for rollback)."""
    qk, qg, kp, vp = prods
    bsz, length = qk.shape[:2]
    h, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hi, di = cfg.indexer_n_heads, cfg.indexer_head_dim
    positions = pos0[:, None] + jnp.arange(length, dtype=jnp.int32)
    ix = p["indexer"]
    q_idx = rms_norm(qk[..., : hi * di].reshape(bsz, length, hi, di), ix["q_layernorm"], cfg.rms_norm_eps)
    q_idx = apply_rope(q_idx, cos, sin)
    kraw = qk[..., hi * di:]
    block_ids, pooled, buf = indexer_blocks(ix, kraw, st["idx_ring"], pos0, rope_fn, cfg)
    ring = ring_after(buf, pos0, n_valid, cfg.indexer_compress_ratio)
    blocks = _scatter_time(st["idx_blocks"], pooled, block_ids, axis=1)
    q = qg.reshape(bsz, length, h, 2 * hd)[..., :hd]
    q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(_kv_whole(kp, hkv).reshape(bsz, length, hkv, hd), p["k_norm"], cfg.rms_norm_eps)
    v = _kv_whole(vp, hkv).reshape(bsz, length, hkv, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kc = _scatter_time(st["k"], jnp.swapaxes(k, 1, 2), positions, axis=2)
    vc = _scatter_time(st["v"], jnp.swapaxes(v, 1, 2), positions, axis=2)
    return q, q_idx, {"k": kc, "v": vc, "idx_blocks": blocks, "idx_ring": ring}, buf


# The masked dense attention of a prefill-sized call (more than qsa_api.MAX_DECODE_TOKENS tokens; decode and verify
# calls keep the whole axis: their scores are small, and a loop would cost them launches) over a KV capacity past
# this many tokens runs over the key axis in chunks of it (`_masked_attention_chunked`). Its fp32 scores were
# [B, Hkv, G, L, T] whole: 1.6 GB a QSA layer for a 2,048-token chunk at an 8K capacity, 51 GB at 262K (an H200
# prefill ledger: the scores' transpose alone 0.77 ms a layer and chunk at 8K). Chunks past the call's last
# position are skipped; a capacity that is not a whole number of chunks ends on a chunk that overlaps the one
# before it, whose keys it masks (a probe's prefill table at a 10,304-token capacity had run the whole axis: 2.6 ms
# of QSA kernels a layer and 2,048-token chunk on the H100). The scores are computed in two passes (max and sum,
# probabilities; three at first: 3.0 ms in that table for the one chunk at position 0, 1.2 of it the three score
# products): one more matrix product over the keys a call sees than the whole's, none over the rest, and
# [B, Hkv, G, L, KEY_CHUNK] fp32 at a time (400 MB at L = 2,048) instead of the capacity's. In the 24-layer 8K
# prefill on the H100 (forty-second session) the chunks' transposes took 13.2 ms of 553 (BENCHMARKS.md).
KEY_CHUNK = 2048


def _masked_attention_chunked(qh, kc, vc, mask, positions, chunk: int, dt):
    """The masked dense attention's softmax(s) @ v over the key axis in `chunk`-token pieces, the same arithmetic as
    the whole: s rounded to dt, scaled, masked; one pass for the row max and exp(s - max)'s sum (the running sum
    rescaled by exp(old max - new max) as the max grows: the scores of each chunk computed twice in all, not three
    times as in the first form's separate max and sum passes), one for the probabilities (exp(s - max) / sum,
    rounded to dt) times v summed in fp32. Only the chunks up to the last query's position run (a loop with that
    trip count), so a prefill chunk early in a long context reads the keys it can see, not the capacity. The sums
    run chunk by chunk: within float error of the whole (an fp32 ulp of the row sum; a bf16 rounding of o may
    flip). qh [B, L, Hkv, G, hd]; kc, vc [B, Hkv, T, hd]; mask [B, L, T]."""
    bsz, length, hkv, grp, hd = qh.shape
    cap = kc.shape[2]
    # chunks holding a position some query can see (positions past the capacity see the whole cache)
    n = jnp.minimum(jnp.max(positions) // chunk + 1, -(-cap // chunk)).astype(jnp.int32)

    def first(c):   # chunk c's first key; a capacity that is not a whole number of chunks: the last chunk ends at
        return jnp.minimum(c * chunk, cap - chunk)      # the capacity, its keys before c * chunk masked (counted)

    def scores(c):
        a = first(c)
        k_c = lax.dynamic_slice_in_dim(kc, a, chunk, axis=2).astype(dt)
        m_c = lax.dynamic_slice_in_dim(mask, a, chunk, axis=2) & (a + jnp.arange(chunk) >= c * chunk)
        s = jnp.einsum("blgrd,bgtd->bgrlt", qh, k_c, precision=HIGHEST, preferred_element_type=F32).astype(dt)
        s = scale(s, hd ** -0.5).astype(F32)
        return jnp.where(m_c[:, None, None], s, -jnp.inf)                      # [B, Hkv, G, L, chunk]

    stat = (bsz, hkv, grp, length)

    def max_sum(c, carry):      # the running max and the sum of exp(s - max), rescaled as the max grows
        m, d = carry
        sc = scores(c)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        at = jnp.where(m_new == -jnp.inf, 0.0, m_new)    # a row with no key seen yet: its terms exp(-inf) = 0
        return m_new, d * jnp.exp(m - at) + jnp.sum(jnp.exp(sc - at[..., None]), axis=-1)
    mx, den = lax.fori_loop(0, n, max_sum, (jnp.full(stat, -jnp.inf, F32), jnp.zeros(stat, F32)))

    def pv(c, acc):
        probs = (jnp.exp(scores(c) - mx[..., None]) / den[..., None]).astype(dt)
        v_c = lax.dynamic_slice_in_dim(vc, first(c), chunk, axis=2).astype(dt)
        return acc + jnp.einsum("bgrlt,bgtd->blgrd", probs, v_c, precision=HIGHEST, preferred_element_type=F32)
    o = lax.fori_loop(0, n, pv, jnp.zeros((bsz, length, hkv, grp, hd), F32))
    return o.astype(dt)


def qsa_layer(p: dict, x: jax.Array, st: dict, pos0: jax.Array, cos: jax.Array, sin: jax.Array, rope_fn, cfg,
              n_valid: jax.Array, impl: str | None = None):
    """x [B, L, D]; pos0 [B] first position of the call; cos/sin [B, L, rot] for the new tokens; n_valid [B] real
    tokens (K/V and blocks written for padding lie past the valid length and are overwritten later).
    The norms, RoPE and state writes run as `prep` (jnp, the reference) or, for calls of L <= 8 tokens whose
    op "qsa_prep" resolves to a kernel, as one launch (fnx.pallas.qsa.prep).
    Calls of L <= 8 tokens (decode, MTP verify) whose `impl` (fnx.pallas.dispatch) resolves to a kernel gather the
    selected tokens (fnx.pallas.qsa.api; "auto" takes it for KV capacities from qsa_api.KERNEL_MIN_CAPACITY up);
    otherwise the masked dense attention below, which is the reference.
    Returns (y [B, L, D], new state, aux {"idx_buf"} for rollback)."""
    bsz, length, _ = x.shape
    h, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    positions = pos0[:, None] + jnp.arange(length, dtype=jnp.int32)
    capacity = st["k"].shape[2]

    wins = linear_windows(x, p, ("indexer/index_qk_proj", "q_proj", "k_proj", "v_proj"))   # fused or not
    why = prep_kernel.why_not(hd, cfg.indexer_head_dim, cos.shape[-1], length, cfg.indexer_compress_ratio)
    which = qsa_api.prep_backend(impl, why)
    if which == "reference":
        q, q_idx, new_st, buf = prep(p, [w.get() for w in wins], st, pos0, cos, sin, rope_fn, cfg, n_valid)
    else:
        bcos, bsin = block_rope_tables(pos0, length, cfg, cos.dtype)
        q, q_idx, new_st, buf = qsa_api.qsa_prep(
            *[(w.buf, w.start) for w in wins], prep_norms(p), cos, sin, bcos, bsin, pos0, n_valid, st, cfg, which)
    kc, vc, blocks = new_st["k"], new_st["v"], new_st["idx_blocks"]

    dt = x.dtype
    why = None if length <= qsa_api.MAX_DECODE_TOKENS else \
        f"{length} tokens > {qsa_api.MAX_DECODE_TOKENS} (prefill runs the masked dense path)"
    if qsa_api.backend(impl, why, prefer_reference=qsa_api.auto_reason(capacity)) != "reference":
        idx = select_token_indices(q_idx, blocks, positions, capacity, cfg, impl)      # [B, L, N]
        # the output gate applied by the api (with the kernels: where the splits merge, the gate read in place)
        o = qsa_api.qsa_decode_attention(q, kc, vc, idx, impl=impl, gate=(wins[1].buf, wins[1].start))
        o = o.reshape(bsz, length, h * hd)
    else:
        mask = select_tokens(q_idx, blocks, positions, capacity, cfg, impl)            # [B, L, T]
        qh = q.reshape(bsz, length, hkv, h // hkv, hd)
        chunk = KEY_CHUNK
        pre = qsa_api.prefill_backend(impl, hd, capacity, h // hkv) if length > qsa_api.MAX_DECODE_TOKENS \
            else "reference"
        if pre != "reference":      # prefill-sized, op "qsa_prefill_attention" on a kernel: one launch
            o = qsa_api.qsa_prefill_attention(qh, kc, vc, mask, positions, pre)
        elif length > qsa_api.MAX_DECODE_TOKENS and capacity > chunk:     # prefill-sized
            o = _masked_attention_chunked(qh, kc, vc, mask, positions, chunk, dt)
        else:
            s = jnp.einsum("blgrd,bgtd->bgrlt", qh, kc.astype(dt), precision=HIGHEST,
                           preferred_element_type=F32).astype(dt)
            s = scale(s, hd ** -0.5).astype(F32)
            s = jnp.where(mask[:, None, None], s, -jnp.inf)
            probs = jax.nn.softmax(s, axis=-1).astype(dt)
            o = jnp.einsum("bgrlt,bgtd->blgrd", probs, vc.astype(dt), precision=HIGHEST,
                           preferred_element_type=F32).astype(dt)
        gate = wins[1].get().reshape(bsz, length, h, 2 * hd)[..., hd:].reshape(bsz, length, h * hd)
        o = o.reshape(bsz, length, h * hd) * jax.nn.sigmoid(gate)
    y = linear(o, p["o_proj"])
    return y, new_st, {"idx_buf": buf}
