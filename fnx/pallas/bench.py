"""What `scripts/bench_kernels.py` runs: each kernel folder's `bench.py` returns `cases(quick)`, a list of
BenchCase, and `time_case` times one on the current device.

Timing: the case's function is applied once to each of its argument sets (distinct weights, so every
application streams from HBM and XLA can merge nothing) inside one jitted program; a program over half the sets
and one over all of them are timed and the slope is the time per application, so the ~70 us fixed cost of a
jitted call cancels (see `time_case`).
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


def _program(case: BenchCase):
    """One jitted program applying case.fn once to each argument set it is given (distinct sets: nothing to
    merge or hoist; every output is returned, so nothing is dead)."""
    return jax.jit(lambda all_args: [case.fn(*a) for a in all_args])


def _median_time(f, sets, iters: int, warmup: int) -> float:
    jax.block_until_ready(f(sets))
    for _ in range(warmup):
        jax.block_until_ready(f(sets))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(sets))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def time_case(case: BenchCase, iters: int = 30, warmup: int = 3) -> dict:
    """Time per application = (t(all n sets) - t(first n/2 sets)) / (n - n/2): the slope between two programs,
    so the fixed cost of a jitted call (~70 us of dispatch and sync on the H200) cancels and only the kernels'
    own time (launches included) remains. `n_sets` makes the first half alone exceed L2 twice over."""
    sets = case.arg_sets
    n = len(sets)
    if n < 2:
        raise ValueError(f"{case.kernel} {case.shape}: the slope timing needs at least 2 argument sets")
    half = n // 2
    t0 = _median_time(_program(case), sets[:half], iters, warmup)
    t1 = _median_time(_program(case), sets, iters, warmup)
    t = max(t1 - t0, 1e-9) / (n - half)
    out = {"kernel": case.kernel, "shape": case.shape, "impl": case.impl, "us": round(t * 1e6, 2),
           "bytes": int(case.bytes), "tbps": round(case.bytes / t / 1e12, 3),
           "frac_bw": round(case.bytes / t / 1e12 / HBM_TBPS, 3),
           "call_us": round(t1 * 1e6, 1), "sets": n}
    if case.flops:
        out["tflops"] = round(case.flops / t / 1e12, 2)
        out["frac_flops"] = round(case.flops / t / 1e12 / BF16_TFLOPS, 3)
    out.update(case.extra)
    return out


def n_sets(bytes_per_set: int, l2_bytes: int = 60 << 20, min_sets: int = 4, max_sets: int = 64) -> int:
    """How many distinct argument sets make half of the rotation exceed L2 twice over."""
    return int(min(max_sets, max(min_sets, -(-4 * l2_bytes // max(1, bytes_per_set)))))
