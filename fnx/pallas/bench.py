"""What `scripts/bench_kernels.py` runs: each kernel folder's `bench.py` returns `cases(quick)`, a list of
BenchCase, and `time_case` times one on the current device.

Timing: the case's function is applied to each of `len(arg_sets)` argument sets (distinct weights, together
larger than the H200's 60 MB L2, so every application streams from HBM), repeated inside one jitted program;
two programs of different repetition counts are timed and the slope is the time per application, so the ~70 us
fixed cost of a jitted call cancels (see `time_case`).
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


def _program(case: BenchCase, reps: int):
    """One jitted program applying case.fn to every argument set, `reps` times over. Each repetition takes the
    sets through an optimization barrier together with the previous repetition's outputs, so XLA can neither
    merge the repetitions (CSE) nor hoist them, and they run in order."""
    from jax import lax

    def many(all_args):
        outs = None
        for _ in range(reps):
            if outs is not None:
                all_args, _ = lax.optimization_barrier((all_args, outs))
            outs = [case.fn(*a) for a in all_args]
        return outs

    return jax.jit(many)


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


def time_case(case: BenchCase, iters: int = 30, warmup: int = 3, reps: tuple[int, int] = (1, 5)) -> dict:
    """Time per application = (t(reps[1]) - t(reps[0])) / ((reps[1] - reps[0]) * len(arg_sets)): the slope
    between two programs of different lengths, so the fixed cost of a jitted call (~70 us dispatch and sync on
    the H200) cancels out and only the kernels' own time (launch included) remains."""
    sets = case.arg_sets
    r0, r1 = reps
    t0 = _median_time(_program(case, r0), sets, iters, warmup)
    t1 = _median_time(_program(case, r1), sets, iters, warmup)
    t = max(t1 - t0, 1e-9) / ((r1 - r0) * len(sets))
    out = {"kernel": case.kernel, "shape": case.shape, "impl": case.impl, "us": round(t * 1e6, 2),
           "bytes": int(case.bytes), "tbps": round(case.bytes / t / 1e12, 3),
           "frac_bw": round(case.bytes / t / 1e12 / HBM_TBPS, 3),
           "call_us": round(t0 * 1e6, 1), "sets": len(sets)}
    if case.flops:
        out["tflops"] = round(case.flops / t / 1e12, 2)
        out["frac_flops"] = round(case.flops / t / 1e12 / BF16_TFLOPS, 3)
    out.update(case.extra)
    return out


def n_sets(bytes_per_set: int, l2_bytes: int = 60 << 20, min_sets: int = 2, max_sets: int = 64) -> int:
    """How many distinct argument sets make the rotation exceed L2 twice over."""
    return int(min(max_sets, max(min_sets, -(-2 * l2_bytes // max(1, bytes_per_set)))))
