"""Server metrics in the Prometheus text exposition format (version 0.0.4). Counters and histograms are updated
on the event loop; gauges read the engine thread's latest snapshot."""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float):
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.n}")
        return out


class Metrics:
    def __init__(self, model_name: str):
        self.model = model_name
        self.lock = threading.Lock()
        self.requests = {}              # finish reason -> count
        self.rejected = {}              # reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.e2e = Histogram()
        self.step = Histogram()
        self.recent = deque()           # (time, tokens) over the last `window` seconds
        self.window = 10.0
        self.engine = {}                # the engine thread's snapshot (see worker.EngineThread.snapshot)

    def finished(self, reason: str, prompt_tokens: int, gen_tokens: int, t_submit: float, t_first: float | None,
                 t_last: float | None):
        with self.lock:
            self.requests[reason] = self.requests.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            if t_first is not None:
                self.e2e.observe((t_last or t_first) - t_submit)
                if gen_tokens > 1 and t_last is not None:
                    self.tpot.observe((t_last - t_first) / (gen_tokens - 1))

    def first_token(self, seconds: float):
        with self.lock:
            self.ttft.observe(seconds)

    def tokens(self, n: int):
        now = time.monotonic()
        with self.lock:
            self.generation_tokens += n
            self.recent.append((now, n))

    def reject(self, reason: str):
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self.lock:
            while self.recent and self.recent[0][0] < now - self.window:
                self.recent.popleft()
            return sum(n for _, n in self.recent) / self.window

    def render(self, queue_depth: int, running: int) -> str:
        e = dict(self.engine)
        tps = self.tokens_per_second()
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(samples)

        metric("fnx_requests_waiting", "gauge", "Requests accepted and not yet admitted to a batch slot (queue depth).",
               [f"fnx_requests_waiting {queue_depth}"])
        metric("fnx_requests_running", "gauge", "Requests holding a batch slot.", [f"fnx_requests_running {running}"])
        with self.lock:
            metric("fnx_requests_finished_total", "counter", "Finished requests by finish reason.",
                   [f'fnx_requests_finished_total{{reason="{k}"}} {v}' for k, v in sorted(self.requests.items())]
                   or ['fnx_requests_finished_total{reason="stop"} 0'])
            metric("fnx_requests_rejected_total", "counter", "Requests refused before reaching the engine.",
                   [f'fnx_requests_rejected_total{{reason="{k}"}} {v}' for k, v in sorted(self.rejected.items())]
                   or ['fnx_requests_rejected_total{reason="queue_full"} 0'])
            metric("fnx_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [f"fnx_prompt_tokens_total {self.prompt_tokens}"])
            metric("fnx_generation_tokens_total", "counter", "Generated tokens.",
                   [f"fnx_generation_tokens_total {self.generation_tokens}"])
            metric("fnx_generation_tokens_per_second", "gauge",
                   f"Generated tokens per second over the last {self.window:g} s.",
                   [f"fnx_generation_tokens_per_second {tps:.3f}"])
            metric("fnx_time_to_first_token_seconds", "histogram", "Time from request arrival to its first token.",
                   self.ttft.lines("fnx_time_to_first_token_seconds"))
            metric("fnx_time_per_output_token_seconds", "histogram",
                   "Mean time between output tokens, per request, after the first.",
                   self.tpot.lines("fnx_time_per_output_token_seconds"))
            metric("fnx_e2e_request_latency_seconds", "histogram", "Time from request arrival to its last token.",
                   self.e2e.lines("fnx_e2e_request_latency_seconds"))
            metric("fnx_engine_step_seconds", "histogram", "Wall time of one Engine.step().",
                   self.step.lines("fnx_engine_step_seconds"))
        metric("fnx_engine_steps_total", "counter", "Engine steps run.", [f"fnx_engine_steps_total {e.get('steps', 0)}"])
        metric("fnx_cache_usage_ratio", "gauge",
               "Decode-state positions held by running requests / (slots x capacity).",
               [f"fnx_cache_usage_ratio {e.get('cache_usage', 0.0):.6f}"])
        metric("fnx_spec_decode_draft_tokens_total", "counter", "MTP draft tokens proposed.",
               [f"fnx_spec_decode_draft_tokens_total {e.get('drafted', 0)}"])
        metric("fnx_spec_decode_accepted_tokens_total", "counter", "MTP draft tokens accepted.",
               [f"fnx_spec_decode_accepted_tokens_total {e.get('accepted', 0)}"])
        metric("fnx_spec_decode_acceptance_length", "gauge",
               "Mean tokens emitted per speculative round and request (accepted drafts + 1); 0 without MTP.",
               [f"fnx_spec_decode_acceptance_length {e.get('acceptance_length', 0.0):.4f}"])
        metric("fnx_compiles_after_warmup_total", "counter",
               "XLA compilations after start-up warm-up, by function (should stay 0: a request waited on these).",
               [f'fnx_compiles_after_warmup_total{{fn="{k}"}} {v}'
                for k, v in sorted(e.get("compiles", {}).items())] or ["fnx_compiles_after_warmup_total 0"])
        return "\n".join(lines) + "\n"
