"""The engine thread: the only code in the server that calls the engine, and so the only thread that touches the
device. It takes commands from a thread-safe inbox between steps, drives `Engine.step()` while there is work, and
hands each step's outputs to a callback (the scheduler, which moves them onto the event loop)."""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
import traceback
from typing import Callable

from fnx.engine import Engine, Output, SamplingParams

log = logging.getLogger("fnx.serve")

_COMPILE_RE = re.compile(r"Finished XLA compilation of (?:jit\()?([\w.<>-]+)\)? in ([0-9.eE+-]+) sec")


class _CompileCounter(logging.Handler):
    """Counts XLA compilations by function name from JAX's `jax_log_compiles` messages."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}
        self.seconds = 0.0

    def emit(self, record):
        m = _COMPILE_RE.search(record.getMessage())
        if m:
            self.counts[m.group(1)] = self.counts.get(m.group(1), 0) + 1
            self.seconds += float(m.group(2))
            log.warning("compiled %s after warm-up in %s s (a request waited on it)", m.group(1), m.group(2))


def warmup_plan(engine: Engine) -> list[tuple[int, int, int]]:
    """(prompt length, logprobs, max_tokens) of the warm-up requests: one prompt per prefill bucket length a request
    can reach (`Engine.prefill_buckets`: those of both prefill budgets; the warm-up's requests run alone, so each
    prompt prefills in one chunk of the idle budget), each with and without top logprobs (the engine compiles separate programs for n_logprobs 0 and > 0,
    see `LOGPROBS_BUCKET`). Each request generates 2 tokens where the capacity leaves room, so the batched decode
    step (or the MTP draft + verify round) runs too. A prompt must leave its tokens and the engine's reserve within
    the capacity: with a capacity below the prefill chunk, the buckets no prompt reaches are not warmed, and the
    longest one that is gets the longest prompt that fits (one token generated if two do not fit)."""
    longest = engine.capacity - engine.reserve - 1          # the longest prompt a request may have (max_tokens 1)
    if longest < 1:
        raise ValueError(f"a context capacity of {engine.capacity} leaves no room for a prompt: the engine reserves "
                         f"{engine.reserve} positions a request (speculative rounds, overlap); raise --capacity")
    plan = []
    for top in engine.prefill_buckets():       # the longest chunk padded to a bucket is the bucket's length
        n = min(top, longest)
        if engine.prefill_bucket(n) == top:    # some prompt reaches this bucket
            plan.append((n, min(2, engine.capacity - engine.reserve - n)))
        if n < top:
            break
    return [(n, lp, mt) for lp in (0, LOGPROBS_BUCKET) for n, mt in plan]


# Top-logprobs requests all run with this many (trimmed per request by the API layer), so that only two
# variants of each program exist: the engine compiles one program per distinct batch-wide n_logprobs.
LOGPROBS_BUCKET = 20


class EngineThread(threading.Thread):
    def __init__(self, engine: Engine, deliver: Callable[[list[Output]], None], warmup: bool = True):
        super().__init__(name="fnx-engine", daemon=True)
        self.engine, self.warmup = engine, warmup
        self.deliver = deliver
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = threading.Event()
        self.failed: BaseException | None = None
        self.snapshot: dict = {"steps": 0, "waiting": 0, "running": 0}
        self.on_snapshot: Callable[[dict], None] | None = None
        self.step_seconds: Callable[[float], None] | None = None
        self.warmup_log: list[str] = []
        self.warmup_seconds = 0.0
        self._compiles = _CompileCounter()
        self._stopping = False
        self._live: set[str] = set()

    # ---- called from other threads ----------------------------------------------------------------------------
    def submit(self, rid: str, prompt: list[int], params: SamplingParams, done: Callable[[BaseException | None], None]):
        self.inbox.put(("submit", rid, prompt, params, done))

    def abort(self, rid: str):
        self.inbox.put(("abort", rid))

    def stop(self):
        """Finish: abort what is left and leave the loop."""
        self.inbox.put(("stop",))

    # ---- the thread ------------------------------------------------------------------------------------------
    def run(self):
        try:
            self._warmup()
        except BaseException as e:  # start-up failure: report it to the main thread
            self.failed = e
            log.error("warm-up failed:\n%s", traceback.format_exc())
            self.ready.set()
            return
        self.ready.set()
        eng = self.engine
        while True:
            cmds = []
            try:
                if not eng.has_work():
                    cmds.append(self.inbox.get(timeout=0.5))
                while True:
                    cmds.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            for cmd in cmds:
                if cmd[0] == "submit":
                    _, rid, prompt, params, done = cmd
                    if self.failed is not None:
                        done(RuntimeError(f"the engine failed earlier and serves no more requests: {self.failed}"))
                        continue
                    try:
                        eng.submit(prompt, params, request_id=rid)
                    except ValueError as e:
                        done(e)
                        continue
                    self._live.add(rid)
                    done(None)
                elif cmd[0] == "abort":
                    if cmd[1] in self._live:
                        eng.abort(cmd[1])
                        self._live.discard(cmd[1])
                elif cmd[0] == "stop":
                    self._stopping = True
            if self._stopping:
                for rid in list(self._live):
                    eng.abort(rid)
                self._live.clear()
                self._publish()
                eng.close()
                return
            if eng.has_work() and self.failed is None:
                t = time.perf_counter()
                try:
                    outs = eng.step()
                except Exception as e:  # an engine bug: fail the requests in flight, stop serving, stay up to say so
                    log.error("Engine.step() raised; failing %d requests:\n%s", len(self._live),
                              traceback.format_exc())
                    self.failed = e
                    outs = [Output(rid, [], [], True, "error") for rid in self._live]
                    for rid in list(self._live):
                        eng.abort(rid)
                if self.step_seconds:
                    self.step_seconds(time.perf_counter() - t)
                for o in outs:
                    if o.finished:
                        self._live.discard(o.request_id)
                self.snapshot["steps"] += 1
                if outs:
                    self.deliver(outs)
            self._publish()

    def _publish(self):
        eng = self.engine
        held = sum(len(r.history) for r in eng.slots if r is not None)
        s = dict(self.snapshot)
        s.update(waiting=len(eng.waiting), running=eng.num_running,
                 cache_usage=held / (len(eng.slots) * eng.capacity),
                 drafted=eng.stats.get("drafted", 0), accepted=eng.stats.get("accepted", 0),
                 acceptance_length=eng.acceptance_length, compiles=dict(self._compiles.counts))
        self.snapshot = s
        if self.on_snapshot:
            self.on_snapshot(s)

    def _warmup(self):
        """Run one tiny request through every program shape requests will use, then count any later compile."""
        import jax
        eng = self.engine
        t0 = time.perf_counter()
        vocab = eng.cfg.vocab_size
        for n, lp, max_tokens in warmup_plan(eng) if self.warmup else []:
            t = time.perf_counter()
            prompt = [(7 * i + 1) % vocab for i in range(n)]
            # with logprobs, the echoed prompt's logprobs too (`/v1/completions` with `echo`: a small program per
            # prefill bucket, `engine._jit_prompt_logprobs`)
            rid = eng.submit(prompt, SamplingParams(max_tokens=max_tokens, logprobs=lp, ignore_eos=True,
                                                    prompt_logprobs=lp or None), request_id=f"warmup-{n}-{lp}")
            while eng.has_work():
                eng.step()
            self.warmup_log.append(f"prefill bucket {eng.prefill_bucket(n):>5} tokens ({n}-token prompt), "
                                   f"logprobs {lp:>2}: {time.perf_counter() - t:.2f} s")
            del rid
        spec = bool(getattr(eng, "spec", None))
        # the plan's requests are greedy; a batch with a sampled row runs other programs (the decode step without
        # its argmax-only shortcut; the speculative draft without the fused argmax), and so does a speculative
        # round with penalties (each window position penalized), and a batch with a logit_bias row (the bias
        # arrays are [slots, MAX_LOGIT_BIAS] then, [slots, 0] without: the sampling after prefill, the decode step
        # and the speculative round (drafts and verify) each compile a biased variant): warm those too,
        # so that no request's options make every running stream wait for a compile
        variants = [(0.7, 1.0, False)] + ([(0.0, 1.1, False), (0.7, 1.1, False)] if spec else [])
        variants += [(t, p, True) for t, p, _ in [(0.0, 1.0, False)] + variants]
        bias = ((min(5, vocab - 1), 1.0),)
        for lp in (0, LOGPROBS_BUCKET) if self.warmup else []:
            for temperature, penalty, biased in variants:
                t = time.perf_counter()
                room = eng.capacity - eng.reserve                # prompt + generated (warmup_plan: >= 2)
                prompt = [1, 2, 3][:min(3, room - 1)]
                eng.submit(prompt, SamplingParams(max_tokens=min(3, room - len(prompt)), temperature=temperature,
                                                  seed=0, logprobs=lp, repetition_penalty=penalty, ignore_eos=True,
                                                  logit_bias=bias if biased else ()),
                           request_id=f"warmup-{temperature}-{penalty}-{lp}{'-bias' if biased else ''}")
                while eng.has_work():
                    eng.step()
                self.warmup_log.append(
                    f"{'sampled' if temperature else 'greedy'} {'speculative round' if spec else 'decode'}"
                    f"{' with penalties' if penalty != 1 else ''}{' with a logit bias' if biased else ''}, "
                    f"logprobs {lp:>2}: {time.perf_counter() - t:.2f} s")
        self.warmup_seconds = time.perf_counter() - t0
        for k in ("drafted", "accepted", "rounds", "decode_steps", "prefill_tokens", "row_rounds"):
            if k in eng.stats:
                eng.stats[k] = 0
        jax.config.update("jax_log_compiles", True)
        for name in ("jax._src.dispatch", "jax._src.interpreters.pxla"):
            lg = logging.getLogger(name)
            lg.addHandler(self._compiles)
            lg.propagate = False  # counted, not printed per request
