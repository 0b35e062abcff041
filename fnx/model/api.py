"""The user-facing model object and the calls around the jitted step: `load`, `forward`, `new_state`, `extend`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from fnx.config import ModelConfig
from fnx.model.transformer import init_state, step
from fnx.ple import NgramConstants, ngram_ids


@dataclass
class Model:
    """A loaded model: config, params pytree, the raw MTP tensors, and (when the checkpoint has them) its
    tokenizer and generation config."""
    cfg: ModelConfig
    params: dict
    mtp: dict = field(default_factory=dict, repr=False)
    path: str | None = None
    tokenizer: object = field(default=None, repr=False)
    generation_config: dict = field(default_factory=dict, repr=False)
    ple_store: object = field(default=None, repr=False)   # a fnx.ple RowStore when the n-gram table stays off
                                                          # the device (params then hold no table)
    ple_device_store: object = field(default=None, repr=False)   # ple_store "uva" / "ring": the store whose handle
                                                                 # the params hold (kept open with the model)

    @property
    def dtype(self):
        return self.params["embed_tokens"].dtype

    def num_parameters(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params, is_leaf=_is_quant))

    def formats(self) -> dict[str, int]:
        """Parameter count per storage format (dtype or quantized type)."""
        out: dict[str, int] = {}
        for leaf in jax.tree.leaves(self.params, is_leaf=_is_quant):
            name = type(leaf).__name__ if _is_quant(leaf) else str(leaf.dtype)
            out[name] = out.get(name, 0) + int(np.prod(leaf.shape))
        return out

    def memory_per_device(self) -> dict[str, float]:
        """GB of params held on each device."""
        out: dict[str, float] = {}
        for leaf in jax.tree.leaves(self.params):
            for shard in getattr(leaf, "addressable_shards", []):
                key = str(shard.device)
                out[key] = out.get(key, 0.0) + shard.data.nbytes / 1e9
        return out

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Stop ids: the config's eos plus the generation config's."""
        ids = set()
        for src in (self.cfg.eos_token_id, self.generation_config.get("eos_token_id")):
            if src is None:
                continue
            ids |= set(src) if isinstance(src, (list, tuple)) else {src}
        return tuple(sorted(int(i) for i in ids))

    def __repr__(self):
        fmts = ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in self.formats().items())
        mem = ", ".join(f"{k}: {v:.3f} GB" for k, v in self.memory_per_device().items())
        return (f"fnx.Model({self.cfg.summary()}\n  params: {self.num_parameters() / 1e6:.2f}M ({fmts})"
                f"\n  memory: {mem or 'n/a'}\n  tokenizer: {'yes' if self.tokenizer else 'none'}; "
                f"MTP: {'yes' if self.mtp else 'none'}; from {self.path})")

    @property
    def ngram(self) -> NgramConstants | None:
        if not self.cfg.ple_layer_ids:
            return None
        if "_ngram" not in self.__dict__:
            self.__dict__["_ngram"] = NgramConstants.from_config(self.cfg, 0)
        return self.__dict__["_ngram"]


LAYOUTS = ("auto", "unrolled", "scanned", "stacked")


