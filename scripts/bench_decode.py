"""Decode benchmark: a randomly initialised Flash-Next (weights generated on the device) at any layer count, at
the released widths by default. Reports ms per decode step (M = 1), ms per MTP k round (draft + verify +
rollback), prefill tokens/s at several contexts, GPU memory, and each time against the bandwidth floor computed
from the actual parameter tree. decode_ms waits for each step's logits (a host round trip per step, as the
engine does today); decode_chained_ms keeps 32 steps in flight, each step's state feeding the next on the device
(the device time once the host launch overlaps it). Positions advance through the timed calls (no per-call
rewind, which would add a jitted op of host time to every step). The MTP round runs the greedy programs. One JSON object per run goes to benchmarks/results/bench_decode.jsonl.

BF16 experts of all 48 layers (241 GB) exceed one H200, so the default keeps the released widths and expert count
with fewer layers (6 GDN + 2 QSA, the PLE layer among them, plus the MTP layer) and extrapolates per layer:
    t_48 = t_fixed + 48 * t_layer, from runs at two layer counts (--layers 4,8). Layers 4-8 run unrolled, the
    48-layer model scans 11 of its 12 groups: --layers 4,12 includes a scanned group (or --no-scan unrolls all).

    python scripts/bench_decode.py [--layers 4,8] [--contexts 1024,8192] [--k 4] [--quick]
    python scripts/bench_decode.py --tiny      # a tiny config: checks the script on the CPU
    python scripts/bench_decode.py --ple-store pageable [--ple-table-gb 51.2]   # PLE rows from a host store:
        the difference to the default (device) run is the PLE cost per step / round, end to end
    python scripts/bench_decode.py --mesh tp=1,ep=1 --mesh tp=2,ep=1 --mesh tp=1,ep=2   # several devices
        (fnx.parallel; one run per mesh, scaling efficiency against the first; NCCL_NVLS_ENABLE=0 on GPUs)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from fnx.config import ModelConfig
from fnx.engine.engine import (HostCopies, _jit_draft, _jit_io_put, _jit_spec_inputs, _jit_spec_round, _jit_verify,
                               _jit_verify_window, draft_head, pack_host)
from fnx.engine.sampling import SamplingArrays, SamplingParams, row_keys
from fnx.model.mtp import init_mtp_state, mtp_param_shapes
from fnx.pallas.bench import fnx_settings
from fnx.model.transformer import init_state, param_shapes, step

PEAK_BW = 4.3e12  # bytes/s: the best device copy measured on the H200 (GPU_NOTES.md); vendor peak is 4.8e12


def bench_config(layers: int, tiny: bool, scan: bool = True, ple_width: int | None = None) -> ModelConfig:
    """ple_width: the PLE input width of the tiny config (a host store's rows are as wide as the release's)."""
    if tiny:
        return ModelConfig(scan_layers=scan, vocab_size=512, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25, mrope_section=(2, 1, 1),
                           linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                           linear_value_head_dim=16, num_experts=16, num_experts_per_tok=4,
                           moe_intermediate_size=32, shared_expert_intermediate_size=32, hc_lowrank=16,
                           indexer_n_heads=4, indexer_head_dim=16, indexer_budget=64, ple_embed_dim=ple_width or 64,
                           ngram_vocab_size_base=1000, eos_token_id=511, mtp_num_hidden_layers=1)
    # released widths; the n-gram table shrunk (2M rows per head instead of 20M): a decode step reads 16 rows
    return ModelConfig(num_hidden_layers=layers, ngram_vocab_size_base=2_000_000, mtp_num_hidden_layers=1,
                       scan_layers=scan)


def random_tree(shapes, key, dtype, shardings=None, quant: str = "bf16"):
    """Random leaves generated where they live (on the mesh, already split, when shardings are given). With
    `quant`, each leaf is quantized as soon as it is drawn (`quantize_leaf`), so the bf16 tree never exists whole:
    48 layers of bf16 experts (241 GB) do not fit one H200, their FP8 / NVFP4 forms do."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    shs = jax.tree.leaves(shardings) if shardings is not None else [None] * len(leaves)

    makers = {}

    def make(k, shape, sh):
        """One compiled generator per (shape, sharding): a 48-layer tree has ~1,000 leaves of ~40 shapes."""
        key_ = (shape, sh)
        if key_ not in makers:
            makers[key_] = jax.jit(lambda k: (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(dtype),
                                   out_shardings=sh)
        return makers[key_](k)
    out = []
    for k, (path, s), sh in zip(keys, leaves, shs):
        shape = tuple(s.shape)
        if quant != "bf16" and sh is None and len(shape) > 3:
            # a leaf stacked over layer groups (the scanned layout): drawn and quantized one group at a time, so
            # the bf16 stack of a group position's experts (34 GiB at the released widths) never exists whole
            parts = []
            for kk in jax.random.split(k, shape[0]):
                part = quantize_leaf(path, make(kk, shape[1:], None), quant)
                parts.append(jax.block_until_ready(part))
            leaf = jax.tree.map(lambda *a: jnp.stack(a), *parts)
            del parts
        else:
            leaf = make(k, shape, sh)
            if quant != "bf16":
                leaf = quantize_leaf(path, leaf, quant)
        jax.block_until_ready(leaf)
        out.append(leaf)
    return jax.tree.unflatten(treedef, out)


def quantize_leaf(path, leaf, quant: str):
    """Online quantization of one random bf16 leaf, as `fnx.load(..., quant="fp8")` does for a checkpoint: "fp8"
    turns the dense projections and the experts into FP8 128x128 blocks; "fp8+nvfp4" does the same but makes the
    routed experts NVFP4 (the layout of the released ModelOpt checkpoint)."""
    if quant == "bf16":
        return leaf
    from fnx.checkpoint.place import online_fp8
    from fnx.model import quant as q

    def chunked(fn, leaf, rows: int = 64):
        """fn over slices of the leading axes (at most `rows` experts at a time: quantizing all 512 experts of a
        layer at once needs tens of GB of fp32 temporaries), fields concatenated back."""
        if leaf.ndim <= 2 or leaf.shape[0] <= rows and leaf.ndim == 3:
            return fn(leaf)
        if leaf.ndim > 3:
            parts = [chunked(fn, leaf[i], rows) for i in range(leaf.shape[0])]
            return jax.tree.map(lambda *a: jnp.stack(a), *parts)
        parts = [fn(leaf[i:i + rows]) for i in range(0, leaf.shape[0], rows)]
        return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)

    names = tuple(getattr(p, "key", getattr(p, "name", "")) for p in path)
    names = tuple(n for n in names if isinstance(n, str))
    if KEEP_BF16 is not None and KEEP_BF16.search("/".join(names)):
        return leaf
    if quant == "fp8+nvfp4" and "experts" in names:
        return chunked(_jitted(q.quantize_nvfp4), leaf)
    # mtp=True: fc_embedding / fc_hidden, paths of the MTP tree alone (the loader quantizes them too)
    if online_fp8(names, "fp8-head" if FP8_HEAD else "fp8", mtp=True):
        return chunked(_jitted(q.quantize_fp8_block), leaf)
    return leaf


