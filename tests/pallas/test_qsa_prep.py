"""The QSA prep kernel (fnx.pallas.qsa.prep: norms, RoPE and the state's writes in one launch) against the model's
jnp (fnx.model.qsa.prep): in interpret mode here, compiled on a GPU; the lowering for CUDA at the released shapes."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.config import ModelConfig
from fnx.model import qsa
from fnx.model.transformer import make_meta
from fnx.pallas import dispatch
from fnx.pallas.qsa import api, prep
from tests.pallas.kernel_mode import INTERPRET, KERNEL

_seed = int(os.environ.get("FNX_TEST_SEED") or np.random.SeedSequence().entropy)   # a failure reports it


def _cfg(h=4, hkv=2, hd=32, hi=2, di=16, cr=4):
    return ModelConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=h, num_key_value_heads=hkv,
                       head_dim=hd, mrope_section=(2, 1, 1), indexer_n_heads=hi, indexer_head_dim=di,
                       indexer_compress_ratio=cr, indexer_budget=4 * cr, ple_layer_ids=())


def _case(cfg, dt, bsz, length, pos, n_valid, cap, seed):
    """Projections as windows of one wider product (as the fused projections give them), layer norms, a state of
    random values (every row the kernel must not write is checked to keep its bits), metadata."""
    h, hkv, hd, hi, di, cr = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_n_heads,
                              cfg.indexer_head_dim, cfg.indexer_compress_ratio)
    ks = iter(jax.random.split(jax.random.key((_seed + seed) % 2 ** 31), 12))
    rnd = lambda *s, sc=1.0: (sc * jax.random.normal(next(ks), s, jnp.float32)).astype(dt)
    sizes = (hi * di + di, 2 * h * hd, hkv * hd, hkv * hd)
    pad = 24                                   # columns before the first window and between the windows
    starts = list(np.cumsum([pad] + [s + pad for s in sizes[:-1]]))
    prod = rnd(bsz, length, int(starts[-1] + sizes[-1] + pad), sc=3.0)
    wins = [(prod, int(s)) for s in starts]
    p = {"q_norm": rnd(hd, sc=0.3), "k_norm": rnd(hd, sc=0.3),
         "indexer": {"q_layernorm": rnd(di, sc=0.3), "k_layernorm": rnd(di, sc=0.3)}}
    st = {"k": rnd(bsz, hkv, cap, hd, sc=5.0), "v": rnd(bsz, hkv, cap, hd, sc=5.0),
          "idx_blocks": rnd(bsz, cap // cr, di, sc=5.0), "idx_ring": rnd(bsz, cr, di, sc=5.0)}
    pos0 = jnp.asarray(pos, jnp.int32)
    meta = make_meta(cfg, pos0, length, dt, jnp.asarray(n_valid, jnp.int32))
    return p, wins, st, pos0, meta


def _run_both(cfg, p, wins, st, pos0, meta):
    from fnx.pallas.kernel_math import take_window
    sizes = (cfg.indexer_n_heads * cfg.indexer_head_dim + cfg.indexer_head_dim,
             2 * cfg.num_attention_heads * cfg.head_dim) + (cfg.num_key_value_heads * cfg.head_dim,) * 2
    prods = [take_window(b, s, n) for (b, s), n in zip(wins, sizes)]
    ref = jax.jit(lambda st: qsa.prep(p, prods, st, pos0, meta["cos"], meta["sin"], meta["rope_fn"], cfg,
                                      meta["n_valid"]))(st)
    return ref, _run_kernel(cfg, p, wins, st, pos0, meta)


def _run_kernel(cfg, p, wins, st, pos0, meta):
    """The kernel alone (op "qsa_prep" on `wins`), as _run_both runs it."""
    length = meta["cos"].shape[1]
    bcos, bsin = qsa.block_rope_tables(pos0, length, cfg, meta["cos"].dtype)
    return jax.jit(lambda st: api.qsa_prep(*wins, qsa.prep_norms(p), meta["cos"], meta["sin"], bcos, bsin, pos0,
                                           meta["n_valid"], st, cfg, KERNEL))(st)


def _near(got, want, dt, what):
    """Within an ulp of the row's scale (the RMS sums run in another order than XLA's); in bf16 nearly all equal."""
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert g.shape == w.shape, (what, g.shape, w.shape)
    ulp = 2.0 ** -7 if dt == jnp.bfloat16 else 2.0 ** -20      # fp32: a few ulps over the ops
    scale = np.max(np.abs(w), axis=-1, keepdims=True)
    bad = np.abs(g - w) > ulp * scale
    assert not bad.any(), (what, np.argwhere(bad)[:5], np.max(np.abs(g - w) / np.maximum(scale, 1e-30)))
    if dt == jnp.bfloat16:     # a sum's last fp32 bit flips a bf16 rounding only rarely (none seen interpreted)
        assert np.mean(g == w) > (0.99 if INTERPRET else 0.9), (what, np.mean(g == w))


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("length,pos,n_valid", [
    (1, (70, 13), (1, 1)),           # one token, two rows at different block phases
    (5, (61, 94), (3, 5)),           # the verify window: a row with 3 valid tokens, a row running past capacity
    (8, (0, 89), (8, 2)),            # a first call at position 0; 8 tokens, 7 of them past a 96-token capacity
])
def test_prep_kernel_matches_the_model(dt, length, pos, n_valid):
    """Every output against fnx.model.qsa.prep: q, q_idx, the K/V caches (the new rows; positions past the capacity
    dropped; every other row keeps its bits), the touched blocks (incomplete ones too, as the reference writes
    them) and the untouched ones, the new ring after n_valid tokens, and the rollback buffer."""
    cfg = _cfg()
    p, wins, st, pos0, meta = _case(cfg, dt, 2, length, pos, n_valid, cap=96, seed=length)
    (q0, qi0, st0, buf0), (q1, qi1, st1, buf1) = _run_both(cfg, p, wins, st, pos0, meta)
    _near(q1, q0, dt, "q")
    _near(qi1, qi0, dt, "q_idx")
    _near(st1["k"], st0["k"], dt, "k cache")
    _near(st1["idx_blocks"], st0["idx_blocks"], dt, "idx_blocks")
    for k in ("v", "idx_ring"):                       # data movement only: the same bits
        np.testing.assert_array_equal(np.asarray(st1[k], np.float32), np.asarray(st0[k], np.float32), err_msg=k)
        assert st1[k].dtype == st0[k].dtype, k
    np.testing.assert_array_equal(np.asarray(buf1, np.float32), np.asarray(buf0, np.float32))
    for k in st0:
        assert st1[k].shape == st0[k].shape and st1[k].dtype == st0[k].dtype, k
    # the writes landed where they should: rows at the tokens' positions changed, the rest kept their bits
    kold, knew = np.asarray(st["k"], np.float32), np.asarray(st1["k"], np.float32)
    for b in range(2):
        written = [t for t in range(pos[b], pos[b] + length) if t < 96]
        keep = np.ones(96, bool)
        keep[written] = False
        np.testing.assert_array_equal(knew[b][:, keep], kold[b][:, keep])
        assert all(np.any(knew[b][:, t] != kold[b][:, t]) for t in written)


@pytest.mark.parametrize("dt,length,pos,n_valid", [
    (jnp.bfloat16, 5, (61, 94), (3, 5)),
    *(pytest.param(dt, *case, marks=pytest.mark.extended)     # the knobs' other cases: FNX_EXTENDED_TESTS=1 or a GPU
      for dt, case in ((jnp.bfloat16, (1, (70, 13), (1, 1))), (jnp.bfloat16, (8, (0, 89), (8, 2))),
                       (jnp.float32, (1, (70, 13), (1, 1))), (jnp.float32, (5, (61, 94), (3, 5))),
                       (jnp.float32, (8, (0, 89), (8, 2)))))])
def test_early_loads_give_the_same_bits(dt, length, pos, n_valid, monkeypatch):
    """`early` 1 (FNX_QSA_PREP_EARLY) only moves the loads before the stores: every output the same bits as
    without it (one token, the verify window with a short row, eight tokens past the capacity); with the ring in
    place too (FNX_QSA_PREP_RING_INPLACE: the new ring written over the old one's buffer), the same bits again; the
    ring in place without the early loads is refused, and a bad knob value raises."""
    cfg = _cfg()
    p, wins, st, pos0, meta = _case(cfg, dt, 2, length, pos, n_valid, cap=96, seed=length + 20)
    outs = {}
    for early, ring in (("0", "0"), ("1", "0"), ("1", "1")):
        monkeypatch.setenv(prep.EARLY_ENV, early)
        monkeypatch.setenv(prep.RING_ENV, ring)
        outs[early + ring] = jax.tree.leaves(_run_kernel(cfg, p, wins, st, pos0, meta))
    for got in ("10", "11"):
        for a, b in zip(outs["00"], outs[got], strict=True):
            np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(a, np.float32))
    monkeypatch.setenv(prep.EARLY_ENV, "0")
    with pytest.raises(ValueError, match="needs the early loads"):
        _run_kernel(cfg, p, wins, st, pos0, meta)
    monkeypatch.setenv(prep.RING_ENV, "0")
    monkeypatch.setenv(prep.EARLY_ENV, "yes")
    with pytest.raises(ValueError, match="0 or 1"):
        _run_kernel(cfg, p, wins, st, pos0, meta)


def test_prep_kernel_keeps_the_cache_dtype():
    """Caches and blocks in float32 under a bf16 model: the kernel stores the new rows converted to their dtype, as
    the reference's scatters do."""
    cfg = _cfg()
    p, wins, st, pos0, meta = _case(cfg, jnp.bfloat16, 1, 5, (42,), (5,), cap=64, seed=7)
    st = {k: v.astype(jnp.float32) if k != "idx_ring" else v for k, v in st.items()}
    (q0, qi0, st0, buf0), (q1, qi1, st1, buf1) = _run_both(cfg, p, wins, st, pos0, meta)
    for k in st0:
        assert st1[k].dtype == st0[k].dtype, (k, st1[k].dtype, st0[k].dtype)
    np.testing.assert_array_equal(np.asarray(st1["v"]), np.asarray(st0["v"]))
    _near(st1["k"], st0["k"], jnp.bfloat16, "k cache")


def test_qsa_layer_runs_the_prep_kernel_when_named(monkeypatch):
    """The model's QSA layer takes the kernel when op qsa_prep resolves to one (FNX_KERNELS), and its output and
    state agree with the reference layer's; prefill (more than MAX_TOKENS tokens) and shapes the kernel cannot tile keep
    the reference (FNX_KERNELS), and an explicit impl names the reason."""
    cfg = _cfg()
    dt = jnp.bfloat16
    ks = iter(jax.random.split(jax.random.key(_seed % 2 ** 31), 16))
    w = lambda *s: (0.2 * jax.random.normal(next(ks), s)).astype(dt)
    d, h, hkv, hd, hi, di = 64, 4, 2, 32, 2, 16
    p = {"q_proj": w(2 * h * hd, d), "k_proj": w(hkv * hd, d), "v_proj": w(hkv * hd, d), "o_proj": w(d, h * hd),
         "q_norm": w(hd), "k_norm": w(hd),
         "indexer": {"index_qk_proj": w(hi * di + di, d), "q_layernorm": w(di), "k_layernorm": w(di)}}
    st = {"k": w(1, hkv, 96, hd) * 5, "v": w(1, hkv, 96, hd) * 5, "idx_blocks": w(1, 24, di) * 5,
          "idx_ring": w(1, 4, di) * 5}
    calls = []
    real = prep.qsa_prep
    monkeypatch.setattr(prep, "qsa_prep", lambda *a, **k: calls.append(1) or real(*a, **k))
    for length in (5, 12):
        x = jax.random.normal(next(ks), (1, length, d)).astype(dt)
        pos0 = jnp.array([50], jnp.int32)
        meta = make_meta(cfg, pos0, length, dt)
        run = lambda: jax.jit(lambda x, st: qsa.qsa_layer(p, x, st, pos0, meta["cos"], meta["sin"],
                                                          meta["rope_fn"], cfg, meta["n_valid"]))(x, st)
        y0, s0, a0 = run()
        calls.clear()
        monkeypatch.setenv("FNX_KERNELS", f"qsa_prep={KERNEL}")
        y1, s1, a1 = run()
        monkeypatch.delenv("FNX_KERNELS")
        assert len(calls) == (1 if length <= prep.MAX_TOKENS else 0), (length, calls)
        tol = 2 ** -7 * float(jnp.max(jnp.abs(y0.astype(jnp.float32))))
        np.testing.assert_allclose(np.asarray(y1, np.float32), np.asarray(y0, np.float32), rtol=0, atol=tol)
        assert np.mean(np.asarray(y1, np.float32) == np.asarray(y0, np.float32)) > 0.9
        for k in s0:
            _near(s1[k], s0[k], dt, k)
    why = prep.why_not(48, 16, 8, 1, 4)
    assert why and "head_dim 48" in why
    with pytest.raises(dispatch.NotApplicable, match="head_dim 48"):
        api.prep_backend(KERNEL, why)
    monkeypatch.setenv("FNX_KERNELS", f"qsa_prep={KERNEL}")
    assert api.prep_backend(None, why) == "reference"
    assert "tokens" in prep.why_not(32, 16, 8, 9, 4)


def test_prep_refuses_mismatched_inputs():
    cfg = _cfg()
    p, wins, st, pos0, meta = _case(cfg, jnp.bfloat16, 1, 1, (10,), (1,), cap=32, seed=3)
    bcos, bsin = qsa.block_rope_tables(pos0, 1, cfg, jnp.bfloat16)
    args = (qsa.prep_norms(p), meta["cos"], meta["sin"], bcos, bsin, pos0, meta["n_valid"])
    with pytest.raises(ValueError, match="window"):
        api.qsa_prep(*wins[:3], (wins[3][0], wins[3][0].shape[-1] - 8), *args, st, cfg, "pallas_interpret")
    bad = dict(st, idx_ring=st["idx_ring"][:, :2])
    with pytest.raises(ValueError, match="idx_ring"):
        api.qsa_prep(*wins, *args, bad, cfg, "pallas_interpret")
    with pytest.raises(ValueError, match="RoPE tables"):
        api.qsa_prep(*wins, args[0], meta["cos"].astype(jnp.float32), *args[2:], st, cfg, "pallas_interpret")


@pytest.mark.parametrize("length", [1, 5])
@pytest.mark.parametrize("early,in_place", [(0, 0), (1, 0), (1, 1)])
def test_prep_lowers_for_cuda_released_shapes(length, early, in_place):
    """Pallas -> Triton at the released shapes: 24 query heads and 2 KV heads of 256, 4 indexer heads of 128, RoPE
    on 64 columns, a 262,144-token cache, the projections as windows of one fused product; in_place 1: the ring
    in place."""
    cfg = ModelConfig()
    h, hkv, hd, hi, di, cr = 24, 2, 256, 4, 128, 4
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.indexer_n_heads,
            cfg.indexer_head_dim, cfg.rotary_dim) == (h, hkv, hd, hi, di, 64)
    cap = 262144
    bf = jnp.bfloat16
    width = hi * di + di + 2 * h * hd + 2 * hkv * hd
    nbb = prep.nbuf_rows(length, cr) // cr
    sds = dict(prod=jax.ShapeDtypeStruct((1, length, width), bf),
               cos=jax.ShapeDtypeStruct((1, length, 64), bf), bcos=jax.ShapeDtypeStruct((1, nbb, 64), bf),
               pos=jax.ShapeDtypeStruct((1,), jnp.int32),
               k=jax.ShapeDtypeStruct((1, hkv, cap, hd), bf), blk=jax.ShapeDtypeStruct((1, cap // cr, di), bf),
               ring=jax.ShapeDtypeStruct((1, cr, di), bf), nd=jax.ShapeDtypeStruct((hd,), bf),
               ni=jax.ShapeDtypeStruct((di,), bf))

    def f(prod, cos, bcos, pos, k, v, blk, ring, nd, ni):
        starts = np.cumsum([0, hi * di + di, 2 * h * hd, hkv * hd])
        st = {"k": k, "v": v, "idx_blocks": blk, "idx_ring": ring}
        return prep.qsa_prep(*[(prod, int(s)) for s in starts], (ni, ni, nd, nd), cos, cos, bcos, bcos, pos, pos,
                             st, heads=h, kv_heads=hkv, head_dim=hd, idx_heads=hi, idx_dim=di, cr=cr, eps=1e-6,
                             early=early, ring_inplace=in_place)
    s = sds
    text = jax.jit(f, donate_argnums=(4, 5, 6)).trace(
        s["prod"], s["cos"], s["bcos"], s["pos"], s["k"], s["k"], s["blk"], s["ring"], s["nd"], s["ni"]
    ).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower() and "qsa_prep" in text


def test_prep_reads_stacked_norms_in_place():
    """With stacked params (`fnx.pallas.stacked.LayerRef`, the layout fnx.serve runs on a GPU) the kernel takes
    the norms' stacks themselves, not a slice (each slice feeding a custom call is a copy kernel of its own), and
    gives the same bits as with plain arrays."""
    from fnx.pallas.stacked import LayerRef
    cfg = _cfg()
    p, wins, st, pos0, meta = _case(cfg, jnp.bfloat16, 1, 5, (30,), (5,), cap=64, seed=11)
    norms = qsa.prep_norms(p)
    stacks = [jnp.stack([n * 0.5, n, n * 2.0]) for n in norms]
    refs = tuple(LayerRef(s, 1) for s in stacks)
    bcos, bsin = qsa.block_rope_tables(pos0, 5, cfg, jnp.bfloat16)
    run = lambda ns, st: api.qsa_prep(*wins, ns, meta["cos"], meta["sin"], bcos, bsin, pos0, meta["n_valid"], st,
                                      cfg, KERNEL)
    jaxpr = jax.make_jaxpr(lambda *s: run(tuple(LayerRef(a, 1) for a in s), st))(*stacks).jaxpr
    calls = [e for e in jaxpr.eqns if "pallas_call" in str(e.primitive)]
    assert len(calls) == 1
    shapes = [tuple(v.aval.shape) for v in calls[0].invars]
    assert all(tuple(s.shape) in shapes for s in stacks), shapes
    assert not any(str(e.primitive) in ("slice", "dynamic_slice", "squeeze") for e in jaxpr.eqns), jaxpr
    got = jax.jit(lambda st: run(refs, st))(st)
    want = jax.jit(lambda st: run(norms, st))(st)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_model_verify_and_rollback_through_the_prep_kernel(monkeypatch, tmp_path):
    """tiny-b in fp32: a prompt, then a five-token verify window (`snapshots=True`, one row with 4 valid tokens)
    and `rollback` to 2 and 5 kept tokens, with every QSA layer's prep through the kernel, against the model's jnp:
    the logits and every state leaf agree within the norms' reordered sums (measured ~1e-7 of their scale); with the
    early loads and the ring in place, the kernel's own bits."""
    from tests.pallas.verify_round import tiny_verify_round
    run = tiny_verify_round(tmp_path, seed=2, rng_seed=1, prompt_len=9, n_valid=[5, 4], n_keep=[2, 5])
    calls = []
    real = prep.qsa_prep
    monkeypatch.setattr(prep, "qsa_prep", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("FNX_KERNELS", "qsa_prep=reference")   # on a GPU `auto` runs the (verified) kernel
    want_lg, want_st = run()
    assert not calls
    monkeypatch.setenv("FNX_KERNELS", f"qsa_prep={KERNEL}")
    got_lg, got_st = run()
    monkeypatch.setenv(prep.EARLY_ENV, "1")                 # the early loads with the ring in place: the same bits
    monkeypatch.setenv(prep.RING_ENV, "1")
    jax.clear_caches()
    for a, b in zip(jax.tree.leaves(run()), jax.tree.leaves((got_lg, got_st)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for env in ("FNX_KERNELS", prep.EARLY_ENV, prep.RING_ENV):
        monkeypatch.delenv(env)
    jax.clear_caches()
    assert calls, "the verify window did not run the prep kernel"
    leaves = list(zip(jax.tree.leaves((got_lg, got_st)), jax.tree.leaves((want_lg, want_st)), strict=True))
    worst = 0.0
    for a, b in leaves:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.abs(a - b).max()) / max(1.0, float(np.abs(b).max())))
    print(f"tiny-b verify window + rollback, qsa_prep kernel vs the model's jnp: {worst:.1e}")
    assert worst < 1e-5
