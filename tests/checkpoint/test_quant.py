"""Quantized layouts: the reference dequantizers against NumPy, and FP8-block / NVFP4 checkpoints (written here from
a tiny float checkpoint in the release layouts) against the float model with the same (dequantized) weights and
against the float source. Measured numbers print with -s."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fnx
from fnx.checkpoint import load_checkpoint
from fnx.engine.sampling import SamplingParams
from fnx.model import quant
from tests.checkpoint import writers
from tests.checkpoint.writers import fro, rel_max

# FP8 E4M3 keeps 3 mantissa bits; with one scale per 128x128 block (here: per whole tiny matrix) the logits of the
# 4-layer tiny model move by this much, relative (Frobenius). NVFP4 (E2M1, 1 mantissa bit) on the experts only.
FP8_LOGIT_TOL = 0.15
NVFP4_LOGIT_TOL = 0.15


def _model(path, **kw):
    out = load_checkpoint(path, dtype=np.float32, **kw)
    return fnx.Model(out.cfg, out.params, out.mtp, str(path)), out


@pytest.fixture(scope="module")
def nvfp4_dirs(src, tmp_path_factory):
    return writers.write_nvfp4(src, tmp_path_factory.mktemp("nvfp4"))


@pytest.fixture(scope="module")
def src_logits(src, ids):
    model, _ = _model(src)
    return np.asarray(fnx.forward(model, ids))


@pytest.mark.parametrize("shape", [(300, 200), (3, 130, 256), (16, 32)])
def test_fp8_dequant_matches_numpy(shape):
    rng = np.random.default_rng(sum(shape))
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 10)
    qb = quant.quantize_fp8_block(jnp.asarray(w))
    assert qb.w.dtype == jnp.float8_e4m3fn and qb.scale_inv.shape == shape[:-2] + (
        -(-shape[-2] // 128), -(-shape[-1] // 128))
    got = np.asarray(quant.dequantize(qb, jnp.float32))
    np.testing.assert_array_equal(got, quant.dequantize_np(qb))
    if len(shape) == 2:   # the independent per-block writer quantizes to the same bytes
        q_np, s_np = writers.fp8_block_np(w)
        np.testing.assert_array_equal(np.asarray(qb.w).view(np.uint8), q_np.view(np.uint8))
        np.testing.assert_array_equal(np.asarray(qb.scale_inv), s_np)
        np.testing.assert_array_equal(got, writers.fp8_block_deq(q_np, s_np))
    # E4M3 error bound: half an ulp (2^-4 relative) for normals, half the smallest subnormal (2^-10) below
    scale = np.repeat(np.repeat(np.asarray(qb.scale_inv), 128, -2), 128, -1)[..., :shape[-2], :shape[-1]]
    assert np.all(np.abs(got - w) <= np.maximum(np.abs(w) * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-6))


@pytest.mark.parametrize("shape", [(3, 256, 128), (200, 96)])
def test_abstract_weights_have_the_quantizers_layouts(shape):
    """`quant.abstract_weight` (shapes only, for tracing and lowering) has the leaves, shapes and dtypes the
    quantizers produce, in every format; an unknown format is refused."""
    w = jnp.ones(shape, jnp.float32)
    for fmt, real in (("fp8", quant.quantize_fp8_block(w)), ("nvfp4", quant.quantize_nvfp4(w)),
                      ("bf16", w.astype(jnp.bfloat16))):
        spec = quant.abstract_weight(shape, fmt)
        got = jax.tree.leaves(spec)
        want = jax.tree.leaves(real)
        assert jax.tree.structure(spec) == jax.tree.structure(real), fmt
        assert [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in want], fmt
    with pytest.raises(ValueError, match="unknown format"):
        quant.abstract_weight(shape, "int4")


def test_fp8_zero_block_and_bf16_rounding():
    w = np.zeros((130, 10), np.float32)
    w[129, 3] = 2.5
    qb = quant.quantize_fp8_block(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(qb.scale_inv), np.array([[1.0], [2.5 * np.float32(1 / 448)]], np.float32))
    np.testing.assert_array_equal(np.asarray(quant.dequantize(qb)), w)
    assert quant.dequantize(qb, jnp.bfloat16).dtype == jnp.bfloat16


def test_nvfp4_dequant_integer_ops_match_lookup_table():
    rng = np.random.default_rng(1)
    packed = np.arange(256, dtype=np.uint8).reshape(4, 64)          # every byte, so every code pair
    scale = rng.uniform(0.01, 4, (4, 8)).astype(ml_dtypes.float8_e4m3fn)
    s2 = rng.uniform(0.5, 2, (4,)).astype(np.float32)
    w = quant.Nvfp4(packed, scale, s2, np.float32(1.0))
    got = np.asarray(quant.dequantize(jax.tree.map(jnp.asarray, w)))
    np.testing.assert_array_equal(got, quant.dequantize_np(w))
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(quant.e2m1_to_f32(jnp.asarray(codes))), quant.E2M1_VALUES)
    # against the independent writer: a quantized matrix dequantizes to the writer's own values
    m = rng.standard_normal((24, 64)).astype(np.float32)
    p, bs, g, deq = writers.nvfp4_np(m)
    w = quant.Nvfp4(p, bs, np.full((24,), g, np.float32), np.float32(1.0))
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jax.tree.map(jnp.asarray, w))), deq)


def test_fp8_checkpoint(fp8_dirs, ids, src_logits):
    fp8, deq = fp8_dirs
    model, out = _model(fp8)
    seg = out.params["segments"][0][0]
    assert isinstance(seg["linear_attn"]["in_proj_qkv"], quant.Fp8Block)
    gu = seg["mlp"]["experts"]["gate_up_proj"]
    assert isinstance(gu, quant.Fp8Block) and gu.w.dtype == jnp.float8_e4m3fn and gu.shape == (8, 32, 32)
    assert out.params["lm_head"].dtype == jnp.float32 and out.params["segments"][0][0]["mlp"]["gate"].dtype == \
        jnp.float32
    assert isinstance(out.mtp["mtp.fc_hidden.weight"], quant.Fp8Block)
    logits = np.asarray(fnx.forward(model, ids))
    ref = np.asarray(fnx.forward(_model(deq)[0], ids))
    exact, err = rel_max(logits, ref), fro(logits, src_logits)
    top1 = float(np.mean(logits.argmax(-1) == src_logits.argmax(-1)))
    print(f"FP8 block checkpoint: vs dequantized float model {exact:.1e}; vs float source: fro {err:.3e}, "
          f"top-1 {top1:.3f}")
    assert exact < 1e-6
    assert err < FP8_LOGIT_TOL


def test_nvfp4_checkpoint(nvfp4_dirs, ids, src_logits):
    nv, deq = nvfp4_dirs
    model, out = _model(nv)
    ex = out.params["segments"][0][0]["mlp"]["experts"]
    assert isinstance(ex["gate_up_proj"], quant.Nvfp4) and ex["gate_up_proj"].w.dtype == jnp.uint8
    assert ex["gate_up_proj"].shape == (8, 32, 32) and ex["down_proj"].shape == (8, 32, 16)
    assert isinstance(out.mtp["mtp.layers.0.self_attn.q_proj.weight"], quant.Fp8Block)
    assert out.params["segments"][0][0]["linear_attn"]["in_proj_qkv"].dtype == jnp.float32
    logits = np.asarray(fnx.forward(model, ids))
    ref = np.asarray(fnx.forward(_model(deq)[0], ids))
    exact, err = rel_max(logits, ref), fro(logits, src_logits)
    print(f"NVFP4 checkpoint: vs dequantized float model {exact:.1e}; vs float source: fro {err:.3e}")
    assert exact < 1e-5
    assert err < NVFP4_LOGIT_TOL


def test_online_fp8(src, ids, src_logits):
    model, out = _model(src, quant="fp8")
    p = out.params
    seg = p["segments"][0][0]
    for leaf in (seg["linear_attn"]["in_proj_qkv"], seg["linear_attn"]["out_proj"], seg["mlp"]["experts"]["down_proj"],
                 seg["mlp"]["shared_expert"]["up_proj"], seg["attn_hyper_connection"]["input_mix_weight_down"],
                 p["segments"][1][0]["self_attn"]["o_proj"] if "self_attn" in p["segments"][1][0] else
                 p["segments"][-1][0]["self_attn"]["o_proj"]):
        assert isinstance(leaf, quant.Fp8Block), type(leaf)
    for leaf in (seg["mlp"]["gate"], seg["mlp"]["shared_expert_gate"], seg["attn_hyper_connection"]["hc_norm"],
                 seg["attn_hyper_connection"]["block_inject_weight"], p["lm_head"], p["embed_tokens"]):
        assert not quant.is_quantized(leaf) and leaf.dtype == jnp.float32
    logits = np.asarray(fnx.forward(model, ids))
    err = fro(logits, src_logits)
    print(f"online quant='fp8': vs float source: fro {err:.3e}")
    assert err < FP8_LOGIT_TOL


def test_online_fp8_head_also_quantizes_the_lm_head(src, ids, src_logits):
    """quant="fp8-head": the lm_head in FP8 blocks too (the embedding stays float); the logits stay within the FP8
    bound; speculative decoding takes it as its draft head, also with a hot-token subset (rows dequantized)."""
    from fnx.engine import Engine, SpeculativeConfig
    from fnx.engine.sampling import SamplingParams
    model, out = _model(src, quant="fp8-head")
    assert isinstance(out.params["lm_head"], quant.Fp8Block)
    assert not quant.is_quantized(out.params["embed_tokens"]) and out.params["embed_tokens"].dtype == jnp.float32
    logits = np.asarray(fnx.forward(model, ids))
    err = fro(logits, src_logits)
    print(f"online quant='fp8-head': vs float source: fro {err:.3e}")
    assert err < FP8_LOGIT_TOL
    with pytest.raises(ValueError, match="not supported"):
        _model(src, quant="int4")
    assert model.mtp, "the tiny checkpoint carries its MTP layer"
    hot = np.arange(0, model.cfg.vocab_size, 3)
    for spec in (SpeculativeConfig(2, fp8_head=True), SpeculativeConfig(2, draft_vocab=hot, fp8_head=True)):
        eng = Engine(model, max_slots=1, capacity=64, prefill_chunk=16, speculative=spec)
        assert isinstance(eng.draft_head if eng.draft_head is not None else out.params["lm_head"], quant.Fp8Block)
        req = eng.requests[eng.submit([int(t) for t in np.asarray(ids)[0][:8]],
                                      SamplingParams(max_tokens=4, ignore_eos=True))]
        while eng.has_work():
            eng.step()
        assert req.generated == 4
        eng.close()


def test_fp8_without_quantization_config_is_refused(fp8_dirs, tmp_path):
    import json
    import shutil
    out = tmp_path / "noqc"
    shutil.copytree(fp8_dirs[0], out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(fnx.checkpoint.CheckpointError,
                       match=r"model-0000\d-of-00002.safetensors: tensor '.*' is stored as fp8_block .*does not "
                             r"allow: config.json has no quantization_config"):
        load_checkpoint(out)


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_moe_paths_read_quantized_experts(kind):
    """Both expert paths on quantized experts equal the dense path on the dequantized experts."""
    from fnx.model import moe
    rng = np.random.default_rng(5)
    e, inter, d, t, k = 4, 16, 32, 6, 2
    gu, dn = rng.standard_normal((e, 2 * inter, d)).astype(np.float32), rng.standard_normal((e, d, inter))
    if kind == "fp8":
        qgu, qdn = quant.quantize_fp8_block(jnp.asarray(gu)), quant.quantize_fp8_block(jnp.asarray(dn))
    else:
        def nv(m):
            parts = [writers.nvfp4_np(x) for x in m]
            return quant.Nvfp4(jnp.asarray(np.stack([p[0] for p in parts])), jnp.asarray(np.stack([p[1] for p in parts])),
                               jnp.asarray(np.stack([np.full(m.shape[1], p[2], np.float32) for p in parts])),
                               jnp.ones((e,), jnp.float32))
        qgu, qdn = nv(gu), nv(dn.astype(np.float32))
    x = jnp.asarray(rng.standard_normal((t, d)).astype(np.float32))
    idx = jnp.asarray(rng.integers(0, e, (t, k)).astype(np.int32))
    dense = moe._expert_gather(quant.dequantize(qgu), quant.dequantize(qdn), x, idx)
    for fn in (moe._expert_gather, moe._expert_ragged):
        got = fn(qgu, qdn, x, idx)
        assert got.shape == (t, k, d)
        np.testing.assert_allclose(np.asarray(got), np.asarray(dense), rtol=1e-5, atol=1e-5)


def _mtp_logits(model, raw):
    """The MTP layer's logits at five positions of two rows (random hidden states and next tokens), its params made
    from `raw` (`Loaded.mtp`-style tensors)."""
    from fnx.model.mtp import init_mtp_state, mtp_params, mtp_step
    cfg = model.cfg
    mp = mtp_params(cfg, raw, np.float32)
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.standard_normal((2, 5, cfg.hc_dim)), jnp.float32)
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    logits, _, _ = mtp_step(model.params, mp, init_mtp_state(cfg, 2, 32, jnp.float32), hidden, toks, cfg=cfg)
    return mp, np.asarray(logits)


@pytest.mark.parametrize("which", ["fp8", "nvfp4", "online-fp8"])
def test_quantized_mtp_layer_drafts(which, src, fp8_dirs, nvfp4_dirs):
    """The MTP layer of an FP8 or NVFP4 release (its projections in FP8 blocks), and under the online FP8
    quantization (the trunk's quantized projections and fc_embedding / fc_hidden): its params keep the FP8 blocks,
    its logits equal the float layer's with the same (dequantized) weights, and speculative greedy decoding gives
    the plain tokens."""
    path, kw = {"fp8": (fp8_dirs[0], {}), "nvfp4": (nvfp4_dirs[0], {}), "online-fp8": (src, {"quant": "fp8"})}[which]
    model, out = _model(path, **kw)
    for name in ("fc_hidden.weight", "fc_embedding.weight", "layers.0.self_attn.q_proj.weight",
                 "layers.0.mlp.shared_expert.down_proj.weight", "hyper_connection_mixer.input_mix_weight_up.weight"):
        assert isinstance(out.mtp["mtp." + name], quant.Fp8Block), name
    if which == "online-fp8":
        assert isinstance(out.mtp["mtp.layers.0.mlp.experts.gate_up_proj"], quant.Fp8Block)
    for name in ("pre_fc_norm_hidden.weight", "layers.0.mlp.gate.weight", "hyper_connection_mixer.hc_norm.weight"):
        assert not quant.is_quantized(out.mtp["mtp." + name]), name
    mp, logits = _mtp_logits(model, out.mtp)
    assert isinstance(mp["fc_hidden"], quant.Fp8Block) and isinstance(mp["layer"]["self_attn"]["o_proj"],
                                                                       quant.Fp8Block)
    dense = {k: quant.dequantize_np(v) if quant.is_quantized(v) else v for k, v in out.mtp.items()}
    _, want = _mtp_logits(model, dense)
    assert rel_max(logits, want) < 1e-5
    prompts = [list(range(3, 20)), list(range(5, 15))]
    sp = SamplingParams(ignore_eos=True)
    plain = fnx.generate(model, prompts, max_new_tokens=8, sampling=sp)
    assert fnx.generate(model, prompts, max_new_tokens=8, sampling=sp, speculative=2) == plain
