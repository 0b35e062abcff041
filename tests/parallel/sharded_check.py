"""Run in a subprocess with forced host devices (the test process may already have initialised jax):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/parallel/sharded_check.py CKPT MODE [MESH ...]
Prints one JSON line per check. MODE: forward | generate | collectives."""

from __future__ import annotations

import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import fnx
from fnx import parallel
from fnx.model.api import extend, new_state


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def tokens(cfg, batch, length, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, cfg.vocab_size, size=(batch, length))
    ids[:, length // 3] = cfg.ple_eos_token_id
    return ids


def run_forward(model, mesh_text, ids):
    """Prefill (past the indexer budget, so the sparse path runs), then 2 decode steps: logits of all three."""
    cfg = model.cfg
    mesh, mcfg = parallel.as_mesh(mesh_text)
    m = parallel.shard_model(model, mesh)
    ep = parallel.ExpertParallel(mesh)
    state = parallel.shard_state(cfg, new_state(model, ids.shape[0], ids.shape[1] + 2), mesh)
    outs = []
    lg, state = extend(m, state, ids, moe_impl=ep)
    outs.append(np.asarray(lg))
    for j in range(1):
        nxt = np.argmax(outs[-1][:, -1], -1)[:, None]
        lg, state = extend(m, state, nxt, moe_impl=ep)
        outs.append(np.asarray(lg))
    return outs, m, state


def spec_of(x):
    return str(getattr(x.sharding, "spec", None))


def main():
    ckpt, mode, meshes = sys.argv[1], sys.argv[2], sys.argv[3:]
    model = fnx.load(ckpt, dtype=np.float32)
    cfg = model.cfg
    if mode == "forward":
        ids = tokens(cfg, 2, 2 * cfg.indexer_budget + 3)
        ref, _, _ = run_forward(model, "tp=1,ep=1", ids)
        for text in meshes:
            outs, m, state = run_forward(model, text, ids)
            seg = m.params["segments"]
            scanned = next(s for s in seg if s[0]["mlp"]["experts"]["down_proj"].ndim == 4)
            qsa = next(l for s in seg for l in s if "self_attn" in l)
            gdn = next(l for s in seg for l in s if "linear_attn" in l)
            gst = next(st for s in state["segments"] for st in s if "rec" in st)
            qst = next(st for s in state["segments"] for st in s if "k" in st)
            shard_shape = lambda a: list(a.addressable_shards[0].data.shape)  # noqa: E731
            print(json.dumps({
                "mesh": text, "rel_err": [rel(o, r) for o, r in zip(outs, ref)],
                "argmax_equal": all(bool((o.argmax(-1) == r.argmax(-1)).all()) for o, r in zip(outs, ref)),
                "spec": {"experts_scanned": spec_of(scanned[0]["mlp"]["experts"]["down_proj"]),
                         "lm_head": spec_of(m.params["lm_head"]), "q_proj": spec_of(qsa["self_attn"]["q_proj"]),
                         "k_proj": spec_of(qsa["self_attn"]["k_proj"]),
                         "in_proj_qkv": spec_of(gdn["linear_attn"]["in_proj_qkv"]),
                         "out_proj": spec_of(gdn["linear_attn"]["out_proj"]),
                         "rec": spec_of(gst["rec"]), "kv_cache": spec_of(qst["k"])},
                "shard_shape": {"experts_scanned": shard_shape(scanned[0]["mlp"]["experts"]["down_proj"]),
                                "lm_head": shard_shape(m.params["lm_head"]),
                                "in_proj_z": shard_shape(gdn["linear_attn"]["in_proj_z"])},
                "notes": parallel.notes(cfg, text)}), flush=True)
    elif mode == "generate":
        from fnx.engine.engine import Engine
        prompts = [list(map(int, tokens(cfg, 1, 11, 1)[0])), list(map(int, tokens(cfg, 1, 2 * cfg.indexer_budget + 1, 2)[0]))]
        for spec in (0, 2):
            ref = fnx.generate(model, prompts, 8, speculative=spec or None)
            for text in meshes:
                eng = Engine(model, max_slots=2, capacity=64, speculative=spec or None, mesh=text)
                out = fnx.generate(model, prompts, 8, engine=eng)
                print(json.dumps({"mesh": text, "speculative": spec, "equal": out == ref, "out": out, "ref": ref,
                                  "state_layout_kept": all(
                                      a.sharding.is_equivalent_to(b, a.ndim) for a, b in zip(
                                          jax.tree.leaves(eng.state),
                                          jax.tree.leaves(parallel.state_shardings(cfg, eng.state, eng.mesh))))}),
                      flush=True)
    elif mode == "collectives":
        from fnx.model.transformer import step
        for text in meshes:
            mesh, _ = parallel.as_mesh(text)
            m = parallel.shard_model(model, mesh)
            state = parallel.shard_state(cfg, new_state(model, 1, 64), mesh)
            ids = jnp.zeros((1, 1, cfg.ngram_heads), jnp.int32)
            f = jax.jit(lambda p, s, t, i: step(p, s, t, i, cfg=cfg, moe_impl=parallel.ExpertParallel(mesh))[0])
            hlo = f.lower(m.params, state, jnp.zeros((1, 1), jnp.int32), ids).compile().as_text()
            kinds = {}
            for line in hlo.splitlines():
                mm = re.search(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\(", line)
                if mm:
                    kinds[mm.group(1)] = kinds.get(mm.group(1), 0) + 1
            print(json.dumps({"mesh": text, "collectives": kinds}), flush=True)


if __name__ == "__main__":
    main()
