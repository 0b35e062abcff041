"""The engine: a fixed set of batch slots over one decode state, requests joining and leaving between steps,
chunked prefill interleaved with decode, sampling, and MTP speculative decoding with exact rollback.

One `Engine.step()` admits waiting requests into free slots, runs one prefill chunk (if any request is still
prefilling) and one decode step (or one speculative round) for every decoding slot. Everything device-side is a
handful of jitted programs whose shapes depend only on (slots, tokens per slot), so nothing recompiles inside a
bucket. The engine is single-threaded: the serving layer drives it from one thread."""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace as _replace
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from fnx.engine.spec import accept, accept_greedy, commit_window, penalized_window
from fnx.engine.sampling import (SamplingArrays, SamplingParams, apply_logit_bias, filtered_logprobs, greedy_tokens,
                                 row_keys, sample, top_logprobs)
from fnx.model.api import Model, ple_input, ple_split
from fnx.model.mtp import init_mtp_state, mtp_params, mtp_step
from fnx.model import hyper
from fnx.model.ops import linear, linear_argmax
from fnx.model.transformer import (front_inputs, init_state, rollback, slot_put, slot_take, step, step_back,
                                   step_front)
from fnx.ple import initial_context, ngram_ids
from fnx.ple.ngram import SMALL_TOKENS, hash_rows

log = logging.getLogger("fnx.engine")

# How a host PLE store's rows reach the step (the engine's `ple_fetch`), the default first: every variant was
# measured in the engine on the H200 (BENCHMARKS.md, "The engine on a host PLE store"); "sync" was the fastest
PLE_FETCH = ("sync", "pipeline", "split", "callback-pure", "callback-io", "callback-buffer")


@dataclass(frozen=True)
class _InGraphFetch:
    """A static jit argument (equal for the same store object and method, so engines on one store share their
    compiled programs): the step fetches its PLE rows from `store` through a host callback
    (`fnx.ple.pipeline.fetch_rows_in_graph`) at the PLE layer."""
    store: object
    method: str


@dataclass(frozen=True)
class SpeculativeConfig:
    """MTP speculative decoding: k draft tokens per round (1..8); draft_vocab: optional hot-token ids (a path to
    a .npy or whitespace-separated text file, or a sequence) that the draft head is restricted to."""
    k: int = 4
    draft_vocab: object = None
    fp8_head: bool = False      # draft head in FP8 128x128 blocks (weight-only): half the bytes per draft step

    def __post_init__(self):
        if not 1 <= self.k <= 8:
            raise ValueError(f"speculative k must be in 1..8, got {self.k}")

    def hot_ids(self, vocab: int) -> np.ndarray | None:
        src = self.draft_vocab
        if src is None:
            return None
        if isinstance(src, (str, os.PathLike)):
            path = os.fspath(src)
            if not os.path.exists(path):
                raise ValueError(f"draft vocabulary file {path!r} does not exist")
            ids = np.load(path) if path.endswith(".npy") else np.loadtxt(path, dtype=np.int64, ndmin=1)
        else:
            ids = np.asarray(src)
        ids = np.unique(np.asarray(ids).astype(np.int64).reshape(-1))
        if ids.size == 0 or ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"draft vocabulary must be non-empty token ids in [0, {vocab})")
        return ids.astype(np.int32)


@dataclass
class Output:
    """What one request gained in one engine step."""
    request_id: str
    token_ids: list[int]
    logprobs: list[dict] = field(default_factory=list)   # per token: {"logprob", "top": [(id, logprob), ...]}
    finished: bool = False
    finish_reason: str | None = None                      # "stop" | "length" | "abort" | "error"
    # with the first token of a request that asked for them (`SamplingParams.prompt_logprobs`): one entry per
    # prompt token, None for the first (nothing precedes it), else {"logprob", "top"} as above
    prompt_logprobs: list[dict | None] | None = None


@dataclass
class Request:
    id: str
    prompt: np.ndarray
    params: SamplingParams
    seed: int
    history: list[int] = field(default_factory=list)
    generated: int = 0
    prefilled: int = 0
    slot: int | None = None
    pending: int | None = None           # sampled, not yet run through the target
    mtp_hidden: object = None            # [n, S*D] target hidden rows awaiting the MTP layer
    mtp_tokens: list[int] = field(default_factory=list)
    prompt_lps: list[dict] = field(default_factory=list)  # prompt logprobs of the chunks prefilled so far
    done: bool = False
    drafted: int = 0
    accepted: int = 0


@dataclass
class _Inflight:
    """A decode step launched on the device whose tokens the host has not read yet."""
    batch: list            # (request, slot) as launched
    tokens: object         # [slots] int32 on the device
    lp_info: object        # its logprob arrays, or None


@dataclass
class _SpecInflight:
    """A speculative round (draft + verify) launched on the device whose outputs the host has not read yet."""
    batch: list            # (request, slot) as launched
    tokens: object         # [slots, k+1] int32: the accepted tokens, then the bonus / corrected one
    n_acc: object          # [slots] int32: accepted drafts per row
    hidden: object         # [slots, k+1, hc_dim]: the target's hidden rows the MTP layer reads next round
    lp_info: object        # its logprob arrays, or None


