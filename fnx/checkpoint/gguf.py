"""GGUF checkpoints of architecture `qwen4exp` (MODEL_SPEC.md section 12).

`translate_gguf` is the one place where a GGUF tensor name becomes HF names; `METADATA` maps the `qwen4exp.*` keys
onto ModelConfig fields. A GGUF file is presented to the HF planner as a reader of HF-named tensors
(`GgufReader`): each `get` dequantizes (`gguf_quants`) and undoes the section 12.3 transforms for one tensor, so
the same checks, errors and streaming apply. The packed blocks stay in the mapped file (`GgufReader.raw`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from fnx.checkpoint import gguf_quants
from fnx.checkpoint.hf import CheckpointError, Plan, QuantSpec, plan_tensors
from fnx.checkpoint.ngram_table import check_row_ids
from fnx.config import ModelConfig

ARCH = "qwen4exp"

# Per-block tensors: GGUF name (after `blk.N.`) -> (HF name after `layers.N.`, transform).
# Transforms: None | "plus1" (stored 1 + w) | "v_rows" / "v_heads" / "v_cols" / "qkv_rows" (GDN V-head order,
# see _v_order) | "neg_exp" (stored -exp(A_log), V-head order) | "row" ([d] -> [1, d]) | ("part", i, axis): one of
# several GGUF tensors concatenated into one HF tensor along `axis`.
BLOCK = {
    "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", "qkv_rows"),
    "attn_gate.weight": ("linear_attn.in_proj_z.weight", "v_rows"),
    "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", "v_heads"),
    "ssm_beta.weight": ("linear_attn.in_proj_b.weight", "v_heads"),
    "ssm_a": ("linear_attn.A_log", "neg_exp"),
    "ssm_dt.bias": ("linear_attn.dt_bias", "v_heads"),
    "ssm_conv1d.weight": ("linear_attn.conv1d.weight", "qkv_rows"),
    "ssm_norm.weight": ("linear_attn.norm.weight", None),
    "ssm_out.weight": ("linear_attn.out_proj.weight", "v_cols"),
    "attn_q.weight": ("self_attn.q_proj.weight", None),
    "attn_k.weight": ("self_attn.k_proj.weight", None),
    "attn_v.weight": ("self_attn.v_proj.weight", None),
    "attn_output.weight": ("self_attn.o_proj.weight", None),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", "plus1"),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", "plus1"),
    "indexer.q_proj.weight": ("self_attn.indexer.index_qk_proj.weight", ("part", 0, 0)),
    "indexer.k_proj.weight": ("self_attn.indexer.index_qk_proj.weight", ("part", 1, 0)),
    "indexer.q_norm.weight": ("self_attn.indexer.q_layernorm.weight", "plus1"),
    "indexer.k_norm.weight": ("self_attn.indexer.k_layernorm.weight", "plus1"),
    "ple_key.weight": ("ple.key_proj.weight", None),
    "ple_value.weight": ("ple.value_proj.weight", None),
    "ple_norm_key.weight": ("ple.norm_key.weight", "plus1"),
    "ple_norm_query.weight": ("ple.norm_query.weight", "plus1"),
    "ple_norm_conv.weight": ("ple.norm_conv.weight", "plus1"),
    "ple_conv1d.weight": ("ple.conv1d.weight", None),
    "ffn_gate_inp.weight": ("mlp.gate.weight", None),
    "ffn_gate_exps.weight": ("mlp.experts.gate_up_proj", ("part", 0, 1)),
    "ffn_up_exps.weight": ("mlp.experts.gate_up_proj", ("part", 1, 1)),
    "ffn_gate_up_exps.weight": ("mlp.experts.gate_up_proj", None),
    "ffn_down_exps.weight": ("mlp.experts.down_proj", None),
    "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", "row"),
    "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", None),
    "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", None),
    "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", None),
}
for _gg, _hf in (("attn", "attn_hyper_connection"), ("ffn", "mlp_hyper_connection")):
    BLOCK[f"hc_{_gg}_norm.weight"] = (f"{_hf}.hc_norm.weight", "plus1")
    BLOCK[f"hc_{_gg}_down.weight"] = (f"{_hf}.input_mix_weight_down.weight", None)
    BLOCK[f"hc_{_gg}_up.weight"] = (f"{_hf}.input_mix_weight_up.weight", None)
    BLOCK[f"hc_{_gg}_inject.weight"] = (f"{_hf}.block_inject_weight.weight", None)

GLOBAL = {
    "token_embd.weight": ("model.embed_tokens.weight", None),
    "output.weight": ("lm_head.weight", None),
    "output_hc_norm.weight": ("model.hyper_connection_mixer.hc_norm.weight", "plus1"),
    "output_hc_down.weight": ("model.hyper_connection_mixer.input_mix_weight_down.weight", None),
    "output_hc_up.weight": ("model.hyper_connection_mixer.input_mix_weight_up.weight", None),
}
# The MTP block (blk.{n_layers}) maps like a trunk block onto mtp.layers.0.*; these are its extra tensors.
NEXTN = {
    "nextn.eh_proj.weight": (("mtp.fc_embedding.weight", "mtp.fc_hidden.weight"), "split_cols"),
    "nextn.enorm.weight": ("mtp.pre_fc_norm_embedding.weight", "plus1"),
    "nextn.hnorm.weight": ("mtp.pre_fc_norm_hidden.weight", "plus1"),
    "nextn.hc_head_norm.weight": ("mtp.hyper_connection_mixer.hc_norm.weight", "plus1"),
    "nextn.hc_head_down.weight": ("mtp.hyper_connection_mixer.input_mix_weight_down.weight", None),
    "nextn.hc_head_up.weight": ("mtp.hyper_connection_mixer.input_mix_weight_up.weight", None),
}
TABLE = "per_layer_token_embd.weight"

# ModelConfig field <- `qwen4exp.<key>` (required unless a default is given; None: optional, config default).
METADATA = {
    "hidden_size": "embedding_length", "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length", "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count", "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
    "linear_conv_kernel_dim": "ssm.conv_kernel", "linear_key_head_dim": "ssm.state_size",
    "linear_num_key_heads": "ssm.group_count", "linear_num_value_heads": "ssm.time_step_rank",
    "hc_count": "hyper_connection.count", "hc_lowrank": "hyper_connection.low_rank",
    "indexer_n_heads": "attention.indexer.head_count", "indexer_head_dim": "attention.indexer.key_length",
    "indexer_budget": "attention.indexer.top_k", "ngram_size": "ple.ngram_size",
    "heads_per_ngram": "ple.heads_per_ngram", "ple_conv_kernel_size": "ple.conv_kernel",
    "eos_token_id": "ple.eos_token_id",
}
_BLK = re.compile(r"blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Mapped:
    hf: tuple[str, ...]      # HF name(s) this GGUF tensor becomes
    transform: object


def translate_gguf(name: str, n_layers: int) -> Mapped | None:
    """GGUF tensor name -> HF name(s) and the transform to undo; None for a name fnx does not know."""
    if name in GLOBAL:
        hf, tr = GLOBAL[name]
        return Mapped((hf,), tr)
    m = _BLK.match(name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if layer == n_layers and rest in NEXTN:
        hf, tr = NEXTN[rest]
        return Mapped(hf if isinstance(hf, tuple) else (hf,), tr)
    if rest not in BLOCK:
        return None
    hf, tr = BLOCK[rest]
    prefix = "mtp.layers.0." if layer == n_layers else f"model.layers.{layer}."
    return Mapped((prefix + hf,), tr)


def _v_order(x: np.ndarray, cfg: ModelConfig, axis: int, per_head: int) -> np.ndarray:
    """GDN V heads from GGUF's tiled order [K0v0, K1v0, ..., K0v1, ...] back to HF's grouped [K0v0, K0v1, ...]."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    r = hv // hk
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(r, hk, per_head, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest))).reshape(hv * per_head, *rest)
    return np.moveaxis(x, 0, axis)


