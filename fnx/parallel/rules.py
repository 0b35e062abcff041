"""Sharding rules as data: which axis of which leaf is split over which mesh axis.

`param_shardings(cfg, params, mesh)` / `state_shardings(cfg, state, mesh)` return pytrees of `NamedSharding` with
the structure of the params / state (scanned segments keep their leading reps axis unsplit; quantized leaves get
one spec per sub-array). A dimension that does not divide by its mesh axes is left whole (replicated) and named
by `notes()`: correctness never depends on the layout, only the collectives XLA inserts do.

The rules below are written for the logical weight (checkpoint layout [out, in], experts [E, ...]) of one layer.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fnx.config import ModelConfig
from fnx.model import quant
from fnx.model.transformer import layer_plan
from fnx.parallel.mesh import AXES, MeshConfig, as_mesh

TP, ALL = "tp", AXES          # ALL = ("ep", "tp"): experts, lm_head rows and n-gram rows use every device


def _ok(cfg: ModelConfig, mcfg: MeshConfig) -> dict:
    tp = mcfg.tp
    return {
        "qsa": cfg.num_attention_heads % tp == 0,
        "kv": cfg.num_key_value_heads % tp == 0,
        "gdn": cfg.linear_num_key_heads % tp == 0 and cfg.linear_num_value_heads % tp == 0,
    }


def notes(cfg: ModelConfig, mesh) -> list[str]:
    """What the mesh cannot split for this config, in words."""
    _, mcfg = as_mesh(mesh)
    ok, out = _ok(cfg, mcfg), []
    if not ok["kv"]:
        out.append(f"{cfg.num_key_value_heads} KV heads do not split over tp={mcfg.tp}: k_proj, v_proj and the "
                   f"K/V cache are replicated on every tp rank (each rank attends with its query heads to all KV "
                   f"heads)")
    if not ok["qsa"]:
        out.append(f"{cfg.num_attention_heads} attention heads do not split over tp={mcfg.tp}: QSA replicated")
    if not ok["gdn"]:
        out.append(f"GDN heads ({cfg.linear_num_key_heads} k / {cfg.linear_num_value_heads} v) do not split over "
                   f"tp={mcfg.tp}: GDN replicated")
    if cfg.num_experts % mcfg.size:
        out.append(f"{cfg.num_experts} experts do not split over ep*tp={mcfg.size}: experts replicated")
    if cfg.vocab_size % mcfg.size:
        out.append(f"vocab {cfg.vocab_size} does not split over {mcfg.size} devices: lm_head replicated")
    return out


def _layer_rule(names: tuple[str, ...], ok: dict, mcfg: MeshConfig) -> tuple:
    """Spec (one entry per logical dim) of a leaf inside one decoder layer, by its key path."""
    leaf = names[-1]
    if "linear_attn" in names:
        t = TP if ok["gdn"] else None
        # in_proj_qkv rows are [q; k; v]: a contiguous split gives rank 0 the q and k blocks (README: "GDN").
        return {"in_proj_qkv": (t, None), "in_proj_z": (t, None), "in_proj_b": (t, None), "in_proj_a": (t, None),
                "conv1d": (t, None), "dt_bias": (t,), "A_log": (t,), "out_proj": (None, t)}.get(leaf, ())
    if "indexer" in names:
        return ()                                    # 640 x D, shared by every head: replicated
    if "self_attn" in names:
        t, kv = (TP if ok["qsa"] else None), (TP if ok["qsa"] and ok["kv"] else None)
        # q_proj rows are [q_h; gate_h] per head, so a contiguous split keeps whole heads together
        return {"q_proj": (t, None), "o_proj": (None, t), "k_proj": (kv, None), "v_proj": (kv, None)}.get(leaf, ())
    if "experts" in names:
        return (ALL, None, None)
    if "shared_expert" in names:
        return {"gate_proj": (TP, None), "up_proj": (TP, None), "down_proj": (None, TP)}[leaf]
    if "ngram_embedding" in names:
        return (ALL, None) if mcfg.ngram == "rows" else ()
    if any(n.endswith("hyper_connection") or n == "hyper_connection_mixer" for n in names):
        if mcfg.hc == "sharded":
            return {"input_mix_weight_down": (None, TP), "input_mix_weight_up": (TP, None),
                    "block_inject_weight": (None, TP)}.get(leaf, ())
        return ()
    return ()                                        # router, norms, PLE projections, shared_expert_gate


def _fit(spec: tuple, shape: tuple, mesh) -> P:
    """Drop splits that do not divide; pad with None to the rank."""
    out = []
    for i, n in enumerate(shape):
        ax = spec[i] if i < len(spec) else None
        if ax is not None:
            size = int(np.prod([mesh.shape[a] for a in (ax if isinstance(ax, tuple) else (ax,))]))
            if size == 1 or n % size:
                ax = None
        out.append(ax)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _leaf_shardings(leaf, spec: tuple, lead: int, mesh):
    """NamedSharding(s) of one leaf: `lead` unsplit stacked axes, then the logical spec. A quantized leaf gets a
    pytree of shardings, each sub-array using the spec entries of the dims it shares with the weight."""
    def one(arr):
        return NamedSharding(mesh, _fit((None,) * lead + tuple(spec), tuple(arr.shape), mesh))
    return jax.tree.map(one, leaf) if quant.is_quantized(leaf) else one(leaf)


def _is_leaf(x):
    return quant.is_quantized(x) or hasattr(x, "shape")


def _names(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path)


def _walk(tree, rule, lead_of):
    return jax.tree_util.tree_map_with_path(lambda path, x: rule(_names(path), x, lead_of(_names(path))), tree,
                                            is_leaf=_is_leaf)


def _segment_lead(cfg):
    plan = layer_plan(cfg)
    return lambda names: 1 if names[0] == "segments" and plan[names[1]].scanned else 0


def param_shardings(cfg: ModelConfig, params, mesh, mcfg: MeshConfig | None = None):
    """NamedSharding pytree for the params (arrays, quantized leaves or ShapeDtypeStructs)."""
    mesh, mc = as_mesh(mesh)
    mcfg = mcfg or mc
    ok = _ok(cfg, mcfg)

    def rule(names, x, lead):
        if names[0] == "lm_head":
            spec = (ALL, None)
        elif names[0] == "embed_tokens":
            spec = ()                                # one row read per token: replicated (README)
        else:
            spec = _layer_rule(tuple(str(n) for n in names), ok, mcfg)
        return _leaf_shardings(x, spec, lead, mesh)
    return _walk(params, rule, _segment_lead(cfg))


def mtp_param_shardings(cfg: ModelConfig, mp, mesh, mcfg: MeshConfig | None = None):
    """The MTP layer's params (`fnx.model.mtp.mtp_params`): its decoder layer follows the QSA rules."""
    mesh, mc = as_mesh(mesh)
    mcfg = mcfg or mc
    ok = _ok(cfg, mcfg)
    return _walk(mp, lambda names, x, lead: _leaf_shardings(x, _layer_rule(tuple(map(str, names)), ok, mcfg), 0,
                                                            mesh), lambda names: 0)