class Engine:
    def __init__(self, model: Model, *, max_slots: int = 4, capacity: int = 4096, prefill_chunk: int = 512,
                 speculative: SpeculativeConfig | int | None = None, moe_impl: str = "auto",
                 extra_eos: tuple[int, ...] = (), mesh=None, overlap: bool = True, ple_fetch: str = "sync",
                 fuse_projections: bool | None = None, prefill_chunk_idle: int | None = None):
        """speculative: k, or SpeculativeConfig(k, draft_vocab=path or ids) where draft_vocab restricts the
        drafter's head to a hot-token subset (a .npy / text file of token ids, or a sequence): cheaper drafts,
        same output distribution (the acceptance rule is exact for any drafter).
        mesh: run on several devices (`fnx.parallel`: a Mesh, a MeshConfig or "tp=2,ep=1").
        overlap: decode steps, and speculative rounds, are queued one ahead: the next is launched before this
        one's tokens reach the host (its inputs, the tokens, the MTP layer's pairs and the PLE n-gram ids, taken
        on the device), so the host's launch and bookkeeping run while the device works; each step's tokens are
        emitted one `step()` later. The same tokens as overlap=False. A request that ends is computed for one
        step or round more, and that result is dropped. Not used with a host PLE store (its rows are fetched on
        the host from the tokens): such an engine runs every step synchronously (a speculative round's draft and
        verify programs still run back to back: the verify window is built on the device).
        ple_fetch: how the rows of a host PLE store (`fnx.load(..., ple_store="pageable")` etc.) reach each step:
          "sync" (default, the fastest measured on the H200): the rows are fetched on the host, then one program
            runs;
          "pipeline": the step runs as two programs split at the PLE layer; a host thread fetches the rows and
            copies them to the device while the first program (embedding, layers before the PLE layer) runs;
          "split": the same two programs, the rows fetched on the engine's own thread right after the first
            program is launched (no thread hand-off). Both lose to "sync" on the H200 host: a second launch
            costs more host time (0.5-1.4 ms, more while the device is busy) than the first program's device time
            they can hide the fetch behind;
          "callback-pure" / "callback-io" / "callback-buffer": one program that calls back into Python for the
            rows at the PLE layer (jax.pure_callback / io_callback / buffer_callback). A failed callback fetch
            cannot say which rows it lost, so every row of that step counts as missing.
        Ignored without a host store (a table in device memory is gathered inside the step).
        prefill_chunk: prompt tokens prefilled per step (across requests) while some request is decoding: a
        decode step waits behind at most one such chunk. prefill_chunk_idle (None: the same): the budget of a step
        in which no request is decoding, so no decode step waits on it; a chunk touches every routed expert of
        every layer whatever its length, so longer chunks prefill a token for less. Each distinct chunk length
        compiles its own program (`prefill_buckets`).
        fuse_projections: run each sublayer's input projections as one product over row-concatenated weights
        (`fnx.model.fuse`: fewer, larger GEMVs per layer; the same values). None (default): on unless on a device
        mesh (the mesh rules shard the separate weights by name; True there is an error). Measured on the H200
        (4 layers, bf16, M = 1): 0.836 ms per chained step against 0.876 separate, 133 kernels against 148
        (BENCHMARKS.md, seventh session). The engine holds its own copy of the fused weights (the dense input
        projections, not the experts): a caller that keeps its `model` keeps both copies of those weights
        (about 2 GB in FP8 for the released model), so drop it, or pass False."""
        if ple_fetch not in PLE_FETCH:
            raise ValueError(f"ple_fetch must be one of {PLE_FETCH}, got {ple_fetch!r}")
        if max_slots < 1 or capacity < 8:
            raise ValueError(f"need max_slots >= 1 and capacity >= 8, got {max_slots} and {capacity}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefill_chunk_idle is None:
            prefill_chunk_idle = prefill_chunk
        if prefill_chunk_idle < prefill_chunk:
            raise ValueError(f"prefill_chunk_idle ({prefill_chunk_idle}) must be at least prefill_chunk "
                             f"({prefill_chunk}): it is the budget of the steps with no decode waiting on them")
        if fuse_projections is None:
            fuse_projections = mesh is None
        if fuse_projections:
            if mesh is not None:
                raise ValueError("fuse_projections is not supported on a device mesh (fnx.parallel shards the "
                                 "separate projection weights by name)")
            from fnx.model.fuse import fuse_projections as _fuse
            model = _replace(model, params=_fuse(model.cfg, model.params))
        self.fused = bool(fuse_projections)
        self.model, self.cfg = model, model.cfg
        if isinstance(speculative, int):
            speculative = SpeculativeConfig(speculative)
        self.spec = speculative
        self.k = speculative.k if speculative else 0
        self.slots: list[Request | None] = [None] * max_slots
        self.capacity, self.prefill_chunk, self.moe_impl = capacity, prefill_chunk, moe_impl
        self.prefill_chunk_idle = prefill_chunk_idle
        dtype = model.dtype
        self.state = init_state(self.cfg, max_slots, capacity, dtype)
        self.empty_slot = init_state(self.cfg, 1, capacity, dtype)
        vocab = self.cfg.vocab_size
        self.seen = jnp.zeros((max_slots, vocab), bool)
        self.out_counts = jnp.zeros((max_slots, vocab), jnp.int32)
        eos = self.cfg.eos_token_id
        self.eos = set(eos if isinstance(eos, tuple) else (() if eos is None else (eos,))) | set(extra_eos)
        if self.spec:
            self.mtp = mtp_params(self.cfg, model.mtp, dtype)
            if fuse_projections:
                from fnx.model.fuse import fuse_mtp
                self.mtp = fuse_mtp(self.mtp)
            hot = speculative.hot_ids(self.cfg.vocab_size)
            self.hot = None if hot is None else jnp.asarray(hot)
            self.draft_head = draft_head(model.params["lm_head"], self.hot, speculative.fp8_head, dtype)
            self.mtp_state = init_mtp_state(self.cfg, max_slots, capacity, dtype)
            self.mtp_empty = init_mtp_state(self.cfg, 1, capacity, dtype)
        self.waiting: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng()
        self.stats = {"drafted": 0, "accepted": 0, "rounds": 0, "decode_steps": 0, "prefill_tokens": 0}
        self._ple_missing: np.ndarray | None = None   # batch rows whose host PLE rows were zero-filled
        self._hints = None                              # the prefill-hint thread (host PLE store only)
        # overlapped decode: the step queued on the device whose outputs are not yet emitted
        self.overlap = bool(overlap) and model.ple_store is None
        self._inflight: _Inflight | _SpecInflight | None = None
        # the overlapped decode's per-step inputs and outputs kept at fixed device addresses (`_decode_overlapped`)
        self._io: dict | None = None
        self._spec_io: dict | None = None    # the same for speculative rounds (`_spec_launch`)
        self._copies = HostCopies(self._replicated)   # where the host's copies of their outputs are written
        self._spec_none = None    # stand-ins for "no round in flight" in _jit_spec_inputs
        self._sp_cache = None
        self._ngram_tables = None
        if (self.overlap or self.spec) and model.ple_store is None and model.ngram is not None:
            from fnx.model.ngram_device import NgramDeviceTables
            self._ngram_tables = NgramDeviceTables.build(model.ngram)
        self._last_hint = None
        self.mesh = None
        if mesh is not None:
            if getattr(model, "ple_device_store", None) is not None:
                raise NotImplementedError("a device mesh with ple_store 'uva' or 'ring' is not implemented (the "
                                          "table's handle is not sharded); load with 'device' or a host ple_store")
            self._place_on_mesh(mesh)
        self.ple_fetch = ple_fetch
        self._pipe = self._cb = None
        if model.ple_store is not None and model.ngram is not None:
            if ple_fetch == "pipeline":
                from fnx.ple.pipeline import PrefetchPipeline
                # on a mesh the rows stay NumPy and the back program places them; else they go to the device
                self._pipe = PrefetchPipeline(model.ple_store, to_device=self.mesh is None)
            elif ple_fetch.startswith("callback-"):
                self._cb = _InGraphFetch(model.ple_store, ple_fetch.split("-", 1)[1])

    def close(self) -> None:
        """Stop the engine's host threads (the PLE pipeline, prompt hints). The model and its store stay open."""
        if self._pipe is not None:
            self._pipe.close()
        if self._hints is not None:
            self._hints.shutdown(wait=True)
            self._hints = None

    def _place_on_mesh(self, mesh):
        """Params and state placed by `fnx.parallel`'s rules; the jitted programs follow the placement (XLA
        inserts the collectives). The routed experts run per shard unless a moe_impl string other than auto was
        asked for."""
        from fnx import parallel
        self.mesh, mcfg = parallel.as_mesh(mesh)
        put = lambda tree, fn: parallel.place(tree, fn(self.cfg, tree, self.mesh, mcfg))  # noqa: E731
        self.model = parallel.shard_model(self.model, self.mesh)
        self.state, self.empty_slot = put(self.state, parallel.state_shardings), put(self.empty_slot,
                                                                                    parallel.state_shardings)
        rep = self._replicated
        self.seen, self.out_counts = rep(self.seen), rep(self.out_counts)
        if self.moe_impl == "auto":
            self.moe_impl = parallel.ExpertParallel(self.mesh)
        if self.spec:
            self.mtp = put(self.mtp, parallel.mtp_param_shardings)
            self.mtp_state, self.mtp_empty = put(self.mtp_state, parallel.state_shardings), put(
                self.mtp_empty, parallel.state_shardings)
            self.hot, self.draft_head = rep(self.hot), rep(self.draft_head)
        if self._ngram_tables is not None:
            self._ngram_tables = rep(self._ngram_tables)
        self._io = self._spec_io = None     # made again, replicated on the mesh, at the next step or round
        self._copies = HostCopies(self._replicated)

    # ---- requests ---------------------------------------------------------------------------------------------
    def submit(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0 or prompt.dtype.kind not in "iu":
            raise ValueError(f"a prompt must be a non-empty list of token ids, got {prompt.dtype} {prompt.shape}")
        if prompt.min() < 0 or prompt.max() >= self.cfg.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.cfg.vocab_size})")
        if params.logit_bias and max(t for t, _ in params.logit_bias) >= self.cfg.vocab_size:
            raise ValueError(f"logit_bias token ids must lie in [0, {self.cfg.vocab_size})")
        need = prompt.size + params.max_tokens + self.reserve
        if need > self.capacity:
            raise ValueError(f"prompt ({prompt.size} tokens) + max_tokens ({params.max_tokens}) needs {need} "
                             f"positions, more than this engine's context capacity of {self.capacity}")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**31 - 1))
        req = Request(rid, prompt.astype(np.int32), params, seed, history=[int(t) for t in prompt])
        self.requests[rid] = req
        self.waiting.append(req)
        if self._hint_store() is not None and self.model.ngram is not None:
            self._hint_prompt(req.prompt)
        return rid

    def _hint_store(self):
        """The store a prompt's rows are prefetched in: a host store, or the one a `ring` handle reads (its rows
        come from the backing store's pages too); None for tables on the device or page-locked (uva)."""
        if self.model.ple_store is not None:
            return self.model.ple_store
        dev = getattr(self.model, "ple_device_store", None)
        return dev if dev is not None and dev.mode == "ring" else None

    def _hint_prompt(self, prompt: np.ndarray) -> None:
        """Prefill hint: the n-gram ids of the whole prompt are computed and their rows prefetched
        (`RowStore.prefetch`: madvise / MADV_POPULATE_READ, advisory) on a background thread, while the request
        waits and its earlier chunks prefill, so the chunked prefill's own fetches find their pages resident."""
        if self._hints is None:
            import concurrent.futures as cf
            self._hints = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fnx-ple-hint")
        store, ng, chunk = self._hint_store(), self.model.ngram, max(self.prefill_chunk, 256)

        def run():
            try:
                ids, _ = ngram_ids(initial_context(1, ng), prompt[None].astype(np.int64), ng)
                ids = ids.reshape(-1, ids.shape[-1])
                for lo in range(0, ids.shape[0], chunk):      # in prefill order, a chunk's rows at a time
                    store.prefetch(ids[lo:lo + chunk])
            except Exception as e:  # advisory only: the fetch itself reports real failures
                log.warning("PLE prefetch hint failed (the prefill fetches the rows itself): %s", e)

        self._last_hint = self._hints.submit(run)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        req.done = True
        if req in self.waiting:
            self.waiting.remove(req)
        if req.slot is not None:
            self.slots[req.slot] = None

    @property
    def reserve(self) -> int:
        """Cache positions a request needs beyond its prompt and max_tokens: a speculative round writes k + 1
        positions past the last committed token, and an overlapped one may run once more after the request's
        last tokens (up to k + 1 of them) are committed on the device but not yet seen by the host: k - 1 more."""
        return positions_reserved(self.k if self.spec else 0, self.overlap)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots) or self._inflight is not None

    def positions_used(self) -> int:
        """Cache positions held by running requests (prompt + generated), out of max_slots * capacity."""
        return sum(len(r.history) for r in self.slots if r is not None)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self.slots)

    # ---- one scheduling iteration ----------------------------------------------------------------------------
    def step(self) -> list[Output]:
        if self.mesh is not None:
            # on a mesh every op traces its XLA reference path, which the SPMD partitioner splits; with
            # FNX_MESH_KERNELS=1 the GEMV kernels run per shard instead (fnx/pallas/gemv/mesh.py: opt-in, not
            # yet measured on a GPU mesh; see fnx/parallel/README.md)
            from fnx.pallas import dispatch
            with dispatch.on_mesh(self.mesh) if os.environ.get("FNX_MESH_KERNELS") == "1" else \
                    dispatch.force("reference"):
                return self._step()
        return self._step()

    def _step(self) -> list[Output]:
        outs: list[Output] = []
        self._admit()
        # prompt tokens prefilled per step, across requests: the idle budget when no request is decoding (none
        # prefilled and running, no step or round in flight), so no decode step waits behind the longer chunk
        idle = self._inflight is None and not any(r is not None and not r.done and r.prefilled == len(r.prompt)
                                                  for r in self.slots)
        budget = self.prefill_chunk_idle if idle else self.prefill_chunk
        for r in [r for r in self.slots if r is not None and r.prefilled < len(r.prompt)]:
            if budget <= 0:
                break
            before = r.prefilled
            outs += self._ple_failed(self._prefill_chunk(r, budget), [r], lambda r: 0)
            budget -= r.prefilled - before
        decoding = [r for r in self.slots if r is not None and r.prefilled == len(r.prompt) and not r.done
                    and r.pending is not None]
        if self.overlap:
            # queue this step (or round) behind the one in flight, then emit the one in flight while this one runs
            launch, finish = ((self._spec_launch, self._spec_finish) if self.spec else
                              (self._decode_overlapped, self._finish_inflight))
            prev, self._inflight = self._inflight, (launch(decoding) if decoding else None)
            if prev is not None:
                outs += finish(prev)
        elif decoding:
            step_outs = self._spec_round(decoding) if self.spec else self._decode(decoding)
            outs += self._ple_failed(step_outs, decoding, lambda r: r.slot)
        return self._ring_failed(outs)

    def _ring_failed(self, outs: list[Output]) -> list[Output]:
        """A `ring` PLE store (rows fetched by its host thread for the step programs themselves) that zero-filled
        rows since the last step: which requests' rows is not known here, so with policy "fail" every running
        request ends with finish_reason "error" (with "degrade" the zero rows stand); stats["ple_missing"] counts
        the requests affected under either policy."""
        store = getattr(self.model, "ple_device_store", None)
        if store is None or store.mode != "ring" or store.consume_pending() is None:
            return outs
        running = [r for r in self.slots if r is not None]
        self.stats["ple_missing"] = self.stats.get("ple_missing", 0) + len(running)
        if store.policy != "fail":
            return outs
        log.error("PLE ring rows missing (%s); ending %d running request(s) with an error", store.last_error,
                  len(running))
        bad = {r.id for r in running}
        outs = [o for o in outs if o.request_id not in bad]
        for rid in sorted(bad):
            self.abort(rid)
            outs.append(Output(rid, [], [], True, "error"))
        self.stats["ple_failed_requests"] = self.stats.get("ple_failed_requests", 0) + len(bad)
        return outs

    def _ple_failed(self, outs: list[Output], reqs: list[Request], row_of) -> list[Output]:
        """After a step whose host PLE fetch zero-filled rows (past its deadline, or unreadable pages): with the
        store's policy "fail", each request whose rows were missing ends here with finish_reason "error" (its
        slot freed; what this step computed for it is dropped), and every other request goes on untouched (rows
        of a batch never mix). With "degrade" the zero rows stand. stats["ple_missing"] counts the sequence-steps
        that had rows missing, under either policy."""
        miss, self._ple_missing = self._ple_missing, None
        if miss is None:
            return outs
        bad = {r.id for r in reqs if miss[row_of(r)]}
        if not bad or self.model.ple_store.policy != "fail":
            return outs
        log.error("PLE rows missing (%s); ending %d request(s) with an error", self.model.ple_store.last_error,
                  len(bad))
        outs = [o for o in outs if o.request_id not in bad]
        for rid in sorted(bad):
            self.abort(rid)
            outs.append(Output(rid, [], [], True, "error"))
        self.stats["ple_failed_requests"] = self.stats.get("ple_failed_requests", 0) + len(bad)
        return outs

    def _admit(self):
        for i, s in enumerate(self.slots):
            if s is None and self.waiting:
                req = self.waiting.popleft()
                req.slot = i
                self.slots[i] = req
                self.state = _jit_slot_put(self.cfg, self.state, i, self.empty_slot)
                if self.spec:
                    self.mtp_state = _jit_mtp_put(self.mtp_state, i, self.mtp_empty)
                row = np.zeros((self.cfg.vocab_size,), bool)
                row[req.prompt] = True
                self.seen, self.out_counts = _reset_row(self.seen, self.out_counts, i, jnp.asarray(row))

    def _host_ids(self, histories: list[list[int]], tokens: np.ndarray) -> np.ndarray | None:
        """The n-gram ids [B, L, H] of `tokens` [B, L] that follow each row's history (None without PLE)."""
        ng = self.model.ngram
        if ng is None:
            return None
        ctx_len = ng.ngram_size - 1
        rows = []                         # each row: its context (eos-padded on the left), then its tokens
        for h, toks in zip(histories, tokens.tolist()):
            tail = list(h[-ctx_len:]) if ctx_len else []
            rows.append([ng.eos_token_id] * (ctx_len - len(tail)) + tail + toks)
        if tokens.size <= SMALL_TOKENS:   # a decode step: Python ints, no NumPy calls per token (host time per step)
            return hash_rows(rows, tokens.shape[1], ng)
        hist = np.asarray(rows, np.int64).reshape(len(rows), ctx_len + tokens.shape[1])
        ids, _ = ngram_ids(hist[:, :ctx_len], hist[:, ctx_len:], ng)
        return ids

    def _context_tail(self, history: list[int], end: int) -> list[int]:
        """The tokens of history[:end] the n-gram ids of the next tokens depend on (the last ngram_size - 1), without
        copying the whole history every step."""
        ng = self.model.ngram
        n = ng.ngram_size - 1 if ng is not None else 0
        return history[max(end - n, 0):end] if n else []

    def _note_missing(self, missing: np.ndarray | None) -> None:
        if missing is not None:                      # handled per request after the step: _ple_failed
            self._ple_missing = missing
            self.stats["ple_missing"] = self.stats.get("ple_missing", 0) + int(missing.sum())

    def _run_ple(self, histories: list[list[int]], tokens: np.ndarray, whole, front=None, back=None):
        """Run one step program for `tokens` [B, L] with its PLE input, the way `ple_fetch` says.
        whole(ple, cb): the one-program step, ple = n-gram ids [B, L, H] (table in the params, or the in-graph
        callback `cb` fetches their rows), rows [B, L, E] (fetched here, "sync"), or None (no PLE layer).
        front() / back(handover, rows): the two programs of "pipeline", the rows fetched and copied by the
        pipeline thread while front() runs on the device."""
        t0 = time.perf_counter()
        ids = self._host_ids(histories, tokens)
        store = self.model.ple_store
        if ids is None or store is None:
            return whole(None if ids is None else ids.astype(np.int32), None)
        t1 = time.perf_counter()
        handover = None
        if self._pipe is not None and front is not None:
            ticket = self._pipe.submit_ids(ids)
            handover = front()
            t2 = time.perf_counter()
            got = self._pipe.take(ticket)
            self._note_missing(self._consume(got.flagged) if got.flagged.any() else None)
            ple = got.rows
        elif self.ple_fetch == "split" and front is not None:
            handover = front()                       # queued on the device; the fetch runs meanwhile
            t2 = time.perf_counter()
            ple, missing = ple_input(self.model, ids)
            self._note_missing(missing)
        elif self._cb is not None:
            t2 = t1
            out = whole(ids.astype(np.int32), self._cb)
            jax.block_until_ready(out)               # the callback's failures are known once the step ran
            if store.consume_pending() is not None:  # which rows failed is not known: the whole batch
                self._note_missing(np.ones(ids.shape[0], bool))
            self._ple_time(t0, t1, t2, t2, time.perf_counter())
            return out
        else:
            t2 = t1
            ple, missing = ple_input(self.model, ids)    # "sync": the rows fetched now, on the host
            self._note_missing(missing)
        t3 = time.perf_counter()
        out = whole(ple, None) if handover is None else back(handover, ple)
        self._ple_time(t0, t1, t2, t3, time.perf_counter())
        return out

    def _ple_time(self, *t):
        """Host seconds of the steps with a host PLE store, by phase: n-gram ids, the first program's launch,
        getting the rows (fetch, or waiting for the pipeline thread), the (second) program's launch."""
        acc = self.stats.setdefault("ple_host_seconds", {"ids": 0.0, "front": 0.0, "rows": 0.0, "launch": 0.0})
        for k, a, b in zip(("ids", "front", "rows", "launch"), t, t[1:]):
            acc[k] += b - a
        self.stats["ple_calls"] = self.stats.get("ple_calls", 0) + 1

    def _consume(self, flagged: np.ndarray) -> np.ndarray:
        """A fetch zero-filled rows: this step's caller handles it per request, so the store's pending error
        (which would fail the next fetch under policy "fail") is consumed here."""
        self.model.ple_store.consume_pending()
        return flagged

    def prefill_bucket(self, n: int) -> int:
        """The token length a prefill chunk of n prompt tokens is padded to (one compiled program per length):
        the next power of two from 16, at most the smaller of the two chunk budgets (prefill_chunk,
        prefill_chunk_idle) that n fits in."""
        b = 16
        while b < n:
            b *= 2
        cap = min((c for c in (self.prefill_chunk, self.prefill_chunk_idle) if c >= n), default=n)
        return min(b, cap)

    def prefill_buckets(self) -> list[int]:
        """Every length a prefill chunk is padded to, ascending (a compiled prefill program each)."""
        top = max(self.prefill_chunk, self.prefill_chunk_idle)
        lengths, b = {self.prefill_chunk, self.prefill_chunk_idle}, 16
        while b <= top:
            lengths.add(b)
            b *= 2
        return sorted({self.prefill_bucket(n) for n in lengths})

    def _prefill_chunk(self, req: Request, budget: int) -> list[Output]:
        start = req.prefilled
        chunk = req.prompt[start:start + min(max(self.prefill_chunk, self.prefill_chunk_idle), budget)]
        n = len(chunk)
        length = self.prefill_bucket(n)
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :n] = chunk
        hist = self._context_tail(req.history, start)
        nv = np.asarray([n], np.int32)
        args = (self.model.params, self.state, req.slot, tokens, nv)
        self.state, last_logits, hidden = self._run_ple(
            [hist], tokens,
            lambda ple, cb: _jit_prefill(*args, ple, self.cfg, self.moe_impl, ple_cb=cb),
            lambda: _jit_prefill_front(*front_inputs(self.cfg, self.model.params, self.state), req.slot, tokens, nv,
                                       self.cfg, self.moe_impl),
            lambda fr, rows: _jit_prefill(*args, rows, self.cfg, self.moe_impl, front=fr))
        req.prefilled += n
        self.stats["prefill_tokens"] += n
        final = req.prefilled == len(req.prompt)
        # prompt logprobs: position j predicts prompt token start + j + 1; the last prompt position's token is the
        # first one generated (its logprob comes with it)
        nt = 0 if req.params.prompt_logprobs is None else n - 1 if final else n
        if nt > 0:
            targets = np.zeros((1, length), np.int32)
            targets[0, :nt] = req.prompt[start + 1:start + 1 + nt]
            chosen, vals, ids = _to_host(_jit_prompt_logprobs(self.model.params, hidden, jnp.asarray(targets),
                                                              self.cfg, MAX_LOGPROBS))
            top_n = req.params.prompt_logprobs
            req.prompt_lps += [{"logprob": float(chosen[0, j]),
                                "top": [(int(i), float(v)) for i, v in zip(ids[0, j, :top_n], vals[0, j, :top_n])]}
                               for j in range(nt)]
        if self.spec:  # the MTP layer reads pairs (H_t, x_{t+1}); the last pair of the prompt waits for x_P
            pairs = n - 1 if final else n
            nxt = np.zeros((1, length), np.int32)
            nxt[0, :pairs] = req.prompt[start + 1:start + 1 + pairs]
            self.mtp_state = _jit_mtp_prefill(self.model.params, self.mtp, self.mtp_state, req.slot, hidden,
                                              jnp.asarray(nxt), jnp.asarray([pairs], jnp.int32), self.cfg,
                                              self.moe_impl)
            if final:
                req.mtp_hidden = np.asarray(_row_at(hidden[0], n - 1).astype(jnp.float32))[None]
        if not final:
            return []
        sp = self._sampling_arrays([req.params])
        keys = row_keys(np.asarray([req.seed], np.uint32), np.zeros((1,), np.uint32))
        tok, lp_info, self.seen, self.out_counts = _jit_sample_rows(
            last_logits, sp, keys, self.seen, self.out_counts, jnp.asarray([req.slot]),
            _n_logprobs([req]))
        lp_info = _to_host(lp_info)
        out = self._emit(req, [int(tok[0])], [_lp(lp_info, 0, 0, req.params.logprobs)])
        if req.params.prompt_logprobs is not None:
            out.prompt_logprobs = [None] + req.prompt_lps
            req.prompt_lps = []
        return [out]

    def _emit(self, req: Request, toks: list[int], lps: list[dict]) -> Output:
        out = Output(req.id, [], [])
        for t, lp in zip(toks, lps):
            req.history.append(t)
            req.generated += 1
            out.token_ids.append(t)
            if req.params.logprobs or lp:
                out.logprobs.append(lp)
            stop = (t in self.eos and not req.params.ignore_eos) or t in req.params.stop_token_ids
            if stop or req.generated >= req.params.max_tokens:
                out.finished, out.finish_reason = True, ("stop" if stop else "length")
                break
        req.pending = out.token_ids[-1] if out.token_ids else req.pending
        if out.finished:
            req.done = True
            self.slots[req.slot] = None
            self.requests.pop(req.id, None)
        return out

    def _sampling_arrays(self, params: list[SamplingParams]) -> SamplingArrays:
        """The per-row sampling parameters on the device, rebuilt only when the batch's parameters change (a
        steady batch would otherwise pay seven host-to-device copies per step). The MTP drafter takes the same
        arrays: it drafts with the rows' penalties and logit bias, as the verify judges."""
        key = tuple(params)
        if self._sp_cache is None or self._sp_cache[0] != key:
            self._sp_cache = (key, SamplingArrays.stack(params))
        return self._sp_cache[1]

    def _row_inputs(self, reqs: list[Request], queued=frozenset()):
        """A decode step's per-row inputs as one [5, slots] uint32 array (one host-to-device copy, handed to the
        program as NumPy: jnp.asarray would dispatch an eager conversion first, 0.4 ms per step on the H200's
        host): the host token, whether the token comes from the host (else from the step in flight), n_valid, the
        seed and the sampling counter; and the rows' SamplingParams. `queued`: ids of the requests whose token is
        still on the device; their counters count it."""
        packed = np.zeros((5, len(self.slots)), np.uint32)
        packed[1] = 1
        params = [SamplingParams()] * len(self.slots)
        for r in reqs:
            q = id(r) in queued
            packed[:, r.slot] = (0 if q else r.pending, not q, 1, r.seed, r.generated + q)
            params[r.slot] = r.params
        return packed, params

    def _decode(self, reqs: list[Request]) -> list[Output]:
        packed, params = self._row_inputs(reqs)
        hist = [[] for _ in range(len(self.slots))]
        for r in reqs:
            hist[r.slot] = self._context_tail(r.history, len(r.history) - 1)
        tokens = packed[0].astype(np.int32)[:, None]
        sp, nlp, greedy = self._sampling_arrays(params), _n_logprobs(reqs), all(r.params.greedy for r in reqs)

        def whole(ple, cb=None, front=None):
            pk, rows = packed, None
            if isinstance(ple, np.ndarray) and not np.issubdtype(ple.dtype, np.integer) and \
                    ple.nbytes <= PACK_ROWS_MAX_BYTES:
                # host rows: appended to the row inputs as uint32 words, so the launch copies one NumPy array in,
                # not two (each NumPy argument costs a launch ~0.1 ms of host time on the H200)
                pk, rows, ple = _pack_rows(packed, ple), (str(ple.dtype), ple.shape[-1]), None
            return _jit_decode(self.model.params, self.state, pk, ple, sp, self.seen, self.out_counts, self.cfg,
                               self.moe_impl, nlp, greedy=greedy, ple_cb=cb, front=front, packed_rows=rows)

        self.state, tok, lp_info, self.seen, self.out_counts = self._run_ple(
            hist, tokens, whole,
            lambda: _jit_front(*front_inputs(self.cfg, self.model.params, self.state), tokens,
                               packed[2].astype(np.int32), self.cfg, self.moe_impl),
            lambda fr, rows: whole(rows, front=fr))
        self.stats["decode_steps"] += 1
        tok, lp_info = _to_host((tok, lp_info))
        return [self._emit(r, [int(tok[r.slot])], [_lp(lp_info, r.slot, 0, r.params.logprobs)]) for r in reqs]

    def _decode_overlapped(self, reqs: list[Request]) -> "_Inflight":
        """Launch one decode step for `reqs` without waiting for anything: a request whose previous token is
        still on the device (it was in the step in flight) takes it from there; one whose token the host already
        emitted (its prefill just ended) passes it in. Sampling counters count the in-flight token, so the
        random streams are those of the synchronous engine."""
        prev = self._inflight
        packed, params = self._row_inputs(reqs, {id(r) for r, _ in prev.batch} if prev is not None else set())
        n = _n_logprobs(reqs)
        io = self._io_buffers(n)
        # Every buffer the step program reads or writes keeps its device address from step to step: the row
        # inputs are copied into a donated buffer by a one-copy program first, the previous token is read from and
        # the new token and logprob arrays written into donated buffers, and the host reads copies a small program
        # writes into buffers of their own (`HostCopies`: no allocation between launches). XLA re-records a
        # program's whole CUDA graph (~2 us a kernel on the H200's host) before any launch in which a buffer it
        # uses has moved; a fresh output still alive at the next launch (the token array the host has not read
        # yet) moved on every step.
        io["packed"] = _jit_io_put(io["packed"], packed)
        self.state, io["tok"], io["lp"][n], self.seen, self.out_counts = _jit_decode_overlap(
            self.model.params, self.state, io["tok"], io["packed"], io["lp"][n], self._ngram_tables,
            self._sampling_arrays(params), self.seen, self.out_counts, self.cfg, self.moe_impl, n,
            greedy=all(r.params.greedy for r in reqs))
        tok, lp_info = self._copies.take(("decode", n), (io["tok"], io["lp"][n]))
        self.stats["decode_steps"] += 1
        return _Inflight([(r, r.slot) for r in reqs], tok, lp_info)

    def _io_buffers(self, n_logprobs: int) -> dict:
        """The overlapped decode's fixed buffers (made at the first step, replicated on a mesh): the row inputs
        [5, slots] uint32, the last sampled token per slot, and per logprob count the (chosen, top values, top ids)
        arrays the step writes."""
        slots = len(self.slots)
        if self._io is None:
            self._io = {"packed": self._replicated(np.zeros((5, slots), np.uint32)),
                        "tok": self._replicated(np.zeros((slots,), np.int32)), "lp": {}}
        if n_logprobs not in self._io["lp"]:
            self._io["lp"][n_logprobs] = self._lp_buffers(1, n_logprobs)
        return self._io

    def _spec_buffers(self, host: dict, n_logprobs: int) -> dict:
        """The speculative round's fixed buffers (`_jit_spec_round`): the host rows (shapes of `host`), the round's
        outputs (hidden rows [S, k+1, D] in the model's dtype, tokens [S, k+1], accepted counts [S]) and per
        logprob count the (chosen, top values, top ids) arrays [S, k+1(, n)]."""
        slots, k = len(self.slots), self.k
        if self._spec_io is None:
            self._spec_io = {
                "host": self._replicated({name: np.zeros(a.shape, a.dtype) for name, a in host.items()}),
                "out": self._replicated({"hidden": jnp.zeros((slots, k + 1, self.cfg.hc_dim), self.model.dtype),
                                       "tok": np.zeros((slots, k + 1), np.int32),
                                       "n_acc": np.zeros((slots,), np.int32)}),
                "lp": {}}
        if n_logprobs not in self._spec_io["lp"]:
            self._spec_io["lp"][n_logprobs] = self._lp_buffers(k + 1, n_logprobs)
        return self._spec_io

    def _replicated(self, tree):
        """`tree` on the device, replicated over the engine's mesh when it has one."""
        if self.mesh is None:
            return jax.device_put(tree)
        from fnx import parallel
        return parallel.place(tree, parallel.replicated(self.mesh, tree))

    def _lp_buffers(self, width: int, n_logprobs: int):
        """Per-row (chosen, top values, top ids) logprob buffers [S, width(, n)] a program writes in place."""
        slots = len(self.slots)
        return self._replicated((np.zeros((slots, width), np.float32),
                                 np.zeros((slots, width, n_logprobs), np.float32),
                                 np.zeros((slots, width, n_logprobs), np.int32)))

    def _finish_inflight(self, inf: "_Inflight") -> list[Output]:
        """Bring a queued step's tokens to the host and emit them; requests that ended (or were aborted) after it
        was launched drop what it computed for them."""
        tok, lp_info = _to_host((inf.tokens, inf.lp_info))
        outs = []
        for r, slot in inf.batch:
            if r.done or self.slots[slot] is not r:
                continue
            outs.append(self._emit(r, [int(tok[slot])], [_lp(lp_info, slot, 0, r.params.logprobs)]))
        return outs

    def _spec_round(self, reqs: list[Request]) -> list[Output]:
        """One speculative round, synchronous: launched, then its tokens emitted."""
        return self._spec_finish(self._spec_launch(reqs))

    def _spec_launch(self, reqs: list[Request]) -> _SpecInflight:
        """Launch one speculative round (the MTP draft program, then the verify program) for `reqs` without
        waiting for it. A request that was in the round in flight (`self._inflight`, overlapped engines) takes
        its inputs from that round's outputs on the device: the MTP layer's pairs (the accepted window's hidden
        rows and tokens), the pending token and the sampling counter advanced by the accepted count; the others
        (a prefill that just ended, or every request of a synchronous engine) pass theirs from the host."""
        k, slots, sd = self.k, len(self.slots), self.cfg.hc_dim
        prev = self._inflight if isinstance(self._inflight, _SpecInflight) else None
        queued = {id(r) for r, _ in prev.batch} if prev is not None else set()
        hid = np.zeros((slots, k + 1, sd), np.float32)
        pair_tok = np.zeros((slots, k + 1), np.int32)
        count = np.zeros((slots,), np.int32)
        pending = np.zeros((slots,), np.int32)
        from_host = np.ones((slots,), bool)
        params = [SamplingParams()] * slots
        seeds = np.zeros((slots,), np.uint32)
        counters = np.zeros((slots,), np.uint32)
        active = np.zeros((slots,), bool)
        for r in reqs:
            params[r.slot] = r.params
            seeds[r.slot], counters[r.slot] = r.seed, r.generated
            active[r.slot] = True
            if id(r) in queued:
                from_host[r.slot] = False
                continue
            rows = np.asarray(r.mtp_hidden, np.float32)
            hid[r.slot, :len(rows)] = rows
            toks = r.mtp_tokens + [r.pending]
            pair_tok[r.slot, :len(toks)] = toks
            count[r.slot] = len(toks)
            pending[r.slot] = r.pending
        sp = self._sampling_arrays(params)
        greedy = all(r.params.greedy for r in reqs)
        dtype = self.model.dtype
        nlp = _n_logprobs(reqs)
        # a row with penalties: the verify program penalizes each window position and updates seen / counts (rows
        # without them never read theirs, so a round without any leaves them as they are: one program fewer)
        penalized = any(r.params.uses_penalties for r in reqs)
        if self.model.ple_store is None:
            # the whole round in one program whose buffers keep their addresses (`_jit_spec_round`); the host rows
            # go in as one packed array through a one-copy program, the host reads copies of the outputs written
            # into buffers of their own (`HostCopies`)
            host = {"hid": hid, "pair_tok": pair_tok, "count": count, "pending": pending, "from_host": from_host,
                    "seeds": seeds, "counters": counters, "active": active}
            io = self._spec_buffers(host, nlp)
            io["host"] = _jit_io_put(io["host"], pack_host(host))
            pen = (self.seen, self.out_counts) if penalized else None
            self.mtp_state, self.state, io["out"], io["lp"][nlp], pen = _jit_spec_round(
                self.model.params, self.mtp, self.mtp_state, self.state, io["out"], io["lp"][nlp], io["host"],
                self._ngram_tables, self.draft_head, self.hot, sp, pen, self.cfg, self.moe_impl, k, nlp,
                greedy=greedy)
            if penalized:
                self.seen, self.out_counts = pen
            out, lp_info = self._copies.take(("spec", nlp), (io["out"], io["lp"][nlp]))
            self.stats["rounds"] += 1
            return _SpecInflight([(r, r.slot) for r in reqs], out["tok"], out["n_acc"], out["hidden"], lp_info)
        # a host PLE store: the engine is never overlapped, so every row comes from the host and the previous
        # round's slots are stand-ins that `_jit_spec_inputs` does not read
        if queued:
            raise RuntimeError("internal: a round of an engine with a host PLE store found a round in flight (such "
                               "an engine runs its rounds synchronously)")
        if self._spec_none is None:
            self._spec_none = (jnp.zeros((slots, k + 1, sd), dtype), jnp.zeros((slots, k + 1), jnp.int32),
                               jnp.zeros((slots,), jnp.int32))
        hid_d, pair_d, count_d, pending_d, keys = _jit_spec_inputs(
            *self._spec_none, hid, pair_tok, count, pending, from_host, seeds, counters, dtype=jnp.dtype(dtype))
        self.mtp_state, drafts, q_lp = _jit_draft(
            self.model.params, self.mtp, self.mtp_state, hid_d, pair_d, count_d, sp,
            keys, self.cfg, self.moe_impl, k, self.draft_head, self.hot, greedy=greedy,
            pen=(self.seen, self.out_counts) if penalized else None)

        def run_verify(verify, ple, cb=None, front=None):
            pen = (self.seen, self.out_counts) if penalized else None
            out = _jit_verify(self.model.params, self.state, verify, active, ple, q_lp, sp, keys,
                              self.cfg, self.moe_impl, nlp, greedy=greedy, ple_cb=cb, front=front, pen=pen)
            if penalized:
                self.seen, self.out_counts = out[5]
            return out[:5]

        # a host PLE store needs the drafts on the host to fetch their rows (never overlapped)
        drafts = np.asarray(drafts)                                   # [S, k]
        verify = np.zeros((slots, k + 1), np.int32)
        hist = [[] for _ in range(slots)]
        for r in reqs:
            verify[r.slot, 0] = r.pending
            verify[r.slot, 1:] = drafts[r.slot]
            hist[r.slot] = self._context_tail(r.history, len(r.history) - 1)
        n_valid = np.where(active, k + 1, 0).astype(np.int32)
        self.state, out_tok, n_acc, hidden, lp_info = self._run_ple(
            hist, verify, lambda ple, cb: run_verify(verify, ple, cb),
            lambda: _jit_front(*front_inputs(self.cfg, self.model.params, self.state), verify, n_valid, self.cfg,
                               self.moe_impl, snapshots=True),
            lambda fr, rows: run_verify(verify, rows, front=fr))
        self.stats["rounds"] += 1
        return _SpecInflight([(r, r.slot) for r in reqs], out_tok, n_acc, hidden, lp_info)

    def _spec_finish(self, inf: _SpecInflight) -> list[Output]:
        """Bring a round's tokens to the host (one transfer for all its arrays) and emit them; requests that ended
        (or were aborted) after it was launched drop what it computed for them."""
        out_tok, n_acc, hidden, lp_info = jax.device_get((inf.tokens, inf.n_acc, inf.hidden, inf.lp_info))
        hidden = np.asarray(hidden, np.float32)
        k = self.k
        outs = []
        for r, slot in inf.batch:
            if r.done or self.slots[slot] is not r:
                continue
            a = int(n_acc[slot])
            self.stats["row_rounds"] = self.stats.get("row_rounds", 0) + 1
            r.drafted += k
            r.accepted += a
            self.stats["drafted"] += k
            self.stats["accepted"] += a
            new = [int(t) for t in out_tok[slot, :a + 1]]
            # the MTP layer's next pairs: (H_P+j, token P+j+1) for the accepted window
            r.mtp_hidden = hidden[slot, :a + 1]
            r.mtp_tokens = new[:-1]
            outs.append(self._emit(r, new, [_lp(lp_info, slot, j, r.params.logprobs) for j in range(a + 1)]))
        return outs

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per speculative round (accepted drafts + the bonus token)."""
        r = self.stats.get("row_rounds", 0)
        return self.stats["accepted"] / r + 1 if r else 0.0


MAX_LOGPROBS = 20


def positions_reserved(k: int, overlap: bool) -> int:
    """`Engine.reserve` for speculative k (0: plain decode) with or without overlap."""
    return k + 1 + (max(k - 1, 0) if overlap else 0)


def draft_head(head, hot, fp8: bool, dtype):
    """The MTP drafter's own head, or None when it drafts through the model's lm_head: the rows of the hot-token
    ids `hot` [H] (of an FP8 head: dequantized, its 128-row blocks no longer whole) and / or FP8 128x128 blocks."""
    from fnx.model import quant
    out = None
    if hot is not None:
        out = (quant.dequantize(head, dtype) if quant.is_quantized(head) else head)[hot]
    if fp8:
        src = head if out is None else out
        out = src if quant.is_quantized(src) else quant.quantize_fp8_block(src)
    return out


def _n_logprobs(reqs) -> int:
    """0 or MAX_LOGPROBS: two compiled variants, whatever each request asks for (trimmed on the host)."""
    return MAX_LOGPROBS if any(r.params.logprobs for r in reqs) else 0


def _to_host(tree):
    """A step's outputs (tokens, logprob arrays) brought to the host together, once per step (not once per
    request): every copy is started before the first is waited for (one round trip, not one per array)."""
    return jax.device_get(tree)


def _lp(info, row, j, n) -> dict:
    if info is None:
        return {}
    chosen, vals, ids = (np.asarray(a) for a in info)
    out = {"logprob": float(chosen[row, j])}
    if n:
        out["top"] = [(int(ids[row, j, i]), float(vals[row, j, i])) for i in range(n)]
    return out


# ---- jitted programs ---------------------------------------------------------------------------------------------

@partial(jax.jit, static_argnums=(0,), donate_argnums=(1,))
def _jit_slot_put(cfg, state, slot, sub):
    return slot_put(cfg, state, slot, sub)


@partial(jax.jit, donate_argnums=(0,))
def _jit_mtp_put(state, slot, sub):
    return jax.tree.map(lambda a, s: jax.lax.dynamic_update_slice_in_dim(a, s, slot, axis=0), state, sub)


@partial(jax.jit, donate_argnums=(0, 1))
def _reset_row(seen, counts, slot, row):
    return seen.at[slot].set(row), counts.at[slot].set(0)


def _step_any(params, state, tokens, ple, front, ple_cb, **kw):
    """`step` on a PLE input (ids, or rows from a host store), or its second half `step_back` continuing
    `front`; with ple_cb (an _InGraphFetch) the ids' rows are fetched by a host callback inside the program."""
    ple_ids, ple_rows = ple_split(ple)
    if ple_cb is not None and ple_ids is not None:
        from fnx.ple.pipeline import fetch_rows_in_graph
        ple_ids, ple_rows = None, fetch_rows_in_graph(ple_cb.store, ple_ids, ple_cb.method)
    if front is None:
        return step(params, state, tokens, ple_ids, ple_rows=ple_rows, **kw)
    return step_back(params, state, tokens, front, ple_ids, ple_rows=ple_rows, **kw)


