"""Fast restore: the converted param tree (quantized leaves included) saved with orbax, restored without any
conversion work.

Layout of a converted directory:
    fnx_checkpoint.json   format tag, the ModelConfig fields, the tree skeleton (containers, quantized-leaf types,
                          shapes and dtypes), and what it was converted from
    state/                orbax StandardCheckpointer payload: a nested dict of arrays with plain keys

The skeleton is the one place that knows how the tree is rebuilt (dict / list / tuple / Fp8Block / Nvfp4)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np

from fnx.checkpoint.place import Loaded
from fnx.config import ModelConfig
from fnx.model import quant as q

FORMAT = "fnx-orbax"
VERSION = 1
MANIFEST = "fnx_checkpoint.json"
_QUANT_TYPES = {"Fp8Block": q.Fp8Block, "Nvfp4": q.Nvfp4}
_TUPLE_FIELDS = ("layer_types", "mrope_section", "ple_layer_ids")


def is_converted(path) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def _encode(tree):
    """-> (skeleton, nested dict of arrays keyed k0, k1, ... or by field name)."""
    if isinstance(tree, dict):
        parts = [_encode(v) for v in tree.values()]
        return ({"t": "dict", "keys": list(tree), "items": [s for s, _ in parts]},
                {f"k{i}": d for i, (_, d) in enumerate(parts)})
    if isinstance(tree, (list, tuple)):
        parts = [_encode(v) for v in tree]
        return ({"t": type(tree).__name__, "items": [s for s, _ in parts]},
                {f"k{i}": d for i, (_, d) in enumerate(parts)})
    if q.is_quantized(tree):
        fields = [f.name for f in dataclasses.fields(tree)]
        data = {f: getattr(tree, f) for f in fields if not isinstance(getattr(tree, f), (int, tuple))}
        meta = {f: getattr(tree, f) for f in fields if f not in data}
        enc = {f: _encode(v) for f, v in data.items()}
        return ({"t": type(tree).__name__, "meta": meta, "fields": {f: s for f, (s, _) in enc.items()}},
                {f: d for f, (_, d) in enc.items()})
    arr = tree if isinstance(tree, jax.Array) else jax.numpy.asarray(np.asarray(tree))
    return {"t": "leaf", "shape": list(arr.shape), "dtype": str(arr.dtype)}, arr


def _abstract(sk, sharding):
    t = sk["t"]
    if t == "leaf":
        return jax.ShapeDtypeStruct(tuple(sk["shape"]), jax.numpy.dtype(sk["dtype"]), sharding=sharding)
    if t in _QUANT_TYPES:
        return {f: _abstract(s, sharding) for f, s in sk["fields"].items()}
    return {f"k{i}": _abstract(s, sharding) for i, s in enumerate(sk["items"])}


def _decode(sk, data, host: bool = False):
    t = sk["t"]
    if t == "leaf":
        return np.asarray(data) if host else data
    if t in _QUANT_TYPES:
        meta = {k: tuple(v) if isinstance(v, list) else v for k, v in sk["meta"].items()}
        return _QUANT_TYPES[t](**{f: _decode(s, data[f], host) for f, s in sk["fields"].items()}, **meta)
    items = [_decode(s, data[f"k{i}"], host) for i, s in enumerate(sk["items"])]
    if t == "dict":
        return dict(zip(sk["keys"], items))
    return tuple(items) if t == "tuple" else items


def save(loaded: Loaded, dst, source: str | None = None, quant: str | None = None) -> None:
    """Write `loaded` (params and mtp; an n-gram table kept on the host is not part of the tree) to `dst`."""
    import orbax.checkpoint as ocp
    dst = os.path.abspath(os.fspath(dst))
    if loaded.ngram:
        raise ValueError("convert the checkpoint with the n-gram table on the device (ngram_table='device'); a "
                         "host-side table view is not a param tree leaf")
    os.makedirs(dst, exist_ok=True)
    sk_params, d_params = _encode(loaded.params)
    sk_mtp, d_mtp = _encode(loaded.mtp)
    cfg = dataclasses.asdict(loaded.cfg)
    manifest = {"format": FORMAT, "version": VERSION, "config": cfg, "params": sk_params, "mtp": sk_mtp,
                "source": source, "quant": quant, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(dst, "state"), {"params": d_params, "mtp": d_mtp}, force=True)
    with open(os.path.join(dst, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def restore(src) -> Loaded:
    import orbax.checkpoint as ocp
    src = os.path.abspath(os.fspath(src))
    with open(os.path.join(src, MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"{src}/{MANIFEST}: format {manifest.get('format')!r} version {manifest.get('version')!r} "
                         f"is not {FORMAT!r} version {VERSION}")
    raw = manifest["config"]
    for k in _TUPLE_FIELDS:
        raw[k] = tuple(raw[k])
    if isinstance(raw.get("eos_token_id"), list):
        raw["eos_token_id"] = tuple(raw["eos_token_id"])
    cfg = ModelConfig(**raw)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"params": _abstract(manifest["params"], sharding), "mtp": _abstract(manifest["mtp"], sharding)}
    t0 = time.perf_counter()
    with ocp.StandardCheckpointer() as ckptr:
        data = ckptr.restore(os.path.join(src, "state"), target)
    params = _decode(manifest["params"], data["params"])
    mtp = _decode(manifest["mtp"], data["mtp"], host=True)
    jax.block_until_ready(params)
    return Loaded(cfg, params, mtp, {}, {"seconds": time.perf_counter() - t0, "source": manifest.get("source")})
