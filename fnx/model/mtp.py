"""The MTP draft layer (MODEL_SPEC.md section 10): one QSA + MoE decoder layer fed with the target's pre-mixer
multi-stream hidden H_t and the embedding of the next token x_{t+1}, predicting x_{t+2}.

    e   = fc_embedding(RMSNorm0c(embed(x_{t+1})))          one RMS over D
    Hn  = RMSNorm0c(H_t)                                    one RMS over all S*D values
    X_j = fc_hidden(Hn_j) + e                               every stream
    H'  = DecoderLayer(X);  logits = lm_head(mixer(H'))

Draft slot t pairs H_t with x_{t+1} at position t. The layer keeps its own QSA state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fnx.config import INDEXED, ModelConfig
from fnx.model import hyper, quant
from fnx.model.ops import linear, rms_norm
from fnx.model.transformer import _hc_shapes, _layer_state, decoder_layer, layer_param_shapes, make_meta

MTP_TOP = ("fc_embedding", "fc_hidden", "pre_fc_norm_embedding", "pre_fc_norm_hidden")


class MtpError(ValueError):
    pass


def mtp_param_shapes(cfg: ModelConfig) -> dict:
    d, sd = cfg.hidden_size, cfg.hc_dim
    qsa_index = cfg.layer_types.index(INDEXED)
    layer = layer_param_shapes(cfg, qsa_index)
    layer.pop("ple", None)
    return {"fc_embedding": (d, d), "fc_hidden": (d, d), "pre_fc_norm_embedding": (d,),
            "pre_fc_norm_hidden": (sd,), "hyper_connection_mixer": _hc_shapes(cfg, inject=False),
            "layer": layer}


def _leaf(name: str, value, shape: tuple, dtype):
    """One MTP weight as a device leaf: a dense array cast to `dtype`; a quantized weight (FP8 blocks from an FP8 /
    NVFP4 release or the online quantization, NVFP4) kept in its format, its arrays on the device. Either must
    have the config's shape."""
    got = tuple(getattr(value, "shape", ()))
    if got != tuple(shape):
        raise MtpError(f"{name} has shape {got}, the config expects {tuple(shape)}")
    if quant.is_quantized(value):
        return jax.tree.map(jnp.asarray, value)
    if isinstance(value, jax.Array):
        return value.astype(jnp.dtype(dtype))
    return jnp.asarray(np.asarray(value).astype(np.dtype(jnp.dtype(dtype))))


def mtp_params(cfg: ModelConfig, raw: dict, dtype) -> dict:
    """The `mtp.*` tensors (raw HF names -> host arrays or quantized weights, as `fnx.load` keeps them) as a params
    tree. A tree already in that layout (a nested dict of arrays, e.g. random weights for a benchmark) is checked
    leaf by leaf against the config's shapes. Dense weights are cast to `dtype`; quantized ones keep their format."""
    from fnx.checkpoint.hf import translate
    if not raw:
        raise MtpError("this checkpoint has no mtp.* tensors: speculative decoding with the MTP layer needs them")
    want = mtp_param_shapes(cfg)
    if not any(isinstance(k, str) and k.startswith("mtp.") for k in raw):
        return _checked_tree(want, raw, dtype)
    tree: dict = {}
    extra = []
    for name, arr in raw.items():
        inner = name[len("mtp."):]
        if inner == "hyper_connection_mixer.block_inject_weight.weight":
            continue  # unused by the mixer (no injection)
        t = translate(inner)
        if t.kind != "param":
            extra.append(name)
            continue
        path = t.path if t.layer is None else ("layer",) + t.path
        if t.layer not in (None, 0):
            extra.append(name)
            continue
        node = want
        for p in path:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, tuple):
            extra.append(name)
            continue
        cur = tree
        for p in path[:-1]:
            cur = cur.setdefault(p, {})
        cur[path[-1]] = _leaf(name, arr, node, dtype)
    if extra:
        raise MtpError(f"unexpected mtp tensors: {sorted(extra)[:10]}")
    missing = []

    def walk(w, t, prefix):
        for k, v in w.items():
            if isinstance(v, dict):
                walk(v, t.get(k, {}) if isinstance(t, dict) else {}, prefix + (k,))
            elif k not in t:
                missing.append(".".join(prefix + (k,)))
    walk(want, tree, ())
    if missing:
        raise MtpError(f"missing mtp tensors: {missing[:10]}")
    return tree


