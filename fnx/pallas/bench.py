"""What `scripts/bench_kernels.py` runs: each kernel folder's `bench.py` returns `cases(quick)`, a list of
BenchCase, and `time_case` times one on the current device.

Timing: the case's function is applied once to each of its argument sets (distinct weights, so every
application streams from HBM and XLA can merge nothing) inside one jitted program; a program over the sets once
and one over them many times (offset activations) are timed and the slope is the time per application, so the
~70 us fixed cost of a jitted call cancels (see `time_case`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from typing import Any, Callable

import jax
import numpy as np

HBM_TBPS = 4.3          # measured H200 copy ceiling (GPU_NOTES.md), the denominator of every bandwidth fraction
BF16_TFLOPS = 627.0     # measured bf16 matmul ceiling


def fnx_settings() -> dict[str, str]:
    """The fnx knobs (FNX_* environment variables, FNX_COMMIT aside) this process runs with, for the JSON lines of
    the benchmark scripts: a timing taken with a knob on says so in its record."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("FNX_") and k != "FNX_COMMIT"}


_VARIANT_LABEL = re.compile(r"^[\w.+-]+$")
_VARIANT_ENV = re.compile(r"^FNX_[A-Z0-9_]+$")


def parse_variants(spec: str, opt: str = "--variants") -> list[tuple[str, dict[str, str]]]:
    """';'-separated 'LABEL: ENV=VALUE ENV=VALUE ...' -> [(label, {env: value})], for the scripts' knob sweeps
    (`opt`: the option named in the errors). Only FNX_ settings: they are read when a program is traced (XLA_FLAGS
    and the like are read once, at start). A value may hold '=' and ',' (FNX_KERNELS=a=pallas,b=pallas); settings
    are separated by spaces. No settings: the defaults."""
    out: list[tuple[str, dict[str, str]]] = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        label, sep, rest = part.partition(":")
        label = label.strip()
        if not sep or not _VARIANT_LABEL.match(label):
            raise SystemExit(f"{opt}: {part!r} must be 'LABEL: ENV=VALUE ...' with a label of letters, "
                             "digits, '.', '+', '-' or '_'")
        if label in (lab for lab, _ in out):
            raise SystemExit(f"{opt}: the label {label!r} is given twice")
        env: dict[str, str] = {}
        for item in rest.split():
            name, eq, value = item.partition("=")
            if not eq or not _VARIANT_ENV.match(name):
                raise SystemExit(f"{opt}: {item!r} in variant {label!r} is not FNX_NAME=VALUE (only fnx's "
                                 "own settings are read when a program is traced)")
            if name in env:
                raise SystemExit(f"{opt}: {name} is set twice in variant {label!r}")
            env[name] = value
        out.append((label, env))
    if not out:
        raise SystemExit(f"{opt}: no variant given")
    return out


@contextlib.contextmanager
def settings(env: dict[str, str]):
    """The FNX_ settings `env` in the environment while programs are traced inside, restored after. fnx reads its
    knobs when a function is traced, and JAX keeps the traces of jitted functions (the kernels' wrappers among
    them): with any setting given, its caches are cleared on the way in and out, so neither these programs nor the
    next ones reuse a trace made under other settings."""
    if not env:
        yield
        return
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    jax.clear_caches()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        jax.clear_caches()


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
    # optional: the same quantity by other means (the reference), fn(*arg_sets[0]) is compared with it before the
    # timing; its max error over max |check| goes into the record, and past `check_tol` the record says "mismatch"
    check: Callable[..., Any] | None = None
    check_tol: float = 0.05
    # FNX_ settings its programs are traced under (a knob variant of a case: bench_kernels.py --variants)
    env: dict = dataclasses.field(default_factory=dict)


def _program(case: BenchCase):
    """One jitted program applying case.fn once to each argument tuple it is given (distinct tuples: nothing to
    merge or hoist; every output is returned, so nothing is dead)."""
    return jax.jit(lambda all_args: [case.fn(*a) for a in all_args])


def _varied(sets: list, reps: int) -> list:
    """`sets` repeated `reps` times, the first argument (every family's small activation) offset per repetition,
    made here, outside the timed program: repeated applications can be neither merged by XLA nor slowed by an
    extra kernel that makes the copy."""
    out = list(sets)
    for r in range(1, reps):
        for a in sets:
            x = a[0]
            out.append((jax.block_until_ready(x + jax.numpy.asarray(r * 2.0 ** -7, x.dtype)),) + tuple(a[1:]))
    return out


def _min_time(f, sets, iters: int, warmup: int) -> float:
    jax.block_until_ready(f(sets))
    for _ in range(warmup):
        jax.block_until_ready(f(sets))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(sets))
        ts.append(time.perf_counter() - t0)
    return float(np.min(ts))   # noise (host jitter, clock ramps) only ever adds