def _state_rule(names, ok):
    leaf = names[-1]
    if leaf == "conv":                               # [B, K-1, conv_dim], channels as in_proj_qkv rows
        return (None, None, TP if ok["gdn"] else None)
    if leaf == "rec":                                # [B, Hv, dk, dv]
        return (None, TP if ok["gdn"] else None)
    if leaf in ("k", "v"):                           # [B, Hkv, T, hd]
        return (None, TP if ok["qsa"] and ok["kv"] else None)
    return ()                                        # positions, n-gram context, indexer keys, PLE conv


def state_shardings(cfg: ModelConfig, state, mesh, mcfg: MeshConfig | None = None):
    """NamedSharding pytree for a decode state (`init_state`) or an MTP state (`init_mtp_state`)."""
    mesh, mc = as_mesh(mesh)
    ok = _ok(cfg, mcfg or mc)
    return _walk(state, lambda names, x, lead: _leaf_shardings(x, _state_rule(names, ok), lead, mesh),
                 _segment_lead(cfg))


def replicated(mesh, tree):
    mesh, _ = as_mesh(mesh)
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def place(tree, shardings):
    """Put every leaf of `tree` on the device(s) its sharding names. Works across processes: each process
    supplies the shards of its own devices from the full host value (every process holds the same values)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def put(x, s):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])
    return jax.tree.map(put, tree, shardings)