@partial(jax.jit, static_argnames=("cfg", "moe_impl", "snapshots"))
def _jit_front(params, state, tokens, n_valid, cfg, moe_impl, snapshots=False):
    """The first of a step's two programs when a host store's rows are fetched meanwhile (`step_front`)."""
    return step_front(params, state, tokens, cfg=cfg, moe_impl=moe_impl, n_valid=n_valid, snapshots=snapshots)


@partial(jax.jit, static_argnames=("cfg", "moe_impl"))
def _jit_prefill_front(params, state, slot, tokens, n_valid, cfg, moe_impl):
    return step_front(params, slot_take(cfg, state, slot), tokens, cfg=cfg, moe_impl=moe_impl, n_valid=n_valid)


@partial(jax.jit, static_argnames=("cfg", "moe_impl", "ple_cb"), donate_argnames=("state",))
def _jit_prefill(params, state, slot, tokens, n_valid, ple, cfg, moe_impl, ple_cb=None, front=None):
    sub = slot_take(cfg, state, slot)
    # the head on each row's last valid token only (the chunk's other logits are never read)
    logits, sub, hidden, _ = _step_any(params, sub, tokens, ple, front, ple_cb, cfg=cfg, moe_impl=moe_impl,
                                       n_valid=n_valid, logits_at=jnp.maximum(n_valid - 1, 0))
    return slot_put(cfg, state, slot, sub), logits[:, 0], hidden


