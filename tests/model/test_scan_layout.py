"""The two params layouts (`ModelConfig.scan_layers`): identical layer groups stacked and scanned, or every layer
separate and unrolled. The same checkpoint loaded both ways gives the same logits, the same decode and the same
speculative verify + rollback; only the arrangement of params and state differs."""

import numpy as np
import pytest

import fnx
from fnx.model.transformer import layer_plan
from tests.model.conftest import prefill_then_decode, rel_err


@pytest.fixture(scope="module")
def twelve(tiny, tmp_path_factory):
    kw = dict(tiny.TINY_CONFIGS["tiny-a"], num_hidden_layers=12)     # PLE in group 0; groups 1 and 2 are scanned
    path = tiny.write_checkpoint(tmp_path_factory.mktemp("twelve") / "ckpt", kw, seed=5)
    return fnx.load(path, dtype=np.float32, scan_layers=True), fnx.load(path, dtype=np.float32, scan_layers=False)


PROMPTS = [[3, 5, 7, 11, 13], [17, 19, 23]]


@pytest.fixture(scope="module")
def flat_ref(twelve):
    """The unrolled model's results every other layout is compared with, computed once: logits of one call, of a
    prefill then token-by-token decode, every layer's output, and greedy MTP speculative generation (k = 2)."""
    from fnx.engine import SamplingParams, SpeculativeConfig
    _, flat = twelve
    ids = np.random.default_rng(0).integers(0, flat.cfg.vocab_size, size=(2, 23))
    sp = SamplingParams(ignore_eos=True)
    return {"ids": ids, "logits": fnx.forward(flat, ids), "decode": prefill_then_decode(flat, ids, 17, 40),
            "layers": fnx.forward(flat, ids[:, :9], return_layers=True),
            "spec": fnx.generate(flat, PROMPTS, max_new_tokens=8, sampling=sp, speculative=SpeculativeConfig(k=2))}


def _speculative(model):
    from fnx.engine import SamplingParams, SpeculativeConfig
    return fnx.generate(model, PROMPTS, max_new_tokens=8, sampling=SamplingParams(ignore_eos=True),
                        speculative=SpeculativeConfig(k=2))


def test_layouts(twelve, tmp_path):
    from fnx.checkpoint import load_any
    from fnx.checkpoint.orbax_io import save
    scanned, flat = twelve
    assert any(s.scanned for s in layer_plan(scanned.cfg))
    assert not any(s.scanned for s in layer_plan(flat.cfg))
    assert len(flat.params["segments"]) == flat.cfg.num_hidden_layers
    save(load_any(scanned.path, dtype=np.float32), tmp_path / "conv")       # a converted tree keeps its layout
    assert load_any(tmp_path / "conv", scan_layers=True).cfg.scan_layers
    with pytest.raises(ValueError, match="saved layout"):
        load_any(tmp_path / "conv", scan_layers=False)


def test_scanned_and_unrolled_agree(twelve, flat_ref):
    scanned, _ = twelve
    ids = flat_ref["ids"]
    assert rel_err(fnx.forward(scanned, ids), flat_ref["logits"]) < 1e-6
    assert rel_err(prefill_then_decode(scanned, ids, 17, 40), flat_ref["decode"]) < 1e-6


def test_speculative_decode_agrees(twelve, flat_ref):
    scanned, _ = twelve
    assert _speculative(scanned) == flat_ref["spec"]


def test_scanned_groups_trace_as_scanned_layers(twelve, monkeypatch):
    """The MoE blocks of the scanned groups are traced inside dispatch.in_scanned_layers (where "auto" keeps the
    expert kernels off: their weights would be copied out of the stacks each step); the unrolled layers are not."""
    import jax
    from fnx.model import moe
    from fnx.pallas import dispatch
    scanned, flat = twelve
    seen, real = [], moe.moe_block
    monkeypatch.setattr(moe, "moe_block", lambda *a, **k: seen.append(dispatch.scanned_layers()) or real(*a, **k))
    ids = np.arange(5)[None] % scanned.cfg.vocab_size
    jax.clear_caches()
    fnx.forward(scanned, ids)
    assert True in seen and False in seen, seen
    seen.clear()
    fnx.forward(flat, ids)
    assert seen and not any(seen)
    assert not dispatch.scanned_layers()