_JITTED = {}
KEEP_BF16 = None      # --keep-bf16: a compiled regex over param paths that online quantization leaves as they are
FP8_HEAD = False      # --fp8-head: the lm_head too in FP8 blocks (`fnx.serve --quant fp8-head`)


def _jitted(fn):
    """fn compiled once per input shape (eager quantizers dispatch op by op, leaf after leaf)."""
    if fn not in _JITTED:
        _JITTED[fn] = jax.jit(fn)
    return _JITTED[fn]


def quantize_tree(params, quant: str):
    """`quantize_leaf` over a whole tree."""
    if quant == "bf16":
        return params
    out = jax.tree_util.tree_map_with_path(lambda path, leaf: quantize_leaf(path, leaf, quant), params)
    jax.block_until_ready(out)
    return out


def draft_head_for(head, vocab: int, draft_vocab: int, draft_fp8: bool, dtype):
    """(hot ids [H] or None, the draft head or None for the model's own lm_head): a hot-token subset of the first
    `draft_vocab` ids (0: the whole vocabulary) and / or FP8 blocks, built by the engine's `draft_head`."""
    if draft_vocab < 0 or draft_vocab > vocab:
        raise SystemExit(f"--draft-vocab {draft_vocab}: give 0 (the whole vocabulary) up to {vocab}")
    hot = jnp.arange(draft_vocab, dtype=jnp.int32) if draft_vocab else None
    return hot, draft_head(head, hot, draft_fp8, dtype)


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def floor_bytes(cfg: ModelConfig, params, tokens: int) -> float:
    """Weight bytes one target forward of `tokens` tokens per sequence must stream: everything but the n-gram table
    and the embedding table, with only the expected distinct routed experts (uniform routing)."""
    total = 0.0
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    distinct = e * (1 - (1 - k / e) ** tokens)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [getattr(p, "key", getattr(p, "name", "")) for p in path]
        size = int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        if "ngram_embedding" in names or "embed_tokens" in names:
            continue
        if "experts" in names:
            size *= distinct / e
        total += size
    return total


def timeit(fn, n):
    fn()  # compile / warm
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


class HostPle:
    """The PLE rows of each timed call fetched from a host row store (`fnx.ple`), as the engine does with
    `fnx.load(..., ple_store=MODE)`: n-gram ids of fresh random tokens on the host, `store.fetch`, the rows copied
    to the device and passed to the step as `ple_rows` (the in-params table is then not read)."""

    def __init__(self, store, consts, seed: int = 0):
        self.store, self.consts = store, consts
        self.rng = np.random.default_rng(seed)

    def rows(self, b: int, length: int):
        from fnx.ple import initial_context, ngram_ids
        tokens = self.rng.integers(0, 248320, size=(b, length))
        ids, _ = ngram_ids(initial_context(b, self.consts), tokens, self.consts)
        got = self.store.fetch(ids.reshape(b * length, -1))
        return jnp.asarray(got.rows.reshape(b, length, -1))