@partial(jax.jit, static_argnames=("cfg", "moe_impl"), donate_argnames=("mstate",))
def _jit_mtp_prefill(params, mp, mstate, slot, hidden, next_tokens, n_valid, cfg, moe_impl):
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=0)  # noqa: E731
    sub = jax.tree.map(take, mstate)
    _, sub, _ = mtp_step(params, mp, sub, hidden, next_tokens, cfg=cfg, n_valid=n_valid, moe_impl=moe_impl)
    return jax.tree.map(lambda a, s: jax.lax.dynamic_update_slice_in_dim(a, s, slot, axis=0), mstate, sub)


PROMPT_LP_ROWS = 512   # positions whose [rows, vocab] logprobs exist at once (the released vocabulary: 0.5 GB)


@partial(jax.jit, static_argnames=("cfg", "n_top"))
def _jit_prompt_logprobs(params, hidden, targets, cfg, n_top):
    """A prefill chunk's prompt logprobs from its multi-stream hidden rows [1, L, S*D] (what the step returns): the
    final mixer and the lm_head over every position (the step itself keeps only the last row's logits), then each
    position's log-probability of `targets` [1, L] (the next prompt token) and the n_top most likely; in blocks of
    PROMPT_LP_ROWS positions, so a long chunk never holds all its logits."""
    length = hidden.shape[1]
    rows = min(length, PROMPT_LP_ROWS)
    blocks = -(-length // rows)
    pad = blocks * rows - length
    h = jnp.pad(hidden[0], ((0, pad), (0, 0))).reshape(blocks, 1, rows, hidden.shape[-1])
    t = jnp.pad(targets[0], (0, pad)).reshape(blocks, 1, rows)

    def block(args):
        hb, tb = args
        x = hyper.gated_residual(params["hyper_connection_mixer"], hb, cfg.hc_count, cfg.rms_norm_eps, inject=False)
        lp = jax.nn.log_softmax(linear(x, params["lm_head"]).astype(jnp.float32), axis=-1)
        vals, ids = lax.top_k(lp, max(n_top, 1))
        return jnp.take_along_axis(lp, tb[..., None], axis=-1)[..., 0], vals[..., :n_top], ids[..., :n_top]
    chosen, vals, ids = lax.map(block, (h, t))
    flat = lambda a: a.reshape(1, blocks * rows, *a.shape[3:])[:, :length]  # noqa: E731
    return flat(chosen), flat(vals), flat(ids)


@jax.jit
def _row_at(x, i):
    return jax.lax.dynamic_index_in_dim(x, i, axis=0, keepdims=False)


def _update_counts(seen, counts, slots, tok):
    return seen.at[slots, tok].set(True), counts.at[slots, tok].add(1)


@partial(jax.jit, static_argnames=("n_logprobs",), donate_argnames=("seen", "counts"))
def _jit_sample_rows(logits, sp, keys, seen, counts, slots, n_logprobs):
    tok, _ = sample(logits, sp, keys, seen[slots], counts[slots])
    info = top_logprobs(logits, tok, n_logprobs)
    seen, counts = _update_counts(seen, counts, slots, tok)
    return tok, jax.tree.map(lambda a: a[:, None], info), seen, counts


def _decode_core(params, state, tokens, n_valid, ple, sp, keys, seen, counts, cfg, moe_impl, n_logprobs, greedy,
                 ple_cb=None, front=None):
    logits, state, _, _ = _step_any(params, state, tokens, ple, front, ple_cb, cfg=cfg, moe_impl=moe_impl,
                                    n_valid=n_valid)
    if greedy:      # every row at temperature 0: the argmax, no sort over the vocabulary (same tokens as sample)
        tok = greedy_tokens(logits[:, 0], sp, seen, counts)
    else:
        tok, _ = sample(logits[:, 0], sp, keys, seen, counts)
    info = top_logprobs(logits[:, 0], tok, n_logprobs)
    rows = jnp.arange(tokens.shape[0])
    active = n_valid > 0
    # scatters that leave inactive rows as they were: the buffers update in place (a where over [S, V] between
    # old and new arrays made XLA copy both whole every step)
    seen = seen.at[rows, tok].max(active)
    counts = counts.at[rows, tok].add(active.astype(counts.dtype))
    return state, tok, jax.tree.map(lambda a: a[:, None], info), seen, counts


# Host PLE rows up to this size ride in the decode step's packed row inputs. Measured on the H200 (BENCHMARKS.md):
# at 1 slot (5 KB of rows) the launch took 0.15 ms less; at 16 slots (80 KB) it was not faster, so larger blocks
# stay a separate argument.
PACK_ROWS_MAX_BYTES = 16384


def _pack_rows(packed: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """[5, S] uint32 row inputs + host PLE rows [S, 1, E] (2- or 4-byte floats) -> [5 + E * itemsize / 4, S]."""
    words = np.ascontiguousarray(rows).reshape(rows.shape[0], -1).view(np.uint32)
    return np.concatenate([packed, words.T])


def _unpack_rows(packed, spec):
    """The rows `_pack_rows` appended, back as [S, 1, E] of their dtype (spec: (dtype name, E))."""
    dtype, width = jnp.dtype(spec[0]), spec[1]
    words = packed[5:].T                                               # [S, E * itemsize / 4] uint32
    return lax.bitcast_convert_type(words, dtype).reshape(words.shape[0], 1, width)


@partial(jax.jit, static_argnames=("cfg", "moe_impl", "n_logprobs", "greedy", "ple_cb", "packed_rows"),
         donate_argnames=("state", "seen", "counts"))
def _jit_decode(params, state, packed, ple, sp, seen, counts, cfg, moe_impl, n_logprobs, greedy=False, ple_cb=None,
                front=None, packed_rows=None):
    """One decode step of every slot. packed [5, S] uint32 (`Engine._row_inputs`): token, (unused here: every
    token comes from the host), n_valid, seed, counter per row; greedy (static) when every active row is at
    temperature 0. front: the hand-over of `_jit_front` (then this is the step's second program).
    packed_rows (static (dtype, width)): host PLE rows follow in packed[5:] (`_pack_rows`), ple is None."""
    if packed_rows is not None:
        ple = _unpack_rows(packed, packed_rows)
    tokens = packed[0].astype(jnp.int32)[:, None]
    keys = row_keys(packed[3], packed[4])
    return _decode_core(params, state, tokens, packed[2].astype(jnp.int32), ple, sp, keys, seen, counts, cfg,
                        moe_impl, n_logprobs, greedy, ple_cb, front)


# keep_unused: a donated buffer the program only writes (the row inputs here, the logprob arrays in the step) is
# still a parameter, so its output is written in place (JAX drops unused parameters otherwise, and the output
# becomes a new buffer every call)
@partial(jax.jit, donate_argnames=("dst",), keep_unused=True)
def _jit_io_put(dst, packed):
    """The host's row inputs, packed by `pack_host` into one uint32 array [rows, words] (one host-to-device copy
    per launch, not one per array), unpacked into the donated device buffers `dst` (a pytree of arrays [rows, ...]
    of 4-byte or bool dtypes, in `pack_host`'s leaf order): the big programs then read them at fixed addresses."""
    out, off = [], 0
    leaves, tree = jax.tree.flatten(dst)
    for d in leaves:
        w = math.prod(d.shape[1:])
        words = packed[:, off:off + w]
        off += w
        v = words != 0 if d.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(words, d.dtype)
        out.append(v.reshape(d.shape))
    return jax.tree.unflatten(tree, out)


def pack_host(tree) -> np.ndarray:
    """`tree` (host arrays [rows, ...] of 4-byte or bool dtypes) as one uint32 array [rows, words] for
    `_jit_io_put` (each NumPy argument costs a launch ~0.1 ms of host time on the H200)."""
    cols = []
    for a in jax.tree.leaves(tree):
        a = np.ascontiguousarray(a)
        if a.dtype == np.bool_:
            a = a.astype(np.uint32)
        elif a.dtype.itemsize != 4:
            raise TypeError(f"pack_host takes 4-byte or bool arrays, got {a.dtype}")
        cols.append(a.view(np.uint32).reshape(a.shape[0], -1))
    return np.concatenate(cols, axis=1)


def _like(dst, src):
    """`src` cast and shaped as the donated tree `dst`, so that XLA writes each leaf in its buffer's place."""
    return jax.tree.map(lambda d, a: a.astype(d.dtype).reshape(d.shape), dst, src)


@partial(jax.jit, donate_argnames=("dst",), keep_unused=True)
def _jit_io_get(dst, src):
    """Copies of a program's output buffers `src`, written into the donated buffers `dst` (`HostCopies`), for the
    host to read while the next launch (which writes the buffers again) runs."""
    return _like(dst, src)


class HostCopies:
    """Two sets of device buffers, used in turn, that take the copies of a program's outputs the host reads
    (`_jit_io_get`). The copies are written in place, so no device memory is allocated between launches: a fresh
    copy still held while the next launch allocated its temporaries (the overlapped engine reads a round's outputs
    after launching the next) moved those temporaries, and XLA re-recorded the round's whole CUDA graph before
    every launch (BENCHMARKS.md, forty-first session). Two sets suffice because at most one launch is in flight:
    the engine reads a launch's copies before it makes the launch after next, whose copies overwrite them."""

    def __init__(self, place):
        self.place = place            # host tree -> device tree (replicated over the engine's mesh)
        self.sets: dict = {}          # key -> [set 0, set 1, index of the set used next]

    def take(self, key, src):
        """Copies of the device tree `src` in the next set of `key`'s buffers (made at the first call)."""
        ring = self.sets.get(key)
        if ring is None:
            zeros = lambda: self.place(jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), src))  # noqa: E731
            ring = self.sets[key] = [zeros(), zeros(), 0]
        i = ring[2]
        try:
            ring[i] = _jit_io_get(ring[i], src)
        except Exception:
            del self.sets[key]      # its donated set may be gone: made afresh at the next call
            raise
        ring[2] = 1 - i
        return ring[i]


