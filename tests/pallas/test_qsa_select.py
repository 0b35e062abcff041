"""Op "qsa_select": the QSA indexer's scores, top-k and token list in one launch, against the separate reference
ops (`fnx.model.qsa.select_token_indices` on "reference"), in interpret mode on the CPU (compiled on a GPU)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.model import qsa
from fnx.pallas import dispatch, grid_sync
from fnx.pallas.qsa import api, select
from tests.pallas.kernel_mode import KERNEL


def _cfg(budget=64, cr=4, di=16):
    return SimpleNamespace(indexer_compress_ratio=cr, block_topk=budget // cr, indexer_head_dim=di)


def _rows_as_sets(idx):
    idx = np.asarray(idx)
    out = []
    for row in idx.reshape(-1, idx.shape[-1]):
        kept = row[row >= 0]
        assert len(set(kept.tolist())) == len(kept), "a position appears twice"
        out.append(sorted(kept.tolist()))
    return out


def _inputs(seed, bsz, length, hi, di, n_blocks, dtype):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    q = jax.random.normal(k1, (bsz, length, hi, di), jnp.float32).astype(dtype)
    blocks = jax.random.normal(k2, (bsz, n_blocks, di), jnp.float32).astype(dtype)
    return q, blocks


def _reference(q, blocks, positions, capacity, cfg):
    return jax.jit(lambda *a: qsa.select_token_indices(*a, capacity, cfg, "reference"))(q, blocks, positions)


def _select(q, blocks, positions, capacity, cfg, impl=KERNEL):
    return jax.jit(lambda *a: api.qsa_select(*a, capacity, cfg.indexer_compress_ratio, cfg.block_topk,
                                             impl=impl))(q, blocks, positions)


@pytest.mark.parametrize("dtype,hi,di,search", [(jnp.bfloat16, 4, 32, "bits"), (jnp.float32, 2, 16, "bits"),
                                               (jnp.bfloat16, 4, 32, "thirds")])
def test_select_equals_the_separate_ops(monkeypatch, dtype, hi, di, search):
    """B = 2 sequences of 5 query rows over 150 blocks (two programs of 128, the second ragged), top-16 of them:
    rows with fewer complete blocks than k (chosen blocks that are not complete give -1), exactly k, a tail of 0 to
    3 tokens, and the cache's last position. The same token set per row as the separate ops; the output layout is
    k * cr block slots then cr - 1 tail slots. search: FNX_QSA_TOPK_SEARCH (how the k-th key is found)."""
    monkeypatch.setenv("FNX_QSA_TOPK_SEARCH", search)
    cfg = _cfg(di=di)
    capacity = 600
    q, blocks = _inputs(11 + hi, 2, 5, hi, di, capacity // 4, dtype)
    positions = jnp.array([[3, 63, 64, 66, 599], [100, 101, 102, 103, 598]], jnp.int32)
    got = np.asarray(_select(q, blocks, positions, capacity, cfg))
    want = np.asarray(_reference(q, blocks, positions, capacity, cfg))
    assert got.shape == want.shape == (2, 5, 16 * 4 + 3) and got.dtype == np.int32
    assert _rows_as_sets(got) == _rows_as_sets(want)
    np.testing.assert_array_equal(got[..., -3:], want[..., -3:])            # the tail, slot for slot
    blocks_got = got[..., :64].reshape(2, 5, 16, 4)[..., 0]
    chosen = blocks_got[blocks_got >= 0]
    assert np.all(np.diff(blocks_got[0, 4]) > 0), "the chosen blocks in ascending order"
    assert chosen.size and np.all(chosen % 4 == 0)
    assert (got[0, 0] >= 0).sum() == 4                                      # position 3: one complete block


def test_select_exact_ties_go_to_the_lower_blocks():
    """All relu'd scores zero, and pairs of equal blocks: the lowest blocks win, as lax.top_k picks them."""
    cfg = _cfg()
    capacity = 300
    q = -jnp.ones((1, 3, 2, 16), jnp.float32)
    blocks = jnp.ones((1, capacity // 4, 16), jnp.float32)
    positions = jnp.array([[131, 140, 299]], jnp.int32)
    got = np.asarray(_select(q, blocks, positions, capacity, cfg))
    for row in got[0]:
        assert sorted(set((row[:64][row[:64] >= 0] // 4).tolist())) == list(range(16))
    q2, b2 = _inputs(5, 1, 3, 2, 16, capacity // 4, jnp.float32)
    b2 = b2.at[:, 1::2].set(b2[:, 0:-1:2])                                    # exact ties in every row
    got = np.asarray(_select(q2, b2, positions, capacity, cfg))
    assert _rows_as_sets(got) == _rows_as_sets(_reference(q2, b2, positions, capacity, cfg))


def test_select_counters_from_a_pool_across_launches():
    """Inside a decode program's counter pool the call takes B * L counters of it; run three times over one region
    (a scanned call site) each launch adds exactly P to each counter, so every launch's last arriver finishes its
    row: the three results are the same, and equal the separate ops'."""
    cfg = _cfg()
    capacity = 600
    q, blocks = _inputs(3, 2, 1, 4, 16, capacity // 4, jnp.float32)
    positions = jnp.array([[599], [300]], jnp.int32)

    def run(q, blocks, positions):
        pool = grid_sync.CounterPool(grid_sync.counter(KERNEL == "pallas_interpret", grid_sync.ZERO_BLOCK))
        with grid_sync.counter_pool(pool):
            def body(c, _):
                return c, api.qsa_select(q, blocks, positions, capacity, 4, cfg.block_topk, impl=KERNEL)
            out = jax.lax.scan(body, 0, None, length=3)[1]
        assert pool.used == 2                                               # B * L counters, once per call site
        return out
    out = np.asarray(jax.jit(run)(q, blocks, positions))
    want = np.asarray(_reference(q, blocks, positions, capacity, cfg))
    for i in range(3):
        np.testing.assert_array_equal(out[i], out[0])
    assert _rows_as_sets(out[0]) == _rows_as_sets(want)


def test_select_reference_backend_is_the_separate_ops():
    """On "reference" the api runs the reference scores, lax.top_k and the token list: the same array as the model's
    reference path."""
    cfg = _cfg()
    q, blocks = _inputs(7, 1, 2, 2, 16, 40, jnp.float32)
    positions = jnp.array([[100, 159]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(_select(q, blocks, positions, 160, cfg, impl="reference")),
                                  np.asarray(_reference(q, blocks, positions, 160, cfg)))


def test_select_applies_and_the_model_routes_through_it():
    """Where it applies, the model's decode-sized token choice under a kernel backend is one qsa_select launch (no
    separate scores or top-k kernel); past 64K context (more blocks than one program holds) op "qsa_select_long",
    one launch as well; rows whose segments' candidates would not fit one program are refused with the reason (an
    explicit backend raises, the model runs the separate ops); "auto" on the CPU keeps the reference."""
    cfg = _cfg()
    q, blocks = _inputs(9, 1, 1, 2, 16, 40, jnp.float32)
    positions = jnp.array([[159]], jnp.int32)
    text = str(jax.make_jaxpr(lambda *a: qsa.select_token_indices(*a, 160, cfg, KERNEL))(q, blocks, positions))
    assert "qsa_select" in text and "qsa_block_topk" not in text and "qsa_index_scores" not in text
    assert {"qsa_select", "qsa_select_long"} <= set(dispatch.KNOWN_OPS)
    assert select.applies(40, 16, 4, 2, 16) is None
    assert "nothing to choose" in select.applies(16, 16, 4, 2, 16)
    assert select.applies(4 * select.TOPK_MAX_BLOCKS, 512, 4, 4, 128) is None           # 256K context
    assert "candidates" in select.applies(40 * select.TOPK_MAX_BLOCKS, 512, 4, 4, 128)
    assert "power-of-two" in select.applies(40, 16, 3, 2, 16)
    assert "head_dim" in select.applies(40, 16, 4, 2, 24)
    wide = SimpleNamespace(indexer_compress_ratio=4, block_topk=512, indexer_head_dim=128)
    qb, pb = jax.ShapeDtypeStruct((1, 1, 4, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 1), jnp.int32)
    long_b = jax.ShapeDtypeStruct((1, 2 * select.TOPK_MAX_BLOCKS + 8, 128), jnp.bfloat16)
    text = str(jax.make_jaxpr(lambda *a: qsa.select_token_indices(*a, 4 * long_b.shape[1], wide, KERNEL))(
        qb, long_b, pb))
    assert "qsa_select_long" in text and "qsa_block_topk" not in text
    huge = jax.ShapeDtypeStruct((1, 40 * select.TOPK_MAX_BLOCKS, 128), jnp.bfloat16)
    with pytest.raises(dispatch.NotApplicable, match="candidates"):
        jax.make_jaxpr(lambda *a: api.qsa_select(*a, 4 * huge.shape[1], 4, 512, impl=KERNEL))(qb, huge, pb)
    if dispatch.why_unavailable("pallas") is not None:
        text = str(jax.make_jaxpr(lambda *a: qsa.select_token_indices(*a, 160, cfg))(q, blocks, positions))
        assert "pallas_call" not in text


@pytest.mark.parametrize("n_blocks,seg,search", [(300, 128, "bits"), (300, 256, "bits"), (520, 128, "bits"),
                                                (300, 128, "thirds"), (300, 128, "radix3")])
def test_select_long_rows_in_segments(monkeypatch, n_blocks, seg, search):
    """Rows longer than one program holds (here `seg` blocks; in the model TOPK_MAX_BLOCKS, past 64K context) in
    one launch: each segment's last program writes its k best as candidates, the last segment the row's k best of
    them. The same token set as the separate ops: B = 2, three query rows, a last segment shorter than the others,
    exact ties across segment edges (pairs of equal blocks), rows with every relu'd score zero (ties everywhere: the
    lowest blocks), few complete blocks. search: FNX_QSA_TOPK_SEARCH (both stages')."""
    monkeypatch.setenv("FNX_QSA_TOPK_SEARCH", search)
    cfg = _cfg()
    capacity = 4 * n_blocks
    q, blocks = _inputs(n_blocks + seg, 2, 3, 2, 16, n_blocks, jnp.float32)
    blocks = blocks.at[0, 1::2].set(blocks[0, 0:-1:2])                       # exact ties in sequence 0
    q = q.at[1, 1].set(-jnp.abs(q[1, 1]))
    blocks = blocks.at[1].set(jnp.abs(blocks[1]))                            # sequence 1, row 1: all scores 0
    positions = jnp.array([[capacity - 1, 700, 90], [capacity - 2, capacity - 1, 517]], jnp.int32)
    got = np.asarray(jax.jit(lambda *a: select.qsa_select(*a, capacity, 4, cfg.block_topk,
                                                          interpret=KERNEL == "pallas_interpret", whole=seg,
                                                          seg=seg))(
        q, blocks, positions))
    want = np.asarray(_reference(q, blocks, positions, capacity, cfg))
    assert _rows_as_sets(got) == _rows_as_sets(want)
    assert _rows_as_sets(got)[4][:64] == list(range(64))                     # the zero row: the lowest 16 blocks
    with pytest.raises(ValueError, match="seg"):
        select.qsa_select(q, blocks, positions, capacity, 4, cfg.block_topk, interpret=True, whole=128, seg=96)


@pytest.mark.parametrize("length,n_blocks", [(1, 2122), (5, 2122), (1, select.TOPK_MAX_BLOCKS),
                                             (1, 2 * select.TOPK_MAX_BLOCKS + 74), (5, 4 * select.TOPK_MAX_BLOCKS)])
def test_select_lowers_for_cuda_released_shapes(length, n_blocks):
    """4 indexer heads x 128, top-512 of 2,122 blocks (8K context) for one query row and an MTP verify window's
    five, of 16,384 (64K context), and in segments at 128K and 256K (op qsa_select_long): one Triton launch
    besides the counters' zeroing."""
    sds = [jax.ShapeDtypeStruct((1, length, 4, 128), jnp.bfloat16),
           jax.ShapeDtypeStruct((1, n_blocks, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, length), jnp.int32)]
    f = jax.jit(lambda q, b, p: select.qsa_select(q, b, p, 4 * n_blocks, 4, 512))
    text = f.trace(*sds).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert ("qsa_select_long" in text) == (n_blocks > select.TOPK_MAX_BLOCKS) and "qsa_select" in text