def engine_decode(cfg: ModelConfig, params, mp, tokens: int, slots_list, store=None, fetches=(),
                  separate: bool = False, spec_k: int = 0, plain: bool = True) -> dict:
    """The Engine's plain decode, synchronous and overlapped (fnx.engine.Engine(overlap=...)): `slots` greedy
    requests of a 64-token prompt; after every prefill has ended, the wall time of the next `tokens` engine
    steps (ms per step, tokens/s). Same programs, so the difference is the host time the overlap hides.
    With a host PLE store: also the engine on that store (always synchronous) with each `ple_fetch` variant in
    `fetches`; its PLE stall is the difference to the synchronous in-params run (the same programs otherwise).
    spec_k: also the engine with MTP speculation (k drafts), synchronous and overlapped rounds: ms per round (one
    engine step) and tokens/s over the timed rounds (random weights accept few drafts: the host overlap, not the
    acceptance, is what the two compare). plain=False: only those (a quick check of the speculative runs)."""
    from fnx.engine import Engine
    from fnx.model.api import Model
    model = Model(cfg, params, mp)
    runs = [("sync", model, dict(overlap=False)), ("overlap", model, dict(overlap=True))] if plain else []
    if separate:   # the same overlapped engine with each input projection a GEMV of its own (the engine's default
        # fuses each sublayer's input projections, fnx.model.fuse)
        runs.append(("overlap_separate", model, dict(overlap=True, fuse_projections=False)))
    if spec_k:
        runs += [(f"spec{spec_k}_sync", model, dict(overlap=False, speculative=spec_k)),
                 (f"spec{spec_k}_overlap", model, dict(overlap=True, speculative=spec_k))]
    if store is not None:
        # the params' (shrunk) table stays, unread: the rows come from the store. The engine hashes the n-grams
        # with the config's constants, so they are the table's own when it is the release's size (every row of
        # the 51.2 GB file can be hit, as in serving), else the bench config's (ids in the first rows)
        from fnx.ple import NgramConstants
        release = ModelConfig(num_hidden_layers=4)
        hcfg = cfg
        if store.src.rows == NgramConstants.from_config(release, 0).num_rows:
            hcfg = dataclasses.replace(cfg, ngram_vocab_size_base=release.ngram_vocab_size_base)
        need = NgramConstants.from_config(hcfg, 0).num_rows
        if store.src.rows < need:
            raise SystemExit(f"--engine on a host store hashes into {need:,} rows; the synthetic table has "
                             f"{store.src.rows:,}: give --ple-table-gb >= {need * store.src.row_bytes / 2**30:.1f}")
        if store.mode in ("uva", "ring"):   # rows reached by the GPU inside every program (pinned table, or ring)
            from fnx.model.api import _with_table
            m = store.mode
            uvam = Model(hcfg, _with_table(hcfg, params, store.table), mp, ple_device_store=store)
            runs += [(f"{m}_sync", uvam, dict(overlap=False)), (f"{m}_overlap", uvam, dict(overlap=True))]
            if spec_k:
                runs += [(f"{m}_spec{spec_k}_overlap", uvam, dict(overlap=True, speculative=spec_k))]
        else:
            hosted = Model(hcfg, params, mp, ple_store=store)
            runs += [(f"ple_{f}", hosted, dict(ple_fetch=f)) for f in fetches]
    out = {}
    for slots in slots_list:
        # the first run twice, the first time discarded: clocks and caches settle after the model's set-up
        for i, (label, mdl, kw) in enumerate([runs[0]] + runs):
            before = dict(store.stats) if store is not None else {}
            eng = Engine(mdl, max_slots=slots, capacity=64 + 2 * tokens + 16, prefill_chunk=64 * slots, **kw)
            rng = np.random.default_rng(0)
            counted = {}

            def run(n, timed):
                reqs = [eng.requests[eng.submit(list(map(int, rng.integers(0, cfg.vocab_size, 64))),
                                                SamplingParams(max_tokens=n, ignore_eos=True))]
                        for _ in range(slots)]
                while any(r.generated == 0 and not r.done for r in reqs):     # every prefill done
                    eng.step()
                times = []
                eng.stats.pop("ple_host_seconds", None)
                eng.stats.pop("ple_calls", None)
                gen0 = sum(r.generated for r in reqs)
                while eng.has_work():
                    t = time.perf_counter()
                    eng.step()
                    times.append(time.perf_counter() - t)
                counted["tok_s"] = (sum(r.generated for r in reqs) - gen0) / max(sum(times), 1e-9)
                # the median step (the last steps of an overlapped engine only drain; a stray slow step is noise)
                return float(np.median(times)) * 1e3 if timed else None

            # phase lines split a log of XLA's (ENGINE_VLOG=1: its command-buffer re-records) by engine and run
            print(f"=== phase engine b{slots} {label} warm-up", flush=True)
            run(4, False)                       # compiles
            print(f"=== phase engine b{slots} {label} timed", flush=True)
            prof_dir = os.environ.get("FNX_ENGINE_PROFILE")   # a directory: cProfile of each timed run, as text
            if prof_dir:
                import cProfile
                import io
                import pstats
                prof = cProfile.Profile()
                ms = prof.runcall(run, tokens, True)
                os.makedirs(prof_dir, exist_ok=True)
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
                with open(os.path.join(prof_dir, f"engine_b{slots}_{label}.txt"), "w") as f:
                    f.write(buf.getvalue())
            else:
                ms = run(tokens, True)
            if i == 0:
                eng.close()
                continue
            key = f"engine_b{slots}_{label}"
            out[key + "_ms_per_step"] = ms
            # plain decode: one token per slot and step; a speculative round: what it emitted over the timed steps
            out[key + "_tok_s"] = counted["tok_s"] if label.startswith("spec") else slots / (ms / 1e3)
            if label.startswith("spec"):
                out[key + "_acceptance_length"] = eng.acceptance_length
            extra = ""
            if label.startswith("ple_") and eng._pipe is not None:
                ps = eng._pipe.stats
                n = max(ps["steps"], 1)
                out.update({f"{key}_pipe_{k.replace('_seconds', '')}_ms": v / n * 1e3 for k, v in ps.items()
                            if k != "steps"})
                extra += (f" [pipeline thread per fetch: queue {ps['queue_seconds'] / n * 1e3:.3f} ms, host "
                          f"{ps['host_seconds'] / n * 1e3:.3f} ms; take() waited {ps['wait_seconds'] / n * 1e3:.3f} ms]")
            if label.startswith("ple_"):
                after = store.stats
                n = max(after["fetches"] - before["fetches"], 1)
                out[key + "_fetch_ms"] = (after["fetch_seconds"] - before["fetch_seconds"]) / n * 1e3
                out[key + "_stall_ms"] = ms - out[f"engine_b{slots}_sync_ms_per_step"]
                extra = (f" (PLE stall {out[key + '_stall_ms']:+.3f} ms against the in-params table; host fetch "
                         f"{out[key + '_fetch_ms']:.3f} ms per fetch, prefill fetches included)") + extra
            if "ple_host_seconds" in eng.stats:     # reset when the timed decode steps began
                calls, ph = eng.stats["ple_calls"], eng.stats["ple_host_seconds"]
                out.update({f"{key}_host_{k}_ms": v / calls * 1e3 for k, v in ph.items()})
                extra += " {host per step: " + ", ".join(f"{k} {v / calls * 1e3:.3f}" for k, v in ph.items()) + " ms}"
            if label.startswith("spec"):
                extra += f" (acceptance length {eng.acceptance_length:.2f})"
            print(f"# engine decode, {slots} slots, {label}: {ms:.3f} ms per step, {out[key + '_tok_s']:.0f} tok/s"
                  + extra, flush=True)
            eng.close()
            eng = None                          # its buffers go before the next engine is made
    return out


