"""Write tiny random Qwen3.8-Flash-Next (`qwen4_exp`) checkpoints for parity tests.

The trunk is written by transformers' own `save_pretrained`, so key names, the split n-gram table and the
config are exactly what transformers produces; the 31 `mtp.*` tensors of MODEL_SPEC.md §10.1 go into an
extra `mtp.safetensors` registered in `model.safetensors.index.json`. With `wrapper=True` the directory is
rewritten into the `Qwen4ExpForConditionalGeneration` layout of the released checkpoints (MODEL_SPEC.md §11).

    python scripts/make_tiny_checkpoint.py OUT_DIR --all --max-shard-size 20KB
"""

from __future__ import annotations

import argparse
import json
import math
import time
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GenerationConfig, Qwen4ExpForCausalLM, Qwen4ExpTextConfig

INDEX_NAME = "model.safetensors.index.json"
MTP_FILE = "mtp.safetensors"


def _rope(head_dim: int, factor: float) -> dict:
    """Interleaved M-RoPE parameters whose sections cover head_dim * factor / 2 frequencies."""
    half = int(head_dim * factor) // 2
    base, extra = divmod(half, 3)  # split like the release's [11, 11, 10] for 32 frequencies
    return {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": factor,
        "mrope_section": [base + (k < extra) for k in range(3)],
        "mrope_interleaved": True,
    }


_COMMON = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    linear_conv_kernel_dim=4,
    ple_conv_kernel_size=4,
    indexer_kv_heads=1,
)

# Qwen4ExpTextConfig kwargs. Every n-gram table has rows divisible by split_ngram_parts, because
# save_pretrained splits it with torch.chunk and loading expects exactly split_ngram_parts pieces.
TINY_CONFIGS: dict[str, dict] = {
    # layer_types from full_attention_interval: GDN, GDN, GDN, QSA; PLE on layer index 1.
    "tiny-a": dict(
        _COMMON,
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=4,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters=_rope(16, 0.5),  # rotary_dim 8
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        output_gate_type="sigmoid",
        hc_count=4,
        hc_lowrank=8,
        ple_layer_ids=[2],
        ngram_size=3,
        heads_per_ngram=2,  # 4 n-gram heads of width 8
        ngram_vocab_size_base=97,  # 408 rows, padded to 416 = 4 x 104
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=4,
        indexer_n_heads=4,
        indexer_head_dim=16,
        indexer_budget=16,
        indexer_compress_ratio=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        eos_token_id=255,
        bos_token_id=255,
    ),
    # 8 layers (QSA at 3 and 7), bigram-only PLE, 2 v-heads per k-head, silu output gate via hidden_act.
    "tiny-b": dict(
        _COMMON,
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=8,
        full_attention_interval=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        rope_parameters=_rope(32, 0.25),  # rotary_dim 8, like the release's 0.25
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        hc_count=2,
        hc_lowrank=16,
        ple_layer_ids=[2],
        ngram_size=2,
        heads_per_ngram=4,  # 4 n-gram heads of width 16
        ngram_vocab_size_base=211,  # 890 rows, padded to 896 = 4 x 224
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=4,
        indexer_n_heads=4,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=2,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        eos_token_id=[511, 509],  # PLE resets on the first id only
        bos_token_id=511,
    ),
    # Explicit layer_types in the checkpoint spelling "full_attention"; PLE on layer index 0; 4-grams.
    "tiny-c": dict(
        _COMMON,
        vocab_size=384,
        hidden_size=48,
        num_hidden_layers=5,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        rope_parameters=_rope(32, 0.5),  # rotary_dim 16
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        output_gate_type="sigmoid",
        hc_count=3,
        hc_lowrank=12,
        ple_layer_ids=[1],
        ngram_size=4,
        heads_per_ngram=1,  # 3 n-gram heads of width 16
        ngram_vocab_size_base=101,  # 311 rows, padded to 312 = 4 x 78
        make_ngram_vocab_size_divisible_by=8,
        split_ngram_parts=4,
        indexer_n_heads=6,
        indexer_head_dim=16,
        indexer_budget=24,
        indexer_compress_ratio=3,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=24,
        eos_token_id=383,
        bos_token_id=383,
    ),
    # No PLE (one conv state per GDN layer); QSA at layers 2 and 5; 3 v-heads per k-head; top-k = all experts.
    "tiny-d": dict(
        _COMMON,
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=6,
        full_attention_interval=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters=_rope(16, 0.5),  # rotary_dim 8
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        output_gate_type="sigmoid",
        hc_count=4,
        hc_lowrank=16,
        ple_layer_ids=[],
        ngram_vocab_size_base=97,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=4,
        indexer_n_heads=8,
        indexer_head_dim=8,
        indexer_budget=12,
        indexer_compress_ratio=4,
        num_experts=4,
        num_experts_per_tok=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        eos_token_id=319,
        bos_token_id=319,
    ),
}

