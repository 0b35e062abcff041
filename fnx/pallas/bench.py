"""What `scripts/bench_kernels.py` runs: each kernel folder's `bench.py` returns `cases(quick)`, a list of
BenchCase, and `time_case` times one on the current device.

Timing: the case's function is applied once to each of `len(arg_sets)` argument sets inside one jitted program
(the sets are distinct weights, together larger than the H200's 60 MB L2, so every call streams from HBM), and
that program is timed over `iters` calls after warm-up; time per application = median / len(arg_sets). One
jitted program amortises the ~70 us dispatch of a jitted call that would otherwise swamp a 10 us kernel.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import numpy as np

HBM_TBPS = 4.3          # measured H200 copy ceiling (GPU_NOTES.md), the denominator of every bandwidth fraction
BF16_TFLOPS = 627.0     # measured bf16 matmul ceiling


@dataclasses.dataclass
class BenchCase:
    kernel: str                  # e.g. "gemv_fp8"
    shape: str                   # human-readable shape, e.g. "M=1 N=2048 K=2560"
    impl: str                    # backend name passed to the api ("pallas", "reference", ...)
    fn: Callable[..., Any]       # fn(*args) -> array or pytree; pure, jittable
    arg_sets: list[tuple]        # distinct argument tuples, rotated through
    bytes: int                   # bytes one application must move (its bandwidth floor)
    flops: int = 0               # FLOPs of one application
    extra: dict = dataclasses.field(default_factory=dict)   # anything else to record (tile config, M, ...)


def time_case(case: BenchCase, iters: int = 30, warmup: int = 3) -> dict:
    sets = case.arg_sets

    def many(all_args):
        return [case.fn(*a) for a in all_args]

    f = jax.jit(many)
    jax.block_until_ready(f(sets))
    for _ in range(warmup):
        jax.block_until_ready(f(sets))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(sets))
        ts.append(time.perf_counter() - t0)
    t = float(np.median(ts)) / len(sets)
    out = {"kernel": case.kernel, "shape": case.shape, "impl": case.impl, "us": round(t * 1e6, 2),
           "bytes": int(case.bytes), "tbps": round(case.bytes / t / 1e12, 3),
           "frac_bw": round(case.bytes / t / 1e12 / HBM_TBPS, 3)}
    if case.flops:
        out["tflops"] = round(case.flops / t / 1e12, 2)
        out["frac_flops"] = round(case.flops / t / 1e12 / BF16_TFLOPS, 3)
    out.update(case.extra)
    return out


def n_sets(bytes_per_set: int, l2_bytes: int = 60 << 20, min_sets: int = 2, max_sets: int = 64) -> int:
    """How many distinct argument sets make the rotation exceed L2 twice over."""
    return int(min(max_sets, max(min_sets, -(-2 * l2_bytes // max(1, bytes_per_set)))))
