"""ModelConfig: the Flash-Next text model's hyper-parameters, read from an HF `config.json`.

Both forms are accepted: the flat `qwen4_exp_text` config and the `qwen4_exp` wrapper that nests it under
`text_config`. Layer types may be spelled `full_attention`, `indexed_attention` or `qwen_sparse_attention`; they
are normalised to `linear_attention` / `indexed_attention`. Validation follows the reference's invariants, and every
error names the field and the value.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

LINEAR = "linear_attention"
INDEXED = "indexed_attention"
_INDEXED_SPELLINGS = {"indexed_attention", "full_attention", "qwen_sparse_attention"}
_TEXT_MODEL_TYPES = {"qwen4_exp_text", "qwen4_exp"}


class ConfigError(ValueError):
    """A config.json that fnx cannot run, with the offending field named."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 248320
    hidden_size: int = 2560
    num_hidden_layers: int = 48
    layer_types: tuple[str, ...] = ()
    num_attention_heads: int = 24
    num_key_value_heads: int = 2
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    max_position_embeddings: int = 262144
    # Gated DeltaNet
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 48
    output_gate_type: str = "sigmoid"
    # MoE
    num_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 640
    shared_expert_intermediate_size: int = 640
    norm_topk_prob: bool = True
    # hyper-connections
    hc_count: int = 4
    hc_lowrank: int = 320
    # QSA indexer
    indexer_n_heads: int = 4
    indexer_kv_heads: int = 1
    indexer_head_dim: int = 128
    indexer_budget: int = 2048
    indexer_compress_ratio: int = 4
    # PLE (ple_layer_ids are 1-based, as in the HF config)
    ple_layer_ids: tuple[int, ...] = (2,)
    ple_embed_dim: int = 2560
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 128
    # tokens
    eos_token_id: int | tuple[int, ...] | None = 248044
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 0
    dtype: str = "bfloat16"
    # runtime layout, not part of the checkpoint: stack runs of identical layer groups and run them under
    # lax.scan (smaller programs, faster compiles), or keep every layer's params and state separate and unroll
    # (no per-layer weight slices inside a loop: on a GPU a loop materialises a copy of every dense weight that
    # a Pallas kernel reads, each step; BENCHMARKS.md "Third H200 session")
    scan_layers: bool = True
    # with scan_layers: run the stacked groups unrolled anyway, each layer reading its slice of the stacked params
    # in place (fnx.pallas.stacked.LayerRef: the kernels index the stack, no copy), with every layer's state
    # separate as when unrolled. One argument array per weight kind and group position instead of one per layer:
    # a launch's host time grows by about 1.2 us per argument array (BENCHMARKS.md, fourteenth H200 session)
    unroll_stacked: bool = False
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(
                self,
                "layer_types",
                tuple(LINEAR if (i + 1) % 4 else INDEXED for i in range(self.num_hidden_layers)),
            )
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def key_dim(self) -> int:  # GDN q/k width
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:  # GDN v/z width
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def block_topk(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio

    @property
    def hc_dim(self) -> int:
        return self.hc_count * self.hidden_size

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_layers(self) -> tuple[int, ...]:
        """0-based indices of the layers that carry a PLE module."""
        return tuple(i - 1 for i in self.ple_layer_ids)

    @property
    def ple_eos_token_id(self) -> int:
        eos = self.eos_token_id
        return int(eos[0]) if isinstance(eos, (tuple, list)) else int(eos)

    @property
    def ple_conv_state_len(self) -> int:
        return (self.ple_conv_kernel_size - 1) * self.ngram_size

    @property
    def gate_activation(self) -> str:
        return self.output_gate_type

    # ---- validation ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str):
            if not cond:
                raise ConfigError(msg)

        for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "shared_expert_intermediate_size", "hc_lowrank",
        ):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"config field {name!r} must be a positive integer, got {value!r}")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - {LINEAR, INDEXED})
        need(not bad, f"unsupported layer_types {bad}; expected 'linear_attention' or 'full_attention'")
        need(self.output_gate_type in ("sigmoid", "silu"),
             f"output_gate_type must be 'sigmoid' or 'silu', got {self.output_gate_type!r}")
        need(self.hidden_act == "silu", f"hidden_act must be 'silu', got {self.hidden_act!r}")
        need(self.hc_count > 1, f"hc_count must be > 1, got {self.hc_count}")
        need(0 < self.num_experts_per_tok <= self.num_experts,
             f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got {self.num_experts_per_tok}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads={self.num_attention_heads} must be a multiple of "
             f"num_key_value_heads={self.num_key_value_heads}")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
             f"linear_num_key_heads={self.linear_num_key_heads}")
        need(0 < self.partial_rotary_factor <= 1,
             f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        need(self.rotary_dim % 2 == 0, f"rotary dim head_dim*partial_rotary_factor={self.rotary_dim} must be even")
        need(sum(self.mrope_section) == self.rotary_dim // 2,
             f"mrope_section {list(self.mrope_section)} must sum to rotary_dim/2 = {self.rotary_dim // 2}")
        if INDEXED in self.layer_types:
            for name in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                         "indexer_compress_ratio"):
                value = getattr(self, name)
                need(isinstance(value, int) and value > 0,
                     f"QSA layers need a positive integer {name!r}, got {value!r}")
            need(self.indexer_kv_heads == 1, f"QSA requires indexer_kv_heads=1, got {self.indexer_kv_heads}")
            need(self.indexer_budget % self.indexer_compress_ratio == 0,
                 f"indexer_budget={self.indexer_budget} must be divisible by "
                 f"indexer_compress_ratio={self.indexer_compress_ratio}")
            need(self.rotary_dim <= self.indexer_head_dim,
                 f"rotary_dim={self.rotary_dim} must fit the QSA index head: indexer_head_dim={self.indexer_head_dim}")
        if self.ple_layer_ids:
            need(self.ngram_size >= 2, f"ngram_size must be >= 2 when PLE is enabled, got {self.ngram_size}")
            need(self.heads_per_ngram >= 1, f"heads_per_ngram must be >= 1, got {self.heads_per_ngram}")
            need(self.ple_embed_dim > 0 and self.ple_embed_dim % self.ngram_heads == 0,
                 f"ple_embed_dim={self.ple_embed_dim} must be divisible by the number of n-gram heads "
                 f"({self.ngram_heads})")
            bad = [i for i in self.ple_layer_ids if not 1 <= i <= self.num_hidden_layers]
            need(not bad, f"ple_layer_ids are 1-based and must lie in [1, {self.num_hidden_layers}], got {bad}")
            bad = [i for i in self.ple_layer_ids if self.layer_types[i - 1] != LINEAR]
            need(not bad, f"PLE is only supported on linear_attention layers, got ple_layer_ids {bad}")
            need(self.eos_token_id is not None and self.eos_token_id != (),
                 "eos_token_id must be set when PLE layers are enabled")
            need(self.ple_conv_kernel_size >= 1, f"ple_conv_kernel_size must be >= 1, got {self.ple_conv_kernel_size}")

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed HF config.json (flat text config, or the wrapper with `text_config`)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        text = raw
        if "text_config" in raw:
            text = raw["text_config"]
            if not isinstance(text, dict):
                raise ConfigError(f"text_config must be an object, got {type(text).__name__}")
        if model_type is not None and model_type not in _TEXT_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not a Flash-Next config (expected one of "
                              f"{sorted(_TEXT_MODEL_TYPES)})")
        text_type = text.get("model_type")
        if text is not raw and text_type not in (None, "qwen4_exp_text"):
            raise ConfigError(f"text_config.model_type {text_type!r} is not 'qwen4_exp_text'")

        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "layer_types", "mrope_section"}
        kw: dict[str, Any] = {}
        for name in known:
            if name in text:
                kw[name] = text[name]
        # tie/eos/bos may only be on the wrapper
        for name in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id"):
            if name not in kw and name in raw:
                kw[name] = raw[name]

        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters must be an object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type {rope_type!r} is not supported (only 'default')")
        if "rope_theta" in rope:
            kw["rope_theta"] = float(rope["rope_theta"])
        elif "rope_theta" in text:
            kw["rope_theta"] = float(text["rope_theta"])
        prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor"))
        if prf is not None:
            kw["partial_rotary_factor"] = float(prf)
        head_dim = int(text.get("head_dim", cls.head_dim))
        if "mrope_section" in rope:
            kw["mrope_section"] = tuple(int(v) for v in rope["mrope_section"])
        else:  # plain 1-D RoPE: all frequencies on the T axis
            kw["mrope_section"] = (int(head_dim * kw.get("partial_rotary_factor", 1.0)) // 2, 0, 0)

        num_layers = int(text.get("num_hidden_layers", cls.num_hidden_layers))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError(f"full_attention_interval must be a positive integer, got {interval!r}")
            layer_types = [LINEAR if (i + 1) % interval else INDEXED for i in range(num_layers)]
        if not isinstance(layer_types, (list, tuple)):
            raise ConfigError(f"layer_types must be a list, got {layer_types!r}")
        norm_types = []
        for i, t in enumerate(layer_types):
            if t in _INDEXED_SPELLINGS:
                norm_types.append(INDEXED)
            elif t == LINEAR:
                norm_types.append(LINEAR)
            else:
                raise ConfigError(f"layer_types[{i}] = {t!r} is not supported; expected 'linear_attention' or "
                                  f"'full_attention'")
        kw["layer_types"] = tuple(norm_types)

        if kw.get("output_gate_type") is None:
            kw["output_gate_type"] = text.get("hidden_act", "silu")
        ple_ids = kw.get("ple_layer_ids")
        kw["ple_layer_ids"] = tuple(sorted(set(ple_ids))) if ple_ids else ()
        if kw.get("ple_embed_dim") is None:
            kw["ple_embed_dim"] = int(text.get("hidden_size", cls.hidden_size))
        eos = kw.get("eos_token_id")
        if isinstance(eos, list):
            kw["eos_token_id"] = tuple(int(e) for e in eos)
        mtp = text.get("mtp_num_hidden_layers")
        kw["mtp_num_hidden_layers"] = int(mtp) if mtp else 0
        if "dtype" in text or "torch_dtype" in text:
            kw["dtype"] = str(text.get("dtype") or text.get("torch_dtype"))
        if kw.get("norm_topk_prob") is None:
            kw.pop("norm_topk_prob", None)
        for name in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                     "indexer_compress_ratio"):
            if name in kw and kw[name] is None:
                kw[name] = 0
        kw["extra"] = {k: v for k, v in text.items() if k not in known}
        try:
            return cls(**kw)
        except TypeError as exc:  # a field of the wrong JSON type
            raise ConfigError(f"invalid config: {exc}") from exc

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"no config.json at {path}")
        with open(path, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        n_gdn = self.layer_types.count(LINEAR)
        return (f"Flash-Next: {self.num_hidden_layers} layers ({n_gdn} GDN + {self.num_hidden_layers - n_gdn} QSA), "
                f"d={self.hidden_size}, {self.hc_count} HC streams, {self.num_experts} experts top-"
                f"{self.num_experts_per_tok}, vocab {self.vocab_size}, PLE on layers {list(self.ple_layers)}")