def _field(reader: GGUFReader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def config_from_gguf(reader: GGUFReader, path: str) -> tuple[ModelConfig, int]:
    """ModelConfig from the `qwen4exp.*` metadata (MODEL_SPEC.md 12.1) and the tensor shapes."""
    arch = _field(reader, "general.architecture")
    if arch != ARCH:
        raise CheckpointError(f"{path}: general.architecture is {arch!r}, expected {ARCH!r}")
    get = lambda k: _field(reader, f"{ARCH}.{k}")
    missing = [f"{ARCH}.{k}" for k in METADATA.values() if get(k) is None]
    for k in ("block_count", "ple.layers", "ple.layer_multipliers", "ple.head_vocab_sizes",
              "embedding_length_per_layer_input", "rope.dimension_count", "ssm.inner_size"):
        if get(k) is None:
            missing.append(f"{ARCH}.{k}")
    if missing:
        raise CheckpointError(f"{path}: GGUF metadata keys missing: {missing}")
    kw = {field: get(key) for field, key in METADATA.items()}
    nextn = get("nextn_predict_layers") or 0
    n_layers = int(get("block_count")) - int(nextn)
    kw["num_hidden_layers"] = n_layers
    interval = get("full_attention_interval")
    if interval is None:
        raise CheckpointError(f"{path}: {ARCH}.full_attention_interval is missing")
    kw["layer_types"] = tuple("linear_attention" if (i + 1) % int(interval) else "indexed_attention"
                              for i in range(n_layers))
    kw["linear_value_head_dim"] = int(get("ssm.inner_size")) // int(kw["linear_num_value_heads"])
    kw["partial_rotary_factor"] = int(get("rope.dimension_count")) / int(kw["head_dim"])
    sections = get("rope.dimension_sections")
    kw["mrope_section"] = tuple(int(s) for s in sections[:3]) if sections else (
        int(get("rope.dimension_count")) // 2, 0, 0)
    ratios = [int(r) for r in (get("attention.compress_ratios") or []) if int(r)]
    if ratios:
        kw["indexer_compress_ratio"] = ratios[0]
    kw["ple_layer_ids"] = tuple(int(i) + 1 for i in get("ple.layers"))
    vocab = np.asarray(get("ple.head_vocab_sizes"), np.int64)
    width = int(get("embedding_length_per_layer_input"))
    tensors = {t.name: t for t in reader.tensors}
    if TABLE not in tensors or "token_embd.weight" not in tensors:
        raise CheckpointError(f"{path}: tensors {TABLE!r} and 'token_embd.weight' are required")
    rows = int(tensors[TABLE].shape[-1])
    kw["vocab_size"] = int(tensors["token_embd.weight"].shape[-1])
    kw["ple_embed_dim"] = width * (int(kw["ngram_size"]) - 1) * int(kw["heads_per_ngram"])
    # The table's hash constants are stored derived; recover the inputs that derive them (checked below).
    kw["ngram_vocab_size_base"] = int(vocab[0])
    total = int(vocab.sum())
    kw["make_ngram_vocab_size_divisible_by"] = next(d for d in (2 ** k for k in range(40)) if -(-total // d) * d == rows
                                                    or d >= rows)
    kw["mtp_num_hidden_layers"] = int(nextn)
    for f in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
              "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads",
              "hc_count", "hc_lowrank", "indexer_n_heads", "indexer_head_dim", "indexer_budget", "ngram_size",
              "heads_per_ngram", "ple_conv_kernel_size", "eos_token_id", "max_position_embeddings"):
        kw[f] = int(kw[f])
    # fp32 in the file: take the shortest decimal that rounds to it (1e-06, not 9.99999997e-07)
    kw["rms_norm_eps"], kw["rope_theta"] = (float(str(np.float32(kw[k]))) for k in ("rms_norm_eps", "rope_theta"))
    cfg = ModelConfig(**kw)
    from fnx.ple import NgramConstants
    consts = NgramConstants.from_config(cfg, 0)
    for key, want in (("ple.layer_multipliers", consts.multipliers), ("ple.head_vocab_sizes", consts.head_vocab_sizes),
                      ("ple.head_offsets", consts.head_offsets)):
        have = np.asarray(get(key), np.int64)
        if have.shape != want.shape or not np.array_equal(have, want):
            raise CheckpointError(f"{path}: {ARCH}.{key} = {have.tolist()} is not what fnx derives ({want.tolist()}) "
                                  f"with seed {cfg.seed}; fnx recomputes the n-gram hash from the config")
    return cfg, n_layers


class GgufReader:
    """The tensors of one GGUF file under their HF names, with the SafetensorsFile interface. Every HF tensor is
    produced on demand (float32), one at a time."""

    def __init__(self, path: str, cfg: ModelConfig, n_layers: int, reader: GGUFReader):
        self.path, self.cfg = path, cfg
        self.gguf = reader
        self.unknown: list[str] = []
        self.bad_type: list[str] = []
        self._parts: dict[str, list] = {}   # HF name -> [(ReaderTensor, transform, index of hf name)]
        ple_layer = cfg.ple_layers[0] if cfg.ple_layers else None
        for t in reader.tensors:
            if t.name == TABLE:
                if ple_layer is None:
                    self.unknown.append(t.name)
                    continue
                m = Mapped((f"model.layers.{ple_layer}.ple.ple_embedding.ngram_embedding.shard_0.weight",), None)
            else:
                m = translate_gguf(t.name, n_layers)
            if m is None:
                self.unknown.append(t.name)
                continue
            q = GGMLQuantizationType(t.tensor_type)
            if q not in gguf_quants.PLAIN and q != GGMLQuantizationType.BF16 and q not in gguf_quants.DEQUANTIZERS:
                self.bad_type.append(f"{t.name} ({q.name})")
                continue
            for i, hf in enumerate(m.hf):
                self._parts.setdefault(hf, []).append((t, m.transform, i))
        self._order = {n: i for i, n in enumerate(self._parts)}

    def table_view(self, name: str) -> "GgufTableView":
        (t, tr, _), = self._parts[name]
        return GgufTableView(t.data, GGMLQuantizationType(t.tensor_type), self._tshape(t), self.path)

    def raw(self, gguf_name: str):
        """The packed bytes and GGML type of a GGUF tensor (for kernels that read blocks)."""
        t = next(t for t in self.gguf.tensors if t.name == gguf_name)
        return t.data, GGMLQuantizationType(t.tensor_type)

    def keys(self) -> list[str]:
        return list(self._parts)

    def offset(self, name: str) -> int:
        return self._order[name]

    def dtype(self, name: str) -> str:
        return "F32"

    @staticmethod
    def _tshape(t) -> tuple[int, ...]:
        return tuple(int(v) for v in reversed(t.shape))

    def shape(self, name: str) -> tuple[int, ...]:
        parts = self._parts[name]
        t, tr, i = parts[0]
        s = self._tshape(t)
        if isinstance(tr, tuple):   # concatenated parts
            axis = tr[2]
            s = list(s)
            s[axis] = sum(self._tshape(p[0])[axis] for p in parts)
            return tuple(s)
        if tr == "row":
            return (1,) + s
        if tr == "split_cols":
            return s[:-1] + (s[-1] // 2,)
        return s

    def nbytes(self, name: str) -> int:
        return 4 * int(np.prod(self.shape(name)))

    def release(self, name: str) -> None:
        return None

    def _one(self, t, tr, i) -> np.ndarray:
        x = gguf_quants.dequantize(t.data, GGMLQuantizationType(t.tensor_type), self._tshape(t))
        cfg = self.cfg
        hd_k, hd_v = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if tr == "plus1":
            return x - np.float32(1.0)
        if tr == "neg_exp":
            return np.log(-_v_order(x, cfg, 0, 1))
        if tr == "v_heads":
            return _v_order(x, cfg, 0, 1)
        if tr == "v_rows":
            return _v_order(x, cfg, 0, hd_v)
        if tr == "v_cols":
            return _v_order(x, cfg, x.ndim - 1, hd_v)
        if tr == "qkv_rows":
            k = 2 * cfg.linear_num_key_heads * hd_k
            return np.concatenate([x[:k], _v_order(x[k:], cfg, 0, hd_v)], axis=0)
        if tr == "row":
            return x[None]
        if tr == "split_cols":
            half = x.shape[-1] // 2
            return x[..., i * half:(i + 1) * half]
        return x

    def get(self, name: str) -> np.ndarray:
        parts = self._parts[name]
        tr = parts[0][1]
        if isinstance(tr, tuple):
            ordered = sorted(parts, key=lambda p: p[1][1])
            return np.concatenate([self._one(t, None, i) for t, _, i in ordered], axis=tr[2])
        return self._one(*parts[0])


@dataclass(frozen=True)
class GgufTableView:
    """The n-gram table of a GGUF file as a row-addressable view over its packed blocks (the interface of
    `NgramTableView`): `rows(ids)` dequantizes only the rows asked for; nothing else is read."""
    data: np.ndarray          # the tensor's bytes in the mapped file, [rows, bytes per row] (or [rows, width])
    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    file: str
    scale = None

    @property
    def dtype(self):
        return np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def rows(self, ids) -> np.ndarray:
        ids, flat = check_row_ids(ids, self.shape[0])
        packed = np.asarray(self.data).reshape(self.shape[0], -1)[flat]
        out = gguf_quants.dequantize(packed, self.qtype, (flat.size, self.shape[1]))
        return out.reshape(*ids.shape, self.shape[1])

    def lookup(self, ids, dtype=np.float32) -> np.ndarray:
        return self.rows(ids).astype(dtype)


def plan_gguf(path) -> Plan:
    """Phase 1 for a GGUF file: metadata -> config, then the HF planner's checks on the translated tensors."""
    path = os.fspath(path)
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from exc
    cfg, n_layers = config_from_gguf(reader, path)
    src = GgufReader(path, cfg, n_layers, reader)
    problems = []
    if src.unknown:
        problems.append(f"{path}: {len(src.unknown)} GGUF tensors fnx does not know: {src.unknown[:20]}")
    if src.bad_type:
        problems.append(f"{path}: tensors of unsupported GGML types {src.bad_type[:20]}; fnx dequantizes "
                        f"{gguf_quants.supported()}")
    plan = Plan(cfg, QuantSpec(), path)
    return plan_tensors(plan, [src], problems)


def load_gguf(path, dtype=None, quant: str | None = None, progress: bool = False, ngram_table: str = "device",
              scan_layers: bool | None = None):
    """Plan, then stream a `qwen4exp` GGUF onto the device (dequantized to `dtype`, or online `quant`)."""
    import jax.numpy as jnp
    from fnx.checkpoint.place import stream_plan
    plan = plan_gguf(path)
    return stream_plan(plan, dtype=jnp.bfloat16 if dtype is None else dtype, quant=quant, progress=progress,
                       ngram_table=ngram_table, scan_layers=scan_layers)