@partial(jax.jit, static_argnames=("cfg", "moe_impl", "n_logprobs", "greedy"),
         donate_argnames=("state", "prev_tok", "lp", "seen", "counts"), keep_unused=True)
def _jit_decode_overlap(params, state, prev_tok, packed, lp, tables, sp, seen, counts, cfg, moe_impl, n_logprobs,
                        greedy=False):
    """`_jit_decode` for the overlapped engine: each row's token is the previous step's sample (still on the
    device, in `prev_tok`) or the one the host passes, and the PLE n-gram ids come from the state's n-gram context.
    packed [5, S] uint32: host token, from-host flag, n_valid, seed, counter per row. The new tokens and logprob
    arrays are returned in the donated `prev_tok` and `lp` buffers' place (`Engine._decode_overlapped`)."""
    from fnx.model.ngram_device import ngram_ids_device
    tokens = jnp.where(packed[1] != 0, packed[0].astype(jnp.int32), prev_tok)[:, None].astype(jnp.int32)
    ids = ngram_ids_device(state["ngram_ctx"], tokens, tables) if tables is not None else None
    keys = row_keys(packed[3], packed[4])
    state, tok, info, seen, counts = _decode_core(params, state, tokens, packed[2].astype(jnp.int32), ids, sp, keys,
                                                  seen, counts, cfg, moe_impl, n_logprobs, greedy)
    return state, _like(prev_tok, tok), _like(lp, info), seen, counts


