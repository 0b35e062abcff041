"""`fnx convert` writes the converted tree with orbax; `fnx.load` restores it unchanged (quantized leaves too)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fnx
from fnx.cli import main
from fnx.model import quant


def _same(a, b):
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8), err_msg=str(path))


@pytest.mark.parametrize("quant_arg", [None, "fp8"])
def test_convert_and_restore(src, tmp_path, quant_arg, capsys):
    dst = tmp_path / "conv"
    argv = ["convert", str(src), str(dst), "--no-progress"] + (["--quant", quant_arg] if quant_arg else [])
    assert main(argv) == 0
    assert "converted" in capsys.readouterr().out
    direct = fnx.load(src, quant=quant_arg)
    restored = fnx.load(dst)
    _same(direct.params, restored.params)
    assert set(direct.mtp) == set(restored.mtp) and len(restored.mtp) == 31
    for k, v in direct.mtp.items():
        if quant.is_quantized(v):                # FP8 blocks under --quant fp8 (the MTP's projections)
            _same(v, restored.mtp[k])
        else:
            np.testing.assert_array_equal(np.asarray(restored.mtp[k]), np.asarray(v))
    assert isinstance(restored.mtp["mtp.fc_hidden.weight"], quant.Fp8Block) == (quant_arg == "fp8")
    assert restored.cfg == direct.cfg
    if quant_arg == "fp8":
        assert isinstance(restored.params["segments"][0][0]["linear_attn"]["in_proj_qkv"], quant.Fp8Block)
    with pytest.raises(ValueError, match="restored as converted"):
        fnx.load(dst, quant="fp8")
    with pytest.raises(ValueError, match="was converted with dtype bfloat16"):
        fnx.load(dst, dtype=jnp.float32)


def test_convert_reports_bad_checkpoint(src, tmp_path, capsys):
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    assert main(["convert", str(tmp_path), str(tmp_path / "out"), "--no-progress"]) == 1
    assert "no .safetensors files" in capsys.readouterr().err
