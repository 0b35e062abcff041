"""HF safetensors checkpoints (config.json + one or many .safetensors, optionally model.safetensors.index.json).

`translate` is the one place where an HF tensor name becomes a path in the internal param tree."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from fnx.checkpoint.safetensors_io import SafetensorsError, SafetensorsFile
from fnx.config import ModelConfig
from fnx.model.transformer import arrange_layers, layer_param_shapes


class CheckpointError(ValueError):
    """A checkpoint that does not match its config, or cannot be read."""


_PREFIXES = ("model.language_model.", "model.")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARD = re.compile(r"ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")
_PLE_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
_NO_WEIGHT_SUFFIX = {"dt_bias", "A_log", "gate_up_proj", "down_proj"}


@dataclass(frozen=True)
class Target:
    """Where one HF tensor goes. kind: 'param' | 'expert' (one slice of a fused expert tensor) | 'ngram_shard' |
    'ple_buffer' | 'mtp' | 'ignore'."""
    kind: str
    layer: int | None = None
    path: tuple[str, ...] = ()
    index: int | None = None


def translate(name: str) -> Target:
    if name.startswith("mtp."):
        return Target("mtp", path=(name,))
    if name.startswith(("model.visual.", "visual.")):
        return Target("ignore")
    if name == "lm_head.weight":
        return Target("param", path=("lm_head",))
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    m = _LAYER.match(name)
    if not m:
        parts = tuple(name.split("."))
        if parts[-1] == "weight":
            parts = parts[:-1]
        return Target("param", path=parts)
    layer, rest = int(m.group(1)), m.group(2)
    if (e := _EXPERT.match(rest)):
        return Target("expert", layer, (e.group(2),), int(e.group(1)))
    if (s := _SHARD.match(rest)):
        return Target("ngram_shard", layer, index=int(s.group(1)))
    parts = tuple(rest.split("."))
    if parts[-1] in _PLE_BUFFERS:
        return Target("ple_buffer", layer, (parts[-1],))
    if parts[-1] == "weight":
        parts = parts[:-1]
    elif parts[-1] not in _NO_WEIGHT_SUFFIX:
        return Target("param", layer, parts + ("<unexpected>",))
    return Target("param", layer, parts)


def _files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{index} names files that are not in {path}: {missing}")
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {path}")
    return [os.path.join(path, f) for f in files]


def _get(tree: dict, path: tuple[str, ...]):
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            return None
        tree = tree[p]
    return tree


def _set(tree: dict, path: tuple[str, ...], value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _flat_paths(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_paths(v, prefix + (k,))
    else:
        yield prefix, tree


def _describe(layer, path):
    return (f"layers.{layer}." if layer is not None else "") + ".".join(path)


def load_hf(path: str | os.PathLike, dtype=jnp.bfloat16, cfg: ModelConfig | None = None, progress=None):
    """Read an HF checkpoint directory into (cfg, params, mtp). `mtp` maps the raw `mtp.*` names to host arrays."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint path {path!r} is not a directory")
    cfg = cfg or ModelConfig.from_json(path)
    np_dtype = np.dtype(jnp.dtype(dtype))
    expected = {"embed_tokens": (cfg.vocab_size, cfg.hidden_size), "lm_head": (cfg.vocab_size, cfg.hidden_size),
                "hyper_connection_mixer": {"hc_norm": (cfg.hc_dim,),
                                           "input_mix_weight_down": (cfg.hc_lowrank, cfg.hc_dim),
                                           "input_mix_weight_up": (cfg.hc_dim, cfg.hc_lowrank)}}
    layer_expected = [layer_param_shapes(cfg, i) for i in range(cfg.num_hidden_layers)]
    top: dict = {}
    layers: list[dict] = [{} for _ in range(cfg.num_hidden_layers)]
    experts: dict = {}
    shards: dict = {}
    mtp: dict = {}
    unexpected: list[str] = []

    def convert(arr: np.ndarray, name: str, want: tuple) -> jnp.ndarray:
        if arr.dtype.kind in "iub":
            raise CheckpointError(f"tensor {name!r} has dtype {arr.dtype}, expected a floating-point weight")
        if tuple(arr.shape) != tuple(want):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(arr.shape)}, but the config "
                                  f"expects {tuple(want)}")
        return jnp.asarray(np.asarray(arr, dtype=np_dtype))

    files = _files(path)
    try:
        readers = [SafetensorsFile(f) for f in files]
    except SafetensorsError as exc:
        raise CheckpointError(str(exc)) from exc
    names = [(r, n) for r in readers for n in r.keys()]
    it = progress(names) if progress else names
    for reader, name in it:
        t = translate(name)
        if t.kind == "ignore":
            continue
        if t.kind == "mtp":
            mtp[name] = np.asarray(reader.get(name))
            continue
        if t.layer is not None and not 0 <= t.layer < cfg.num_hidden_layers:
            unexpected.append(name)
            continue
        arr = reader.get(name)
        if t.kind == "param":
            want_tree = expected if t.layer is None else layer_expected[t.layer]
            want = _get(want_tree, t.path)
            if not isinstance(want, tuple):
                unexpected.append(name)
                continue
            if t.path[-1] == "conv1d" and arr.ndim == 3:  # [C, 1, K] depthwise -> [C, K]
                arr = arr[:, 0, :]
            _set(top if t.layer is None else layers[t.layer], t.path, convert(arr, name, want))
        elif t.kind == "expert":
            experts.setdefault(t.layer, {}).setdefault(t.path[0], {})[t.index] = arr
        elif t.kind == "ngram_shard":
            shards.setdefault(t.layer, {})[t.index] = arr
        elif t.kind == "ple_buffer":
            _check_ple_buffer(cfg, t.layer, t.path[0], np.asarray(arr), name)

    for layer, parts in experts.items():
        _fuse_experts(cfg, layer, parts, layers, layer_expected, convert)
    for layer, parts in shards.items():
        idx = sorted(parts)
        if idx != list(range(len(idx))):
            raise CheckpointError(f"layers.{layer}: n-gram table shards {idx} are not a complete 0..N-1 range")
        table = np.concatenate([parts[i] for i in idx], axis=0)
        want = _get(layer_expected[layer], ("ple", "ple_embedding", "ngram_embedding"))
        if want is None:
            unexpected.append(f"layers.{layer}.ple.ple_embedding.ngram_embedding.shard_*")
            continue
        _set(layers[layer], ("ple", "ple_embedding", "ngram_embedding"),
             convert(table, f"layers.{layer}.ple.ple_embedding.ngram_embedding", want))

    if unexpected:
        raise CheckpointError(f"{len(unexpected)} tensors in {path} do not belong to this config "
                              f"({cfg.summary()}): {sorted(unexpected)[:20]}")
    missing = [_describe(None, p) for p, _ in _flat_paths(expected) if _get(top, p) is None]
    for i, want in enumerate(layer_expected):
        missing += [_describe(i, p) for p, _ in _flat_paths(want) if _get(layers[i], p) is None]
    if missing:
        raise CheckpointError(f"{len(missing)} tensors the config needs are missing from {path}: {missing[:20]}")
    params = dict(top)
    params["segments"] = arrange_layers(cfg, layers)
    return cfg, params, mtp


