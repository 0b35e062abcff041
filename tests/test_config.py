"""ModelConfig from HF config.json: both forms, the layer-type spellings, and validation errors that name the field."""

import json

import pytest

from fnx.config import INDEXED, LINEAR, ConfigError, ModelConfig

RELEASE_TEXT = {
    "model_type": "qwen4_exp_text", "vocab_size": 248320, "hidden_size": 2560, "num_hidden_layers": 48,
    "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)],
    "full_attention_interval": 4, "num_attention_heads": 24, "num_key_value_heads": 2, "head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "hidden_act": "silu", "output_gate_type": "sigmoid",
    "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
    "linear_num_value_heads": 48, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 640,
    "shared_expert_intermediate_size": 640, "hc_count": 4, "hc_lowrank": 320, "indexer_n_heads": 4,
    "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048, "indexer_compress_ratio": 4,
    "ple_layer_ids": [2], "ple_embed_dim": 2560, "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20000000, "make_ngram_vocab_size_divisible_by": 128, "split_ngram_parts": 128,
    "eos_token_id": 248044, "bos_token_id": 248044, "tie_word_embeddings": False, "mtp_num_hidden_layers": 1,
    "dtype": "bfloat16",
}


def test_release_flat_config():
    cfg = ModelConfig.from_dict(RELEASE_TEXT)
    assert cfg.layer_types.count(INDEXED) == 12 and cfg.layer_types[3] == INDEXED and cfg.layer_types[0] == LINEAR
    assert (cfg.key_dim, cfg.value_dim, cfg.conv_dim) == (2048, 6144, 10240)
    assert cfg.rotary_dim == 64 and cfg.block_topk == 512 and cfg.hc_dim == 10240
    assert cfg.ple_layers == (1,) and cfg.ngram_heads == 16 and cfg.ple_conv_state_len == 9
    assert cfg.rope_theta == 1e7 and cfg.mtp_num_hidden_layers == 1 and cfg.split_ngram_parts == 128
    assert cfg == ModelConfig(bos_token_id=248044, mtp_num_hidden_layers=1)  # the defaults are the release


def test_wrapper_form_and_spellings(tmp_path):
    text = dict(RELEASE_TEXT)
    text["layer_types"] = ["indexed_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    wrapper = {"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForConditionalGeneration"],
               "text_config": text, "vision_config": {"depth": 27}, "image_token_id": 248056}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    assert ModelConfig.from_json(tmp_path) == ModelConfig.from_dict(RELEASE_TEXT)
    spaced = dict(RELEASE_TEXT, layer_types=["qwen_sparse_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                             for i in range(48)])
    assert ModelConfig.from_dict(spaced).layer_types == ModelConfig().layer_types


def test_interval_and_gate_defaults():
    raw = {k: v for k, v in RELEASE_TEXT.items() if k not in ("layer_types", "output_gate_type")}
    raw["full_attention_interval"] = 2
    raw["ple_layer_ids"] = [1]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_types[:4] == (LINEAR, INDEXED, LINEAR, INDEXED)
    assert cfg.output_gate_type == "silu"  # falls back to hidden_act, as the reference does


@pytest.mark.parametrize("change, field", [
    ({"hc_count": 1}, "hc_count"),
    ({"num_experts_per_tok": 600}, "num_experts_per_tok"),
    ({"indexer_kv_heads": 2}, "indexer_kv_heads"),
    ({"indexer_budget": 2050}, "indexer_budget"),
    ({"indexer_head_dim": 32}, "rotary_dim"),
    ({"indexer_n_heads": None}, "indexer_n_heads"),
    ({"output_gate_type": "tanh"}, "output_gate_type"),
    ({"ple_layer_ids": [4]}, "ple_layer_ids"),
    ({"ple_layer_ids": [49]}, "ple_layer_ids"),
    ({"ple_embed_dim": 2561}, "ple_embed_dim"),
    ({"layer_types": ["mamba"] * 48}, "layer_types[0]"),
    ({"layer_types": ["linear_attention"] * 47}, "layer_types has 47"),
    ({"hidden_size": -5}, "hidden_size"),
    ({"eos_token_id": None}, "eos_token_id"),
    ({"num_attention_heads": 25}, "num_attention_heads"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e7}}, "rope_type"),
    ({"model_type": "llama"}, "model_type"),
])
def test_bad_configs_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_dict(dict(RELEASE_TEXT, **change))


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_json(tmp_path)
