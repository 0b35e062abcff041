"""HF safetensors checkpoints (config.json + one or many .safetensors, optionally model.safetensors.index.json):
the BF16 release (experts fused or per expert), the FP8 block release and the ModelOpt NVFP4 release.

`translate` is the one place where an HF tensor name becomes a path in the internal param tree. `LAYOUTS` and
`QUANT_METHODS` are the format tables: how a stored weight is encoded (its dtype and companion tensors) and which
encodings each `quantization_config` allows. A load runs in two phases:

1. plan: every header is read and every tensor checked (file present, bytes present, name known, shape, dtype and
   layout allowed by the config, nothing missing). Every problem is reported at once, naming file and tensor, and
   nothing has touched the device yet.
2. stream: tensors are read one at a time through mmap in file order, converted and written into their place in
   the device param tree (`fnx.checkpoint.place`); the pages are released after each tensor."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from fnx.checkpoint.safetensors_io import SafetensorsError, SafetensorsFile
from fnx.config import ModelConfig
from fnx.model.transformer import layer_param_shapes


class CheckpointError(ValueError):
    """A checkpoint that does not match its config, or cannot be read."""


_PREFIXES = ("model.language_model.", "model.")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARD = re.compile(r"ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")
_PLE_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
_NO_WEIGHT_SUFFIX = {"dt_bias", "A_log", "gate_up_proj", "down_proj"}
NGRAM_SCALE = "ple.ple_embedding.ngram_embedding.weight_scale"


@dataclass(frozen=True)
class Target:
    """Where one HF tensor goes. kind: 'param' | 'expert' (one slice of a fused expert tensor) | 'ngram_shard' |
    'ngram_scale' | 'ple_buffer' | 'mtp' | 'ignore'."""
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
    if rest == NGRAM_SCALE:
        return Target("ngram_scale", layer)
    parts = tuple(rest.split("."))
    if parts[-1] in _PLE_BUFFERS:
        return Target("ple_buffer", layer, (parts[-1],))
    if parts[-1] == "weight":
        parts = parts[:-1]
    elif parts[-1] not in _NO_WEIGHT_SUFFIX:
        return Target("param", layer, parts + ("<unexpected>",))
    return Target("param", layer, parts)


# ---- format tables --------------------------------------------------------------------------------------------

FLOAT_DTYPES = ("BF16", "F16", "F32")
# How a stored weight is encoded: its dtype and the companion tensors stored beside it (`<name>.<companion>` for a
# weight `<name>.weight`). Checked in this order; a weight whose companions match none of them is an error.
LAYOUTS = {
    "dense": {"dtypes": FLOAT_DTYPES, "companions": ()},
    "fp8_block": {"dtypes": ("F8_E4M3",), "companions": ("weight_scale_inv",)},
    "nvfp4": {"dtypes": ("U8",), "companions": ("weight_scale", "weight_scale_2", "input_scale")},
    # the FP8 n-gram table: shards without companions, one `ngram_embedding.weight_scale` for all of them
    "fp8_shared_scale": {"dtypes": ("F8_E4M3",), "companions": (), "only": "ngram_shard"},
}
COMPANIONS = ("weight_scale_inv", "weight_scale_2", "weight_scale", "input_scale")
# quantization_config.quant_method (or ModelOpt's quant_algo) -> the layouts it allows for weights.
QUANT_METHODS = {
    None: ("dense",),
    "fp8": ("dense", "fp8_block", "fp8_shared_scale"),
    "nvfp4": ("dense", "nvfp4", "fp8_block", "fp8_shared_scale"),   # ModelOpt NVFP4: routed experts NVFP4, the MTP layer FP8 blocks
}
# Params that `quant="fp8"` turns into FP8 blocks (suffixes of the param path). The tiny layers (router, norms,
# shared-expert gate, indexer, HC inject, GDN a/b) and lm_head / embeddings stay in the load dtype.
ONLINE_FP8 = (
    ("linear_attn", "in_proj_qkv"), ("linear_attn", "in_proj_z"), ("linear_attn", "out_proj"),
    ("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
    ("experts", "gate_up_proj"), ("experts", "down_proj"),
    ("shared_expert", "gate_proj"), ("shared_expert", "up_proj"), ("shared_expert", "down_proj"),
    ("input_mix_weight_down",), ("input_mix_weight_up",),
    ("ple", "key_proj"), ("ple", "value_proj"),
)
# "fp8": the ONLINE_FP8 params; "fp8-head": those and the lm_head too (the step's largest GEMV: 168 against 279 us
# per step on the H200 through the FP8 GEMV kernel, BENCHMARKS.md seventh session; the logits move by one FP8
# rounding of the head's weights)
ONLINE_QUANT = ("fp8", "fp8-head")


@dataclass(frozen=True)
class QuantSpec:
    method: str | None = None
    block: tuple[int, int] = (128, 128)
    group: int = 16
    source: str = ""

    @property
    def layouts(self) -> tuple[str, ...]:
        return QUANT_METHODS[self.method]


def quant_spec(path: str, raw: dict) -> QuantSpec:
    """The checkpoint's quantization from config.json's `quantization_config` (wrapper or text config) or
    ModelOpt's `hf_quant_config.json`."""
    qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
    src = os.path.join(path, "config.json")
    hf_quant = os.path.join(path, "hf_quant_config.json")
    if qc is None and os.path.exists(hf_quant):
        with open(hf_quant, encoding="utf-8") as f:
            qc = {"quant_method": "modelopt", **json.load(f).get("quantization", {})}
        src = hf_quant
    if qc is None:
        return QuantSpec()
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(f"{src}: quantization_config.weight_block_size must be two positive integers, "
                                  f"got {block!r}; fnx reads block-scaled FP8 only")
        return QuantSpec("fp8", block=tuple(block), source=src)
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo != "NVFP4":
            raise CheckpointError(f"{src}: ModelOpt quant_algo {qc.get('quant_algo')!r} is not supported "
                                  "(fnx reads NVFP4)")
        group = int(qc.get("group_size", 16))
        if group != 16:
            raise CheckpointError(f"{src}: NVFP4 group_size {group} is not supported (expected 16)")
        return QuantSpec("nvfp4", group=group, source=src)
    raise CheckpointError(f"{src}: quantization_config {qc!r} is not supported; fnx reads quant_method 'fp8' "
                          "(128x128 blocks) and ModelOpt 'NVFP4'")