def load(path: str | os.PathLike, dtype=None, progress: bool = False, quant: str | None = None,
         ple_store: str = "device", ple_options: dict | None = None, scan_layers: bool | None = None,
         layers: str = "auto") -> Model:
    """Read a checkpoint into an `fnx.Model`: an HF directory (config.json + safetensors; BF16, FP8 block or
    NVFP4, streamed onto the device; `quant="fp8"` quantizes the dense projections and experts while loading,
    `quant="fp8-head"` the lm_head too) or a directory
    written by `fnx convert` (restored as converted). dtype defaults to bfloat16 for HF checkpoints and to the
    converted dtype for converted ones.

    ple_store: where the PLE n-gram table lives. "device" (default) puts it in the params, in device memory.
    "pinned", "pageable", "swap" or "direct" keep it on the host (`fnx.ple.open_store`: read-only mmap of the
    checkpoint's own shards, anonymous swappable memory, pinned memory or O_DIRECT reads); the params then hold
    no table and every step's rows are fetched on the host from the ids of its tokens (`Engine`, `extend`).
    "uva" keeps it in pinned host memory and puts a handle in the params instead of the table: each step gathers
    its rows on the GPU from that memory (`fnx.pallas.uva_gather`), so the model runs as with the table in the
    params (overlapped engine, jitted generate) with the table off the device. "ring" keeps the table in a host
    mode (pageable by default: evictable) and puts a ring's handle in the params: each step hands its row ids to
    a host thread through page-locked memory and reads the rows back at the PLE layer (`fnx.ple.ring`). Both need
    a CUDA GPU (on the CPU only `ple_options={"emulate": True}` for tests) and the PLE layer outside a scanned
    group.
    ple_options go to `open_store` (policy, deadline_s, io_threads, ...).

    layers: the params layout (as `fnx.serve --layers`).
    - "unrolled": every layer's params separate, every layer unrolled in every program (longer compiles).
    - "scanned": identical layer groups stacked [groups, ...] and run under lax.scan (the shortest compiles; on a
      GPU the loop copies the weights each kernel reads out of the stacks every step, so the MoE kernels stay off:
      see fnx.pallas.dispatch.in_scanned_layers).
    - "stacked": the scanned params, every layer run unrolled, the kernels reading each layer's slice of the
      stacks in place (`ModelConfig.unroll_stacked`). A step takes about a sixth of the unrolled layout's
      argument arrays; on the H200 (48 layers, 8K context) a decode step took 6.02 ms chained against 9.56 ms
      unrolled, an MTP k=4 round 21.4 ms against 31.3 ms (BENCHMARKS.md, fifteenth session).
    - "auto" (default): stacked on an accelerator, scanned on the CPU. An fnx-converted checkpoint is restored in
      its saved layout (a scanned one runs stacked on an accelerator).
    scan_layers (older spelling): True is "scanned", False "unrolled"; it may not contradict `layers`."""
    from fnx.checkpoint import load_any
    from fnx.checkpoint.orbax_io import is_converted
    from fnx.ple.store import MODES
    if layers not in LAYOUTS:
        raise ValueError(f"layers must be one of {LAYOUTS}, got {layers!r}")
    if scan_layers is not None:
        named = "scanned" if scan_layers else "unrolled"
        if layers not in ("auto", named):
            raise ValueError(f"scan_layers={scan_layers} contradicts layers={layers!r}")
        layers = named
    if layers == "auto":
        layers = "scanned" if jax.default_backend() == "cpu" else "stacked"
        scan_layers = None if is_converted(path) else True      # a converted tree keeps its saved layout
    else:
        scan_layers = layers != "unrolled"
    if ple_store not in MODES:
        raise ValueError(f"ple_store must be one of {MODES}, got {ple_store!r}")
    host = ple_store not in ("device", "uva", "ring")
    if ple_options and ple_store == "device":
        raise ValueError("ple_options apply to a host ple_store (pinned, pageable, swap, direct), not 'device'")
    out = load_any(path, dtype=dtype, quant=quant, progress=progress,
                   ngram_table="device" if ple_store == "device" else "host", scan_layers=scan_layers)
    cfg = out.cfg
    if layers == "stacked" and cfg.scan_layers:
        cfg = cfg.replace(unroll_stacked=True)
    store = None
    if host:
        if not out.cfg.ple_layer_ids:
            raise ValueError(f"ple_store={ple_store!r}: {path} has no PLE layer (no n-gram table to keep)")
        from fnx.ple.store import open_store
        store = open_store(path, ple_store, cfg=out.cfg, **(ple_options or {}))
    params, uva = out.params, None
    if ple_store in ("uva", "ring"):
        if not out.cfg.ple_layer_ids:
            raise ValueError(f"ple_store={ple_store!r}: {path} has no PLE layer (no n-gram table to keep)")
        from fnx.pallas.dispatch import why_unavailable
        from fnx.ple.store import open_store
        why = why_unavailable("pallas")
        if why and not (ple_options or {}).get("emulate"):
            raise ValueError(f"ple_store={ple_store!r} reaches host memory from CUDA kernels, which cannot run here "
                             f"({why}); use 'device', 'pinned' or 'pageable'")
        uva = open_store(path, ple_store, cfg=out.cfg, **(ple_options or {}))
        params = _with_table(cfg, params, uva.table)
    tokenizer, gen_cfg = None, {}
    d = os.fspath(path)
    if os.path.isdir(d):
        if os.path.exists(os.path.join(d, "tokenizer.json")):
            from fnx.tokenizer import Tokenizer
            tokenizer = Tokenizer(d)
        gpath = os.path.join(d, "generation_config.json")
        if os.path.exists(gpath):
            import json
            with open(gpath, encoding="utf-8") as f:
                gen_cfg = json.load(f)
    return Model(cfg, params, out.mtp, d, tokenizer, gen_cfg, store, uva)


