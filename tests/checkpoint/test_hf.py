"""Reading HF checkpoints: both layouts, sharded files, per-expert tensors, and clear errors for checkpoints that do
not match their config or are damaged."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import fnx
from fnx.checkpoint import CheckpointError
from fnx.checkpoint.hf import translate
from fnx.config import ConfigError
from tests.conftest import load_script


@pytest.fixture(scope="module")
def tiny():
    return load_script("make_tiny_checkpoint")


@pytest.fixture(scope="module")
def flat(tiny, tmp_path_factory):
    return tiny.write_checkpoint(tmp_path_factory.mktemp("ck") / "flat", "tiny-a", seed=3)


def _leaves(model):
    import jax
    return jax.tree_util.tree_leaves_with_path(model.params)


def _same_params(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def test_translate_names():
    assert translate("model.language_model.layers.3.self_attn.q_proj.weight").path == ("self_attn", "q_proj")
    assert translate("model.layers.0.linear_attn.A_log").path == ("linear_attn", "A_log")
    t = translate("model.layers.1.ple.ple_embedding.ngram_embedding.shard_7.weight")
    assert (t.kind, t.layer, t.index) == ("ngram_shard", 1, 7)
    t = translate("model.language_model.layers.5.mlp.experts.17.up_proj.weight")
    assert (t.kind, t.layer, t.index, t.path) == ("expert", 5, 17, ("up_proj",))
    assert translate("mtp.fc_hidden.weight").kind == "mtp"
    assert translate("model.visual.blocks.0.attn.qkv.weight").kind == "ignore"
    assert translate("lm_head.weight").path == ("lm_head",)


def test_wrapper_sharded_and_flat_load_the_same(tiny, flat, tmp_path):
    wrapped = tiny.write_checkpoint(tmp_path / "wrap", "tiny-a", seed=3, max_shard_size="20KB", wrapper=True)
    assert len(list(wrapped.glob("*.safetensors"))) > 3
    a, b = fnx.load(flat, dtype=np.float32), fnx.load(wrapped, dtype=np.float32)
    _same_params(a, b)
    assert len(a.mtp) == 31 and set(a.mtp) == set(b.mtp)
    assert "MTP: yes" in repr(a)


def test_per_expert_tensors_load_like_fused(flat, tmp_path):
    """The quantized releases store experts one by one; the loader fuses them into the same tensors."""
    out = tmp_path / "per_expert"
    shutil.copytree(flat, out)
    for f in out.glob("model-*.safetensors"):
        sd = load_file(f)
        for k in [k for k in sd if k.endswith("mlp.experts.gate_up_proj")]:
            base, gu = k[: -len("gate_up_proj")], sd.pop(k)
            down = sd.pop(base + "down_proj")
            inter = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                sd[f"{base}{e}.gate_proj.weight"] = gu[e, :inter].contiguous()
                sd[f"{base}{e}.up_proj.weight"] = gu[e, inter:].contiguous()
                sd[f"{base}{e}.down_proj.weight"] = down[e].contiguous()
        save_file(sd, f)
    (out / "model.safetensors.index.json").unlink()
    _same_params(fnx.load(flat, dtype=np.float32), fnx.load(out, dtype=np.float32))


def _edit(flat, tmp_path, fn):
    out = tmp_path / "edited"
    shutil.copytree(flat, out)
    fn(out)
    return out


def _edit_tensors(out, fn):
    for f in sorted(out.glob("model-*.safetensors")):
        sd = load_file(f)
        fn(sd)
        save_file(sd, f)


def test_config_mismatch_names_tensor_and_shapes(flat, tmp_path):
    def widen(out):
        cfg = json.loads((out / "config.json").read_text())
        cfg["moe_intermediate_size"] += 8
        (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"experts.*has shape .* expects"):
        fnx.load(_edit(flat, tmp_path, widen))


def test_missing_tensor(flat, tmp_path):
    out = _edit(flat, tmp_path, lambda o: _edit_tensors(o, lambda sd: sd.pop(
        "model.layers.2.linear_attn.in_proj_z.weight", None)))
    with pytest.raises(CheckpointError, match=r"missing.*layers\.2\.linear_attn\.in_proj_z"):
        fnx.load(out)


def test_unexpected_tensor(flat, tmp_path):
    def add(sd):
        sd["model.layers.0.linear_attn.bogus.weight"] = torch.zeros(3)
    out = _edit(flat, tmp_path, lambda o: _edit_tensors(o, add))
    with pytest.raises(CheckpointError, match="bogus"):
        fnx.load(out)


def test_more_layers_than_config(flat, tmp_path):
    def fewer(out):
        cfg = json.loads((out / "config.json").read_text())
        cfg["num_hidden_layers"] = 3
        cfg["layer_types"] = cfg["layer_types"][:3]
        (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="do not belong to this config"):
        fnx.load(_edit(flat, tmp_path, fewer))


def test_ple_constants_checked(flat, tmp_path):
    def reseed(out):
        cfg = json.loads((out / "config.json").read_text())
        cfg["seed"] = 99
        (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="layer_multipliers"):
        fnx.load(_edit(flat, tmp_path, reseed))


def test_truncated_file(flat, tmp_path):
    def cut(out):
        f = sorted(out.glob("model-*.safetensors"))[0]
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        fnx.load(_edit(flat, tmp_path, cut))


def test_bad_paths(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        fnx.load(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        fnx.load(tmp_path)


def test_bad_tokens(flat):
    model = fnx.load(flat, dtype=np.float32)
    with pytest.raises(ValueError, match="token ids must lie in"):
        fnx.forward(model, [[1, 2, model.cfg.vocab_size]])
    with pytest.raises(ValueError, match="integers shaped"):
        fnx.forward(model, [[0.5, 1.0]])
    state = fnx.new_state(model, 1, 4)
    with pytest.raises(ValueError, match="state holds 4 tokens"):
        fnx.extend(model, state, [[1, 2, 3, 4, 5]])
