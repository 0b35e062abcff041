"""Parity of the fnx text model with the transformers 5.23.0 reference (float32, eager attention) on tiny random
configs. Tolerance: the worst logit error relative to the largest reference logit must stay below 5e-5; measured
values are around 5e-6 (printed with -s)."""

import numpy as np
import pytest

import fnx
from tests.model.conftest import rel_err

CONFIGS = ["tiny-a", "tiny-b", "tiny-c", "tiny-d"]
TOL = 5e-5


def dense_len(cfg):  # the longest sequence whose every query attends densely
    return cfg.indexer_budget + cfg.indexer_compress_ratio - 1


def sparse_len(cfg):  # well past budget + compress_ratio: block selection decides the output
    return 3 * cfg.indexer_budget + 2 * cfg.indexer_compress_ratio + 3


@pytest.mark.parametrize("name", CONFIGS)
def test_dense_regime(cases, name):
    c = cases(name)
    ids = c.tokens(2, dense_len(c.cfg), seed=1)
    err = rel_err(fnx.forward(c.model, ids), c.reference(ids))
    print(f"{name} dense T={ids.shape[1]}: rel err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_sparse_regime(cases, name):
    c = cases(name)
    ids = c.tokens(2, sparse_len(c.cfg), seed=2)
    ref = c.reference(ids)
    err = rel_err(fnx.forward(c.model, ids), ref)
    print(f"{name} sparse T={ids.shape[1]}: rel err {err:.2e}")
    assert err < TOL
    # the selection must matter: the same weights attending densely give different logits
    dense = fnx.Model(c.cfg.replace(indexer_budget=c.cfg.indexer_compress_ratio * ids.shape[1]), c.model.params)
    assert rel_err(fnx.forward(dense, ids), ref) > 100 * TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_then_decode(cases, name):
    """Prefill a prefix, extend by a multi-token chunk, then decode token by token: equal to the full forward."""
    c = cases(name)
    total = sparse_len(c.cfg) - 4
    # seed 4: with seed 3, tiny-c has a near-tie at the block-selection budget at position 51, and on an AVX-512
    # CPU (2026-12-01) the one-token decode's scores round differently in the last ulp from the full forward's, so
    # the top-k picked another block there (rel err 1e-2 from that position on; other seeds and hosts agree to
    # 1e-6). The selection is a hard top-k over fp32 scores: two computations of one score that differ by an ulp
    # may choose differently when two blocks are that close, in fnx as in the reference.
    ids = c.tokens(2, total, seed=4)
    ref = c.reference(ids)
    prefix, chunk = c.cfg.indexer_budget + 1, 5
    state = fnx.new_state(c.model, 2, total)
    outs = []
    logits, state = fnx.extend(c.model, state, ids[:, :prefix])
    outs.append(np.asarray(logits))
    logits, state = fnx.extend(c.model, state, ids[:, prefix:prefix + chunk])
    outs.append(np.asarray(logits))
    for t in range(prefix + chunk, total):
        logits, state = fnx.extend(c.model, state, ids[:, t:t + 1])
        outs.append(np.asarray(logits))
    err = rel_err(np.concatenate(outs, axis=1), ref)
    print(f"{name} prefill {prefix} + chunk {chunk} + decode to {total}: rel err {err:.2e}")
    assert err < TOL
    assert np.asarray(state["pos"]).tolist() == [total, total]


def test_chunked_calls_match_the_reference(cases):
    """`forward` / `extend` in chunks of 7 tokens (the last one shorter, chunk edges inside the compressed blocks and
    the GDN chunks, past the selection budget): the reference's logits, and the hidden and state of one call."""
    c = cases("tiny-b")
    ids = c.tokens(2, sparse_len(c.cfg), seed=6)
    err = rel_err(fnx.forward(c.model, ids, chunk=7), c.reference(ids))
    print(f"tiny-b chunks of 7, T={ids.shape[1]}: rel err {err:.2e}")
    assert err < TOL
    one = fnx.extend(c.model, fnx.new_state(c.model, 2, ids.shape[1]), ids, chunk=None, return_hidden=True)
    many = fnx.extend(c.model, fnx.new_state(c.model, 2, ids.shape[1]), ids, chunk=7, return_hidden=True)
    assert many[0].shape == one[0].shape and many[2].shape == one[2].shape
    assert rel_err(many[2], one[2]) < TOL
    assert np.asarray(many[1]["pos"]).tolist() == np.asarray(one[1]["pos"]).tolist() == [ids.shape[1]] * 2
    np.testing.assert_array_equal(np.asarray(many[1]["ngram_ctx"]), np.asarray(one[1]["ngram_ctx"]))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="chunk must be"):
            fnx.forward(c.model, ids, chunk=bad)


def test_batch_rows_are_independent(cases):
    """A batch of two different sequences gives each row the logits it gets alone. Within float32 noise: the
    matmuls' accumulation order depends on the batch shape (measured ~1e-6); leakage between rows would show at
    1e-2 and above."""
    c = cases("tiny-a")
    ids = c.tokens(2, 30, seed=4)
    both = np.asarray(fnx.forward(c.model, ids, moe_impl="grouped"))
    for b in range(2):
        alone = np.asarray(fnx.forward(c.model, ids[b:b + 1], moe_impl="grouped"))
        assert rel_err(both[b:b + 1], alone) < 1e-5


def test_moe_paths_agree(cases):
    c = cases("tiny-c")
    ids = c.tokens(1, 40, seed=5)
    a = fnx.forward(c.model, ids, moe_impl="gather")
    b = fnx.forward(c.model, ids, moe_impl="ragged")
    g = fnx.forward(c.model, ids, moe_impl="grouped")
    assert rel_err(a, b) < 1e-6 and rel_err(a, g) < 1e-6
    with pytest.raises(ValueError, match="unknown MoE implementation"):
        fnx.forward(c.model, ids, moe_impl="bogus")


@pytest.mark.parametrize("pattern", ["distinct", "skewed", "one"])
def test_grouped_blocks_cover_every_pair(pattern):
    """The grouped path allocates ceil(T*K / block) + min(T*K, E) blocks, not one per expert: every (token, k)
    pair still lands in a block of its own expert, whether each pair has its own expert, a few experts take most
    pairs, or one expert takes them all (partial blocks everywhere)."""
    import jax.numpy as jnp
    from fnx.model import moe
    rng = np.random.default_rng(7)
    e, t, k, d, inter, block = 48, 11, 3, 16, 8, 4
    gu = jnp.asarray(rng.standard_normal((e, 2 * inter, d)).astype(np.float32))
    dn = jnp.asarray(rng.standard_normal((e, d, inter)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((t, d)).astype(np.float32))
    if pattern == "distinct":
        idx = rng.permutation(e)[:t * k].reshape(t, k)
    elif pattern == "skewed":
        idx = np.stack([rng.choice([1, 2, 5, 40], size=k, replace=False) for _ in range(t)])
    else:
        idx = np.full((t, k), e - 1)
    idx = jnp.asarray(idx.astype(np.int32))
    want = moe._expert_gather(gu, dn, x, idx)
    got = moe._expert_grouped(gu, dn, x, idx, block=block, blocks_per_step=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
