"""Where a decode step's time goes: a profile of N calls, its device kernels counted and their time attributed to
a family (GEMV, MoE, GDN, QSA, HC, PLE, head, library GEMM, copies, other XLA), plus the idle time between them.

    led = ledger.profile(lambda: step_and_wait(), calls=5)
    led["launches_per_call"], led["families"]["moe"]["ms_per_call"], led["idle_ms_per_call"]

`profile` runs the calls under `jax.profiler.trace(..., create_perfetto_trace=True)` and reads the Perfetto JSON
it writes. Kernels are the complete events on a device's stream lanes (process "/device:GPU:N", threads named
"Stream ..."); the derived lanes ("XLA Ops", "XLA Modules", ...) repeat them and are skipped. A kernel's family is
the first pattern in FAMILIES that matches its name or one of its arguments: the Pallas kernels are named after
their family (fnx_gemv_*, moe_*, gdn_*, qsa_*, hc_*), and the model puts every op under a named scope (ple, hc,
gdn, qsa, moe, head: `fnx.model.transformer.decoder_layer`) that reaches the kernel's `tf_op` / `long_name`
arguments. On a host without a GPU there are no device lanes: the ledger says so (device_kernels 0) instead of
inventing numbers.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
import time
from typing import Callable

# (family, pattern) in priority order: the kernel's own name first (a Pallas kernel says what it is), then the
# scope the op came from
FAMILIES = (
    ("gemv", re.compile(r"fnx_gemv")),
    ("moe", re.compile(r"\bmoe_|/moe/")),
    ("gdn", re.compile(r"\bgdn_|/gdn/")),
    ("qsa", re.compile(r"\bqsa_|/qsa/")),
    ("hc", re.compile(r"\bhc_|/hc/")),
    ("ple", re.compile(r"/ple/")),
    ("head", re.compile(r"/head/")),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|cublas", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)
OTHER = "xla_other"


def classify(name: str, args: dict | None = None) -> str:
    """The family of one kernel event (its name, then its string arguments, pattern by pattern)."""
    texts = [name] + [v for v in (args or {}).values() if isinstance(v, str)]
    for fam, rx in FAMILIES:
        if any(rx.search(t) for t in texts):
            return fam
    return OTHER


def device_kernels(trace: dict) -> list[dict]:
    """The complete ("X") events on device stream lanes of a Perfetto/Chrome trace dict, sorted by start."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            procs[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    device_pids = {p for p, n in procs.items() if re.search(r"/device:(GPU|TPU)", n)}
    out = [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids
           and threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]
    return sorted(out, key=lambda e: e["ts"])


def summarize(kernels: list[dict], calls: int, wall_ms: float | None = None, top: int = 12) -> dict:
    """Per call: kernel count, busy time, and per family the count and milliseconds; idle = wall - busy (launch
    gaps, host work, syncs) when the wall time of the calls is given. Overlapping kernels (several streams) count
    their union as busy. `top`: the kernel names that took the most time, with their family, launches and
    microseconds per call."""
    fams: dict[str, dict] = {}
    names: dict[str, dict] = {}
    for e in kernels:
        fam = classify(e.get("name", ""), e.get("args"))
        f = fams.setdefault(fam, {"kernels": 0, "us": 0.0})
        f["kernels"] += 1
        f["us"] += float(e.get("dur", 0.0))
        k = names.setdefault(e.get("name", ""), {"family": fam, "kernels": 0, "us": 0.0})
        k["kernels"] += 1
        k["us"] += float(e.get("dur", 0.0))
    busy, end = 0.0, None
    for e in kernels:                        # union of [ts, ts + dur)
        s, t = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        if end is None or s >= end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    n = max(calls, 1)
    out = {"calls": calls, "device_kernels": len(kernels), "launches_per_call": len(kernels) / n,
           "busy_ms_per_call": busy / 1e3 / n,
           "families": {k: {"kernels_per_call": v["kernels"] / n, "ms_per_call": v["us"] / 1e3 / n}
                        for k, v in sorted(fams.items(), key=lambda kv: -kv[1]["us"])},
           "top_kernels": [{"name": k[:80], "family": v["family"], "kernels_per_call": v["kernels"] / n,
                            "us_per_call": round(v["us"] / n, 2)}
                           for k, v in sorted(names.items(), key=lambda kv: -kv[1]["us"])[:top]]}
    if wall_ms is not None:
        out["wall_ms_per_call"] = wall_ms / n
        out["idle_ms_per_call"] = max(0.0, wall_ms / n - out["busy_ms_per_call"])
    if not kernels:
        out["note"] = "no device kernels in the trace (no GPU on this host): nothing to attribute"
    return out


def profile(fn: Callable[[], object], calls: int = 5, log_dir: str | None = None) -> dict:
    """Run `fn` (which must block until its device work is done) `calls` times under the profiler and return
    `summarize` of its kernels. The trace is written to `log_dir` (a temporary directory by default)."""
    import jax
    fn()                                      # compiled and warm before the trace
    own = log_dir is None
    log_dir = log_dir or tempfile.mkdtemp(prefix="fnx_ledger_")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        wall_ms = (time.perf_counter() - t0) * 1e3
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"the profiler wrote no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(paths[-1], "rt") as f:
        trace = json.load(f)
    out = summarize(device_kernels(trace), calls, wall_ms)
    out["trace"] = None if own else paths[-1]
    return out