def _with_table(cfg: ModelConfig, params: dict, table) -> dict:
    """params with `table` (a `fnx.ple.store.UvaTable`) as the PLE layer's n-gram table; the PLE layer must be a
    segment of its own (not stacked in a scanned group, where a leaf is one slice of a stacked array)."""
    from fnx.model.transformer import layer_plan
    layer = cfg.ple_layers[0]
    segs = list(params["segments"])
    for i, seg in enumerate(layer_plan(cfg)):
        if seg.start <= layer < seg.start + seg.reps * seg.period:
            if seg.scanned:
                raise NotImplementedError("ple_store 'uva' / 'ring' with the PLE layer inside a scanned layer group: "
                                          "its params are slices of stacked arrays; load with layers='unrolled'")
            p = dict(segs[i][0])
            p["ple"] = dict(p["ple"])
            p["ple"]["ple_embedding"] = dict(p["ple"].get("ple_embedding", {}), ngram_embedding=table)
            segs[i] = (p,) + tuple(segs[i][1:])
            return {**params, "segments": type(params["segments"])(segs)}
    raise AssertionError(f"no segment holds the PLE layer {layer}")


def _is_quant(x) -> bool:
    return type(x).__name__ in ("Fp8Block", "Nvfp4")


def ple_split(ple):
    """A step's PLE input as (ple_ids, ple_rows): int32 n-gram ids [B, L, heads] for a table in the params, or
    rows [B, L, embed] already fetched from a host store (decided by dtype, at trace time)."""
    if ple is None or jnp.issubdtype(ple.dtype, jnp.integer):
        return ple, None
    return None, ple


def ple_input(model: Model, ids: np.ndarray | None):
    """ids [B, L, heads] -> (what a step takes, missing), as NumPy. The input is the ids themselves (int32) for a
    table in the params, or, with a host store, the rows fetched now [B, L, heads * width]. missing: None, or bool [B] for
    the sequences some of whose rows could not be read (zero-filled: past the fetch deadline, or unreadable
    pages); the caller decides per the store's policy (the Engine ends those requests under "fail", `extend`
    raises). The store's own pending error is consumed here (under "degrade" it is logged once)."""
    if ids is None:
        return None, None
    store = model.ple_store
    if store is None:   # NumPy: a jitted step copies it in with its call (no eager conversion dispatched first)
        return ids.astype(np.int32), None
    b, length, heads = ids.shape
    got = store.fetch(ids.reshape(b * length, heads), surface=False)
    missing = None
    if got.missing.any():
        missing = got.missing.reshape(b, length).any(axis=1)
        store.consume_pending()    # consumed: this call's caller handles the failure, not the next fetch
    return got.rows.reshape(b, length, -1), missing


@partial(jax.jit, static_argnames=("cfg", "moe_impl"), donate_argnames=("state",))
def _jit_step(params, state, tokens, ple, cfg, moe_impl="auto"):
    ids, rows = ple_split(ple)
    return step(params, state, tokens, ids, cfg=cfg, moe_impl=moe_impl, ple_rows=rows)


def new_state(model: Model, batch: int, capacity: int) -> dict:
    """Empty decode state for `batch` sequences of up to `capacity` tokens."""
    return init_state(model.cfg, batch, capacity, model.dtype)


