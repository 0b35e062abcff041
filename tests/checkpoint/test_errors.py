"""Damaged or mismatched checkpoints fail in the plan phase, before any device work, with the file and the tensor."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import fnx.checkpoint.place
from fnx.checkpoint import CheckpointError, load_checkpoint


@pytest.fixture(autouse=True)
def no_device_work(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the load reached the streaming phase")
    monkeypatch.setattr(fnx.checkpoint.place, "stream_plan", fail)


def _copy(src, tmp_path):
    out = tmp_path / "ck"
    shutil.copytree(src, out)
    return out


def _trunk(out):
    return sorted(out.glob("model-*.safetensors"))[0]


def _edit(path, fn):
    sd = load_file(path)
    fn(sd)
    save_file(sd, path)


def test_missing_shard_names_file_and_tensors(src, tmp_path):
    out = _copy(src, tmp_path)
    (out / "mtp.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"mtp\.safetensors: file is missing; .*index\.json puts 31 tensors "
                                              r"there, e\.g\. \['mtp\."):
        load_checkpoint(out)


def test_truncated_file_names_file_and_tensor(src, tmp_path):
    out = _copy(src, tmp_path)
    f = _trunk(out)
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=rf"{f.name}: tensor '[^']+' \(F32 \[.*does not fit .*truncated"):
        load_checkpoint(out)


def test_wrong_shape_names_file_and_tensor(src, tmp_path):
    out = _copy(src, tmp_path)
    name = "model.layers.0.linear_attn.in_proj_z.weight"
    _edit(_trunk(out), lambda sd: sd.__setitem__(name, np.zeros((16, 31), np.float32)))
    with pytest.raises(CheckpointError, match=rf"{_trunk(out).name}: tensor '{name}' has shape \(16, 31\), but the "
                                              r"config expects \(16, 32\)"):
        load_checkpoint(out)


def test_dtype_not_allowed_names_file_and_tensor(src, tmp_path):
    out = _copy(src, tmp_path)
    name = "model.layers.2.mlp.shared_expert.up_proj.weight"
    _edit(_trunk(out), lambda sd: sd.__setitem__(name, sd[name].astype(np.int32)))
    with pytest.raises(CheckpointError, match=rf"{_trunk(out).name}: tensor '{name}' is I32 \(24, 32\) with "
                                              r"companions \[\], which is no known layout"):
        load_checkpoint(out)


def test_config_mismatch_and_every_problem_reported(src, tmp_path):
    out = _copy(src, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_experts"] = 7
    (out / "config.json").write_text(json.dumps(cfg))
    _edit(_trunk(out), lambda sd: sd.pop("model.layers.3.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(out)
    msg = str(err.value)
    assert f"{_trunk(out).name}: tensor 'model.layers.0.mlp.gate.weight' has shape (8, 32), but the config " \
           "expects (7, 32)" in msg
    assert "do not belong to this config" in msg and "model.layers.0.mlp.experts.7.up_proj.weight" in msg
    assert "missing" in msg and "layers.3.self_attn.k_norm" in msg


def test_unknown_quantization_config(src, tmp_path):
    out = _copy(src, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config .*gptq.* is not supported"):
        load_checkpoint(out)


def _edit_torch(path, fn):
    from safetensors.torch import load_file as tload, save_file as tsave
    sd = tload(path)
    fn(sd)
    tsave(sd, path)


def _holding(out, name):
    from safetensors import safe_open
    for f in sorted(out.glob("model-*.safetensors")):
        with safe_open(f, "np") as h:
            if name in h.keys():
                return f
    raise AssertionError(name)


def test_quantized_companions_checked(src, tmp_path):
    from tests.checkpoint import writers
    nv, _ = writers.write_nvfp4(src, tmp_path)
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    f = _holding(nv, name)
    _edit_torch(f, lambda sd: sd.pop(name[: -len("weight")] + "weight_scale_2"))
    with pytest.raises(CheckpointError, match=rf"{f.name}: tensor '{name}' is U8 \(16, 16\) with companions "
                                              r"\['input_scale', 'weight_scale'\], which is no known layout"):
        load_checkpoint(nv)


def test_fp8_scale_shape_checked(fp8_dirs, tmp_path):
    out = _copy(fp8_dirs[0], tmp_path)
    name = "model.layers.0.linear_attn.in_proj_z.weight_scale_inv"
    f = _holding(out, name)
    import torch
    _edit_torch(f, lambda sd: sd.__setitem__(name, torch.ones((2, 1))))
    with pytest.raises(CheckpointError, match=rf"{f.name}: tensor 'model.layers.0.linear_attn.in_proj_z.weight'"
                                              r"\.weight_scale_inv is F32 \(2, 1\), expected F32 \(1, 1\)"):
        load_checkpoint(out)