@partial(jax.jit, static_argnames=("dtype",))
def _jit_spec_inputs(prev_hidden, prev_tok, prev_nacc, hid, pair_tok, count, pending, from_host, seeds, counters,
                     dtype):
    """A speculative round's draft inputs in an overlapped engine: per row, from the host (hid [S, k+1, D] f32,
    pair_tok [S, k+1], count [S], pending [S], where from_host) or from the round in flight on the device: its
    accepted window's a+1 hidden rows and tokens as the MTP layer's pairs (the rest zero, as the host fills them),
    its last token pending, and the sampling counter advanced by a+1 (what the host adds on emitting them).
    Returns (hidden in `dtype`, pair_tok, count, pending, keys)."""
    n = prev_nacc.astype(jnp.int32) + 1                                              # [S]
    keep = jnp.arange(prev_tok.shape[1])[None, :] < n[:, None]                         # [S, k+1]
    dev_hid = jnp.where(keep[..., None], prev_hidden.astype(jnp.float32), 0.0)
    dev_tok = jnp.where(keep, prev_tok.astype(jnp.int32), 0)
    dev_pending = jnp.take_along_axis(prev_tok.astype(jnp.int32), (n - 1)[:, None], axis=1)[:, 0]
    fh = from_host
    hid = jnp.where(fh[:, None, None], hid, dev_hid).astype(dtype)
    pair_tok = jnp.where(fh[:, None], pair_tok, dev_tok)
    count = jnp.where(fh, count, n)
    pending = jnp.where(fh, pending, dev_pending)
    counters = jnp.where(fh, counters, counters + n.astype(jnp.uint32))
    return hid, pair_tok, count, pending, row_keys(seeds, counters)


