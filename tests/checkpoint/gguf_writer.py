"""Test-side GGUF writer: a tiny HF checkpoint -> `qwen4exp` GGUF with the `gguf` package's writer, applying the
forward transforms of MODEL_SPEC.md 12.3 (its own name table, written from the spec, not from fnx's)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T, GGUFValueType as V

from tests.checkpoint.writers import read_all

A = "qwen4exp"
HC = {"hc_norm.weight": "norm", "input_mix_weight_down.weight": "down", "input_mix_weight_up.weight": "up",
      "block_inject_weight.weight": "inject"}
LAYER = {
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight", "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.A_log": "ssm_a", "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.conv1d.weight":
    "ssm_conv1d.weight", "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight":
    "ssm_out.weight", "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.indexer.q_layernorm.weight": "indexer.q_norm.weight",
    "self_attn.indexer.k_layernorm.weight": "indexer.k_norm.weight",
    "ple.key_proj.weight": "ple_key.weight", "ple.value_proj.weight": "ple_value.weight",
    "ple.norm_key.weight": "ple_norm_key.weight", "ple.norm_query.weight": "ple_norm_query.weight",
    "ple.norm_conv.weight": "ple_norm_conv.weight", "ple.conv1d.weight": "ple_conv1d.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
for hf, gg in HC.items():
    LAYER[f"attn_hyper_connection.{hf}"] = f"hc_attn_{gg}.weight"
    LAYER[f"mlp_hyper_connection.{hf}"] = f"hc_ffn_{gg}.weight"
PLUS1 = ("hc_norm.weight", "q_norm.weight", "k_norm.weight", "q_layernorm.weight", "k_layernorm.weight",
         "ple.norm_key.weight", "ple.norm_query.weight", "ple.norm_conv.weight")


def _tiled(x, hk, hv, per, axis=0):
    """HF grouped V heads -> GGUF tiled order along `axis` (per: rows per head)."""
    x = np.moveaxis(x, axis, 0)
    r = hv // hk
    rest = x.shape[1:]
    x = x.reshape(hk, r, per, *rest).swapaxes(0, 1).reshape(hv * per, *rest)
    return np.moveaxis(x, 0, axis)


def _fuse_experts(sd):
    out, per = {}, {}
    for k, v in sd.items():
        parts = k.split(".mlp.experts.")
        if len(parts) == 2 and parts[1][0].isdigit():
            e, proj = parts[1].split(".")[:2]
            per.setdefault(parts[0], {}).setdefault(proj, {})[int(e)] = v
        else:
            out[k] = v
    for base, projs in per.items():
        n = len(projs["gate_proj"])
        out[f"{base}.mlp.experts.gate_up_proj"] = np.concatenate(
            [np.stack([projs["gate_proj"][e] for e in range(n)]), np.stack([projs["up_proj"][e] for e in range(n)])], 1)
        out[f"{base}.mlp.experts.down_proj"] = np.stack([projs["down_proj"][e] for e in range(n)])
    return out


def write_gguf(src: Path, out: Path, mode: str = "f32") -> Path:
    """mode 'f32': every tensor F32; 'mixed': Q8_0 where rows hold multiples of 32 values, F16 for the other
    matrices, F32 for vectors."""
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    sd = {k.replace("model.language_model.", "model."): v for k, v in _fuse_experts(read_all(src)).items()}
    n, hk, hv = cfg["num_hidden_layers"], cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    tensors: dict[str, np.ndarray] = {}

    def layer_tensors(prefix: str, blk: str):
        for k in [k for k in sd if k.startswith(prefix)]:
            rest, v = k[len(prefix):], np.asarray(sd[k], np.float32)
            if rest.endswith(PLUS1):
                v = v + np.float32(1.0)
            if rest == "linear_attn.A_log":
                v = _tiled(-np.exp(v), hk, hv, 1)
            elif rest in ("linear_attn.dt_bias", "linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"):
                v = _tiled(v, hk, hv, 1)
            elif rest == "linear_attn.in_proj_z.weight":
                v = _tiled(v, hk, hv, dv)
            elif rest == "linear_attn.out_proj.weight":
                v = _tiled(v, hk, hv, dv, axis=1)
            elif rest in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
                if v.ndim == 3:
                    v = v[:, 0, :]
                kk = 2 * hk * dk
                v = np.concatenate([v[:kk], _tiled(v[kk:], hk, hv, dv)], 0)
            elif rest == "ple.conv1d.weight":
                v = v[:, 0, :]
            elif rest == "mlp.shared_expert_gate.weight":
                v = v[0]
            if rest == "self_attn.indexer.index_qk_proj.weight":
                q = cfg["indexer_n_heads"] * cfg["indexer_head_dim"]
                tensors[f"{blk}indexer.q_proj.weight"], tensors[f"{blk}indexer.k_proj.weight"] = v[:q], v[q:]
            elif rest == "mlp.experts.gate_up_proj":
                i = v.shape[1] // 2
                tensors[f"{blk}ffn_gate_exps.weight"], tensors[f"{blk}ffn_up_exps.weight"] = v[:, :i], v[:, i:]
            elif ".ngram_embedding.shard_" in rest or rest.startswith("ple.ple_embedding."):
                continue
            else:
                tensors[blk + LAYER[rest]] = v

    for i in range(n):
        layer_tensors(f"model.layers.{i}.", f"blk.{i}.")
    layer_tensors("mtp.layers.0.", f"blk.{n}.")
    tensors["token_embd.weight"] = sd["model.embed_tokens.weight"]
    tensors["output.weight"] = sd["lm_head.weight"]
    for hf, gg in (("hc_norm", "norm"), ("input_mix_weight_down", "down"), ("input_mix_weight_up", "up")):
        v = sd[f"model.hyper_connection_mixer.{hf}.weight"]
        tensors[f"output_hc_{gg}.weight"] = v + np.float32(1.0) if gg == "norm" else v
        v = sd[f"mtp.hyper_connection_mixer.{hf}.weight"]
        tensors[f"blk.{n}.nextn.hc_head_{gg}.weight"] = v + np.float32(1.0) if gg == "norm" else v
    tensors[f"blk.{n}.nextn.eh_proj.weight"] = np.concatenate([sd["mtp.fc_embedding.weight"],
                                                               sd["mtp.fc_hidden.weight"]], axis=1)
    tensors[f"blk.{n}.nextn.enorm.weight"] = sd["mtp.pre_fc_norm_embedding.weight"] + np.float32(1.0)
    tensors[f"blk.{n}.nextn.hnorm.weight"] = sd["mtp.pre_fc_norm_hidden.weight"] + np.float32(1.0)
    ple_layer = cfg["ple_layer_ids"][0] - 1
    pre = f"model.layers.{ple_layer}.ple.ple_embedding."
    shards = sorted((k for k in sd if k.startswith(pre + "ngram_embedding.shard_")),
                    key=lambda k: int(k.split("shard_")[1].split(".")[0]))
    tensors["per_layer_token_embd.weight"] = np.concatenate([sd[k] for k in shards], 0)

    w = gguf.GGUFWriter(str(out), A)
    u32 = lambda k, v: w.add_uint32(f"{A}.{k}", int(v))
    u32("block_count", n + 1)
    u32("nextn_predict_layers", 1)
    u32("context_length", cfg["max_position_embeddings"])
    u32("embedding_length", cfg["hidden_size"])
    u32("attention.head_count", cfg["num_attention_heads"])
    u32("attention.head_count_kv", cfg["num_key_value_heads"])
    u32("attention.key_length", cfg["head_dim"])
    u32("attention.value_length", cfg["head_dim"])
    w.add_float32(f"{A}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    w.add_float32(f"{A}.rope.freq_base", rope["rope_theta"])
    u32("rope.dimension_count", int(cfg["head_dim"] * rope["partial_rotary_factor"]))
    w.add_array(f"{A}.rope.dimension_sections", list(rope["mrope_section"]) + [0])
    u32("expert_count", cfg["num_experts"])
    u32("expert_used_count", cfg["num_experts_per_tok"])
    u32("expert_feed_forward_length", cfg["moe_intermediate_size"])
    u32("expert_shared_feed_forward_length", cfg["shared_expert_intermediate_size"])
    u32("ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    u32("ssm.state_size", dk)
    u32("ssm.group_count", hk)
    u32("ssm.time_step_rank", hv)
    u32("ssm.inner_size", hv * dv)
    types = cfg["layer_types"]
    interval = next(i + 1 for i, t in enumerate(types) if t != "linear_attention")
    assert all((t != "linear_attention") == ((i + 1) % interval == 0) for i, t in enumerate(types)), types
    u32("full_attention_interval", interval)
    u32("hyper_connection.count", cfg["hc_count"])
    u32("hyper_connection.low_rank", cfg["hc_lowrank"])
    u32("attention.indexer.head_count", cfg["indexer_n_heads"])
    u32("attention.indexer.key_length", cfg["indexer_head_dim"])
    u32("attention.indexer.top_k", cfg["indexer_budget"])
    w.add_array(f"{A}.attention.compress_ratios",
                [cfg["indexer_compress_ratio"] if t != "linear_attention" else 0 for t in cfg["layer_types"]] + [0])
    w.add_array(f"{A}.ple.layers", [ple_layer])
    u32("ple.ngram_size", cfg["ngram_size"])
    u32("ple.heads_per_ngram", cfg["heads_per_ngram"])
    u32("ple.conv_kernel", cfg["ple_conv_kernel_size"])
    eos = cfg["eos_token_id"]
    u32("ple.eos_token_id", eos[0] if isinstance(eos, list) else eos)
    u32("embedding_length_per_layer_input", tensors["per_layer_token_embd.weight"].shape[1])
    for key, buf in (("ple.layer_multipliers", "layer_multipliers"), ("ple.head_vocab_sizes", "ngram_heads_vocab_sizes"),
                     ("ple.head_offsets", "ngram_heads_offsets")):
        w.add_key_value(f"{A}.{key}", [int(x) for x in sd[pre + buf]], V.ARRAY, sub_type=V.UINT64)
    for name, v in tensors.items():
        v = np.ascontiguousarray(v, np.float32)
        if mode == "mixed" and v.ndim >= 2 and v.shape[-1] % 32 == 0 and "norm" not in name:
            w.add_tensor(name, gguf.quants.quantize(v, T.Q8_0), raw_dtype=T.Q8_0)
        elif mode == "mixed" and v.ndim >= 2:
            w.add_tensor(name, v.astype(np.float16))
        else:
            w.add_tensor(name, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)
