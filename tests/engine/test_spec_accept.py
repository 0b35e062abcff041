"""The speculative acceptance rule preserves the target distribution: a statistical test on a tiny vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np

from fnx.engine.spec import accept


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