@partial(jax.jit, static_argnames=("cfg", "moe_impl", "k", "n_logprobs", "greedy"),
         donate_argnames=("mstate", "state", "io", "lp", "pen"), keep_unused=True)
def _jit_spec_round(params, mp, mstate, state, io, lp, host, tables, head, hot, sp, pen, cfg, moe_impl, k,
                    n_logprobs, greedy=False):
    """One speculative round in one program (device PLE; `Engine._spec_launch`): the draft inputs from the host
    rows or, for rows of the round before, from its outputs in `io` (`_jit_spec_inputs`), the MTP drafts, the
    verify window and its n-gram ids, and the verify. The round's outputs (hidden rows, tokens, accepted counts,
    logprob arrays) are written in the donated `io` / `lp` buffers' place and the host rows are read from `host`
    (filled by `_jit_io_put`), so no buffer of the program moves between rounds and XLA keeps its CUDA graph."""
    hid_d, pair_d, count_d, pending_d, keys = _jit_spec_inputs(
        io["hidden"], io["tok"], io["n_acc"], host["hid"], host["pair_tok"], host["count"], host["pending"],
        host["from_host"], host["seeds"], host["counters"], dtype=io["hidden"].dtype)
    mstate, drafts, q_lp = _jit_draft(params, mp, mstate, hid_d, pair_d, count_d, sp, keys, cfg, moe_impl, k,
                                      head, hot, greedy=greedy, pen=pen)
    verify, ple = _jit_verify_window(pending_d, drafts, state["ngram_ctx"], tables)
    state, toks, n_acc, hidden, info, pen = _jit_verify(params, state, verify, host["active"], ple, q_lp, sp, keys,
                                                        cfg, moe_impl, n_logprobs, greedy=greedy, pen=pen)
    return mstate, state, _like(io, {"hidden": hidden, "tok": toks, "n_acc": n_acc}), _like(lp, info), pen


