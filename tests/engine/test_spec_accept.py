"""The speculative acceptance rule preserves the target distribution: a statistical test on a tiny vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np

from fnx.engine.spec import accept, accept_greedy


def _chi2_ok(counts, probs, n):
    expected = probs * n
    mask = expected > 5
    chi2 = float(np.sum((counts[mask] - expected[mask]) ** 2 / expected[mask]))
    dof = int(mask.sum()) - 1
    return chi2 < dof + 6 * np.sqrt(2 * dof), chi2, dof   # about 6 sigma: fails only when the rule is wrong


def test_rejection_sampling_preserves_target():
    rng = np.random.default_rng(0)
    vocab, k, n = 6, 3, 40000
    p = rng.dirichlet(np.ones(vocab) * 0.7, size=k + 1)       # target p_1..p_{k+1}
    q = rng.dirichlet(np.ones(vocab) * 0.7, size=k)           # a different drafter
    keys = jax.random.split(jax.random.PRNGKey(1), n)
    dkeys = jax.random.split(jax.random.PRNGKey(2), n * k).reshape(n, k, 2)
    drafts = jax.vmap(jax.vmap(lambda kk, lq: jax.random.categorical(kk, lq)), in_axes=(0, None))(
        dkeys, jnp.log(jnp.asarray(q, jnp.float32))).astype(jnp.int32)
    p_lp = jnp.broadcast_to(jnp.log(jnp.asarray(p, jnp.float32)), (n, k + 1, vocab))
    q_lp = jnp.broadcast_to(jnp.log(jnp.asarray(q, jnp.float32)), (n, k, vocab))
    toks, n_acc = accept(p_lp, q_lp, drafts, keys)
    toks, n_acc = np.asarray(toks), np.asarray(n_acc)
    # the first emitted token is always p_1-distributed
    ok, chi2, dof = _chi2_ok(np.bincount(toks[:, 0], minlength=vocab), p[0], n)
    assert ok, (chi2, dof)
    # the second, among rows that emitted it (the first draft was accepted), is p_2-distributed: the emitted
    # tokens are independent of the drafts' acceptance pattern only because of the residual rule
    rows = n_acc >= 1
    ok, chi2, dof = _chi2_ok(np.bincount(toks[rows, 1], minlength=vocab), p[1], int(rows.sum()))
    assert ok, (chi2, dof)
    # acceptance rate of the first draft is sum_x min(p, q)
    assert abs(rows.mean() - np.minimum(p[0], q[0]).sum()) < 0.01


def test_a_broken_rule_is_caught():
    """Accepting every draft emits q, not p: the same statistic must reject it."""
    rng = np.random.default_rng(3)
    vocab, n = 6, 40000
    p, q = rng.dirichlet(np.ones(vocab), size=2)
    draws = rng.choice(vocab, size=n, p=q)
    ok, _, _ = _chi2_ok(np.bincount(draws, minlength=vocab), p, n)
    assert not ok


def test_greedy_rows_take_the_longest_matching_prefix():
    vocab = 5
    p = jnp.log(jax.nn.one_hot(jnp.array([[2, 4, 1, 3]]), vocab) + 1e-30)
    drafts = jnp.array([[2, 4, 0]])
    q = jnp.log(jax.nn.one_hot(drafts, vocab) + 1e-30)
    toks, n_acc = accept(p, q, drafts, jax.random.PRNGKey(0)[None])
    assert int(n_acc[0]) == 2 and np.asarray(toks)[0, :3].tolist() == [2, 4, 1]


def test_greedy_acceptance_from_logits_equals_the_general_rule_on_one_hot_distributions():
    """accept_greedy (argmax of the target logits, longest matching prefix) gives the tokens and counts of
    `accept` on the one-hot distributions of greedy rows: every row's tokens, all k+1 positions, bit for bit,
    over no match, partial matches and full acceptance, with tied logits (the lower id wins in both)."""
    rng = np.random.default_rng(0)
    bsz, k, vocab = 64, 4, 11
    logits = rng.integers(-3, 3, size=(bsz, k + 1, vocab)).astype(np.float32)   # many exact ties
    target = logits.argmax(-1)
    drafts = rng.integers(0, vocab, size=(bsz, k))
    n_match = rng.integers(0, k + 1, size=bsz)
    for b in range(bsz):
        drafts[b, :n_match[b]] = target[b, :n_match[b]]
    p = np.where(np.arange(vocab) == target[..., None], 0.0, -np.inf).astype(np.float32)
    q = np.where(np.arange(vocab) == drafts[..., None], 0.0, -np.inf).astype(np.float32)
    keys = jax.random.split(jax.random.PRNGKey(1), bsz)
    want_t, want_n = accept(jnp.asarray(p), jnp.asarray(q), jnp.asarray(drafts, jnp.int32), keys)
    got_t, got_n = accept_greedy(jnp.asarray(logits, jnp.bfloat16), jnp.asarray(drafts, jnp.int32))
    assert np.asarray(got_n).tolist() == np.asarray(want_n).tolist()
    assert np.asarray(got_t).tolist() == np.asarray(want_t).tolist()
    assert set(np.asarray(got_n).tolist()) == set(range(k + 1))
