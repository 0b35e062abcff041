"""Fused input projections (fnx.model.fuse): the same logits and the same tokens as the separate weights, in both
params layouts, with online FP8 weights (partial fusion by format), and through the engine with MTP drafts."""

import dataclasses

import jax
import numpy as np
import pytest

import fnx
from fnx.model import fuse, quant
from tests.model.conftest import prefill_then_decode, rel_err


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory):
    return tiny.write_checkpoint(tmp_path_factory.mktemp("fuse") / "ckpt", "tiny-a", seed=3)


def _fused(model):
    return dataclasses.replace(model, params=fuse.fuse_projections(model.cfg, model.params))


def _layer_keys(params):
    keys = set()
    for seg in params["segments"]:
        for layer in seg:
            for sub in layer.values():
                if isinstance(sub, dict):
                    keys |= set(sub) | {f"indexer/{k}" for k in sub.get("indexer", {})}
    return keys


def test_fused_tree_replaces_each_group_and_leaves_the_input_alone(ckpt):
    model = fnx.load(ckpt, dtype=np.float32)
    fused = fuse.fuse_projections(model.cfg, model.params)
    keys = _layer_keys(fused)
    for names in fuse.GROUPS.values():
        for n in names:
            assert n not in keys, n                       # every member moved into its fused weight
    assert {k for k in keys if k.startswith(fuse.PREFIX)} >= {
        "fused:in_proj_qkv+in_proj_z+in_proj_b+in_proj_a",
        "fused:q_proj+k_proj+v_proj+indexer/index_qk_proj",
        "fused:gate+shared_expert/gate_proj+shared_expert/up_proj+shared_expert_gate",
        "fused:key_proj+value_proj"}
    assert "in_proj_qkv" in _layer_keys(model.params)     # the input tree is unchanged
    assert fuse.is_fused(fused) and not fuse.is_fused(model.params)
    assert len(jax.tree.leaves(fused)) < len(jax.tree.leaves(model.params))


def test_fused_forward_and_decode_equal_the_separate_weights(tiny, tmp_path):
    # 12 layers: group 0 (the PLE layer's) unrolled, groups 1 and 2 stacked and scanned (fused along the row axis
    # of [reps, out, in]): both layouts in one model
    kw = dict(tiny.TINY_CONFIGS["tiny-a"], num_hidden_layers=12)
    model = fnx.load(tiny.write_checkpoint(tmp_path / "twelve", kw, seed=5), dtype=np.float32)
    fused = _fused(model)
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, size=(2, 19))
    # each output row is the same dot, but the CPU's fp32 matmul blocks its sums differently for a wider weight:
    # a few ulp per layer (2.3e-6 over 12 layers), far under the 5e-5 the parity tests allow against transformers
    assert rel_err(fnx.forward(fused, ids), fnx.forward(model, ids)) < 1e-5
    assert rel_err(prefill_then_decode(fused, ids, 15, 32), prefill_then_decode(model, ids, 15, 32)) < 1e-5


def test_online_fp8_fuses_by_format(ckpt):
    """quant="fp8" keeps the GDN b/a projections (and the router, the shared gate) in the load dtype: those fuse
    with each other, adjacent in the group or not; FP8 weights fuse only when their rows are whole 128-row blocks (the tiny ones are not)."""
    model = fnx.load(ckpt, dtype=np.float32, quant="fp8")
    fused = fuse.fuse_projections(model.cfg, model.params)
    gdn = fused["segments"][0][0]["linear_attn"]
    assert "fused:in_proj_b+in_proj_a" in gdn
    # the router and the shared expert's gate logit stay in the load dtype on both sides of the FP8 gate / up pair
    assert "fused:gate+shared_expert_gate" in fused["segments"][0][0]["mlp"]
    assert isinstance(gdn["in_proj_qkv"], quant.Fp8Block) and isinstance(gdn["in_proj_z"], quant.Fp8Block)
    ids = np.random.default_rng(1).integers(0, model.cfg.vocab_size, size=(1, 11))
    assert rel_err(fnx.forward(dataclasses.replace(model, params=fused), ids), fnx.forward(model, ids)) < 1e-5


def test_fp8_blocks_of_whole_rows_fuse_with_their_scales():
    rng = np.random.default_rng(2)
    ws = [quant.quantize_fp8_block(jax.numpy.asarray(rng.standard_normal((r, 256)), jax.numpy.float32))
          for r in (256, 128)]
    p = fuse.fuse_sublayer({"a": ws[0], "b": ws[1]}, ("a", "b"))
    f = p["fused:a+b"]
    assert isinstance(f.w, quant.Fp8Block) and f.w.shape == (384, 256) and f.sizes == (256, 128)
    x = jax.numpy.asarray(rng.standard_normal((3, 256)), jax.numpy.float32)
    ya, yb = fuse.linears(x, p, ("a", "b"))
    from fnx.model.ops import linear
    np.testing.assert_allclose(np.asarray(ya), np.asarray(linear(x, ws[0])), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(yb), np.asarray(linear(x, ws[1])), rtol=1e-6, atol=1e-6)
    # the same outputs as windows into the one product: a kernel reads them in place
    wa, wb = fuse.linear_windows(x, p, ("a", "b"))
    assert wa.buf is wb.buf and (wa.start, wa.size, wb.start, wb.size) == (0, 256, 256, 128)
    np.testing.assert_array_equal(np.asarray(wb.get()), np.asarray(yb))
    (own,) = fuse.linear_windows(x, {"c": ws[1]}, ("c",))          # an unfused projection: its own product
    assert (own.start, own.size) == (0, 128) and own.get() is own.buf


def test_engine_with_fused_projections_generates_the_same_tokens(ckpt):
    from fnx.engine import Engine, SamplingParams
    model = fnx.load(ckpt, dtype=np.float32)
    prompts = [[3, 5, 7, 11, 13, 2, 9], [17, 19, 23]]
    got = []
    for kw in (dict(), dict(fuse_projections=True), dict(fuse_projections=True, speculative=2)):
        eng = Engine(model, max_slots=2, capacity=64, **kw)
        ids = [eng.submit(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
        out = {i: [] for i in ids}
        while eng.has_work():
            for o in eng.step():
                out[o.request_id] += o.token_ids
        got.append([out[i] for i in ids])
        if kw:
            assert eng.fused and fuse.is_fused(eng.model.params)
    assert got[1] == got[0] and got[2] == got[0]
    assert "in_proj_qkv" in _layer_keys(model.params)     # the caller's model keeps its separate weights
    with pytest.raises(ValueError, match="mesh"):
        Engine(model, max_slots=1, capacity=64, fuse_projections=True, mesh="tp=1,ep=1")
