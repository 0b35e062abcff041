"""Speculative verification. Drafts d_1..d_k were sampled from the drafter's distributions q_1..q_k; the
target's are p_1..p_{k+1}. Draft i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first
rejection the replacement is drawn from max(0, p_i - q_i) renormalised; after k acceptances a bonus token is drawn
from p_{k+1}. The emitted tokens are distributed exactly as sampling from p one token at a time. Greedy rows have
one-hot p and q, which makes this the longest matching prefix plus the target's own next token.

Penalties (repetition / presence / frequency) act on p: position j of the window is penalized with the history it
follows, the tokens emitted before the round and the drafts d_1..d_j (`penalized_window`); the emitted tokens then
join that history (`commit_window`). The drafter penalizes its own logits the same way (draft i with the history
and d_1..d_{i-1}: `engine._jit_draft(pen=...)`), so q aims where the penalized p does; acceptance is exact for
any q, and on fnx-mini the penalized drafts raised the mean tokens per k = 4 round from 1.79 to 2.07 (greedy,
repetition penalty 1.3) and from 1.88 to 2.21 (temperature 0.8)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fnx.engine.sampling import SamplingArrays, apply_penalties


def penalized_window(logits: jax.Array, sp: SamplingArrays, seen: jax.Array, counts: jax.Array,
                     drafts: jax.Array) -> jax.Array:
    """logits [B, k+1, V] -> fp32 with each position's penalties. seen [B, V] bool / counts [B, V] int32: the
    prompt and the tokens emitted so far (counts: emitted only); position j follows those and drafts[:, :j]. One
    elementwise pass over the window (each position's draft counts as a running sum of one-hot rows), not k + 1
    updates of [B, V] arrays one after another."""
    vocab = logits.shape[-1]
    onehot = (drafts[:, :, None] == jnp.arange(vocab, dtype=drafts.dtype)).astype(counts.dtype)      # [B, k, V]
    before = jnp.concatenate([jnp.zeros_like(onehot[:, :1]), jnp.cumsum(onehot, axis=1)], axis=1)  # [B, k+1, V]
    flat = lambda a: a.reshape(-1, vocab)                                                         # noqa: E731
    width = logits.shape[1]
    rows = jax.tree.map(lambda a: jnp.repeat(a, width, axis=0), sp)          # each row's parameters per position
    out = apply_penalties(flat(logits.astype(jnp.float32)), rows, flat(seen[:, None] | (before > 0)),
                          flat(counts[:, None] + before))
    return out.reshape(logits.shape)


def commit_window(seen: jax.Array, counts: jax.Array, toks: jax.Array, n_acc: jax.Array, active: jax.Array):
    """seen / counts with each active row's emitted tokens toks[:, :n_acc + 1] added (repeats counted)."""
    bsz, width = toks.shape
    emit = (jnp.arange(width)[None, :] <= n_acc[:, None]) & active[:, None]
    rows = jnp.broadcast_to(jnp.arange(bsz)[:, None], toks.shape)
    return seen.at[rows, toks].max(emit), counts.at[rows, toks].add(emit.astype(counts.dtype))


def accept_greedy(logits: jax.Array, drafts: jax.Array):
    """`accept` for rows that all decode greedily, from the target's logits [B, k+1, V] alone: a draft is accepted
    while it equals the target's argmax, and the first mismatch (or the bonus position) takes the argmax. The
    tokens and counts equal `accept` on the one-hot distributions greedy rows get (drafts after the emitted
    window kept as they were), with no sort, softmax or random draw over the vocabulary."""
    bsz, k = drafts.shape
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)                     # [B, k+1]
    ok = drafts == target[:, :k]
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    toks = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    return toks.at[jnp.arange(bsz), n_acc].set(target[jnp.arange(bsz), n_acc]), n_acc


def accept(p_lp: jax.Array, q_lp: jax.Array, drafts: jax.Array, keys: jax.Array):
    """p_lp [B, k+1, V], q_lp [B, k, V] log-probabilities; drafts [B, k]; keys [B, 2] (one per row).
    Returns (tokens [B, k+1]: the first n_acc + 1 are emitted, n_acc [B])."""
    bsz, k = drafts.shape
    ku, kx = jax.vmap(lambda kk: jax.random.split(kk, 2))(keys).transpose(1, 0, 2)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(ku)
    p_d = jnp.exp(jnp.take_along_axis(p_lp[:, :k], drafts[..., None], axis=-1)[..., 0])
    q_d = jnp.exp(jnp.take_along_axis(q_lp, drafts[..., None], axis=-1)[..., 0])
    ok = (u * q_d < p_d) & (q_d > 0)
    n_acc = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_at = jnp.take_along_axis(p_lp, n_acc[:, None, None], axis=1)[:, 0]
    q_pad = jnp.concatenate([q_lp, jnp.full_like(q_lp[:, :1], -jnp.inf)], axis=1)
    q_at = jnp.take_along_axis(q_pad, n_acc[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(jnp.exp(p_at) - jnp.exp(q_at), 0.0)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, jnp.exp(p_at))
    extra = jax.vmap(lambda kk, r: jax.random.categorical(kk, jnp.log(r)))(kx, resid).astype(jnp.int32)
    toks = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    return toks.at[jnp.arange(bsz), n_acc].set(extra), n_acc