def _check_tokens(model: Model, tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers shaped [batch, tokens], got {tokens.dtype} {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= model.cfg.vocab_size):
        raise ValueError(f"token ids must lie in [0, {model.cfg.vocab_size}), got range "
                         f"[{tokens.min()}, {tokens.max()}]")
    return tokens.astype(np.int32)


# Tokens per call of `extend` (and so `forward`): longer inputs run in chunks of this many, one after another on the
# state. At the released widths one 8,192-token call of the 48-layer model asked the H200 for a single 35 GiB buffer
# (the MoE's experts for every token at once) and failed, where 2,048-token chunks ran (BENCHMARKS.md, fourteenth
# H200 session). The engine prefills the same way (`prefill_chunk`).
PREFILL_CHUNK = 2048


def extend(model: Model, state: dict, token_ids, moe_impl: str = "auto", return_hidden: bool = False,
           chunk: int | None = PREFILL_CHUNK):
    """Run new tokens [B, L] on `state` (consumed). Returns (logits [B, L, V], new state[, pre-mixer hidden]).

    More than `chunk` tokens run as chunks of `chunk` (the last one shorter) through the same step, one after
    another: the same logits and state as one call, with one chunk's activations in memory at a time. Each distinct
    chunk length compiles once. chunk=None runs the whole input in one call. The n-gram ids (and a host store's
    rows) of the whole input are computed first, so a PLE failure under the "fail" policy leaves the state as it
    was."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive number of tokens or None, got {chunk!r}")
    tokens = _check_tokens(model, token_ids)
    pos = np.asarray(state["pos"])
    capacity = _capacity(state)
    if capacity is not None and int(pos.max()) + tokens.shape[1] > capacity:
        raise ValueError(f"state holds {capacity} tokens; {int(pos.max())} used, {tokens.shape[1]} more requested")
    ple = None
    if model.ngram is not None:
        ids, _ = ngram_ids(np.asarray(state["ngram_ctx"]).astype(np.int64), tokens, model.ngram)
        ple, missing = ple_input(model, ids)
        if missing is not None and model.ple_store.policy == "fail":   # before the state is consumed
            from fnx.ple.store import PleFetchError
            raise PleFetchError(f"PLE rows of {int(missing.sum())} sequence(s) could not be read "
                                f"({model.ple_store.last_error}); the state is unchanged")
    n = tokens.shape[1]
    bounds = [(0, n)] if chunk is None or n <= chunk else [(a, min(n, a + chunk)) for a in range(0, n, chunk)]
    logits, hidden = [], []
    for a, b in bounds:
        part = ple if ple is None or len(bounds) == 1 else ple[:, a:b]
        lg, state, hd, _ = _jit_step(model.params, state, jnp.asarray(tokens[:, a:b]), part, model.cfg, moe_impl)
        logits.append(lg)
        hidden.append(hd)
    logits = logits[0] if len(logits) == 1 else jnp.concatenate(logits, axis=1)
    if not return_hidden:
        return logits, state
    return logits, state, hidden[0] if len(hidden) == 1 else jnp.concatenate(hidden, axis=1)


def _capacity(state: dict) -> int | None:
    for seg in state["segments"]:
        for st in seg:
            if "k" in st:
                return st["k"].shape[-2]
    return None


def forward(model: Model, token_ids, moe_impl: str = "auto", return_layers: bool = False,
            chunk: int | None = PREFILL_CHUNK):
    """Logits [B, T, V] for whole sequences from a fresh state, in calls of up to `chunk` tokens (see `extend`).

    With `return_layers`, also a dict: "hidden" [layers, B, T, S*D] (every layer's output, all hyper-connection
    streams), "experts" [layers, B, T, K] (routed expert ids) and "final" [B, T, S*D] (the pre-mixer hidden).

        logits = fnx.forward(model, [[1, 2, 3]])                    # [1, 3, vocab]
        logits, layers = fnx.forward(model, ids, return_layers=True)
    """
    tokens = _check_tokens(model, token_ids)
    if not return_layers:
        state = new_state(model, tokens.shape[0], tokens.shape[1])
        logits, _ = extend(model, state, tokens, moe_impl, chunk=chunk)
        return logits
    logits, hidden, aux = _jit_collect(model.params, jnp.asarray(tokens), _device_tables(model), model.cfg, moe_impl)
    return logits, {"hidden": aux["hidden"], "experts": aux["experts"], "final": hidden}


def require_device_table(model: Model, what: str) -> None:
    """Paths that compute n-gram ids inside a jitted program gather from the table in the params; a model whose
    table lives in a host store cannot take them."""
    if model.ple_store is not None:
        raise NotImplementedError(
            f"{what} computes the PLE n-gram ids on the device and gathers rows from a table in the params, but "
            f"this model keeps its table in a host store (ple_store={model.ple_store.mode!r}). Load it with "
            "ple_store='device', or use fnx.extend / the Engine, which fetch rows from the host store.")


def _device_tables(model: Model):
    from fnx.model.ngram_device import NgramDeviceTables
    require_device_table(model, "this function")
    return NgramDeviceTables.build(model.ngram) if model.ngram is not None else None


def logits_fn(model: Model, moe_impl: str = "auto"):
    """A pure function `f(params, token_ids [B, T]) -> logits [B, T, V]` from a fresh state, with the PLE n-gram
    ids computed on the device: it composes with `jax.jit`, `jax.grad` (float32 params) and `jax.vmap`.

        loss = lambda p: -jax.nn.log_softmax(fnx.model.logits_fn(model)(p, ids))[0, -1, target]
        grads = jax.grad(loss)(model.params)
    """
    cfg, tables = model.cfg, _device_tables(model)

    def f(params, tokens):
        return _forward_pure(params, tokens, tables, cfg, moe_impl, False)[0]
    return f


def _forward_pure(params, tokens, tables, cfg, moe_impl, collect):
    from fnx.model.ngram_device import ngram_ids_device
    bsz, length = tokens.shape
    state = init_state(cfg, bsz, length, params["embed_tokens"].dtype)
    ids = ngram_ids_device(state["ngram_ctx"], tokens, tables) if tables is not None else None
    logits, _, hidden, aux = step(params, state, tokens, ids, cfg=cfg, moe_impl=moe_impl, collect=collect)
    return logits, hidden, aux


@partial(jax.jit, static_argnames=("cfg", "moe_impl"))
def _jit_collect(params, tokens, tables, cfg, moe_impl):
    return _forward_pure(params, tokens, tables, cfg, moe_impl, True)
