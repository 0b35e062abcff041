"""Phase 2 of a load: stream checked tensors onto the device, one at a time, into the params pytree.

The tree has the layout of `fnx.model.transformer.arrange_layers` (segments of the layer plan; scanned runs are
stacked). Stacked leaves are preallocated on the device and each layer is written into its slot by a donated
`dynamic_update_slice`, so the device never holds two copies of a segment; per-expert tensors are written into
their fused slot the same way. Host memory stays near the largest tensor being converted: the mmap pages of each
tensor are released after it has been placed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fnx.checkpoint.ngram_table import NgramTableView
from fnx.config import ModelConfig
from fnx.model import quant as q
from fnx.model.transformer import layer_plan

NGRAM_PATH = ("ple", "ple_embedding", "ngram_embedding")


@dataclass
class Loaded:
    cfg: ModelConfig
    params: dict
    mtp: dict = field(default_factory=dict)        # raw `mtp.*` weight name -> host array or quantized weight
    ngram: dict = field(default_factory=dict)      # layer -> NgramTableView, when the table stays on the host
    stats: dict = field(default_factory=dict)      # bytes, seconds


@partial(jax.jit, donate_argnums=0)
def _write(buf, x, starts):
    """buf with x written at `starts` (x may lack buf's leading axes). buf is donated: updated in place."""
    x = x.astype(buf.dtype).reshape((1,) * (buf.ndim - x.ndim) + x.shape)
    return lax.dynamic_update_slice(buf, x, tuple(starts[i] for i in range(buf.ndim)))


@partial(jax.jit, static_argnums=1)
def _cast(x, dtype):
    return x.astype(dtype)


_quantize_fp8 = jax.jit(q.quantize_fp8_block, static_argnums=1)


def _put(x):
    """Host array -> a device copy. Never an alias of the host memory: the source is a view of a mapped file whose
    pages are released once the copy is done."""
    return jax.device_put(x, may_alias=False)


def _starts(ndim: int, lead: tuple[int, ...] = ()) -> np.ndarray:
    return np.array(tuple(lead) + (0,) * (ndim - len(lead)), np.int32)


def _set(tree: dict, path, value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _get(tree, path):
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            return None
        tree = tree[p]
    return tree


class TreeBuilder:
    """Collects leaves per layer into the segment layout, writing stacked leaves into preallocated slots."""

    def __init__(self, cfg: ModelConfig):
        self.plan = layer_plan(cfg)
        self.loc = {}
        for si, seg in enumerate(self.plan):
            for g in range(seg.reps):
                for j in range(seg.period):
                    self.loc[seg.start + g * seg.period + j] = (si, j, g if seg.scanned else None)
        self.top: dict = {}
        self.seg = [[{} for _ in range(seg.period)] for seg in self.plan]

    def put(self, layer: int | None, path: tuple[str, ...], value):
        """Place a leaf; returns what now holds it (the value, or the stacked buffer it was written into)."""
        if layer is None:
            _set(self.top, path, value)
            return value
        si, j, g = self.loc[layer]
        tree = self.seg[si][j]
        if g is None:
            _set(tree, path, value)
            return value
        buf = _get(tree, path)
        if buf is None:
            reps = self.plan[si].reps
            buf = jax.tree.map(lambda a: jnp.zeros((reps,) + tuple(a.shape), a.dtype), value)
        buf = jax.tree.map(lambda b, a: _write(b, a, _starts(b.ndim, (g,))), buf, value)
        _set(tree, path, buf)
        return buf

    def params(self) -> dict:
        segments = [tuple(self.seg[si]) if seg.scanned else (self.seg[si][0],) for si, seg in enumerate(self.plan)]
        return {**self.top, "segments": segments}


# the MTP layer's own input projections (MODEL_SPEC.md 10.1): FP8 blocks under the online quantization too, as in
# the FP8 and NVFP4 releases (every draft step reads them: 2 x 2560 x 2560)
MTP_ONLINE_FP8 = (("fc_embedding",), ("fc_hidden",))


def online_fp8(path: tuple[str, ...], quant: str | None = "fp8", mtp: bool = False) -> bool:
    """Whether online quantization `quant` ("fp8", "fp8-head", None) turns the param at `path` into FP8 blocks.
    mtp: `path` is in the MTP layer's tree (`fnx.model.mtp.mtp_params`), where fc_embedding / fc_hidden are too."""
    from fnx.checkpoint.hf import ONLINE_FP8, ONLINE_QUANT
    if quant not in ONLINE_QUANT:
        return False
    path = tuple(path)
    return (any(path[-len(s):] == s for s in ONLINE_FP8) or (quant == "fp8-head" and path == ("lm_head",))
            or (mtp and path in MTP_ONLINE_FP8))


def mtp_value(w, spec, quant: str | None, block=(128, 128)):
    """One `mtp.*` tensor as `Loaded.mtp` keeps it: as stored (a host array or a quantized weight), or, under an
    online quantization, FP8 blocks on the device where the trunk's same projection is quantized (the decoder
    layer's projections and experts, the HC mixer's down / up) and for fc_embedding / fc_hidden."""
    from fnx.checkpoint.hf import translate
    value = _stored(w, spec)
    if q.is_quantized(value) or quant is None or getattr(value, "ndim", 0) < 2:
        return value
    t = translate(w.name[len("mtp."):])
    if t.kind == "param" and online_fp8(t.path, quant, mtp=True):
        return _quantize_fp8(_put(value), tuple(block))
    return value


def _stored(w, spec) -> object:
    """A checked Weight's arrays (mmap views) as one host value: an array or a quantized weight."""
    a = w.arrays()
    if w.layout in ("dense", "fp8_shared_scale"):
        x = a["weight"]
        return x[:, 0, :] if w.squeeze else x
    if w.layout == "fp8_block":
        return q.Fp8Block(a["weight"], a["weight_scale_inv"].astype(np.float32), tuple(spec.block))
    if w.layout == "nvfp4":
        s2 = np.broadcast_to(a["weight_scale_2"].astype(np.float32).reshape(()), w.shape[:-1])
        return q.Nvfp4(a["weight"], a["weight_scale"], np.ascontiguousarray(s2),
                       a["input_scale"].astype(np.float32).reshape(()), spec.group)
    raise AssertionError(w.layout)


def to_device(value, dtype, quantize: bool, block=(128, 128)):
    """Host value -> device leaf: dense arrays are cast to `dtype` (or FP8-quantized), quantized ones stay as
    they are stored."""
    if q.is_quantized(value):
        return jax.tree.map(_put, value)
    x = _put(value)
    if quantize:
        return _quantize_fp8(x, tuple(block))
    return x if x.dtype == jnp.dtype(dtype) else _cast(x, jnp.dtype(dtype))   # _put already copied


def _fused_expert_template(ws: dict, n: int, rows_each: int, dtype, spec):
    """Device buffers for the fused [E, rows, in] tensor built from per-expert weights (all of one layout)."""
    w0 = next(iter(ws.values()))
    rows, inp = rows_each, w0.shape[-1]
    if w0.layout == "dense":
        return jnp.zeros((n, rows, inp), jnp.dtype(dtype)), None
    if w0.layout == "fp8_block":
        bo, bi = spec.block
        per = w0.shape[-2]
        fbo = bo if per % bo == 0 else per          # checked in the plan: per % bo == 0 or per < bo
        return q.Fp8Block(jnp.zeros((n, rows, inp), q.FP8), jnp.zeros((n, rows // fbo, -(-inp // bi)), jnp.float32),
                          (fbo, bi)), fbo
    if w0.layout == "nvfp4":
        return q.Nvfp4(jnp.zeros((n, rows, inp // 2), jnp.uint8), jnp.zeros((n, rows, inp // spec.group), q.FP8),
                       jnp.zeros((n, rows), jnp.float32), jnp.zeros((n,), jnp.float32), spec.group), None
    raise AssertionError(w0.layout)


def _write_expert(buf, fbo, value, e: int, row0: int):
    """Write one expert's weight (host value) at expert e, row offset row0 of the fused buffer."""
    if isinstance(buf, q.Fp8Block):
        return q.Fp8Block(_write(buf.w, _put(value.w), _starts(3, (e, row0))),
                          _write(buf.scale_inv, _put(value.scale_inv), _starts(3, (e, row0 // fbo))),
                          buf.block)
    if isinstance(buf, q.Nvfp4):
        cur = buf.input_scale
        # gate and up read the same input: keep the larger calibrated activation scale
        ins = jnp.maximum(cur[e], jnp.asarray(value.input_scale)) if row0 else jnp.asarray(value.input_scale)
        return q.Nvfp4(_write(buf.w, _put(value.w), _starts(3, (e, row0))),
                       _write(buf.scale, _put(value.scale), _starts(3, (e, row0))),
                       _write(buf.scale_2, _put(value.scale_2), _starts(2, (e, row0))),
                       cur.at[e].set(ins), buf.group)
    return _write(buf, _put(value), _starts(3, (e, row0)))


def stream_plan(plan, dtype=jnp.bfloat16, quant: str | None = None, ngram_table: str = "device",
                progress: bool = False, scan_layers: bool | None = None) -> Loaded:
    """scan_layers: the params layout (`ModelConfig.scan_layers`); None keeps the config's. quant: None or one
    of `fnx.checkpoint.hf.ONLINE_QUANT` (HF and GGUF plans alike)."""
    from fnx.checkpoint.hf import ONLINE_QUANT
    if quant not in (None, *ONLINE_QUANT):
        raise ValueError(f"quant={quant!r} is not supported; choose None or one of {list(ONLINE_QUANT)}")
    cfg, spec = plan.cfg, plan.quant
    if scan_layers is not None:
        cfg = cfg.replace(scan_layers=bool(scan_layers))
    builder = TreeBuilder(cfg)
    t0 = time.perf_counter()

    jobs = []   # (file, offset, kind, payload)
    for w in plan.weights:
        jobs.append((w, "param", None))
    for (layer, proj), ws in plan.experts.items():
        for e, w in ws.items():
            jobs.append((w, "expert", (layer, proj, e)))
    ngram: dict = {}
    for layer, parts in plan.shards.items():
        ordered = [parts[i] for i in sorted(parts)]
        scale = plan.ngram_scale.get(layer, (None, None))[1]
        reader, name = ordered[0].parts["weight"]
        if ngram_table == "host" and len(ordered) == 1 and hasattr(reader, "table_view"):
            ngram[layer] = reader.table_view(name)       # rows dequantized on demand from the packed blocks
        elif ngram_table == "host":
            ngram[layer] = NgramTableView(tuple(_stored(w, spec) for w in ordered), tuple(w.file for w in ordered),
                                          None if scale is None else np.array(scale).reshape(1))
        else:
            for i, w in enumerate(ordered):
                jobs.append((w, "shard", (layer, i)))
    first = lambda w: min(r.offset(n) for r, n in w.parts.values())
    jobs.sort(key=lambda j: (j[0].file, first(j[0])))
    total = sum(w.nbytes for w, _, _ in jobs)

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading", smoothing=0.1)

    fused: dict = {}      # (layer, "gate_up_proj" | "down_proj") -> [buffer, fbo, writes left]
    tables: dict = {}     # layer -> [device buffer, shards left]
    e_n, inter = cfg.num_experts, cfg.moe_intermediate_size
    for w, kind, info in jobs:
        value = _stored(w, spec)
        placed = None   # the device value that read this tensor's pages
        if kind == "param":
            path = w.target.path
            placed = builder.put(w.target.layer, path,
                                 to_device(value, dtype, online_fp8(path, quant), spec.block))
        elif kind == "expert":
            layer, proj, e = info
            key = (layer, "down_proj" if proj == "down_proj" else "gate_up_proj")
            if key not in fused:
                ws = plan.experts[(layer, proj)]
                rows = w.shape[-2] * (1 if proj == "down_proj" else 2)
                buf, fbo = _fused_expert_template(ws, e_n, rows, dtype, spec)
                fused[key] = [buf, fbo, e_n * (1 if proj == "down_proj" else 2)]
            slot = fused[key]
            row0 = inter if proj == "up_proj" else 0
            slot[0] = placed = _write_expert(slot[0], slot[1], value, e, row0)
            slot[2] -= 1
            if slot[2] == 0:
                buf = fused.pop(key)[0]
                if quant in ONLINE_QUANT and not q.is_quantized(buf):
                    buf = _quantize_fp8(buf, (128, 128))
                builder.put(layer, ("mlp", "experts", key[1]), buf)
        elif kind == "shard":
            layer, i = info
            parts = plan.shards[layer]
            if layer not in tables:
                rows = sum(p.shape[0] for p in parts.values())
                tables[layer] = [jnp.zeros((rows, w.shape[-1]), jnp.dtype(dtype)), len(parts)]
            x = _put(value)
            scale = plan.ngram_scale.get(layer, (None, None))[1]
            if scale is not None:   # FP8 rows as the reference reads them: row * scale in the scale's dtype
                s = jnp.asarray(np.array(scale).reshape(()))
                x = (x.astype(jnp.float32) * s.astype(jnp.float32)).astype(s.dtype)
            slot = tables[layer]
            slot[0] = placed = _write(slot[0], x, _starts(2, (i * w.shape[0],)))
            slot[1] -= 1
            if slot[1] == 0:
                builder.put(layer, NGRAM_PATH, tables.pop(layer)[0])
        # Transfers are asynchronous: wait until this tensor has been copied before dropping its pages, or the
        # copy would fault them back in (and queued copies would pile up in host memory).
        jax.block_until_ready(placed)
        w.release()
        if bar is not None:
            bar.update(w.nbytes)
    if bar is not None:
        bar.close()
    assert not fused and not tables, (list(fused), list(tables))

    mtp = {w.name: mtp_value(w, spec, quant, spec.block) for w in plan.mtp}
    params = builder.params()
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    return Loaded(cfg, params, mtp, ngram, {"bytes": total, "seconds": seconds})