def run_one(cfg: ModelConfig, contexts, k: int, reps: int, dtype, mesh=None, quant: str = "bf16",
            host_ple: HostPle | None = None, ledger_calls: int = 0, engine_tokens: int = 0, engine_slots=(1,),
            engine_fetches=(), engine_separate: bool = False, fuse: bool = False, draft_vocab: int = 0,
            draft_fp8: bool = False, prefill_chunk: int = 2048, engine_spec: int = 0, engine_only: bool = False,
            prefill_only: bool = False, prefill_chunks: tuple[int, ...] = ()):
    key = jax.random.PRNGKey(0)
    moe = "auto"
    shapes = param_shapes(cfg, dtype)
    mshapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), mtp_param_shapes(cfg),
                           is_leaf=lambda x: isinstance(x, tuple))
    psh = msh = None
    if mesh is not None:
        from fnx import parallel
        mesh, mcfg = parallel.as_mesh(mesh)
        psh, msh = parallel.param_shardings(cfg, shapes, mesh, mcfg), parallel.mtp_param_shardings(cfg, mshapes, mesh)
        moe = parallel.ExpertParallel(mesh)
        shard = lambda st: parallel.place(st, parallel.state_shardings(cfg, st, mesh, mcfg))  # noqa: E731
    else:
        shard = lambda st: st  # noqa: E731
    if quant != "bf16" and mesh is not None:
        raise SystemExit("--quant with --mesh is not supported by this script yet")
    params = random_tree(shapes, key, dtype, psh, quant)
    mp = random_tree(mshapes, jax.random.PRNGKey(1), dtype, msh, quant)
    uva = host_ple is not None and host_ple.store.mode in ("uva", "ring") and bool(cfg.ple_layer_ids)
    engine_params = params      # the engine part's baseline runs keep the table in the params (its uva runs swap)
    if uva:     # the params' table is the handle of the pinned table: the timed programs gather from host memory
        from fnx.model.api import _with_table
        params = _with_table(cfg, params, host_ple.store.table)
    # the drafter's head, as `Engine(speculative=Speculative(draft_vocab=..., fp8_head=...))` builds it: the first
    # `draft_vocab` token ids stand for a hot-token list (random weights: which ids does not matter for time)
    hot, dhead = draft_head_for(params["lm_head"], cfg.vocab_size, draft_vocab, draft_fp8, dtype)
    floors = {"decode": floor_bytes(cfg, params, 1), "verify": floor_bytes(cfg, params, k + 1),
              "draft": floor_bytes(cfg, {"m": mp, "lm": params["lm_head"] if dhead is None else dhead}, 1)}
    res = {"params_gb": nbytes(params) / 1e9, "mtp_gb": nbytes(mp) / 1e9, "fused_projections": fuse}

    def finish(res):
        """The engine part (--engine), then the peak memory."""
        if engine_tokens:
            if mesh is not None:
                raise SystemExit("--engine runs on one device")
            res.update(engine_decode(cfg, engine_params, mp, engine_tokens, engine_slots,
                                     None if host_ple is None else host_ple.store, engine_fetches, engine_separate,
                                     engine_spec))
        try:
            devs = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
            res["peak_mem_gb"] = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in devs) / 1e9
        except Exception:  # noqa: BLE001 - memory stats are optional per backend
            res["peak_mem_gb"] = None
        return res

    if engine_only:     # (--engine-only: the 48-layer model's engine run fits one device call without the rest)
        return finish(res)
    # the timed programs read `sparams` / `smp`: each sublayer's input projections fused into one product, as the
    # engine and the server run them by default (fnx.model.fuse); the engine part builds its own from params
    sparams, smp = params, mp
    if fuse:
        from fnx.model.fuse import fuse_mtp, fuse_projections
        sparams, smp = fuse_projections(cfg, params), fuse_mtp(mp)
        if not engine_tokens:
            del params, mp, engine_params
    ctx = max(contexts)
    # positions advance from ctx through every timed call (no per-call rewind: resetting `pos` costs a jitted op
    # of host time per call, which the step time would include); the spare capacity covers every call
    calls = (reps + 1) + (ledger_calls + 1)                       # timed + warm-up calls of each kind
    # decode steps, chained steps (held outputs, then in place), MTP rounds (+ chained, + chained in place)
    spare = calls + 200 + (calls + 8 * 8) * (k + 1) + 64
    # a whole number of 256-token blocks, as a served cache is (`fnx.serve --capacity` 4,096): with 1,532 slots
    # XLA padded the QSA layer's K and V to 1,536 for its attention dots, two copy kernels per QSA layer per step
    # that a served step does not run (the 4-layer kernel table of 20e27fc)
    cap = -(-(ctx + spare) // 256) * 256
    heads = cfg.ngram_heads
    step_j = jax.jit(partial(step, cfg=cfg, moe_impl=moe), donate_argnames=("state",))
    ids = lambda b, l: jnp.zeros((b, l, heads), jnp.int32) if cfg.ple_layer_ids else None  # noqa: E731

    uva_ids: dict = {}

    def ple(b, length):
        """(ple_ids, ple_rows) for one call: zero ids for the in-params table, random ids over the pinned table
        (uva; eight sets in turn, so the reads do not hit one set of lines), or rows fetched from the host."""
        if host_ple is None or not cfg.ple_layer_ids:
            return ids(b, length), None
        if uva:
            if (b, length) not in uva_ids:      # made once (not per call: their making is host time)
                uva_ids[(b, length)] = [jnp.asarray(host_ple.rng.integers(
                    0, host_ple.store.src.rows, (b, length, heads)), jnp.int32) for _ in range(8)]
            sets = uva_ids[(b, length)]
            sets.append(sets.pop(0))
            return sets[0], None
        return None, host_ple.rows(b, length)

    def prefill_runs():
        """Prefill throughput at each context (and its ledger at the first)."""
        # prefill throughput
        # in chunks of prefill_chunk tokens, as the engine prefills (fnx.serve: --prefill-chunk, 512 by default); one
        # 8K-token chunk of the 48-layer model asked for a 35 GiB buffer on the H200 (the MoE's gathered experts)
        from fnx.pallas import ledger
        res["prefill_chunk"] = prefill_chunk
        sweep = [(c, ch) for c in contexts for ch in (prefill_chunks or (prefill_chunk,)) if c % min(c, ch) == 0]
        for c in contexts:
            for ch in prefill_chunks:
                if c % min(c, ch):
                    res[f"prefill_{c}_chunk{ch}_skipped"] = "the chunk does not divide the context"
        for c, ch in sweep:
            ch = min(c, ch)
            # a sweep (--prefill-chunks) names each result by its chunk as well; one chunk size keeps the old keys
            key = f"prefill_{c}" if not prefill_chunks else f"prefill_{c}_chunk{ch}"
            st = shard(init_state(cfg, 1, c, dtype))

            last = jnp.full((1,), ch - 1, jnp.int32)   # the head on each chunk's last token, as the engine's prefill

            def pre():
                s = st_box["s"]
                s = dict(s, pos=jnp.zeros_like(s["pos"]))
                for a in range(0, c, ch):
                    pi, pr = ple(1, ch)
                    logits, s, _, _ = step_j(sparams, s, jnp.ones((1, ch), jnp.int32), pi, ple_rows=pr, logits_at=last)
                st_box["s"] = s
                jax.block_until_ready(logits)
            st_box = {"s": st}
            try:
                ms = timeit(pre, max(1, reps // 10))
                res[f"{key}_tok_s"] = c / (ms / 1e3)
                if ledger_calls and (c, ch) == (sweep[0][0], min(*sweep[0])):   # by kernel family (one call)
                    res["ledger_prefill"] = dict(ledger.profile(pre, 1), tokens=c, chunk=ch)
            except jax.errors.JaxRuntimeError as exc:  # recorded, not hidden: the run goes on to the next context
                res[f"{key}_error"] = str(exc).splitlines()[0][:200]
            st_box.clear()

    if prefill_only:    # (--prefill-only: the prefill alone, e.g. its ledger on a card the whole run does not fit)
        prefill_runs()
        return finish(res)
    # decode at the largest context: prefill first (chunks of prefill_chunk)
    state = shard(init_state(cfg, 1, cap, dtype))
    chunk = min(prefill_chunk, ctx)
    for a in range(0, ctx, chunk):
        toks = jnp.ones((1, chunk), jnp.int32)
        _, state, _, _ = step_j(sparams, state, toks, ids(1, chunk))
    jax.block_until_ready(state)
    one = jnp.ones((1, 1), jnp.int32)
    holder = {"s": state}

    def dec():
        pi, pr = ple(1, 1)
        logits, holder["s"], _, _ = step_j(sparams, holder["s"], one, pi, ple_rows=pr)
        jax.block_until_ready(logits)
    res["decode_ms"] = timeit(dec, reps)

    def chained(n=32):
        """n steps in flight, each step's state feeding the next on the device, one wait at the end: the step
        time once the host launch overlaps the device (what a scheduler that keeps tokens on the device gets)."""
        t = time.perf_counter()
        for _ in range(n):
            pi, pr = ple(1, 1)
            logits, holder["s"], _, _ = step_j(sparams, holder["s"], one, pi, ple_rows=pr)
        jax.block_until_ready(logits)
        return (time.perf_counter() - t) / n * 1e3
    chained(4)
    res["decode_chained_ms"] = min(chained() for _ in range(3))

    def chained_inplace(n=32):
        """`chained` with every output but the state dropped at once, as the engine's overlapped decode keeps its
        buffers (`Engine._decode_overlapped`): no buffer of the step moves between calls, so XLA does not re-record
        the step's CUDA graph before each launch (a logits array still alive at the next call moved every step)."""
        t = time.perf_counter()
        for _ in range(n):
            pi, pr = ple(1, 1)
            holder["s"] = step_j(sparams, holder["s"], one, pi, ple_rows=pr)[1]
        jax.block_until_ready(holder["s"])
        return (time.perf_counter() - t) / n * 1e3
    chained_inplace(4)
    res["decode_chained_inplace_ms"] = min(chained_inplace() for _ in range(3))
    res["decode_floor_ms"] = floors["decode"] / PEAK_BW * 1e3
    if ledger_calls:
        from fnx.pallas import ledger
        res["ledger_decode"] = ledger.profile(dec, ledger_calls)
    # the decode numbers as soon as they exist: a run cut short by its time limit (48 layers compile for minutes)
    # still reports them
    print(json.dumps({"layers": cfg.num_hidden_layers, "part": "decode",
                      **{k_: v for k_, v in res.items() if k_.startswith("decode")},
                      "ledger_decode": {k_: v for k_, v in res.get("ledger_decode", {}).items()
                                        if k_ != "kernels"}}), flush=True)

    # one MTP round: catch-up + k-1 chained drafts, verify (k+1 tokens, snapshots), accept, rollback; greedy rows
    # (temperature 0), so both programs are the engine's greedy ones
    mstate = shard(init_mtp_state(cfg, 1, cap, dtype))
    mstate = dict(mstate, pos=holder["s"]["pos"] + 0)
    sp = SamplingArrays.stack([SamplingParams()])
    keys = row_keys(jnp.zeros((1,), jnp.uint32), jnp.zeros((1,), jnp.uint32))
    hid = jnp.zeros((1, k + 1, cfg.hc_dim), dtype)
    mh = {"m": mstate}

    def rnd():
        m, drafts, q = _jit_draft(sparams, smp, mh["m"], hid, jnp.ones((1, k + 1), jnp.int32),
                                  jnp.ones((1,), jnp.int32), sp, keys, cfg, moe, k, head=dhead, hot=hot,
                                  greedy=True)
        mh["m"] = m
        s = holder["s"]
        verify = jnp.concatenate([one, drafts], axis=1)
        pi, pr = ple(1, k + 1)
        s, toks, n_acc, _, _, _ = _jit_verify(sparams, s, verify, jnp.ones((1,), bool), pr if pi is None else pi, q,
                                              sp, keys, cfg, moe, 0, greedy=True)
        holder["s"] = s
        jax.block_until_ready(toks)
    res["mtp_round_ms"] = timeit(rnd, reps)

    def rounds_chained(n=8):
        """n rounds in flight, each round's draft inputs (the MTP pairs, the pending token, the sampling keys)
        taken on the device from the previous verify, as the overlapped engine runs them, one wait at the end:
        the round time once the host's launches overlap the device."""
        sd = cfg.hc_dim
        prev = (hid, jnp.ones((1, k + 1), jnp.int32), jnp.zeros((1,), jnp.int32))
        host = (np.zeros((1, k + 1, sd), np.float32), np.zeros((1, k + 1), np.int32), np.zeros((1,), np.int32),
                np.zeros((1,), np.int32), np.zeros((1,), bool), np.zeros((1,), np.uint32), np.zeros((1,), np.uint32))
        pi, pr = ple(1, k + 1)
        t = time.perf_counter()
        for _ in range(n):
            h_d, pair_d, count_d, pend_d, kk = _jit_spec_inputs(*prev, *host, dtype=jnp.dtype(dtype))
            mh["m"], drafts, q = _jit_draft(sparams, smp, mh["m"], h_d, pair_d, count_d, sp, kk, cfg, moe, k,
                                            head=dhead, hot=hot, greedy=True)
            verify, _ = _jit_verify_window(pend_d, drafts, None, None)
            holder["s"], toks, n_acc, hidden, _, _ = _jit_verify(
                sparams, holder["s"], verify, jnp.ones((1,), bool), pr if pi is None else pi, q, sp, kk, cfg, moe, 0,
                greedy=True)
            prev = (hidden, toks, n_acc)
        jax.block_until_ready(toks)
        return (time.perf_counter() - t) / n * 1e3
    rounds_chained(2)
    res["mtp_round_chained_ms"] = min(rounds_chained() for _ in range(3))

    def rounds_chained_inplace(n=8):
        """The engine's round program as `Engine._spec_launch` runs it (`_jit_spec_round`: draft inputs, drafts,
        verify window and verify in one program; the host rows packed into one array and copied into donated buffers
        by a one-copy program, the outputs written in donated buffers' place, a copy of them taken each round for
        the host into one of two buffer sets used in turn, `HostCopies`): no buffer of the round program moves,
        so XLA does not re-record its CUDA graph per launch. n rounds chained, the rows'
        inputs from the round before (as overlapped), one wait at the end."""
        t = time.perf_counter()
        for _ in range(n):
            ib["host"] = _jit_io_put(ib["host"], pack_host(host_rows))
            mh["m"], holder["s"], ib["out"], ib["lp"], _ = _jit_spec_round(
                sparams, smp, mh["m"], holder["s"], ib["out"], ib["lp"], ib["host"], tables, dhead, hot, sp, None,
                cfg, moe, k, 0, greedy=True)
            got = copies.take("round", (ib["out"], ib["lp"]))
        jax.block_until_ready(got)
        return (time.perf_counter() - t) / n * 1e3
    if host_ple is None and mesh is None:   # (the engine runs rounds this way with the table on the device)
        from fnx.model.ngram_device import NgramDeviceTables
        from fnx.ple import NgramConstants
        tables = NgramDeviceTables.build(NgramConstants.from_config(cfg, 0)) if cfg.ple_layer_ids else None
        sd = cfg.hc_dim
        host_rows = {"hid": np.zeros((1, k + 1, sd), np.float32), "pair_tok": np.ones((1, k + 1), np.int32),
                     "count": np.full((1,), k + 1, np.int32), "pending": np.ones((1,), np.int32),
                     "from_host": np.zeros((1,), bool), "seeds": np.zeros((1,), np.uint32),
                     "counters": np.zeros((1,), np.uint32), "active": np.ones((1,), bool)}
        ib = {"host": jax.device_put({a: np.zeros(v.shape, v.dtype) for a, v in host_rows.items()}),
              "out": {"hidden": jnp.zeros((1, k + 1, sd), dtype), "tok": jnp.ones((1, k + 1), jnp.int32),
                      "n_acc": jnp.zeros((1,), jnp.int32)},
              "lp": (jnp.zeros((1, k + 1), jnp.float32), jnp.zeros((1, k + 1, 0), jnp.float32),
                     jnp.zeros((1, k + 1, 0), jnp.int32))}
        copies = HostCopies(jax.device_put)
        rounds_chained_inplace(2)
        res["mtp_round_chained_inplace_ms"] = min(rounds_chained_inplace() for _ in range(3))
        ib.clear()
    if ledger_calls:
        res["ledger_mtp_round"] = ledger.profile(rnd, ledger_calls)
    res["mtp_round_floor_ms"] = (floors["verify"] + k * floors["draft"]) / PEAK_BW * 1e3
    holder.clear()                         # the states' buffers go before the prefill's
    mh.clear()
    del state
    print(json.dumps({"layers": cfg.num_hidden_layers, "decode_ms": res["decode_ms"],
                      "decode_chained_ms": res["decode_chained_ms"],
                      "decode_chained_inplace_ms": res["decode_chained_inplace_ms"],
                      "decode_floor_ms": res["decode_floor_ms"], "mtp_round_ms": res["mtp_round_ms"],
                      "mtp_round_chained_ms": res["mtp_round_chained_ms"],
                      "mtp_round_chained_inplace_ms": res.get("mtp_round_chained_inplace_ms"),
                      "mtp_round_floor_ms": res["mtp_round_floor_ms"]}), flush=True)

    prefill_runs()
    return finish(res)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="4,8", help="layer counts to run (multiples of 4), for the extrapolation")
    ap.add_argument("--contexts", default="1024,8192,32768", help="prefill contexts (tokens)")
    ap.add_argument("--prefill-chunk", type=int, default=2048,
                    help="tokens per prefill call (the context is prefilled in chunks of this many)")
    ap.add_argument("--k", type=int, default=4, help="MTP draft tokens per round")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="a tiny config (CPU check of the script)")
    ap.add_argument("--mesh-kernels", action="store_true",
                    help="with --mesh: the GEMV kernels per shard (dispatch.on_mesh) instead of the reference paths")
    ap.add_argument("--keep-bf16", default=None, metavar="REGEX",
                    help="with --quant, params whose path ('/'-joined names) matches stay bf16, e.g. "
                         "'input_mix_weight' for an HC boundary A/B")
    ap.add_argument("--fp8-head", action="store_true",
                    help="the lm_head in FP8 128x128 blocks too (online, as `fnx.serve --quant fp8-head`); with "
                         "--quant fp8 or fp8+nvfp4")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="the MTP drafter's head over a hot-token subset of N ids (the engine's draft_vocab; 0: the "
                         "whole vocabulary)")
    ap.add_argument("--draft-fp8", action="store_true",
                    help="the MTP drafter's head in FP8 blocks (the engine's Speculative(fp8_head=True))")
    ap.add_argument("--no-fuse", action="store_true",
                    help="separate input projections (the default fuses each sublayer's, as the engine and the "
                         "server do; never on a mesh)")
    ap.add_argument("--no-scan", action="store_true",
                    help="every layer separate and unrolled (ModelConfig.scan_layers=False) instead of scanned groups")
    ap.add_argument("--unroll-stacked", action="store_true",
                    help="the scanned layout's stacked params run unrolled, every layer reading its views of the "
                         "stacks (ModelConfig.unroll_stacked): the unrolled program with one argument array per "
                         "weight kind and group position")
    ap.add_argument("--quick", action="store_true", help="fewer reps and contexts")
    ap.add_argument("--out", default="benchmarks/results/bench_decode.jsonl")
    ap.add_argument("--quant", default="bf16", choices=("bf16", "fp8", "fp8+nvfp4"),
                    help="weights: bf16, FP8 blocks for dense + experts, or FP8 dense + NVFP4 experts")
    ap.add_argument("--ple-store", default="device",
                    choices=("device", "pinned", "pageable", "swap", "direct", "uva", "ring"),
                    help="device: the n-gram table in the params; uva: a synthetic FP8 table (scripts/bench_ple.py's) "
                         "in pinned host memory, its rows gathered by the GPU inside every program; ring: that table "
                         "mmap'd (pageable), each program's rows copied by the store's host thread into a pinned "
                         "ring while its first layers run; else every call's rows are fetched from a host store of "
                         "that table and passed as ple_rows")
    ap.add_argument("--ple-emulate", action="store_true",
                    help="uva / ring on a CPU (a check of this script): the device side emulated")
    ap.add_argument("--ple-table-gb", type=float, default=4.0,
                    help="size of the synthetic host table (>= 47.7: the release's 51.2 GB)")
    ap.add_argument("--ple-dir", default="/tmp/fnx_ple_bench", help="where the synthetic table is written")
    ap.add_argument("--ledger", type=int, default=0, metavar="N",
                    help="also profile N decode steps and N MTP rounds: kernels per call and the time per family "
                         "(fnx.pallas.ledger)")
    ap.add_argument("--engine", type=int, default=0, metavar="N",
                    help="also time N plain decode steps of fnx.engine.Engine, synchronous and overlapped")
    ap.add_argument("--engine-slots", default="1,8", help="batch slots for --engine (comma list)")
    ap.add_argument("--engine-spec", type=int, default=0, metavar="K",
                    help="with --engine: also the engine with MTP speculation (K drafts), synchronous and "
                         "overlapped rounds")
    ap.add_argument("--engine-only", action="store_true",
                    help="with --engine: only the engine runs (no step / round / prefill timings of this script)")
    ap.add_argument("--prefill-only", action="store_true",
                    help="only the prefill timings (and, with --ledger, the prefill's ledger): no step or round")
    ap.add_argument("--prefill-chunks", default="", metavar="N,N,...",
                    help="with --prefill-only: the prefill at each of these chunk sizes (the MoE reads every "
                         "expert once a chunk, so its cost a token falls with the chunk): prefill_<ctx>_chunk<N>_tok_s "
                         "for each context the chunk divides")
    ap.add_argument("--engine-separate", action="store_true",
                    help="with --engine: also the overlapped engine with separate input projections (its default "
                         "fuses them, fnx.model.fuse)")
    ap.add_argument("--engine-ple-fetch", default="pipeline,sync",
                    help="with --engine and a host --ple-store: the Engine's ple_fetch variants to time (comma list)")
    ap.add_argument("--mesh", action="append", help="tp=N,ep=N (repeatable: one run per mesh, the first is the "
                    "scaling baseline); without it one device, no mesh")
    args = ap.parse_args()
    global KEEP_BF16, FP8_HEAD
    if args.engine_only and not args.engine:
        raise SystemExit("--engine-only needs --engine N (the engine steps to time)")
    if args.fp8_head and args.quant == "bf16":
        raise SystemExit("--fp8-head quantizes the lm_head online: give --quant fp8 or fp8+nvfp4 too")
    FP8_HEAD = args.fp8_head
    if args.keep_bf16:
        import re
        KEEP_BF16 = re.compile(args.keep_bf16)
    if args.quick:
        args.reps, args.contexts = 5, "1024,8192"
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.unroll_stacked and args.no_scan:
        raise SystemExit("--unroll-stacked runs the scanned layout's stacks unrolled: drop --no-scan")
    prefill_chunks = tuple(int(x) for x in args.prefill_chunks.split(",") if x.strip())
    if prefill_chunks and (not args.prefill_only or min(prefill_chunks) < 1):
        raise SystemExit("--prefill-chunks takes positive chunk sizes, with --prefill-only")
    if args.prefill_chunk < 1 or any(c % min(c, args.prefill_chunk) for c in contexts):
        raise SystemExit(f"--prefill-chunk {args.prefill_chunk}: give a positive chunk that divides every context "
                         f"larger than it (contexts {contexts})")
    layer_counts = [int(x) for x in args.layers.split(",")]
    commit = os.environ.get("FNX_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                           capture_output=True, text=True).stdout.strip()
    device = jax.devices()[0]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    host_ple = None
    if args.ple_store != "device":
        import bench_ple as bp      # scripts/ is this script's folder on sys.path

        from fnx.ple.store import open_store
        from fnx.ple.table import from_raw
        os.makedirs(args.ple_dir, exist_ok=True)
        path = bp.synthetic_table(os.path.join(args.ple_dir, f"ple_synthetic_{args.ple_table_gb:g}g.raw"),
                                  args.ple_table_gb)
        consts = bp.bench_consts(from_raw(path).rows)
        store = open_store(path, args.ple_store, consts=consts,
                           **({"emulate": True} if args.ple_emulate and args.ple_store in ("uva", "ring") else {}))
        embed = bench_config(4, args.tiny, ple_width=store.width * consts.num_heads).ple_embed_dim
        if embed != store.width * consts.num_heads:
            raise SystemExit(f"the synthetic table's rows ({store.width * consts.num_heads} wide) do not match the "
                             f"model's PLE width {embed}")
        host_ple = HostPle(store, consts)
        print(f"PLE rows from a host {args.ple_store} store: {path}", flush=True)
    first = None
    for mesh_text in args.mesh or [None]:
        mcfg = None
        if mesh_text is not None:
            from fnx.parallel import MeshConfig
            mcfg = MeshConfig.parse(mesh_text)
        ndev = mcfg.size if mcfg else 1
        kernels_label = (("gemv per shard (mesh)" if args.mesh_kernels else "reference (mesh)") if mcfg
                         else os.environ.get("FNX_KERNELS", "auto"))
        if os.environ.get("FNX_MOE_TOKENS_TILES"):     # several-token MoE tiles changed for this run
            kernels_label += f"; moe tokens tiles {os.environ['FNX_MOE_TOKENS_TILES']}"
        runs = {}
        for n in layer_counts:
            cfg = bench_config(n, args.tiny, scan=not args.no_scan,
                               ple_width=None if host_ple is None else host_ple.store.width * host_ple.consts.num_heads)
            cfg = cfg.replace(unroll_stacked=args.unroll_stacked)
            if mcfg is not None:  # the XLA reference paths, or with --mesh-kernels the GEMV kernels per shard
                from fnx.pallas import dispatch
                with dispatch.on_mesh(mcfg) if args.mesh_kernels else dispatch.force("reference"):
                    r = run_one(cfg, contexts, args.k, args.reps, jnp.bfloat16, mcfg, args.quant, host_ple,
                                args.ledger)
            else:
                r = run_one(cfg, contexts, args.k, args.reps, jnp.bfloat16, mcfg, args.quant, host_ple, args.ledger,
                            args.engine, [int(x) for x in args.engine_slots.split(",")],
                            [f for f in args.engine_ple_fetch.split(",") if f], args.engine_separate,
                            fuse=not args.no_fuse, draft_vocab=args.draft_vocab, draft_fp8=args.draft_fp8,
                            prefill_chunk=args.prefill_chunk, engine_spec=args.engine_spec,
                            engine_only=args.engine_only, prefill_only=args.prefill_only,
                            prefill_chunks=prefill_chunks)
            runs[n] = r
            line = {"mesh": mesh_text, "layers": n, **{k: round(v, 4) if isinstance(v, float) else v
                                                       for k, v in r.items()}}
            for key in ("ledger_decode", "ledger_mtp_round", "ledger_prefill"):
                if key in r:
                    led = r[key]
                    led["launches_per_layer"] = round(led["launches_per_call"] / n, 2)   # issue 8 asks <= ~6
                    print(f"# {key} ({n} layers): {led['launches_per_call']:.0f} kernels "
                          f"({led['launches_per_layer']:.1f} per layer), busy "
                          f"{led['busy_ms_per_call']:.3f} ms, idle {led.get('idle_ms_per_call', 0):.3f} ms; "
                          + ", ".join(f"{f} {v['ms_per_call']:.3f} ms / {v['kernels_per_call']:.0f}"
                                      for f, v in led["families"].items()), flush=True)
            print(json.dumps(line), flush=True)
            with open(args.out, "a") as f:   # each layer count as soon as it ran: a run cut short keeps it
                f.write(json.dumps({"record": "run", "date": datetime.date.today().isoformat(), "commit": commit,
                                    "device": device.device_kind, "quant": args.quant, "keep_bf16": args.keep_bf16,
                                    "fp8_head": args.fp8_head, "draft_vocab": args.draft_vocab,
                                    "draft_fp8": args.draft_fp8,
                                    "ple_store": args.ple_store,
                                    "kernels": kernels_label, "settings": fnx_settings(), "reps": args.reps,
                                    "scan_layers": not args.no_scan, "unroll_stacked": args.unroll_stacked,
                                    "mtp_round": "greedy", **line}) + "\n")
        rec = {"date": datetime.date.today().isoformat(), "commit": commit, "device": device.device_kind,
               "platform": device.platform, "jax": jax.__version__, "host": platform.node(), "k": args.k,
               "tiny": args.tiny, "mesh": mesh_text, "devices": ndev, "quant": args.quant,
               "ple_store": args.ple_store, "scan_layers": not args.no_scan, "unroll_stacked": args.unroll_stacked,
               "mtp_round": "greedy",
               "kernels": kernels_label, "settings": fnx_settings(),
               "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "runs": runs}
        if len(layer_counts) >= 2:
            a, b = sorted(layer_counts)[:2]
            ext = {}
            for key in ("decode_ms", "decode_chained_ms", "mtp_round_ms", "mtp_round_chained_ms", "decode_floor_ms",
                        "mtp_round_floor_ms"):
                per_layer = (runs[b][key] - runs[a][key]) / (b - a)
                ext[key] = runs[a][key] + per_layer * (48 - a)
                ext[key + "_per_layer"] = per_layer
            # the floor of a mesh: every device streams its share of the weights at once
            ext["decode_frac_of_floor"] = ext["decode_floor_ms"] / ndev / ext["decode_ms"]
            ext["mtp_round_frac_of_floor"] = ext["mtp_round_floor_ms"] / ndev / ext["mtp_round_ms"]
            rec["extrapolated_48_layers"] = ext
            if first is None:
                first = (ndev, ext)
            else:  # scaling efficiency against the first mesh: (t_first / t) / (devices / devices_first)
                rec["scaling_vs_first_mesh"] = {
                    key: (first[1][key] / ext[key]) / (ndev / first[0]) for key in ("decode_ms", "mtp_round_ms")}
            print(json.dumps({"mesh": mesh_text, "extrapolated_48_layers": ext,
                              "scaling_vs_first_mesh": rec.get("scaling_vs_first_mesh")}), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")

if __name__ == "__main__":
    main()