def _checked_tree(want: dict, tree: dict, dtype, prefix: str = "") -> dict:
    """`tree` with every leaf of `want` (shapes) present at its shape, cast to dtype; no other leaves."""
    if not isinstance(tree, dict):
        raise MtpError(f"mtp params{prefix or ''}: expected a dict of tensors, got {type(tree).__name__}")
    extra = sorted(set(tree) - set(want))
    if extra:
        raise MtpError(f"unexpected mtp tensors: {[prefix + '.' + str(k) if prefix else k for k in extra][:10]}")
    out = {}
    for k, shape in want.items():
        name = f"{prefix}.{k}" if prefix else k
        if k not in tree:
            raise MtpError(f"missing mtp tensors: [{name!r}]")
        if isinstance(shape, dict):
            out[k] = _checked_tree(shape, tree[k], dtype, name)
            continue
        out[k] = _leaf(name, tree[k], shape, dtype)
    return out


def init_mtp_state(cfg: ModelConfig, batch: int, capacity: int, dtype) -> dict:
    qsa_index = cfg.layer_types.index(INDEXED)
    st = _layer_state(cfg, qsa_index, batch, capacity, dtype)
    st.pop("ple_conv", None)
    return {"pos": jnp.zeros((batch,), jnp.int32), "layer": st}


def mtp_step(params: dict, mp: dict, state: dict, hidden: jax.Array, next_tokens: jax.Array, *, cfg: ModelConfig,
             n_valid: jax.Array | None = None, moe_impl: str = "auto", head: jax.Array | None = None,
             head_fn=None, at: jax.Array | None = None):
    """hidden [B, L, S*D] (target pre-mixer hidden at positions pos..pos+L-1, or the layer's own output when
    chaining drafts), next_tokens [B, L] (x_{t+1}); head: the draft head's rows (default the full lm_head; a
    hot-token subset [H, D] gives logits over that subset only); head_fn(out, rows) replaces the head's matmul
    (e.g. a fused greedy argmax); at [B] (int): the head runs on row b's position at[b] only (the drafter's
    catch-up needs the last valid position's logits, not L rows of them), and the logits are [B, 1, V].
    Returns (logits [B, L, V] or head_fn's result, new state, H' [B, L, S*D])."""
    bsz, length = next_tokens.shape
    dtype = params["embed_tokens"].dtype
    eps = cfg.rms_norm_eps
    meta = make_meta(cfg, state["pos"], length, dtype, n_valid, gdn=False)    # (no GDN layer in the MTP layer)
    e = params["embed_tokens"][next_tokens]
    from fnx.pallas import grid_sync
    with grid_sync.counter_pool(meta["counters"]):      # the program's counters (`transformer.counter_pool`)
        e = linear(rms_norm(e, mp["pre_fc_norm_embedding"], eps), mp["fc_embedding"])
        hn = rms_norm(hidden.astype(dtype), mp["pre_fc_norm_hidden"], eps)
        streams = hn.reshape(bsz, length, cfg.hc_count, cfg.hidden_size)
        x = (linear(streams, mp["fc_hidden"]) + e[:, :, None, :]).reshape(bsz, length, cfg.hc_dim)
        h, st, _, _ = decoder_layer(cfg, INDEXED, False, mp["layer"], state["layer"], x, meta, moe_impl)
        out = hyper.gated_residual(mp["hyper_connection_mixer"], h, cfg.hc_count, eps, inject=False)
    if at is not None:
        out = jnp.take_along_axis(out, at.astype(jnp.int32).reshape(bsz, 1, 1), axis=1)      # [B, 1, D]
    rows = params["lm_head"] if head is None else head
    logits = linear(out, rows) if head_fn is None else head_fn(out, rows)
    return logits, {"pos": state["pos"] + meta["n_valid"], "layer": st}, h
