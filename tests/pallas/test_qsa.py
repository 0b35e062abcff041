"""QSA sparse decode attention: token selection as indices (against the mask reference), the Pallas kernel in
interpret mode (against fnx.pallas.qsa.reference), the model's decode path through the kernel, and the lowering
for CUDA at the released shapes."""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.model import qsa
from fnx.pallas.qsa import api, reference
from fnx.pallas.qsa import pallas as kernel
from tests.pallas.kernel_mode import INTERPRET, KERNEL  # noqa: F401

# bf16: one rounding of the output plus bf16 probabilities summed in a different order (~2 ulp at |o| <= 1)
TOL = {jnp.bfloat16: 2e-2, jnp.float32: 2e-5}


def _cfg(budget=16, cr=4, di=16):
    return SimpleNamespace(indexer_compress_ratio=cr, block_topk=budget // cr, indexer_head_dim=di)


def _mask_from_indices(idx, capacity):
    idx = np.asarray(idx)
    m = np.zeros(idx.shape[:2] + (capacity,), bool)
    for b in range(idx.shape[0]):
        for l in range(idx.shape[1]):
            row = idx[b, l][idx[b, l] >= 0]
            assert len(set(row.tolist())) == len(row), "a position appears twice"
            m[b, l, row] = True
    return m


def _check_selection(q_idx, blocks, positions, capacity, cfg, impl="reference"):
    idx = jax.jit(lambda *a: qsa.select_token_indices(*a, capacity, cfg, impl))(q_idx, blocks, positions)
    mask = jax.jit(lambda *a: qsa.select_tokens(*a, capacity, cfg))(q_idx, blocks, positions)
    np.testing.assert_array_equal(_mask_from_indices(idx, capacity), np.asarray(mask))
    return np.asarray(idx)


@pytest.mark.parametrize("capacity", [16, 18, 64, 66])   # dense regime (NB <= top-k) and sparse
def test_indices_match_mask_every_position(capacity):
    """Every query position 0..capacity-1: the budget boundary, tails of 0..3 tokens, B = 2."""
    cfg = _cfg()
    k1, k2 = jax.random.split(jax.random.PRNGKey(np.random.randint(1 << 30)))
    bsz, nb = 2, capacity // cfg.indexer_compress_ratio
    q_idx = jax.random.normal(k1, (bsz, capacity, 2, cfg.indexer_head_dim), jnp.float32)
    blocks = jax.random.normal(k2, (bsz, nb, cfg.indexer_head_dim), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (bsz, capacity))
    idx = _check_selection(q_idx, blocks, positions, capacity, cfg)
    n_tail = (idx[..., -(cfg.indexer_compress_ratio - 1):] >= 0).sum(-1)
    np.testing.assert_array_equal(n_tail, (np.asarray(positions) + 1) % cfg.indexer_compress_ratio)


@pytest.mark.parametrize("impl", ["reference", KERNEL])
def test_exact_ties_pick_lower_blocks(impl):
    """All scores 0 (every ReLU is zero): the lowest valid block indices win, as in the mask reference."""
    cfg = _cfg()
    capacity, di = 64, cfg.indexer_head_dim
    blocks = jnp.ones((1, capacity // 4, di), jnp.float32)
    q_idx = -jnp.ones((1, 3, 2, di), jnp.float32)
    positions = jnp.array([[31, 40, 63]], jnp.int32)        # tail 0, 1 and 0 tokens
    idx = _check_selection(q_idx, blocks, positions, capacity, cfg, impl)
    for l in range(3):
        chosen = sorted(set((idx[0, l, :16][idx[0, l, :16] >= 0] // 4).tolist()))
        assert chosen == [0, 1, 2, 3]


@pytest.mark.parametrize("capacity", [66, 256])
def test_prefill_mask_block_choice_through_the_topk_kernel(capacity):
    """The mask of a prefill-sized call (every position of the cache as a query row, B = 2) with its block choice
    through op "qsa_block_topk" equals lax.top_k's: the same set, ties to the lower blocks (pairs of equal blocks,
    and rows with many zero ReLU scores)."""
    cfg = _cfg()
    k1, k2 = jax.random.split(jax.random.PRNGKey(np.random.randint(1 << 30)))
    bsz, nb = 2, capacity // cfg.indexer_compress_ratio
    q_idx = jax.random.normal(k1, (bsz, capacity, 2, cfg.indexer_head_dim), jnp.float32)
    blocks = jax.random.normal(k2, (bsz, nb, cfg.indexer_head_dim), jnp.float32)
    blocks = blocks.at[:, 1::2].set(blocks[:, 0:nb - 1:2])      # pairs of equal blocks: exact ties in every row
    q_idx = q_idx.at[:, ::7].set(-jnp.abs(q_idx[:, ::7]))        # and rows with many ReLU zeros
    positions = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (bsz, capacity))
    want = jax.jit(lambda *a: qsa.select_tokens(*a, capacity, cfg))(q_idx, blocks, positions)
    got = jax.jit(lambda *a: qsa.select_tokens(*a, capacity, cfg, KERNEL))(q_idx, blocks, positions)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(want).sum(-1).max() < capacity        # sparse rows exist: the top-k chose


def test_budget_boundary_is_dense():
    """A query with exactly top-k complete blocks sees every causal token; one block more drops one block."""
    cfg = _cfg()
    capacity = 64
    k1, k2 = jax.random.split(jax.random.PRNGKey(np.random.randint(1 << 30)))
    q_idx = jax.random.normal(k1, (1, 4, 2, 16), jnp.float32)
    blocks = jax.random.normal(k2, (1, 16, 16), jnp.float32)
    positions = jnp.array([[15, 18, 19, 20]], jnp.int32)   # 4, 4, 5, 5 complete blocks
    idx = _check_selection(q_idx, blocks, positions, capacity, cfg)
    counts = (idx >= 0).sum(-1)[0].tolist()
    assert counts == [16, 19, 16, 17]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_index_scores_kernel(dtype):
    """Indexer scores: the kernel against the reference (fp32 sums in another order: ~1 ulp), -inf exactly where
    the reference has it, and the same selection."""
    cfg = _cfg()
    k1, k2 = jax.random.split(jax.random.PRNGKey(np.random.randint(1 << 30)))
    capacity, length = 600, 5                                # 150 blocks: two programs of 128, ragged
    q_idx = jax.random.normal(k1, (2, length, 2, 16), jnp.float32).astype(dtype)
    blocks = jax.random.normal(k2, (2, capacity // 4, 16), jnp.float32).astype(dtype)
    positions = jnp.array([[3, 300, 301, 302, 599], [100, 101, 102, 103, 104]], jnp.int32)
    want = np.asarray(reference.qsa_index_scores(q_idx, blocks, positions, 4))
    got = np.asarray(jax.jit(lambda *a: api.qsa_index_scores(*a, 4, impl=KERNEL))(q_idx, blocks,
                                                                                               positions))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-6)
    _check_selection(q_idx, blocks, positions, capacity, cfg, KERNEL)


def _inputs(dtype, bsz, length, hq, hkv, hd, seq, n_sel, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (bsz, length, hq, hd), jnp.float32).astype(dtype)
    kc = jax.random.normal(ks[1], (bsz, hkv, seq, hd), jnp.float32).astype(dtype)
    vc = jax.random.normal(ks[2], (bsz, hkv, seq, hd), jnp.float32).astype(dtype)
    rng = np.random.default_rng(seed)
    idx = np.full((bsz, length, n_sel), -1, np.int32)
    for b in range(bsz):
        for l in range(length):
            n = rng.integers(1, n_sel + 1)
            idx[b, l, :n] = rng.choice(seq, size=n, replace=False)
            rng.shuffle(idx[b, l])
    idx[0, 0] = -1                                          # a row with nothing selected gives zeros
    return q, kc, vc, jnp.asarray(idx)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("tiles", [None, kernel.Tiles(block_n=16, iters=2, n_splits=3)])
def test_kernel_matches_reference(dtype, tiles):
    seed = np.random.randint(1 << 30)
    q, kc, vc, idx = _inputs(dtype, bsz=2, length=2, hq=6, hkv=2, hd=32, seq=150, n_sel=70, seed=seed)
    want = jax.jit(reference.qsa_decode_attention)(q, kc, vc, idx)
    got = jax.jit(lambda *a: api.qsa_decode_attention(*a, impl=KERNEL, tiles=tiles))(q, kc, vc, idx)
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got[0, 0], 0.0)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_v_first_gives_the_same_bits(dtype):
    """`Tiles.vfirst` only moves V's gather before K's: the same bits, one step per program and several."""
    q, kc, vc, idx = _inputs(dtype, bsz=2, length=2, hq=6, hkv=2, hd=32, seq=150, n_sel=70, seed=7)
    for t in (kernel.Tiles(block_n=16, iters=1, n_splits=5), kernel.Tiles(block_n=32, iters=2, n_splits=2)):
        run = lambda t: np.asarray(api.qsa_decode_attention(q, kc, vc, idx, impl=KERNEL, tiles=t), np.float32)  # noqa
        np.testing.assert_array_equal(run(dataclasses.replace(t, vfirst=1)), run(t), err_msg=str(t))
    assert kernel.choose_tiles(1, 2, 2051, kernel.Choice(vfirst=1)).vfirst == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_loads_ahead_give_the_same_bits(dtype):
    """`Tiles.ahead` (the next step's gathers and the step after's indices issued by hand before each step's
    arithmetic): the same bits as the default walk at one step per program, two, and five with a ragged last
    program (its steps past the selection load nothing); the tile choice carries it and builds it with one stage."""
    q, kc, vc, idx = _inputs(dtype, bsz=2, length=2, hq=6, hkv=2, hd=32, seq=150, n_sel=70, seed=13)
    for t in (kernel.Tiles(block_n=16, iters=1, n_splits=5), kernel.Tiles(block_n=16, iters=2, n_splits=3),
              kernel.Tiles(block_n=16, iters=5, n_splits=1)):
        run = lambda t: np.asarray(api.qsa_decode_attention(q, kc, vc, idx, impl=KERNEL, tiles=t), np.float32)  # noqa
        np.testing.assert_array_equal(run(dataclasses.replace(t, ahead=1)), run(t), err_msg=str(t))
    t = kernel.choose_tiles(8, 2, 2051, kernel.Choice(ahead=1))
    assert (t.ahead, t.num_stages, t.iters) == (1, 1, 4)
    with pytest.raises(ValueError, match="ahead 0 or 1"):
        kernel.parse_choice("ahead=2", "FNX_QSA_TILES")


def test_loads_ahead_and_early_top_k_lower_for_cuda(monkeypatch):
    """The released QSA shapes at B = 8 (four steps a program): with `Tiles.ahead` the decode kernel is built with one
    stage and its loop carries the next step's K and V tiles ([32, 256] bf16 each) and indices; with
    FNX_QSA_TOPK_EARLY=1 the top-k's search is a while loop (at 8K and, in two launches, 128K context)."""
    from fnx.pallas import triton_ir
    S = jax.ShapeDtypeStruct
    args = (S((8, 1, 24, 256), jnp.bfloat16), S((8, 2, 8192, 256), jnp.bfloat16), S((8, 2, 8192, 256), jnp.bfloat16),
            S((8, 1, 2051), jnp.int32))
    for ahead in (1, 0):
        t = kernel.choose_tiles(8, 2, 2051, kernel.Choice(ahead=ahead))
        lowered = jax.jit(lambda *a, _t=t: kernel.qsa_decode_splits(*a, tiles=_t)).trace(*args).lower(
            lowering_platforms=("cuda",))
        ((name, _, stages, text),) = triton_ir.launches(lowered)
        loop = next(ln for ln in text.splitlines() if "scf.for" in ln)
        assert (stages, loop.split("->")[-1].count("tensor<32x256xbf16>")) == ((1, 2) if ahead else (2, 0)), loop
    for early in ("1", "0"):
        monkeypatch.setenv(kernel.TOPK_EARLY_ENV, early)
        for nb, n_launches in ((2122, 1), (32768, 2)):
            lowered = jax.jit(lambda s: kernel.qsa_block_topk(s, 512)).trace(S((1, nb), jnp.float32)).lower(
                lowering_platforms=("cuda",))
            texts = [text for *_, text in triton_ir.launches(lowered)]
            assert len(texts) == n_launches and all(("scf.while" in x) == (early == "1") for x in texts), nb


def test_split_kernel_alone_gives_the_partials_the_merge_takes():
    """`qsa_decode_splits` (what the benchmark times apart from the merge) returns the partials that `combine`
    merges into the reference's output: [rows, Hkv, n_splits, Gp] and [..., hd], one split per program."""
    q, kc, vc, idx = _inputs(jnp.float32, bsz=2, length=2, hq=6, hkv=2, hd=32, seq=150, n_sel=70, seed=9)
    t = kernel.Tiles(block_n=16, iters=2, n_splits=3)
    m, l, acc = kernel.qsa_decode_splits(q, kc, vc, idx, tiles=t, interpret=True)
    assert m.shape == l.shape == (4, 2, 3, 16) and acc.shape == (4, 2, 3, 16, 32)
    got = np.asarray(kernel.combine(m, l, acc)[:, :, :3]).reshape(2, 2, 6, 32)
    want = np.asarray(reference.qsa_decode_attention(q, kc, vc, idx))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_tile_choice_covers_every_slot_and_its_knobs(monkeypatch):
    """`choose_tiles`: the selected slots split over about `Choice.programs` programs, every slot in exactly one
    program's range and no program without a slot; `FNX_QSA_TILES` replaces the choice's fields (bad specs raise,
    naming the knob); the bench's `FNX_QSA_SWEEP` variants are choices, and a variant's tiles run the kernel."""
    from fnx.pallas.qsa import bench
    monkeypatch.delenv(kernel.TILES_ENV, raising=False)
    assert kernel.choose_tiles(8, 2, 2051) == kernel.Tiles(block_n=32, iters=4, n_splits=17)   # B = 8, one token
    for rows in (1, 5, 8, 40):
        for c in (kernel.Choice(), kernel.Choice(programs=1056), kernel.Choice(programs=4096, block_n=16),
                  kernel.Choice(programs=1, block_n=64)):
            t = kernel.choose_tiles(rows, 2, 2051, c)
            span = t.block_n * t.iters
            assert t.n_splits * span >= 2051 > (t.n_splits - 1) * span, (rows, c, t)
            assert t.block_n == (c.block_n or 32) and t.n_splits <= max(1, -(-c.programs // (rows * 2))), (rows, c)
    monkeypatch.setenv(kernel.TILES_ENV, "programs=1056,num_warps=8")
    t = kernel.choose_tiles(8, 2, 2051)
    assert (t.n_splits, t.iters, t.num_warps) == (65, 1, 8)       # 66 programs a row wanted, 65 chunks of 32
    for bad, why in (("block_n=24", "power of"), ("programs=0", "programs"), ("vfirst=2", "vfirst and ahead 0 or 1"),
                     ("splits=4", "not field=value")):
        monkeypatch.setenv(kernel.TILES_ENV, bad)
        with pytest.raises(ValueError, match=why):
            kernel.choose_tiles(8, 2, 2051)
    monkeypatch.delenv(kernel.TILES_ENV)
    monkeypatch.setenv(bench.SWEEP_ENV, "programs=1056; block_n=16,num_stages=1")
    assert [c for _, c in bench.sweep_choices()] == [kernel.Choice(programs=1056),
                                                     kernel.Choice(block_n=16, num_stages=1)]
    q, kc, vc, idx = _inputs(jnp.float32, bsz=2, length=1, hq=6, hkv=2, hd=32, seq=150, n_sel=70, seed=5)
    want = np.asarray(reference.qsa_decode_attention(q, kc, vc, idx))
    for _, c in bench.sweep_choices():
        t = kernel.choose_tiles(2, 2, 70, c)
        got = np.asarray(api.qsa_decode_attention(q, kc, vc, idx, impl=KERNEL, tiles=t))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=str(t))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("ns", [3, 65])        # fewer splits than one combine step; more, not a power of two
def test_combine_kernel_equals_the_jnp_merge_and_gate(dtype, ns):
    """The splits' merge in one launch (`combine_kernel`) against `combine` in jnp, rounded as the attention's
    output, then the model's output gate read in place from a wider product (o * sigmoid(gate), each rounded):
    empty splits (m = -inf) and a row with no split at all among them; 3 heads of a group padded to 16."""
    rng = np.random.default_rng(np.random.randint(1 << 30))
    rows, hkv, gp, grp, hd = 3, 2, 16, 3, 32
    m = rng.normal(size=(rows, hkv, ns, gp)).astype(np.float32) * 3
    m[0, 1, : max(1, ns // 2)] = -np.inf
    m[1, 0] = -np.inf                                       # nothing selected: zeros
    l_ = np.where(np.isfinite(m), rng.uniform(0.5, 4.0, m.shape), 0.0).astype(np.float32)
    acc = (rng.normal(size=(rows, hkv, ns, gp, hd)) * np.isfinite(m)[..., None]).astype(np.float32)
    hq, start, width = hkv * grp, 5, hkv * grp * 2 * hd + 11
    buf = jnp.asarray(rng.normal(size=(rows, width)) * 2, dtype)
    m, l_, acc = jnp.asarray(m), jnp.asarray(l_), jnp.asarray(acc)
    base = kernel.combine(m, l_, acc)[:, :, :grp].astype(dtype).reshape(rows, hq, hd)
    plain = kernel.combine_kernel(m, l_, acc, grp, dtype, interpret=INTERPRET)
    gate = buf[:, start:start + hq * 2 * hd].reshape(rows, hq, 2 * hd)[..., hd:]
    want = base * jax.nn.sigmoid(gate)
    got = kernel.combine_kernel(m, l_, acc, grp, dtype, gate=(buf, start), interpret=INTERPRET)
    assert got.shape == plain.shape == (rows, hq, hd) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(plain[1, :grp], np.float32), 0.0)
    # bf16: the merge's sums in another order may round o one step apart, and the gated product rounds again
    tol = dict(rtol=2 ** -7, atol=1e-6) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(plain, np.float32), np.asarray(base, np.float32), **tol)
    tol = dict(rtol=2 ** -6, atol=1e-6) if dtype == jnp.bfloat16 else tol
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    with pytest.raises(ValueError, match="gate window"):
        kernel.combine_kernel(m, l_, acc, grp, dtype, gate=(buf, width - 10), interpret=INTERPRET)
    # `CombineTiles.early` only moves loads: the same bits as without it, at 16 and 8 columns a program and shorter
    # steps (the columns a program takes and its steps' length change no element's sum order in the kernel's source)
    for t in (kernel.CombineTiles(early=1), kernel.CombineTiles(bd=8, early=1), kernel.CombineTiles(bd=8, splits=4),
              kernel.CombineTiles(bd=8, splits=4, early=1)):
        for g_ in (None, (buf, start)):
            run = lambda tiles: np.asarray(kernel.combine_kernel(m, l_, acc, grp, dtype, gate=g_,  # noqa: E731
                                                                 interpret=INTERPRET, tiles=tiles), np.float32)
            ref = run(dataclasses.replace(t, early=0))
            np.testing.assert_array_equal(run(t), ref, err_msg=str(t))
            np.testing.assert_allclose(ref, np.asarray(plain if g_ is None else got, np.float32), **tol)


def test_combine_tiles_knob(monkeypatch):
    """FNX_QSA_COMBINE_TILES (a benchmark knob) replaces the combine's tile fields; bad values raise."""
    monkeypatch.delenv(kernel.COMBINE_TILES_ENV, raising=False)
    assert kernel.combine_tiles() == kernel.CombineTiles()
    monkeypatch.setenv(kernel.COMBINE_TILES_ENV, "bd=8,early=1")
    assert kernel.combine_tiles() == kernel.CombineTiles(bd=8, early=1)
    for bad, why in (("bd=12", "power of two"), ("splits=0", "power of two"), ("width=8", "not field=value")):
        monkeypatch.setenv(kernel.COMBINE_TILES_ENV, bad)
        with pytest.raises(ValueError, match=why):
            kernel.combine_tiles()
    monkeypatch.setenv(kernel.COMBINE_TILES_ENV, "bd=64")
    acc = jnp.zeros((1, 1, 2, 16, 32), jnp.float32)
    with pytest.raises(ValueError, match="not a multiple of bd 64"):
        kernel.combine_kernel(acc[..., 0], acc[..., 0], acc, 3, jnp.float32, interpret=True)


def test_kernel_path_applies_the_gate_as_the_model():
    """api.qsa_decode_attention(gate=...) on the kernel (fused merge + gate) and on the reference (XLA's ops)."""
    q, kc, vc, idx = _inputs(jnp.bfloat16, bsz=1, length=2, hq=6, hkv=2, hd=32, seq=150, n_sel=70, seed=5)
    buf = jax.random.normal(jax.random.PRNGKey(1), (1, 2, 6 * 64 + 40), jnp.bfloat16)
    ref = api.qsa_decode_attention(q, kc, vc, idx, impl="reference", gate=(buf, 40))
    plain = reference.qsa_decode_attention(q, kc, vc, idx)
    g = buf[..., 40:].reshape(1, 2, 6, 64)[..., 32:]
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(plain * jax.nn.sigmoid(g), np.float32))
    got = api.qsa_decode_attention(q, kc, vc, idx, impl=KERNEL, gate=(buf, 40))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=0,
                               atol=TOL[jnp.bfloat16] * float(jnp.abs(ref.astype(jnp.float32)).max()))
    jaxpr = jax.make_jaxpr(lambda *a: api.qsa_decode_attention(*a, impl=KERNEL, gate=(buf, 40)))(q, kc, vc, idx)
    prims = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert prims.count("pallas_call") == 2 and "logistic" not in prims, prims    # attention, then merge + gate


def test_reference_matches_masked_dense():
    """The gather reference equals the model's masked dense softmax for the same token set."""
    seed = np.random.randint(1 << 30)
    q, kc, vc, idx = _inputs(jnp.bfloat16, bsz=1, length=3, hq=4, hkv=2, hd=16, seq=40, n_sel=20, seed=seed)
    idx = idx.at[0, 0, 0].set(5)
    mask = jnp.asarray(_mask_from_indices(idx, 40))

    @jax.jit
    def dense(q, kc, vc, mask):
        dt = q.dtype
        qh = q.reshape(1, 3, 2, 2, 16)
        s = jnp.einsum("blgrd,bgtd->bgrlt", qh, kc, preferred_element_type=jnp.float32).astype(dt)
        s = (s.astype(jnp.float32) * 0.25).astype(dt).astype(jnp.float32)
        probs = jax.nn.softmax(jnp.where(mask[:, None, None], s, -jnp.inf), axis=-1).astype(dt)
        return jnp.einsum("bgrlt,bgtd->blgrd", probs, vc, preferred_element_type=jnp.float32).astype(dt)
    dense = dense(q, kc, vc, mask)
    got = jax.jit(reference.qsa_decode_attention)(q, kc, vc, idx)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(dense.reshape(1, 3, 4, 16), np.float32),
                               rtol=0, atol=1e-2)


def _layer_setup(seed):
    from fnx.config import ModelConfig
    from fnx.model.transformer import make_meta
    cfg = ModelConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, mrope_section=(2, 1, 1), indexer_n_heads=2, indexer_head_dim=16,
                      indexer_budget=16, ple_layer_ids=())
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
    dt = jnp.float32
    w = lambda *s: 0.2 * jax.random.normal(next(ks), s, dt)
    d, h, hkv, hd, hi, di = 64, 4, 2, 32, 2, 16
    p = {"q_proj": w(2 * h * hd, d), "k_proj": w(hkv * hd, d), "v_proj": w(hkv * hd, d), "o_proj": w(d, h * hd),
         "q_norm": w(hd), "k_norm": w(hd),
         "indexer": {"index_qk_proj": w(hi * di + di, d), "q_layernorm": w(di), "k_layernorm": w(di)}}
    cap = 96
    st = {"k": w(1, hkv, cap, hd) * 5, "v": w(1, hkv, cap, hd) * 5, "idx_blocks": w(1, cap // 4, di) * 5,
          "idx_ring": w(1, 4, di) * 5}
    return cfg, p, st, make_meta, dt, next(ks)


@pytest.mark.parametrize("length,pos", [(1, 70), (5, 61), (1, 11)])   # sparse T=1, sparse verify T=5, dense
def test_qsa_layer_decode_through_kernel(length, pos):
    cfg, p, st, make_meta, dt, kx = _layer_setup(np.random.randint(1 << 30))
    x = jax.random.normal(kx, (1, length, 64), dt)
    pos0 = jnp.array([pos], jnp.int32)
    meta = make_meta(cfg, pos0, length, dt)
    run = lambda impl: jax.jit(lambda x, st: qsa.qsa_layer(p, x, st, pos0, meta["cos"], meta["sin"],
                                                           meta["rope_fn"], cfg, meta["n_valid"], impl=impl))
    y_ref, st_ref, _ = run("reference")(x, st)
    y_ker, st_ker, _ = run(KERNEL)(x, st)
    np.testing.assert_allclose(np.asarray(y_ker), np.asarray(y_ref), rtol=1e-4, atol=1e-5)
    for k in st_ref:   # the cache writes are the same jnp code in both programs: bit-equal in the interpreter;
        # on a GPU the two programs fuse differently and the fp32 state may differ by an ulp (seen on the H200)
        if INTERPRET:
            np.testing.assert_array_equal(np.asarray(st_ker[k]), np.asarray(st_ref[k]))
        else:
            np.testing.assert_allclose(np.asarray(st_ker[k]), np.asarray(st_ref[k]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("length,pos", [(20, 30), (24, 0), (12, 90), (16, 88)])
def test_masked_attention_over_key_chunks(length, pos, dtype, monkeypatch):
    """The masked dense attention of a prefill-sized call (more than 8 tokens; an 8-token call keeps the whole axis)
    over the key axis in chunks (capacity > KEY_CHUNK; here 96 keys in chunks of 32): only the chunks up to the last
    query's position run, and the layer's output is
    the whole-axis computation's within float error (the row sums in another order), its state the same bits. Cases:
    sparse queries in the middle, a first call at position 0 (one chunk runs), queries reaching the last chunk, and
    queries past the capacity (the cache's last keys; the loop must not run past it); capacities that are not a
    whole number of chunks (the last chunk overlaps the one before and masks its keys)."""
    cfg, p, st, make_meta, _, kx = _layer_setup(7 + length + pos)
    st = jax.tree.map(lambda a: a.astype(dtype), st)
    p = jax.tree.map(lambda a: a.astype(dtype), p)
    x = jax.random.normal(kx, (1, length, 64), dtype)
    pos0 = jnp.array([pos], jnp.int32)
    meta = make_meta(cfg, pos0, length, dtype)

    def run(chunk):
        monkeypatch.setattr(qsa, "KEY_CHUNK", chunk)
        return jax.jit(lambda x, st: qsa.qsa_layer(p, x, st, pos0, meta["cos"], meta["sin"], meta["rope_fn"], cfg,
                                                   meta["n_valid"], impl="reference"))(x, st)
    y_ref, st_ref, _ = run(4096)                  # the whole key axis (96 <= KEY_CHUNK)
    calls = []
    real = qsa._masked_attention_chunked
    monkeypatch.setattr(qsa, "_masked_attention_chunked", lambda *a: calls.append(a[-2]) or real(*a))
    y, st_new, _ = run(32)
    assert calls == [32]
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 2.0 ** -7     # bf16: a probability or o may round the other way
    assert np.abs(y - y_ref).max() <= tol * np.abs(y_ref).max(), np.abs(y - y_ref).max() / np.abs(y_ref).max()
    for k in st_ref:
        np.testing.assert_array_equal(np.asarray(st_new[k], np.float32), np.asarray(st_ref[k], np.float32))
    for odd in (40, 5):     # 96 keys in chunks of 40 (the last one, keys 56..95, overlaps the one before) or 5
        calls.clear()
        y_odd = np.asarray(run(odd)[0], np.float32)
        assert calls == [odd]
        assert np.abs(y_odd - y_ref).max() <= tol * np.abs(y_ref).max(), (odd, np.abs(y_odd - y_ref).max())
    calls.clear()
    monkeypatch.setattr(qsa, "_masked_attention_chunked", lambda *a: calls.append("decode") or real(*a))
    x8, meta8 = x[:, :8], make_meta(cfg, pos0, 8, dtype)    # an 8-token call (decode / verify sized): the whole axis
    monkeypatch.setattr(qsa, "KEY_CHUNK", 32)
    jax.jit(lambda x, st: qsa.qsa_layer(p, x, st, pos0, meta8["cos"], meta8["sin"], meta8["rope_fn"], cfg,
                                        meta8["n_valid"], impl="reference"))(x8, st)
    assert calls == []


@pytest.mark.parametrize("length", [1, 5])
def test_index_scores_lower_for_cuda_released_shapes(length):
    """65,536 blocks (262,144 tokens), 4 indexer heads x 128."""
    sds = [jax.ShapeDtypeStruct((1, length, 4, 128), jnp.bfloat16),
           jax.ShapeDtypeStruct((1, 65536, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, length), jnp.int32)]
    f = jax.jit(lambda q, b, p: kernel.qsa_index_scores(q, b, p, 4))
    assert "triton" in f.trace(*sds).lower(lowering_platforms=("cuda",)).as_text().lower()


@pytest.mark.parametrize("length", [1, 5])
@pytest.mark.parametrize("loads_first", [False, True])
def test_lowers_for_cuda_released_shapes(length, loads_first, monkeypatch):
    """Pallas -> Triton lowering at the released shapes: 24 q heads, 2 KV heads, hd 256, 262,144-token cache,
    2048 + 3 selected slots; the attention and the combine with their default tiles and with the load-first ones."""
    monkeypatch.setenv(kernel.COMBINE_TILES_ENV, "bd=8,early=1" if loads_first else "")
    monkeypatch.setenv(kernel.TILES_ENV, "vfirst=1" if loads_first else "")
    sds = [jax.ShapeDtypeStruct((1, length, 24, 256), jnp.bfloat16),
           jax.ShapeDtypeStruct((1, 2, 262144, 256), jnp.bfloat16),
           jax.ShapeDtypeStruct((1, 2, 262144, 256), jnp.bfloat16),
           jax.ShapeDtypeStruct((1, length, 2051), jnp.int32)]
    f = jax.jit(lambda q, k, v, i: kernel.qsa_decode_attention(q, k, v, i))
    text = f.trace(*sds).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower()
    gate = jax.ShapeDtypeStruct((length, 24 * 512 + 2 * 256 * 2 + 4 * 128 + 128), jnp.bfloat16)
    f = jax.jit(lambda q, k, v, i, g: kernel.qsa_decode_attention(q, k, v, i, gate=(g, 640), fused_combine=True))
    text = f.trace(*sds, gate).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("triton") >= 2 and "qsa_combine" in text


def test_kernel_reads_q_and_the_selection_in_place():
    """The query heads of a KV group (3, padded to a 16-row tile) and the selection's tail past its 70 indices are
    read by the kernel itself: the traced call holds no pad of q or of the indices (each was one more XLA kernel
    per QSA layer and call)."""
    q, kc, vc, idx = _inputs(jnp.bfloat16, bsz=1, length=5, hq=6, hkv=2, hd=32, seq=150, n_sel=70, seed=3)
    jaxpr = str(jax.make_jaxpr(lambda *a: api.qsa_decode_attention(*a, impl=KERNEL))(q, kc, vc, idx))
    assert " pad[" not in jaxpr and "= pad " not in jaxpr, jaxpr[:3000]


def _topk_scores(seed: int, nb: int) -> np.ndarray:
    """Rows [2, 3, NB] of block scores the top-k must get right: distinct, half and wholly -inf (blocks not yet
    complete), rounded (heavy ties), zeros, all equal, and huge."""
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((2, 3, nb)).astype(np.float32)
    s[0, 0, : nb // 2] = -np.inf
    s[0, 1] = np.round(s[0, 1])
    s[0, 2, ::3] = 0.0
    s[1, 0] = -np.inf
    s[1, 1] = 1.0
    s[1, 2] = np.abs(s[1, 2]) * 1e30
    return s


@pytest.mark.parametrize("nb,k", [(70, 16), (2122, 512), (40, 40), (33, 1)])
def test_block_topk_kernel_is_the_top_k_set(nb, k):
    """The top-k block kernel picks the set lax.top_k picks, in ascending block order: distinct scores, heavy ties
    (the lower blocks first, as top_k), rows half or wholly -inf (blocks not yet complete), zeros, k = NB and k = 1."""
    s = _topk_scores(nb * 1000 + k, nb)
    got = np.asarray(api.qsa_block_topk(jnp.asarray(s), k, impl=KERNEL))
    want = np.sort(np.asarray(jax.lax.top_k(jnp.asarray(s), k)[1]), axis=-1)
    assert got.shape == (2, 3, k) and got.dtype == np.int32
    np.testing.assert_array_equal(np.sort(got, axis=-1) if KERNEL == "reference" else got, want)
    with pytest.raises(ValueError, match="k=0"):
        kernel.qsa_block_topk(jnp.asarray(s), 0, interpret=True)


@pytest.mark.parametrize("nb,k,seg", [(100, 16, 32), (2122, 64, 512), (70, 16, 16), (257, 32, 64), (33, 1, 16)])
def test_block_topk_long_rows_in_segments(nb, k, seg):
    """Rows longer than one program holds (here `seg` blocks; in the model TOPK_MAX_BLOCKS, 128K and 256K context)
    in two launches: each segment's k best with their keys, then the k best of the candidates. The set lax.top_k
    picks, in ascending block order, with ties across segment edges going to the lower blocks (all-equal rows,
    rounded scores, zeros), wholly and half -inf rows, and a last segment shorter than k."""
    s = _topk_scores(nb * 7 + k, nb)
    got = np.asarray(jax.jit(lambda x: kernel.qsa_block_topk(x, k, interpret=INTERPRET, seg=seg))(jnp.asarray(s)))
    want = np.sort(np.asarray(jax.lax.top_k(jnp.asarray(s), k)[1]), axis=-1)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="seg"):
        kernel.qsa_block_topk(jnp.asarray(s), k, interpret=True, seg=k // 2 if k > 1 else 3)


@pytest.mark.parametrize("nb,k,seg", [(2122, 512, 0), (70, 16, 0), (33, 1, 0), (2122, 64, 512), (257, 32, 64)])
def test_block_topk_early_stop_gives_the_same_set(monkeypatch, nb, k, seg):
    """FNX_QSA_TOPK_EARLY=1 (the search stops once exactly k keys are >= its prefix): the set lax.top_k picks on the
    same rows as the full search (distinct, tied, -inf, zero, equal and huge scores; relu-sum rows like the
    indexer's, which stop early; one and two launches); a bad value raises."""
    s = _topk_scores(nb * 31 + k, nb)
    rng = np.random.default_rng(nb + k)
    relu = np.maximum(rng.standard_normal((4, 64)) @ rng.standard_normal((64, nb)), 0).sum(0).astype(np.float32)
    s = np.concatenate([s.reshape(6, nb), relu[None]])
    want = np.sort(np.asarray(jax.lax.top_k(jnp.asarray(s), k)[1]), axis=-1)
    monkeypatch.setenv(kernel.TOPK_EARLY_ENV, "1")
    run = jax.jit(lambda x: kernel.qsa_block_topk(x, k, interpret=INTERPRET, **({"seg": seg} if seg else {})))
    np.testing.assert_array_equal(np.asarray(run(jnp.asarray(s))), want)
    monkeypatch.setenv(kernel.TOPK_EARLY_ENV, "2")
    with pytest.raises(ValueError, match="FNX_QSA_TOPK_EARLY"):
        kernel.qsa_block_topk(jnp.asarray(s), k, interpret=True)


@pytest.mark.parametrize("search,nb,k,seg", [("bits", 2122, 512, 0), ("bits", 257, 32, 64),
                                             ("thirds", 2122, 512, 0), ("thirds", 33, 1, 0), ("thirds", 40, 40, 0),
                                             ("thirds", 257, 32, 64), ("radix2", 2122, 512, 0),
                                             ("radix3", 33, 1, 0), ("radix4", 257, 32, 64)])
def test_block_topk_searches_give_the_same_set(monkeypatch, search, nb, k, seg):
    """FNX_QSA_TOPK_SEARCH: the k-th key found in thirds (two candidates a count, packed) or r bits a count (one
    [2^r, NB] count each, the last digit shorter where r does not divide 31): the set lax.top_k picks (distinct,
    tied, -inf, zero, equal, huge and huge negative scores, negative ties; one and two launches); bad values and
    the early stop with a search other than "bits" raise."""
    s = _topk_scores(nb * 17 + k, nb).reshape(6, nb)
    rng = np.random.default_rng(nb + k)
    neg = (-np.abs(rng.standard_normal(nb)) * 1e30).astype(np.float32)
    s = np.concatenate([s, neg[None], np.round(neg[None] * 1e-30)])
    want = np.sort(np.asarray(jax.lax.top_k(jnp.asarray(s), k)[1]), axis=-1)
    monkeypatch.setenv(kernel.TOPK_SEARCH_ENV, search)
    run = jax.jit(lambda x: kernel.qsa_block_topk(x, k, interpret=INTERPRET, **({"seg": seg} if seg else {})))
    np.testing.assert_array_equal(np.asarray(run(jnp.asarray(s))), want)
    for bad in ("radix1", "radix5", "x"):
        monkeypatch.setenv(kernel.TOPK_SEARCH_ENV, bad)
        with pytest.raises(ValueError, match="FNX_QSA_TOPK_SEARCH"):
            kernel.topk_search(4096)
    monkeypatch.setenv(kernel.TOPK_SEARCH_ENV, search)
    monkeypatch.setenv(kernel.TOPK_EARLY_ENV, "1")
    if search == "bits":
        assert kernel.topk_search(4096) == "bits"
    else:
        with pytest.raises(ValueError, match="FNX_QSA_TOPK_EARLY"):
            kernel.topk_search(4096)


def test_top_k_search_default_by_row_width(monkeypatch):
    """Unset, the search is "thirds" for rows of up to 4,096 lanes (8K context, where it was measured faster) in
    launches of decode-sized row counts, and "bits" for wider rows (the one-program rows past 16K context and the
    segments past 64K) and a prefill chunk's rows; the early stop keeps "bits"; a named search applies at every
    width."""
    monkeypatch.delenv(kernel.TOPK_SEARCH_ENV, raising=False)
    monkeypatch.delenv(kernel.TOPK_EARLY_ENV, raising=False)
    assert [kernel.topk_search(n) for n in (64, 4096, 8192, 16384)] == ["thirds", "thirds", "bits", "bits"]
    assert [kernel.topk_search(4096, rows) for rows in (5, 64, 65, 2048)] == ["thirds", "thirds", "bits", "bits"]
    monkeypatch.setenv(kernel.TOPK_EARLY_ENV, "1")
    assert kernel.topk_search(4096) == "bits"
    monkeypatch.delenv(kernel.TOPK_EARLY_ENV)
    monkeypatch.setenv(kernel.TOPK_SEARCH_ENV, "radix3")
    assert kernel.topk_search(64) == kernel.topk_search(16384) == "radix3"


def test_top_set_thirds_on_keys_at_the_int32_edges():
    """The thirds search's offsets never overflow: keys at the int32 extremes and next to them, and rows whose
    k-th key is the largest or the lowest key (the whole range walked to either end)."""
    edge = np.array([2 ** 31 - 1, 2 ** 31 - 2, -2 ** 31, -2 ** 31 + 1, 0, -1, 1, 2 ** 30], np.int32)
    rng = np.random.default_rng(3)
    rows = [edge, edge[::-1], np.full(8, 2 ** 31 - 1, np.int32), np.full(8, -2 ** 31, np.int32),
            rng.integers(-2 ** 31, 2 ** 31, 8, dtype=np.int64).astype(np.int32)]
    for row in rows:
        for k in (1, 3, 8):
            sel, _ = jax.jit(lambda x, _k=k: kernel.top_set(x, _k, search="thirds"))(jnp.asarray(row))
            want = np.zeros(8, bool)
            want[np.asarray(jax.lax.top_k(jnp.asarray(row), k)[1])] = True
            np.testing.assert_array_equal(np.asarray(sel), want, err_msg=f"{row} k={k}")


def test_block_topk_searches_lower_for_cuda(monkeypatch):
    """"thirds": a fori loop of 20 packed counts (no 2-D count); "radix2": [4, nbp] counts (15 two-bit digits in the
    loop, the last bit a [2, nbp] count after it); in one launch at 8K and two at 128K context, and in
    `qsa_select`."""
    from fnx.pallas import triton_ir
    from fnx.pallas.qsa import select
    S = jax.ShapeDtypeStruct
    for search, two_d in (("thirds", False), ("radix2", True)):
        monkeypatch.setenv(kernel.TOPK_SEARCH_ENV, search)
        for nb, n_launches in ((2122, 1), (32768, 2)):
            lowered = jax.jit(lambda s: kernel.qsa_block_topk(s, 512)).trace(S((1, nb), jnp.float32)).lower(
                lowering_platforms=("cuda",))
            texts = [text for *_, text in triton_ir.launches(lowered)]
            assert len(texts) == n_launches and all(("tensor<4x" in x) == two_d and "scf.for" in x
                                                    for x in texts), (search, nb)
        lowered = jax.jit(lambda q, b, p: select.qsa_select(q, b, p, 4 * 2122, 4, 512)).trace(
            S((1, 1, 4, 128), jnp.bfloat16), S((1, 2122, 128), jnp.bfloat16), S((1, 1), jnp.int32)).lower(
            lowering_platforms=("cuda",))
        (text,) = [t for *_, t in triton_ir.launches(lowered) if "scf.for" in t]
        assert ("tensor<4x4096xi32>" in text and "tensor<2x4096xi32>" in text) == two_d, search


def test_block_topk_long_rows_dispatch(monkeypatch):
    """Past TOPK_MAX_BLOCKS (64K context) the api asks op "qsa_block_topk_long": the two-launch kernel where it is
    named, and under "auto" on a GPU (its compiled tests passed: VERIFIED_ON_GPU); lax.top_k's sort under "auto" on the
    CPU; rows whose candidates would not fit one program are refused with the reason."""
    from fnx.pallas import dispatch
    nb, k = kernel.TOPK_MAX_BLOCKS + 300, 512
    s = jax.random.normal(jax.random.PRNGKey(3), (1, 2, nb), jnp.float32)
    s = s.at[0, 1, 100:2000].set(2.0)                       # a tie run across many candidates
    assert "qsa_block_topk_long" in dispatch.KNOWN_OPS and "qsa_block_topk_long" in dispatch.VERIFIED_ON_GPU
    want = np.sort(np.asarray(jax.lax.top_k(s, k)[1]), axis=-1)
    monkeypatch.setenv("FNX_KERNELS", f"qsa_block_topk_long={KERNEL}")
    text = str(jax.make_jaxpr(lambda x: api.qsa_block_topk(x, k))(s))
    assert text.count("pallas_call") == 2 and "sort" not in text
    np.testing.assert_array_equal(np.asarray(api.qsa_block_topk(s, k)), want)
    monkeypatch.delenv("FNX_KERNELS")
    if dispatch.why_unavailable("pallas") is not None:     # auto on the CPU: lax.top_k
        assert "pallas_call" not in str(jax.make_jaxpr(lambda x: api.qsa_block_topk(x, k))(s))
    assert kernel.long_rows(4 * kernel.TOPK_MAX_BLOCKS, 512) is None
    assert "candidates" in kernel.long_rows(40 * kernel.TOPK_MAX_BLOCKS, 512)


def test_block_topk_kernel_lowers_for_cuda():
    """The top-k block kernel lowers through Pallas -> Triton at 8K and 64K context (2,122 and 16,384 blocks), one
    query row and the five of an MTP verify window, and in two launches at 128K and 256K; rows whose candidates
    would not fit one program are refused with the reason."""
    for rows, nb in [(1, 2122), (5, 2122), (1, kernel.TOPK_MAX_BLOCKS)]:
        text = jax.jit(lambda s: kernel.qsa_block_topk(s, 512)).trace(
            jax.ShapeDtypeStruct((rows, nb), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1, (rows, nb)
    for rows, nb in [(1, 32768), (5, 65536)]:           # 128K and 256K context: two launches
        text = jax.jit(lambda s: kernel.qsa_block_topk(s, 512)).trace(
            jax.ShapeDtypeStruct((rows, nb), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 2, (rows, nb)
    with pytest.raises(ValueError, match="candidates"):
        kernel.qsa_block_topk(jnp.zeros((1, 40 * kernel.TOPK_MAX_BLOCKS)), 512)