# Standard deviations, relative to 1/sqrt(fan_in) for matrices. The router is wider so that the routing
# softmax is peaked rather than flat; attention and expert outputs are wider so that every block adds about
# 0.3 to residual streams of std ~1 (attention averages over tokens, the experts multiply two small factors);
# the lm_head is wider so that the logits have std ~1.5.
NORM_STD = 0.1
ROUTER_GAIN = 4.0
BLOCK_OUT_GAIN = 3.0
LM_HEAD_GAIN = 3.0
BLOCK_OUTPUTS = ("self_attn.o_proj.weight", "experts.down_proj", "shared_expert.down_proj.weight")


def _config_kwargs(name_or_kwargs: str | dict) -> dict:
    if isinstance(name_or_kwargs, dict):
        return name_or_kwargs
    if name_or_kwargs not in TINY_CONFIGS:
        raise KeyError(f"unknown tiny config {name_or_kwargs!r}; choose from {sorted(TINY_CONFIGS)}")
    return TINY_CONFIGS[name_or_kwargs]


def make_config(name_or_kwargs: str | dict) -> Qwen4ExpTextConfig:
    """A config from a TINY_CONFIGS name or a kwargs dict."""
    return Qwen4ExpTextConfig(**_config_kwargs(name_or_kwargs))


def _generator(seed: int, name: str) -> torch.Generator:
    # One stream per tensor name, so a tensor's values do not depend on which other tensors exist.
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def _random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """fp32 random values for one parameter, chosen by its checkpoint name."""
    g = _generator(seed, name)
    normal = torch.randn(shape, generator=g, dtype=torch.float32)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        # decay rate A in [1, 16), as in the reference init
        return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
    if leaf == "dt_bias":
        # softplus(dt_bias) = dt, log-uniform in [1e-3, 1e-1]: per-token decays exp(-A*dt) of about 0.2..0.999
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + NORM_STD * normal  # gated RMSNorm multiplies by the weight itself
    if len(shape) == 1:
        return NORM_STD * normal  # zero-centred RMSNorm: scale is (1 + weight)
    if "embed_tokens" in name or "ngram_embedding" in name:
        return normal
    std = 1.0 / math.sqrt(shape[-1])  # fan_in is the last axis for Linear, fused experts and depthwise conv
    if name.endswith("mlp.gate.weight"):
        std *= ROUTER_GAIN
    elif name.endswith(BLOCK_OUTPUTS):
        std *= BLOCK_OUT_GAIN
    elif name == "lm_head.weight":
        std *= LM_HEAD_GAIN
    return std * normal


