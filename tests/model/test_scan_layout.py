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


def test_scanned_and_unrolled_agree(twelve):
    scanned, flat = twelve
    rng = np.random.default_rng(0)
    ids = rng.integers(0, scanned.cfg.vocab_size, size=(2, 23))
    a, b = fnx.forward(scanned, ids), fnx.forward(flat, ids)
    assert rel_err(b, a) < 1e-6
    assert rel_err(prefill_then_decode(flat, ids, 17, 40), prefill_then_decode(scanned, ids, 17, 40)) < 1e-6


def test_speculative_decode_agrees(twelve):
    from fnx.engine import SamplingParams, SpeculativeConfig
    scanned, flat = twelve
    prompts = [[3, 5, 7, 11, 13], [17, 19, 23]]
    sp = SamplingParams(ignore_eos=True)
    want = fnx.generate(scanned, prompts, max_new_tokens=8, sampling=sp, speculative=SpeculativeConfig(k=2))
    got = fnx.generate(flat, prompts, max_new_tokens=8, sampling=sp, speculative=SpeculativeConfig(k=2))
    assert got == want


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


def test_load_unrolls_on_an_accelerator(twelve, monkeypatch):
    """fnx.load's default layout: the config's (scanned) on the CPU, unrolled when the default backend is an
    accelerator (only the layout is decided here: nothing runs)."""
    import jax
    scanned, _ = twelve
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert fnx.load(scanned.path, dtype=np.float32).cfg.scan_layers
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not fnx.load(scanned.path, dtype=np.float32).cfg.scan_layers
    assert fnx.load(scanned.path, dtype=np.float32, scan_layers=True).cfg.scan_layers


def _stacked_unrolled(scanned):
    """The scanned model's stacked params, run unrolled: every layer reads its views of the stacks."""
    return fnx.Model(scanned.cfg.replace(unroll_stacked=True), scanned.params, scanned.mtp, scanned.path,
                     scanned.tokenizer, scanned.generation_config)


def test_stacked_params_run_unrolled_agree(twelve):
    """`unroll_stacked`: the scanned layout's params (one array per weight kind and group position), every layer
    unrolled with its own state: the unrolled model's logits, decode and state, with far fewer argument arrays."""
    import jax
    scanned, flat = twelve
    model = _stacked_unrolled(scanned)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, scanned.cfg.vocab_size, size=(2, 23))
    assert rel_err(fnx.forward(model, ids), fnx.forward(flat, ids)) < 1e-6
    assert rel_err(prefill_then_decode(model, ids, 20, 40), prefill_then_decode(flat, ids, 20, 40)) < 1e-6
    st = fnx.new_state(model, 2, 40)
    assert len(st["segments"]) == scanned.cfg.num_hidden_layers            # the state: one per layer
    assert len(jax.tree.leaves(model.params)) < len(jax.tree.leaves(flat.params))
    with pytest.raises(NotImplementedError, match="unroll_stacked"):
        fnx.forward(model, ids, return_layers=True)


def test_stacked_params_run_unrolled_speculative_decode_agrees(twelve):
    from fnx.engine import SamplingParams, SpeculativeConfig
    scanned, flat = twelve
    prompts = [[3, 5, 7, 11, 13], [17, 19, 23]]
    sp = SamplingParams(ignore_eos=True)
    want = fnx.generate(flat, prompts, max_new_tokens=5, sampling=sp, speculative=SpeculativeConfig(k=2))
    got = fnx.generate(_stacked_unrolled(scanned), prompts, max_new_tokens=5, sampling=sp,
                       speculative=SpeculativeConfig(k=2))
    assert got == want