# ---- phase 1: the plan --------------------------------------------------------------------------------------

@dataclass
class Weight:
    """One stored weight and its companions, checked. `shape` is the logical [..., out, in] shape."""
    name: str
    file: str
    layout: str
    shape: tuple
    parts: dict            # "weight" / companion -> (SafetensorsFile, tensor name)
    target: Target
    nbytes: int = 0
    squeeze: bool = False  # depthwise conv stored [C, 1, K]

    def arrays(self) -> dict:
        return {k: r.get(n) for k, (r, n) in self.parts.items()}

    def release(self):
        for r, n in self.parts.values():
            r.release(n)


@dataclass
class Plan:
    cfg: ModelConfig
    quant: QuantSpec
    path: str
    weights: list[Weight] = field(default_factory=list)
    experts: dict = field(default_factory=dict)    # (layer, proj) -> {expert: Weight}
    shards: dict = field(default_factory=dict)     # layer -> {index: Weight}
    ngram_scale: dict = field(default_factory=dict)  # layer -> (file, np.ndarray)
    mtp: list[Weight] = field(default_factory=list)
    readers: list[SafetensorsFile] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        ws = self.weights + self.mtp + [w for d in self.experts.values() for w in d.values()]
        ws += [w for d in self.shards.values() for w in d.values()]
        return sum(w.nbytes for w in ws)