@dataclasses.dataclass
class Prepared:
    """The two compiled programs of `time_case` and their argument lists (`prepare_case`)."""
    once: Any
    once_args: list
    many: Any
    many_args: list
    reps: int


def prepare_case(case: BenchCase, min_apps: int = 64) -> Prepared:
    """Build and compile the two programs `time_case` times (A over the argument sets once, B over them 1 + R
    times), without running them. Safe on a host thread: the GEMV tuner compiles a batch of candidates at once,
    then times them one by one with no compilation running (a compile thread holding the interpreter lock would
    delay the timing thread's returns)."""
    sets = case.arg_sets
    n = len(sets)
    if n < 2:
        raise ValueError(f"{case.kernel} {case.shape}: the slope timing needs at least 2 argument sets")
    reps = 1 + max(1, -(-min_apps // n))
    many = _varied(sets, reps)
    with settings(case.env):
        return Prepared(_program(case).lower(sets).compile(), sets, _program(case).lower(many).compile(), many, reps)


def time_case(case: BenchCase, iters: int = 30, warmup: int = 3, min_apps: int = 64,
              prepared: Prepared | None = None) -> dict:
    """Time per application = (t(B) - t(A)) / (apps(B) - apps(A)), A the program over the n argument sets once
    and B over them 1 + R times (R * n >= min_apps, later repetitions with offset activations): the slope
    between two programs, so the fixed cost of a jitted call (~70 us of dispatch and sync on the H200) cancels,
    and over enough applications that host jitter is a small fraction. Each program's time is its minimum over
    `iters` calls. `n_sets` makes one pass over the sets exceed L2 four times over, so every application streams
    from HBM. A slope that is not positive is an error, never a number. `prepared`: the programs compiled
    beforehand by `prepare_case` (for this case and min_apps)."""
    p = prepared if prepared is not None else prepare_case(case, min_apps)
    n, reps = len(p.once_args), p.reps
    t0 = _min_time(p.once, p.once_args, iters, warmup)
    t1 = _min_time(p.many, p.many_args, iters, warmup)
    if t1 <= t0:
        raise RuntimeError(f"{case.kernel} {case.shape} {case.impl}: {(reps - 1) * n} more applications did not "
                           f"take longer ({t0 * 1e6:.1f} us vs {t1 * 1e6:.1f} us): timing noise, no result")
    t = (t1 - t0) / ((reps - 1) * n)
    out = {"kernel": case.kernel, "shape": case.shape, "impl": case.impl, "us": round(t * 1e6, 2),
           "bytes": int(case.bytes), "tbps": round(case.bytes / t / 1e12, 3),
           "frac_bw": round(case.bytes / t / 1e12 / HBM_TBPS, 3),
           "call_us": round(t0 * 1e6, 1), "sets": n, "apps": reps * n}
    if case.flops:
        out["tflops"] = round(case.flops / t / 1e12, 2)
        out["frac_flops"] = round(case.flops / t / 1e12 / BF16_TFLOPS, 3)
    out.update(case.extra)
    out.update(check_case(case))
    return out


_checked: dict = {}


def check_case(case: BenchCase) -> dict:
    """{} without case.check; else case.fn against case.check on the first argument set: max |fn - check| over
    max |check| ("max_rel_err"; for several outputs the largest of each output's own) and "check": "ok", or
    "mismatch" past case.check_tol (or not finite)."""
    if case.check is None:
        return {}
    args = case.arg_sets[0]
    as_list = lambda out: [np.asarray(o, np.float32) for o in (out if isinstance(out, (tuple, list)) else [out])]  # noqa: E731
    with settings(case.env):
        got = as_list(jax.jit(case.fn)(*args))
    hit = _checked.get((id(case.check), id(args[0])))
    if hit is not None and hit[0] is case.check and hit[1] is args[0]:
        want = hit[2]        # cases that share a check object and arguments (tile variants) compute it once
    else:
        want = as_list(jax.jit(case.check)(*args))
        if len(_checked) > 16:
            _checked.clear()
        _checked[(id(case.check), id(args[0]))] = (case.check, args[0], want)
    if len(got) != len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
        return {"max_rel_err": "shapes differ", "check": "mismatch"}
    err = max(float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30)) for g, w in zip(got, want))
    return {"max_rel_err": round(err, 5) if np.isfinite(err) else str(err),
            "check": "ok" if np.isfinite(err) and err <= case.check_tol else "mismatch"}


def n_sets(bytes_per_set: int, l2_bytes: int = 60 << 20, min_sets: int = 4, max_sets: int = 64) -> int:
    """How many distinct argument sets make one pass over them exceed L2 four times over."""
    return int(min(max_sets, max(min_sets, -(-4 * l2_bytes // max(1, bytes_per_set)))))