def _fuse_experts(cfg, layer, parts, layers, layer_expected, convert):
    e = cfg.num_experts
    for proj in ("gate_proj", "up_proj", "down_proj"):
        have = sorted(parts.get(proj, {}))
        if have != list(range(e)):
            raise CheckpointError(f"layers.{layer}.mlp.experts: {proj} present for {len(have)} of {e} experts")
    gate = np.stack([parts["gate_proj"][i] for i in range(e)])
    up = np.stack([parts["up_proj"][i] for i in range(e)])
    down = np.stack([parts["down_proj"][i] for i in range(e)])
    want = layer_expected[layer]["mlp"]["experts"]
    base = f"layers.{layer}.mlp.experts"
    _set(layers[layer], ("mlp", "experts", "gate_up_proj"),
         convert(np.concatenate([gate, up], axis=1), base + ".gate_up_proj", want["gate_up_proj"]))
    _set(layers[layer], ("mlp", "experts", "down_proj"), convert(down, base + ".down_proj", want["down_proj"]))


def _check_ple_buffer(cfg, layer, buf, arr, name):
    from fnx.ple import NgramConstants
    if layer not in cfg.ple_layers:
        raise CheckpointError(f"tensor {name!r} belongs to a PLE layer, but the config has PLE on "
                              f"{list(cfg.ple_layers)} (0-based)")
    consts = NgramConstants.from_config(cfg, cfg.ple_layers.index(layer))
    want = {"layer_multipliers": consts.multipliers, "ngram_heads_vocab_sizes": consts.head_vocab_sizes,
            "ngram_heads_offsets": consts.head_offsets}[buf]
    if arr.shape != want.shape or not np.array_equal(arr.astype(np.int64), want):
        raise CheckpointError(f"{name} = {arr.tolist()} does not match the values derived from the config "
                              f"({want.tolist()}); check seed, vocab_size, ngram_size and heads_per_ngram")