def make_model(name_or_kwargs: str | dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen4ExpForCausalLM:
    """A Qwen4ExpForCausalLM (eager attention, eval mode) with every parameter random and seeded."""
    config = make_config(name_or_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen4ExpForCausalLM._from_config(config, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_random_tensor(name, tuple(param.shape), seed))
    # The hash buffers (layer_multipliers, ngram_heads_*) are left as the model derives them.
    for name, module in model.named_modules():
        if name.endswith("ple_embedding"):
            rows = module.ngram_embedding.weight.shape[0]
            if rows % config.split_ngram_parts:
                raise ValueError(
                    f"{name}: {rows} n-gram rows do not split into split_ngram_parts={config.split_ngram_parts}; "
                    "pick make_ngram_vocab_size_divisible_by as a multiple of split_ngram_parts"
                )
    return model.eval()


def mtp_shapes(config: Qwen4ExpTextConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the 31 `mtp.*` tensors (MODEL_SPEC.md §10.1) for this config."""
    d, n, r = config.hidden_size, config.hc_count, config.hc_lowrank
    nd = n * d
    hd, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    ihd, inh, ikv = config.indexer_head_dim, config.indexer_n_heads, config.indexer_kv_heads
    e, i, si = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size

    def hyper_connection(prefix: str, inject: bool) -> dict[str, tuple[int, ...]]:
        shapes = {
            f"{prefix}.hc_norm.weight": (nd,),
            f"{prefix}.input_mix_weight_down.weight": (r, nd),
            f"{prefix}.input_mix_weight_up.weight": (nd, r),
        }
        if inject:
            shapes[f"{prefix}.block_inject_weight.weight"] = (n, nd)
        return shapes

    layer = "mtp.layers.0"
    shapes = {
        "mtp.fc_embedding.weight": (d, d),
        "mtp.fc_hidden.weight": (d, d),  # shared by the n streams
        "mtp.pre_fc_norm_embedding.weight": (d,),
        "mtp.pre_fc_norm_hidden.weight": (nd,),
        **hyper_connection("mtp.hyper_connection_mixer", inject=False),
        **hyper_connection(f"{layer}.attn_hyper_connection", inject=True),
        **hyper_connection(f"{layer}.mlp_hyper_connection", inject=True),
        f"{layer}.self_attn.q_proj.weight": (2 * nh * hd, d),  # query and output gate, interleaved per head
        f"{layer}.self_attn.k_proj.weight": (nkv * hd, d),
        f"{layer}.self_attn.v_proj.weight": (nkv * hd, d),
        f"{layer}.self_attn.o_proj.weight": (d, nh * hd),
        f"{layer}.self_attn.q_norm.weight": (hd,),
        f"{layer}.self_attn.k_norm.weight": (hd,),
        f"{layer}.self_attn.indexer.index_qk_proj.weight": ((inh + ikv) * ihd, d),
        f"{layer}.self_attn.indexer.q_layernorm.weight": (ihd,),
        f"{layer}.self_attn.indexer.k_layernorm.weight": (ihd,),
        f"{layer}.mlp.gate.weight": (e, d),
        f"{layer}.mlp.experts.gate_up_proj": (e, 2 * i, d),  # rows [0, i) gate, [i, 2i) up
        f"{layer}.mlp.experts.down_proj": (e, d, i),
        f"{layer}.mlp.shared_expert.gate_proj.weight": (si, d),
        f"{layer}.mlp.shared_expert.up_proj.weight": (si, d),
        f"{layer}.mlp.shared_expert.down_proj.weight": (d, si),
        f"{layer}.mlp.shared_expert_gate.weight": (1, d),
    }
    assert len(shapes) == 31, len(shapes)
    return shapes


def make_mtp_tensors(
    config: Qwen4ExpTextConfig, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The 31 random `mtp.*` tensors, drawn by the same rules as the trunk."""
    tensors = {
        name: _random_tensor(name, shape, seed).to(dtype).contiguous() for name, shape in mtp_shapes(config).items()
    }
    assert len(tensors) == 31, len(tensors)
    return tensors


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def _file_keys(path: Path) -> list[str]:
    with safe_open(path, "pt") as f:
        return list(f.keys())


def _load_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _write_index(out_dir: Path, index: dict) -> None:
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def _to_wrapper_layout(out_dir: Path, index: dict) -> dict:
    """Rename `model.` to `model.language_model.` in every weight file and wrap config.json."""

    def rename(key: str) -> str:
        return "model.language_model." + key[len("model.") :] if key.startswith("model.") else key

    for file_name in sorted(set(index["weight_map"].values())):
        tensors, metadata = _load_file(out_dir / file_name)
        save_file({rename(k): v for k, v in tensors.items()}, out_dir / file_name, metadata=metadata)
    index["weight_map"] = {rename(k): v for k, v in index["weight_map"].items()}

    text_config = json.loads((out_dir / "config.json").read_text())
    text_config.pop("architectures", None)
    version = text_config.pop("transformers_version", None)
    wrapper = {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "text_config": text_config,  # model_type stays qwen4_exp_text
        "tie_word_embeddings": False,
        "dtype": text_config.get("dtype"),
        "transformers_version": version,
    }
    (out_dir / "config.json").write_text(json.dumps(wrapper, indent=2, sort_keys=True) + "\n")
    return index


def write_checkpoint(
    out_dir: str | Path,
    name_or_kwargs: str | dict,
    seed: int = 0,
    dtype: str | torch.dtype = "float32",
    max_shard_size: str | int | None = None,
    wrapper: bool = False,
) -> Path:
    """Write a tiny checkpoint directory: trunk via save_pretrained, `mtp.safetensors`, one index.json.

    Safetensors files and the index already in out_dir are deleted first, so no stale shard survives.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("*.safetensors"), out_dir / INDEX_NAME]:
        stale.unlink(missing_ok=True)
    torch_dtype = _torch_dtype(dtype)
    model = make_model(name_or_kwargs, seed=seed, dtype=torch_dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **kwargs)

    layer_types = _config_kwargs(name_or_kwargs).get("layer_types")
    if layer_types is not None:
        # save_pretrained writes "indexed_attention"; keep the spelling asked for (the release's "full_attention").
        config_path = out_dir / "config.json"
        saved = json.loads(config_path.read_text())
        saved["layer_types"] = list(layer_types)
        config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    if (out_dir / INDEX_NAME).exists():
        index = json.loads((out_dir / INDEX_NAME).read_text())
    else:
        # A single model.safetensors: give it a shard name so the index is the one entry point.
        single = "model-00001-of-00001.safetensors"
        (out_dir / "model.safetensors").rename(out_dir / single)
        keys = _file_keys(out_dir / single)
        total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(keys, single)}

    mtp = make_mtp_tensors(model.config, seed=seed, dtype=torch_dtype)
    save_file(mtp, out_dir / MTP_FILE, metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(mtp, MTP_FILE))
    metadata = index.setdefault("metadata", {})
    metadata["total_size"] = metadata.get("total_size", 0) + sum(t.numel() * t.element_size() for t in mtp.values())
    metadata.pop("total_parameters", None)  # would no longer match once mtp.* is added

    if wrapper:
        index = _to_wrapper_layout(out_dir, index)
    _write_index(out_dir, index)

    config = model.config
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(out_dir)
    return out_dir


def _describe(out_dir: Path) -> str:
    index = json.loads((out_dir / INDEX_NAME).read_text())
    files = sorted(p for p in out_dir.iterdir() if p.is_file())
    total = sum(p.stat().st_size for p in files)
    n_weight_files = len(set(index["weight_map"].values()))
    lines = [f"{out_dir}: {len(index['weight_map'])} tensors in {n_weight_files} safetensors files, {total} bytes"]
    lines += [f"  {p.name:40s} {p.stat().st_size:>10d}" for p in files]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="one subdirectory per config is written here")
    parser.add_argument("--config", action="append", choices=sorted(TINY_CONFIGS), help="repeatable")
    parser.add_argument("--all", action="store_true", help="every config in TINY_CONFIGS (default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max-shard-size", default=None, help="e.g. 20KB; default: one trunk file")
    parser.add_argument("--wrapper", action="store_true", help="Qwen4ExpForConditionalGeneration layout")
    args = parser.parse_args(argv)

    names = sorted(TINY_CONFIGS) if args.all or not args.config else args.config
    for name in names:
        start = time.perf_counter()
        out = write_checkpoint(
            args.out_dir / name,
            name,
            seed=args.seed,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            wrapper=args.wrapper,
        )
        print(_describe(out))
        print(f"  ({time.perf_counter() - start:.2f} s)")


if __name__ == "__main__":
    main()