def _index_files(path: str, problems: list) -> dict[str, list[str]]:
    """file -> tensor names it should hold (from the index), or every .safetensors file in the directory."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from exc
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        for fname in sorted(files):
            if not os.path.exists(os.path.join(path, fname)):
                names = sorted(files[fname])
                problems.append(f"{os.path.join(path, fname)}: file is missing; {index} puts {len(names)} tensors "
                                f"there, e.g. {names[:3]}")
        return {f: v for f, v in files.items() if os.path.exists(os.path.join(path, f))}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors files in {path}")
    return {f: None for f in files}


def _split_companion(name: str) -> tuple[str, str | None]:
    for c in COMPANIONS:
        if name.endswith("." + c):
            return name[: -len(c)] + "weight", c
    return name, None


def _logical_shape(base: str, file: str, layout: str, shapes: dict, dtypes: dict, spec: QuantSpec,
                   problems: list) -> tuple | None:
    """Check the companions of one weight and return its logical shape (None after recording a problem)."""
    wshape = shapes["weight"]
    where = f"{file}: tensor {base!r}"
    if layout in ("dense", "fp8_shared_scale"):
        return wshape
    if len(wshape) < 2:
        problems.append(f"{where}: a {layout} weight must be at least 2-D, got shape {wshape}")
        return None
    out, inp = wshape[-2], wshape[-1]
    if layout == "fp8_block":
        bo, bi = spec.block
        want = wshape[:-2] + (-(-out // bo), -(-inp // bi))
        if shapes["weight_scale_inv"] != want or dtypes["weight_scale_inv"] not in ("F32", "BF16"):
            problems.append(f"{where}.weight_scale_inv is {dtypes['weight_scale_inv']} "
                            f"{shapes['weight_scale_inv']}, expected F32 {want} for {bo}x{bi} blocks of {wshape}")
            return None
        return wshape
    if layout == "nvfp4":
        logical = wshape[:-1] + (2 * inp,)
        want = wshape[:-1] + (2 * inp // spec.group,)
        if (2 * inp) % spec.group or shapes["weight_scale"] != want or dtypes["weight_scale"] != "F8_E4M3":
            problems.append(f"{where}.weight_scale is {dtypes['weight_scale']} {shapes['weight_scale']}, expected "
                            f"F8_E4M3 {want} (one scale per {spec.group} of {logical})")
            return None
        for c in ("weight_scale_2", "input_scale"):
            if shapes[c] not in ((), (1,)) or dtypes[c] != "F32":
                problems.append(f"{where}.{c} is {dtypes[c]} {shapes[c]}, expected one F32 value")
                return None
        return logical
    raise AssertionError(layout)


def plan_checkpoint(path: str, cfg: ModelConfig | None = None) -> Plan:
    """Phase 1: read every header and check every tensor against the config. Raises CheckpointError listing all
    problems (each with its file and tensor) before anything is read or placed."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint path {path!r} is not a directory")
    cfg = cfg or ModelConfig.from_json(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        spec = quant_spec(path, json.load(f))
    plan = Plan(cfg, spec, path)
    problems: list[str] = []
    files = _index_files(path, problems)
    readers = []
    for fname, listed in sorted(files.items()):
        fpath = os.path.join(path, fname)
        try:
            reader = SafetensorsFile(fpath)
        except SafetensorsError as exc:
            problems.append(str(exc))
            continue
        readers.append(reader)
        if listed is not None:
            absent = sorted(set(listed) - set(reader.keys()))
            if absent:
                problems.append(f"{fpath}: the index puts {len(absent)} tensors in this file that it does not "
                                f"hold, e.g. {absent[:3]}")
    return plan_tensors(plan, readers, problems)


def plan_tensors(plan: "Plan", readers: list, problems: list[str]) -> "Plan":
    """Check the tensors of `readers` (anything with the SafetensorsFile interface: keys, shape, dtype, nbytes,
    offset, get, release, path) against `plan.cfg`; HF names. Raises CheckpointError listing every problem."""
    cfg, spec, path = plan.cfg, plan.quant, plan.path
    groups: dict[str, dict] = {}   # base weight name -> {"file", "parts", "shapes", "dtypes"}
    for reader in readers:
        fpath = reader.path
        plan.readers.append(reader)
        have = set(reader.keys())
        for name in sorted(have, key=reader.offset):
            base, comp = _split_companion(name)
            g = groups.setdefault(base, {"file": fpath, "parts": {}, "shapes": {}, "dtypes": {}})
            key = comp or "weight"
            g["parts"][key] = (reader, name)
            g["shapes"][key] = reader.shape(name)
            g["dtypes"][key] = reader.dtype(name)

    expected_top = {"embed_tokens": (cfg.vocab_size, cfg.hidden_size), "lm_head": (cfg.vocab_size, cfg.hidden_size),
                    "hyper_connection_mixer": {"hc_norm": (cfg.hc_dim,),
                                               "input_mix_weight_down": (cfg.hc_lowrank, cfg.hc_dim),
                                               "input_mix_weight_up": (cfg.hc_dim, cfg.hc_lowrank)}}
    expected = [layer_param_shapes(cfg, i) for i in range(cfg.num_hidden_layers)]
    seen_top: set = set()
    seen: list[set] = [set() for _ in expected]
    unexpected: list[str] = []

    for base, g in groups.items():
        file = g["file"]
        t = translate(base)
        if t.kind == "ignore":
            continue
        if "weight" not in g["parts"]:
            scale = [(r, n) for r, n in g["parts"].values() if translate(n).kind == "ngram_scale"]
            if len(scale) == 1 and len(g["parts"]) == 1:
                r, n = scale[0]
                plan.ngram_scale[translate(n).layer] = (file, np.array(r.get(n)))
                continue
            problems.append(f"{file}: scale tensors {sorted(n for _, n in g['parts'].values())} have no weight "
                            f"{base!r} beside them")
            continue
        comps = tuple(sorted(k for k in g["parts"] if k != "weight"))
        dtype = g["dtypes"]["weight"]
        if t.kind == "ple_buffer":
            r, n = g["parts"]["weight"]
            _check_ple_buffer(cfg, t.layer, t.path[0], np.asarray(r.get(n)), n, file)
            continue
        layout = next((k for k, v in LAYOUTS.items() if tuple(sorted(v["companions"])) == comps
                       and dtype in v["dtypes"] and v.get("only", t.kind) == t.kind), None)
        if layout is None:
            problems.append(f"{file}: tensor {base!r} is {dtype} {g['shapes']['weight']} with companions "
                            f"{list(comps)}, which is no known layout (known: " + "; ".join(
                                f"{k}: {'/'.join(v['dtypes'])} + {list(v['companions'])}" for k, v in LAYOUTS.items())
                            + ")")
            continue
        if layout not in spec.layouts:
            why = ("config.json has no quantization_config" if spec.method is None
                   else f"{spec.source} declares {spec.method}")
            problems.append(f"{file}: tensor {base!r} is stored as {layout} ({dtype}), which this checkpoint's "
                            f"config does not allow: {why} (allowed: {list(spec.layouts)})")
            continue
        shape = _logical_shape(base, file, layout, g["shapes"], g["dtypes"], spec, problems)
        if shape is None:
            continue
        nbytes = sum(r.nbytes(n) for r, n in g["parts"].values())
        w = Weight(base, file, layout, shape, g["parts"], t, nbytes)
        if t.kind == "mtp":
            plan.mtp.append(w)
            continue
        if t.layer is not None and not 0 <= t.layer < cfg.num_hidden_layers:
            unexpected.append(f"{file}: {base}")
            continue
        if t.kind == "ngram_shard":
            plan.shards.setdefault(t.layer, {})[t.index] = w
            continue
        if t.kind == "expert":
            ex = expected[t.layer]["mlp"]["experts"]
            e, two_i, d = ex["gate_up_proj"]
            want = (two_i // 2, d) if t.path[0] != "down_proj" else ex["down_proj"][1:]
            if shape != want:
                problems.append(f"{file}: tensor {base!r} has shape {shape}, but the config expects {want}")
            elif not 0 <= t.index < e:
                unexpected.append(f"{file}: {base}")
            else:
                plan.experts.setdefault((t.layer, t.path[0]), {})[t.index] = w
            continue
        want = _get(expected_top if t.layer is None else expected[t.layer], t.path)
        if not isinstance(want, tuple):
            unexpected.append(f"{file}: {base}")
            continue
        if t.path[-1] == "conv1d" and len(shape) == 3 and shape[1] == 1:
            shape, w.squeeze = (shape[0], shape[2]), True
            w.shape = shape
        (seen_top if t.layer is None else seen[t.layer]).add(t.path)
        if tuple(shape) != tuple(want):
            problems.append(f"{file}: tensor {base!r} has shape {tuple(shape)}, but the config expects {tuple(want)}")
            continue
        plan.weights.append(w)

    # experts: complete, one layout per projection
    for (layer, proj), parts in sorted(plan.experts.items()):
        n = expected[layer]["mlp"]["experts"]["gate_up_proj"][0]
        have = sorted(parts)
        if have != list(range(n)):
            problems.append(f"layers.{layer}.mlp.experts: {proj} present for {len(have)} of {n} experts "
                            f"(missing e.g. {sorted(set(range(n)) - set(have))[:5]})")
        kinds = {w.layout for w in parts.values()}
        if len(kinds) > 1:
            problems.append(f"layers.{layer}.mlp.experts.*.{proj}: mixed layouts {sorted(kinds)}")
    for layer in {lay for lay, _ in plan.experts}:
        kinds = {w.layout for (lay, _), d in plan.experts.items() if lay == layer for w in d.values()}
        if {"gate_proj", "up_proj", "down_proj"} - {p for lay, p in plan.experts if lay == layer}:
            problems.append(f"layers.{layer}.mlp.experts: per-expert tensors need gate_proj, up_proj and down_proj")
        seen[layer].update({("mlp", "experts", "gate_up_proj"), ("mlp", "experts", "down_proj")})
        if len(kinds) == 1 and "fp8_block" in kinds:
            inter, bo = cfg.moe_intermediate_size, spec.block[0]
            if inter % bo and inter > bo:
                problems.append(f"layers.{layer}.mlp.experts: moe_intermediate_size {inter} is neither a multiple "
                                f"of the FP8 block {bo} nor smaller than it, so gate and up cannot be fused")

    # n-gram table: a complete range of equal shards, FP8 only with its per-tensor scale
    for layer, parts in sorted(plan.shards.items()):
        want = _get(expected[layer], ("ple", "ple_embedding", "ngram_embedding"))
        if want is None:
            unexpected.append(f"layers.{layer}.ple.ple_embedding.ngram_embedding.shard_*")
            continue
        idx = sorted(parts)
        if idx != list(range(len(idx))):
            problems.append(f"layers.{layer}: n-gram table shards {idx} are not a complete 0..N-1 range")
            continue
        shapes = {parts[i].shape for i in idx}
        rows = sum(parts[i].shape[0] for i in idx)
        if len(shapes) != 1 or (rows, parts[0].shape[-1]) != tuple(want):
            bad = next(parts[i] for i in idx if parts[i].shape != parts[0].shape) if len(shapes) > 1 else parts[0]
            problems.append(f"{bad.file}: n-gram shards of layers.{layer} are {sorted(shapes)}, together "
                            f"({rows}, {parts[0].shape[-1]}), but the config expects {tuple(want)} in equal shards")
            continue
        dt = parts[0].parts["weight"][0].dtype(parts[0].parts["weight"][1])
        if dt == "F8_E4M3":
            if layer not in plan.ngram_scale:
                problems.append(f"{parts[0].file}: the n-gram table of layers.{layer} is FP8 but no "
                                f"'...{NGRAM_SCALE}' per-tensor scale was found")
            elif plan.ngram_scale[layer][1].size != 1:
                problems.append(f"{plan.ngram_scale[layer][0]}: the n-gram table scale must hold one value, got "
                                f"shape {plan.ngram_scale[layer][1].shape}")
        seen[layer].add(("ple", "ple_embedding", "ngram_embedding"))

    missing = [".".join(p) for p, _ in _flat_paths(expected_top) if p not in seen_top]
    for i, want in enumerate(expected):
        missing += [f"layers.{i}." + ".".join(p) for p, _ in _flat_paths(want) if p not in seen[i]]
    if unexpected:
        problems.append(f"{len(unexpected)} tensors do not belong to this config ({cfg.summary()}): "
                        f"{sorted(unexpected)[:20]}")
    if missing:
        problems.append(f"{len(missing)} tensors the config needs are missing from {path}: {missing[:20]}")
    if problems:
        head = f"checkpoint {path} cannot be loaded ({len(problems)} problems):\n  "
        raise CheckpointError(head + "\n  ".join(problems[:40]))
    return plan


def _get(tree, path: tuple[str, ...]):
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            return None
        tree = tree[p]
    return tree


def _flat_paths(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_paths(v, prefix + (k,))
    else:
        yield prefix, tree


def _check_ple_buffer(cfg, layer, buf, arr, name, file):
    from fnx.ple import NgramConstants
    if layer not in cfg.ple_layers:
        raise CheckpointError(f"{file}: tensor {name!r} belongs to a PLE layer, but the config has PLE on "
                              f"{list(cfg.ple_layers)} (0-based)")
    consts = NgramConstants.from_config(cfg, cfg.ple_layers.index(layer))
    want = {"layer_multipliers": consts.multipliers, "ngram_heads_vocab_sizes": consts.head_vocab_sizes,
            "ngram_heads_offsets": consts.head_offsets}[buf]
    if arr.shape != want.shape or not np.array_equal(arr.astype(np.int64), want):
        raise CheckpointError(f"{file}: {name} = {arr.tolist()} does not match the values derived from the config "
                              f"({want.tolist()}); check seed, vocab_size, ngram_size and heads_per_ngram")


# ---- phase 2: stream ------------------------------------------------------------------------------------------

def load_checkpoint(path, dtype=jnp.bfloat16, cfg: ModelConfig | None = None, quant: str | None = None,
                    ngram_table: str = "device", progress: bool = False, scan_layers: bool | None = None):
    """Plan, then stream an HF checkpoint onto the device. Returns `fnx.checkpoint.place.Loaded`.
    scan_layers: the params layout (`ModelConfig.scan_layers`); None keeps the config's (scanned)."""
    from fnx.checkpoint.place import stream_plan
    if quant not in (None, *ONLINE_QUANT):
        raise ValueError(f"quant={quant!r} is not supported; choose None or one of {list(ONLINE_QUANT)}")
    if ngram_table not in ("device", "host"):
        raise ValueError(f"ngram_table must be 'device' or 'host', got {ngram_table!r}")
    plan = plan_checkpoint(path, cfg)
    return stream_plan(plan, dtype=dtype, quant=quant, ngram_table=ngram_table, progress=progress,
                       scan_layers=scan_layers)


def load_hf(path: str | os.PathLike, dtype=jnp.bfloat16, cfg: ModelConfig | None = None, progress=None,
            quant: str | None = None):
    """Read an HF checkpoint directory into (cfg, params, mtp). `mtp` maps the raw `mtp.*` weight names to host
    arrays (or quantized weights with host leaves)."""
    out = load_checkpoint(path, dtype=dtype, cfg=cfg, quant=quant, progress=bool(progress))
    return out.cfg, out.params, out.mtp