def test_load_layouts(twelve, monkeypatch):
    """fnx.load's layouts: by default the config's (scanned) on the CPU, and on an accelerator the stacked params
    run unrolled (only the layout is decided here: nothing runs); each layout by name; the older scan_layers
    spelling; contradictions and unknown names refused."""
    import jax
    scanned, _ = twelve
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    cfg = fnx.load(scanned.path, dtype=np.float32).cfg
    assert cfg.scan_layers and not cfg.unroll_stacked
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg = fnx.load(scanned.path, dtype=np.float32).cfg
    assert cfg.scan_layers and cfg.unroll_stacked
    for layers, scan, unroll in (("unrolled", False, False), ("scanned", True, False), ("stacked", True, True)):
        cfg = fnx.load(scanned.path, dtype=np.float32, layers=layers).cfg
        assert (cfg.scan_layers, cfg.unroll_stacked) == (scan, unroll), layers
    assert not fnx.load(scanned.path, dtype=np.float32, scan_layers=False).cfg.scan_layers
    cfg = fnx.load(scanned.path, dtype=np.float32, scan_layers=True).cfg
    assert cfg.scan_layers and not cfg.unroll_stacked
    with pytest.raises(ValueError, match="contradicts"):
        fnx.load(scanned.path, dtype=np.float32, scan_layers=False, layers="stacked")
    with pytest.raises(ValueError, match="layers must be one of"):
        fnx.load(scanned.path, dtype=np.float32, layers="flat")


def _stacked_unrolled(scanned):
    """The scanned model's stacked params, run unrolled: every layer reads its views of the stacks."""
    return fnx.Model(scanned.cfg.replace(unroll_stacked=True), scanned.params, scanned.mtp, scanned.path,
                     scanned.tokenizer, scanned.generation_config)


def test_stacked_params_run_unrolled_agree(twelve, flat_ref):
    """`unroll_stacked`: the scanned layout's params (one array per weight kind and group position), every layer
    unrolled with its own state: the unrolled model's logits, decode, state and per-layer outputs, with far fewer
    argument arrays."""
    import jax
    scanned, flat = twelve
    model = _stacked_unrolled(scanned)
    ids = flat_ref["ids"]
    assert rel_err(fnx.forward(model, ids), flat_ref["logits"]) < 1e-6
    assert rel_err(prefill_then_decode(model, ids, 17, 40), flat_ref["decode"]) < 1e-6
    st = fnx.new_state(model, 2, 40)
    assert len(st["segments"]) == scanned.cfg.num_hidden_layers            # the state: one per layer
    assert len(jax.tree.leaves(model.params)) < len(jax.tree.leaves(flat.params))
    got, got_layers = fnx.forward(model, ids[:, :9], return_layers=True)       # every layer's output collected
    want, want_layers = flat_ref["layers"]
    assert rel_err(got, want) < 1e-6
    for key in want_layers:
        assert rel_err(got_layers[key], want_layers[key]) < 1e-6, key


