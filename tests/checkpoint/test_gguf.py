"""GGUF `qwen4exp`: a tiny HF checkpoint written as GGUF by the `gguf` package's writer (with the forward
transforms of MODEL_SPEC.md 12.3) loads back, through the inverse transforms, to the same model."""

import gguf
import numpy as np
import pytest

import fnx
from fnx.checkpoint import CheckpointError
from fnx.checkpoint.gguf import translate_gguf
from tests.checkpoint.gguf_writer import write_gguf
from tests.checkpoint.writers import fro, rel_max

# Q8_0 for every matrix whose rows hold multiples of 32 values, F16 for the rest: logits move this much (Frobenius).
MIXED_TOL = 0.05


@pytest.fixture(scope="module")
def src_model(src):
    return fnx.load(src, dtype=np.float32)


def test_translate_gguf_names():
    assert translate_gguf("blk.5.attn_qkv.weight", 8).hf == ("model.layers.5.linear_attn.in_proj_qkv.weight",)
    assert translate_gguf("blk.8.attn_q.weight", 8).hf == ("mtp.layers.0.self_attn.q_proj.weight",)
    m = translate_gguf("blk.8.nextn.eh_proj.weight", 8)
    assert m.hf == ("mtp.fc_embedding.weight", "mtp.fc_hidden.weight") and m.transform == "split_cols"
    assert translate_gguf("blk.2.indexer.k_proj.weight", 8).transform == ("part", 1, 0)
    assert translate_gguf("output_hc_norm.weight", 8).transform == "plus1"
    assert translate_gguf("blk.2.bogus.weight", 8) is None


def test_f32_gguf_gives_the_same_model(src, src_model, ids, tmp_path):
    path = write_gguf(src, tmp_path / "tiny-f32.gguf", "f32")
    model = fnx.load(str(path), dtype=np.float32)
    for f in ("hidden_size", "num_hidden_layers", "layer_types", "linear_num_value_heads", "ple_layer_ids",
              "ngram_vocab_size_base", "mrope_section", "indexer_compress_ratio", "vocab_size", "ple_embed_dim"):
        assert getattr(model.cfg, f) == getattr(src_model.cfg, f), f
    assert model.cfg.rms_norm_eps == src_model.cfg.rms_norm_eps and model.cfg.rope_theta == src_model.cfg.rope_theta
    # the remaining config differences (split_ngram_parts, bos, dtype, mtp count) do not enter the step; reuse the
    # source's compiled step
    a = np.asarray(fnx.forward(src_model, ids))
    b = np.asarray(fnx.forward(fnx.Model(src_model.cfg, model.params, model.mtp), ids))
    assert rel_max(b, a) < 1e-6
    # every param back in the HF layout; only the 1 + w norms round (w + 1 - 1 in fp32)
    import jax
    for (p, x), (_, y) in zip(jax.tree_util.tree_leaves_with_path(model.params),
                              jax.tree_util.tree_leaves_with_path(src_model.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=2e-7, err_msg=str(p))
    assert set(model.mtp) == set(src_model.mtp)
    for k, v in src_model.mtp.items():
        np.testing.assert_allclose(model.mtp[k], v, rtol=0, atol=2e-7, err_msg=k)


def test_q8_0_gguf_close(src, src_model, ids, tmp_path):
    path = write_gguf(src, tmp_path / "tiny-q8.gguf", "mixed")
    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(path)).tensors}
    assert {"Q8_0", "F16", "F32"} <= types
    model = fnx.load(str(path), dtype=np.float32)
    same_cfg = fnx.Model(src_model.cfg, model.params, model.mtp)   # see test_f32_gguf_gives_the_same_model
    err = fro(np.asarray(fnx.forward(same_cfg, ids)), np.asarray(fnx.forward(src_model, ids)))
    print(f"Q8_0/F16 GGUF vs float source: fro {err:.3e}")
    assert err < MIXED_TOL


def test_gguf_errors(src, tmp_path):
    path = write_gguf(src, tmp_path / "t.gguf", "f32")
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "qwen4exp")
    for f in r.fields.values():
        if f.name.startswith("qwen4exp."):
            v = f.contents()
            if isinstance(v, list):
                w.add_key_value(f.name, v, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType(f.types[-1]))
            else:
                w.add_key_value(f.name, v, gguf.GGUFValueType(f.types[0]))
    for t in r.tensors:
        if t.name != "blk.0.ssm_out.weight":
            w.add_tensor(t.name, np.asarray(t.data))
    w.add_tensor("blk.0.mystery.weight", np.zeros((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"bad\.gguf: 1 GGUF tensors fnx does not know: \['blk\.0\.mystery"
                                              r"\.weight'\](.|\n)*missing.*layers\.0\.linear_attn\.out_proj"):
        fnx.load(str(tmp_path / "bad.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"llama\.gguf: general\.architecture is 'llama', expected 'qwen4exp'"):
        fnx.load(str(tmp_path / "llama.gguf"))


def test_host_table_view_reads_packed_rows(src, src_model, tmp_path):
    """With the table on the host, a GGUF table is never dequantized whole: rows come from the packed blocks."""
    from fnx.checkpoint import load_any
    path = write_gguf(src, tmp_path / "tiny-q8.gguf", "mixed")
    out = load_any(str(path), dtype=np.float32, ngram_table="host")
    view = out.ngram[1]
    assert view.qtype == gguf.GGMLQuantizationType.F16 and view.shape == (416, 8)   # rows of 8: not Q8_0
    assert "ple_embedding" not in out.params["segments"][1][0]["ple"]
    table = np.asarray(fnx.load(str(path), dtype=np.float32).params["segments"][1][0]["ple"]["ple_embedding"][
        "ngram_embedding"])
    ids = np.random.default_rng(2).integers(0, 416, (2, 3, 4))
    np.testing.assert_array_equal(view.rows(ids), table[ids])


@pytest.mark.parametrize("qtype", ["Q8_0", "IQ4_NL"])
def test_table_view_rows_of_quantized_blocks(qtype):
    from fnx.checkpoint.gguf import GgufTableView
    from fnx.checkpoint.gguf_quants import dequantize
    qt = gguf.GGMLQuantizationType[qtype]
    table = np.random.default_rng(3).standard_normal((50, 160)).astype(np.float32)
    if qt == gguf.GGMLQuantizationType.Q8_0:
        packed = gguf.quants.quantize(table, qt)              # [50, 5 blocks * type size]
    else:                                                     # the gguf package cannot quantize IQ4_NL: random blocks
        packed = np.random.default_rng(4).integers(0, 256, (50 * 5, 18), dtype=np.uint8)
        packed[:, :2] = np.full(50 * 5, 0.01, np.float16).view(np.uint8).reshape(-1, 2)
        packed = packed.reshape(50, 90)
    view = GgufTableView(packed, qt, (50, 160), "t.gguf")
    full = dequantize(packed, qt, (50, 160))
    ids = np.array([[3, 49, 0], [7, 7, 21]])
    np.testing.assert_array_equal(view.rows(ids), full[ids])
    with pytest.raises(IndexError, match=r"\[0, 50\)"):
        view.rows([50])