@jax.jit
def _jit_verify_window(pending, drafts, ngram_ctx, tables):
    """The speculative round's verify tokens [S, k+1] = [pending, drafts] and their PLE n-gram ids (None without a
    PLE layer), on the device."""
    from fnx.model.ngram_device import ngram_ids_device
    verify = jnp.concatenate([pending[:, None], drafts.astype(jnp.int32)], axis=1)
    return verify, (ngram_ids_device(ngram_ctx, verify, tables) if tables is not None else None)


@partial(jax.jit, static_argnames=("cfg", "moe_impl", "k", "greedy"), donate_argnames=("mstate",))
def _jit_draft(params, mp, mstate, hidden, pair_tok, count, sp, keys, cfg, moe_impl, k, head=None, hot=None,
               greedy=False, pen=None):
    """MTP catch-up on the pending pairs (committed), then k-1 chained draft steps (discarded).
    With a hot-token head [H, D] and its ids hot [H], drafts are drawn over that subset.
    greedy (every row at temperature 0): each draft is the head's argmax through the fused GEMV-argmax (no
    logits, no softmax or sort over the vocabulary), and its distribution is the one-hot greedy rows get anyway.
    The drafts aim at the token each row's target will choose: sp's logit bias (when the batch has one) is added
    to the draft logits as the verify adds it, and pen (None, or (seen [B, V] bool, counts [B, V] int32) when a
    row has penalties) penalizes draft i as the verify penalizes window position i (the history and drafts
    0..i-1). Either computes the draft logits (no fused argmax, even greedy); rows without penalties or bias get
    the plain logits through neutral parameters.
    Returns (committed MTP state, drafts [B, k], draft log-distributions over the full vocabulary [B, k, V];
    None when greedy: a greedy verify compares tokens and needs no distribution).
    The catch-up and the chained steps take their kernels' counters from one pool for the whole program
    (`fnx.model.transformer.counter_pool`; one zeroing launch, not one per step)."""
    from fnx.model.transformer import counter_pool
    from fnx.pallas import grid_sync
    with grid_sync.counter_pool(counter_pool(pair_tok.size, None)):
        return _draft_body(params, mp, mstate, hidden, pair_tok, count, sp, keys, cfg, moe_impl, k, head, hot,
                           greedy, pen)


def _draft_body(params, mp, mstate, hidden, pair_tok, count, sp, keys, cfg, moe_impl, k, head, hot, greedy, pen):
    """`_jit_draft`'s work, traced within its counter pool."""
    vocab = params["lm_head"].shape[0]

    def widen(lg):  # subset logits -> full vocabulary, -inf outside the subset
        if hot is None:
            return lg
        return jnp.full(lg.shape[:-1] + (vocab,), -jnp.inf, lg.dtype).at[..., hot].set(lg)

    head_fn = None
    # the head's argmax fused into its GEMV (ids, no logits) where nothing moves the logits before the argmax
    fused = greedy and pen is None and sp.bias_ids.shape[-1] == 0
    if fused:
        def head_fn(out, rows):  # ids [B, L] over the full vocabulary
            ids = linear_argmax(out, rows)
            return ids if hot is None else hot[ids]
    # the head on each row's last valid position only (its logits are the first draft's; the others' are unused)
    logits, mstate, h = mtp_step(params, mp, mstate, hidden, pair_tok, cfg=cfg, n_valid=count, moe_impl=moe_impl,
                                 head=head, head_fn=head_fn, at=count - 1)
    if not fused:
        logits = widen(logits.astype(jnp.float32))
    last = lambda a: jnp.take_along_axis(a, (count - 1).reshape((-1,) + (1,) * (a.ndim - 1)), axis=1)  # noqa
    lg, hh = logits[:, 0], last(h)
    subkeys = jax.vmap(lambda kk: jax.random.split(kk, k + 2))(keys)             # [B, k+2, 2]
    seen = counts = None
    draft_toks, draft_lps = [], []
    scratch = mstate
    for i in range(k):
        if pen is not None:     # the history and the drafts before this one (as the verify's window position i),
            ids = jnp.arange(vocab, dtype=jnp.int32)        # elementwise: no copy of the [B, V] arrays per draft
            extra = sum(((ids == t[:, None]).astype(pen[1].dtype) for t in draft_toks), jnp.zeros((), pen[1].dtype))
            seen, counts = pen[0] | (extra > 0), pen[1] + extra
        if fused:
            tok, lp = lg.astype(jnp.int32), None
        elif greedy:
            tok, lp = greedy_tokens(lg, sp, seen, counts), None
        else:
            tok, lp = sample(lg.astype(jnp.float32), sp, subkeys[:, i], seen, counts)
        draft_toks.append(tok)
        draft_lps.append(lp)
        if i + 1 < k:
            lgs, scratch, hh = mtp_step(params, mp, scratch, hh, tok[:, None], cfg=cfg, moe_impl=moe_impl,
                                        head=head, head_fn=head_fn)
            lg = lgs[:, 0] if fused else widen(lgs[:, 0].astype(jnp.float32))
    return (draft_state_in_place(mstate, scratch), jnp.stack(draft_toks, 1),
            None if greedy else jnp.stack(draft_lps, 1))


# The MTP layer's caches the chained draft steps may write in the committed state's own buffers: position-indexed
# (the KV rows, the indexer's compressed block keys), read only at positions <= a row's pos (the causal mask, the
# complete blocks and the tail), and every position a draft step wrote past the committed pos is written again by
# the next catch-up before pos reaches it (a block's compressed key is recomputed when its last position is). The
# indexer's ring (the current block's last cr keys, indexed by position modulo cr) is not: with k - 1 >= 2 drafts a
# draft can wrap onto a committed position of the same block, which no catch-up rewrites, so it stays the committed
# one (a [B, cr, di] copy), as does pos.
DRAFT_IN_PLACE = ("k", "v", "idx_blocks")
DRAFT_IN_PLACE_ENV = "FNX_MTP_DRAFT_IN_PLACE"    # 0: the chained drafts write a copy (read when a program is traced)


def draft_state_in_place(committed: dict, scratch: dict) -> dict:
    """The MTP state `_jit_draft` returns: the committed state (after the catch-up) with the position-indexed caches
    taken from the chained draft steps' state (`DRAFT_IN_PLACE`). XLA can then update one buffer for the catch-up
    and the drafts: the committed caches are dead once the drafts write theirs, so no copy of the whole cache is
    needed for the drafts to write in (the draft programs measured before this copied the MTP layer's K and V every
    round: two copies, 13 us at 8K and ~180 us at 128K on an H100, more with more slots). Rows past a row's
    committed pos hold the drafts' entries until rewritten. `FNX_MTP_DRAFT_IN_PLACE=0`: the committed state as it
    was (the drafts write a copy), for measurement."""
    v = os.environ.get(DRAFT_IN_PLACE_ENV, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{DRAFT_IN_PLACE_ENV}={v!r}: 1 (the drafts write the committed caches) or 0 (a copy)")
    if v == "0":
        return committed
    layer = dict(committed["layer"])
    for name in DRAFT_IN_PLACE:         # the MTP layer is a QSA layer: each of them is there (a KeyError if not)
        layer[name] = scratch["layer"][name]
    return {**committed, "layer": layer}


@partial(jax.jit, static_argnames=("cfg", "moe_impl", "n_logprobs", "greedy", "ple_cb"),
         donate_argnames=("state", "pen"))
def _jit_verify(params, state, verify, active, ple, q_lp, sp, keys, cfg, moe_impl, n_logprobs, greedy=False,
                ple_cb=None, front=None, pen=None):
    """Target on [pending, d_1..d_k]; speculative rejection sampling (greedy rows: longest matching prefix);
    rollback to the accepted length. Returns (state, tokens [B, k+1] (first a+1 valid), a [B], hidden, logprobs,
    pen). greedy (every row at temperature 0; q_lp may be None): the same tokens and counts from the target's
    argmax and the longest matching prefix, without the filtered distributions (a sort over the vocabulary per
    position) or any random draw. pen: None, or (seen, counts) [B, V] when a row has penalties: each position's
    logits are penalized with its history (`spec.penalized_window`) and the emitted tokens join it (returned)."""
    width = verify.shape[1]
    k = width - 1
    n_valid = jnp.where(active, width, 0).astype(jnp.int32)
    logits, full, hidden, aux = _step_any(params, state, verify, ple, front, ple_cb, cfg=cfg, moe_impl=moe_impl,
                                          n_valid=n_valid, snapshots=True)
    target = logits if pen is None else penalized_window(logits, sp, *pen, verify[:, 1:])
    if sp.bias_ids.shape[-1]:                      # a row with a logit_bias: every position's logits get it
        target = jax.vmap(lambda lg: apply_logit_bias(lg.astype(jnp.float32), sp), in_axes=1, out_axes=1)(target)
    if greedy:
        toks, n_acc = accept_greedy(target, verify[:, 1:])
    else:
        p_lp = jax.vmap(lambda lg: filtered_logprobs(lg.astype(jnp.float32), sp), in_axes=1, out_axes=1)(target)
        subkeys = jax.vmap(lambda kk: jax.random.split(kk, k + 2))(keys)
        toks, n_acc = accept(p_lp, q_lp, verify[:, 1:], subkeys[:, k])
    n_keep = jnp.where(active, n_acc + 1, 0)
    state = rollback(cfg, full, aux, n_keep)
    chosen, vals, ids = jax.vmap(lambda lg, t: top_logprobs(lg, t, n_logprobs), in_axes=(1, 1), out_axes=1)(
        logits, toks)
    if pen is not None:
        pen = commit_window(*pen, toks, n_acc, active)
    return state, toks, n_acc, hidden, (chosen, vals, ids), pen