def test_stacked_step_split_at_the_ple_layer(twelve):
    """The stacked layout split at the PLE layer (the Engine's pipeline / split PLE fetch): step_back of step_front,
    the front given only `front_inputs` (its state cut by layer, the params by group), is the whole step: the
    same logits, state and rollback material."""
    import jax
    import jax.numpy as jnp
    from fnx.model.transformer import front_inputs, ple_split_point, step, step_back, step_front
    from fnx.ple import initial_context, ngram_ids
    scanned, _ = twelve
    model = _stacked_unrolled(scanned)
    cfg = model.cfg
    assert ple_split_point(cfg) is not None
    toks = jnp.asarray(np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 5)), jnp.int32)
    ids = jnp.asarray(ngram_ids(initial_context(2, model.ngram), np.asarray(toks), model.ngram)[0], jnp.int32)
    state = fnx.new_state(model, 2, 16)
    n_valid = jnp.asarray([5, 3], jnp.int32)
    whole = jax.jit(lambda s: step(model.params, s, toks, ids, cfg=cfg, n_valid=n_valid, snapshots=True))(state)
    front = jax.jit(lambda p, s: step_front(p, s, toks, cfg=cfg, n_valid=n_valid, snapshots=True))(
        *front_inputs(cfg, model.params, state))
    halves = jax.jit(lambda s, f: step_back(model.params, s, toks, f, ids, cfg=cfg, n_valid=n_valid,
                                            snapshots=True))(state, front)
    # two programs against one: XLA fuses the float32 arithmetic differently, so not bit for bit (the unrolled
    # layout's split differs from its whole step by the same 2.4e-5 at most on this model)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(halves), strict=True):
        assert a.shape == b.shape
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * max(1.0, np.abs(a).max()))


def test_stacked_params_run_unrolled_speculative_decode_agrees(twelve, flat_ref):
    assert _speculative(_stacked_unrolled(twelve[0])) == flat_ref["spec"]


def test_logits_at_gives_those_rows_of_the_whole_head(twelve):
    """`step(..., logits_at=...)` (the engine's prefill: the head on each row's last valid token only) gives those
    rows of the whole step's logits [B, 1, V] and the same state and hidden; so does `step_back` after
    `step_front` (the split PLE path)."""
    import jax
    import jax.numpy as jnp
    from fnx.model.transformer import front_inputs, step, step_back, step_front
    from fnx.ple import initial_context, ngram_ids
    scanned, _ = twelve
    model = _stacked_unrolled(scanned)
    cfg = model.cfg
    toks = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, size=(2, 6)), jnp.int32)
    ids = jnp.asarray(ngram_ids(initial_context(2, model.ngram), np.asarray(toks), model.ngram)[0], jnp.int32)
    state = fnx.new_state(model, 2, 16)
    n_valid = jnp.asarray([6, 2], jnp.int32)
    at = n_valid - 1
    whole = jax.jit(lambda s: step(model.params, s, toks, ids, cfg=cfg, n_valid=n_valid))(state)
    rows = jax.jit(lambda s: step(model.params, s, toks, ids, cfg=cfg, n_valid=n_valid, logits_at=at))(state)
    front = jax.jit(lambda p, s: step_front(p, s, toks, cfg=cfg, n_valid=n_valid))(*front_inputs(cfg, model.params,
                                                                                                  state))
    halves = jax.jit(lambda s, f: step_back(model.params, s, toks, f, ids, cfg=cfg, n_valid=n_valid, logits_at=at))(
        state, front)
    want = np.asarray(whole[0])[np.arange(2), np.asarray(at)][:, None]
    scale = max(1.0, np.abs(want).max())
    for got in (rows, halves):
        assert got[0].shape == (2, 1, cfg.vocab_size)
        np.testing.assert_allclose(np.asarray(got[0]), want, rtol=0, atol=1e-5 * scale)
        assert np.abs(np.asarray(got[0]) - np.asarray(whole[0])[:, :1]).max() > 1e-3   # row 1's pick is not row 0
        for a, b in zip(jax.tree.leaves(whole[1:3]), jax.tree.leaves(got[1:3]), strict=True):
            np.testing.assert_allclose(np.asarray(b, np.float64), np.asarray(a, np.float64), rtol=0,
                                       atol=1e-5 * max(1.0, float(np.abs(np.asarray(a, np.float64)).max())))
