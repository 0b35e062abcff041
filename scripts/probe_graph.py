"""The host cost of launching N kernels in one jitted program, apart from any model: is the ~3 us per kernel a
decode step pays on the H200 (and ~19 us on a slower host) the CUDA graph launch itself, or XLA updating the
graph because buffers moved?

    python scripts/probe_graph.py --nodes 50 400 --out gpu_out/graph
    XLA_PYTHON_CLIENT_ALLOCATOR=vmm XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP \
        python scripts/probe_graph.py --label skip_temp ...

The program is a chain of N Pallas kernels over a small fp32 vector, each adding 1 to its predecessor's output
(one kernel source, compiled once; XLA cannot merge custom calls, so each is one node of its command buffer, as
the step's kernels are).
Each node may also read a weight row of its own (all ones, so the result stays x + N), passed as N separate
argument arrays ("separate", as the model passes ~34 arrays per layer) or as one stacked [N, width] array that
node i indexes ("stacked"): whether the host pays per argument array. For each case and N it times:
- dispatch: the host time until the call returns (no wait for the device);
- sync: one call and a wait for its result;
- chained: --chain calls in flight, each feeding the next, one wait at the end, per call.
The slope of each against N is the host (or device) cost per kernel node. The result is checked against the
closed form. One JSON line per (case, N) and one with the fitted slopes go to --out/probe_graph.jsonl.
On a machine without a GPU the kernels run in Pallas's interpreter (the numbers then mean nothing)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


WEIGHTS = ("none", "separate", "stacked")
EXTRAS = ("", "dot", "out2")   # dot: one XLA matmul node first (cuBLAS or a GEMM fusion, with its workspace);
                               # out2: a second, non-donated output (a reduce of the result) next to the donated one


def chain_program(n: int, width: int, interpret: bool, weights: str = "none"):
    """f(x, w) = x + n as n separate kernels: each adds 1, or its weight row of ones (w: None, a list of n [width]
    arrays, or one [n, width] array)."""
    out = jax.ShapeDtypeStruct((width,), jnp.float32)
    # the Triton lowering, as fnx's kernels use (without compiler params Pallas may pick Mosaic GPU)
    kw = {"interpret": True} if interpret else {"compiler_params": plt.CompilerParams(num_warps=4)}
    def one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    def add(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] + w_ref[...]
    if weights == "none":
        node = pl.pallas_call(one, out_shape=out, **kw, name="graph_node")
        return lambda x, w: _repeat(n, lambda i, x: node(x), x)
    if weights == "separate":
        node = pl.pallas_call(add, out_shape=out, **kw, name="graph_node_w")
        return lambda x, w: _repeat(n, lambda i, x: node(x, w[i]), x)
    if weights != "stacked":
        raise ValueError(f"weights {weights!r}: one of {WEIGHTS}")

    def row(i):   # node i reads row i of the stacked array in place (no slice of it is materialised)
        return pl.pallas_call(add, out_shape=out, **kw, name="graph_node_s",
                              in_specs=[pl.BlockSpec((width,), lambda: (0,)),
                                        pl.BlockSpec((None, width), lambda: (i, 0))],
                              out_specs=pl.BlockSpec((width,), lambda: (0,)))
    return lambda x, w: _repeat(n, lambda i, x: row(i)(x, w), x)


def _repeat(n, fn, x):
    for i in range(n):
        x = fn(i, x)
    return x


def weight_args(n: int, width: int, weights: str):
    if weights == "none":
        return None
    if weights == "separate":
        return [jnp.ones((width,), jnp.float32) for _ in range(n)]
    return jnp.ones((n, width), jnp.float32)


def with_extra(prog, extra: str, width: int):
    """prog(x, w) -> x + n, with the case's extra: (prog, its extra arguments, how to take x out of a result)."""
    if extra == "":
        return prog, (), lambda r: r
    if extra == "dot":   # a [8, 1024] x [1024, 1024] product of zeros added first: a library / GEMM node
        def g(x, w, a, b):
            d = jnp.dot(a, b, preferred_element_type=jnp.float32).reshape(-1)
            return prog(x + jnp.resize(d, (width,)), w)
        return g, (jnp.zeros((8, 1024), jnp.float32), jnp.zeros((1024, 1024), jnp.float32)), lambda r: r
    if extra == "out2":
        def g(x, w):
            y = prog(x, w)
            return y, jnp.sum(y, keepdims=True)
        return g, (), lambda r: r[0]
    raise ValueError(f"extra {extra!r}: one of {EXTRAS}")


def measure(n: int, width: int, donate: bool, reps: int, chain: int, interpret: bool,
            weights: str = "none", extra: str = "") -> dict:
    prog, more, first = with_extra(chain_program(n, width, interpret, weights), extra, width)
    g = jax.jit(prog, donate_argnums=(0,) if donate else ())
    w = weight_args(n, width, weights)
    f = lambda x: first(g(x, w, *more))  # noqa: E731
    add = n
    x = jnp.zeros((width,), jnp.float32)
    t = time.perf_counter()
    x = f(x)
    jax.block_until_ready(x)
    compile_s = time.perf_counter() - t
    calls = 1
    for _ in range(3):                       # warm: XLA records its command buffers after a first plain run
        x = f(x)
        calls += 1
    jax.block_until_ready(x)
    dispatch, sync = [], []
    for _ in range(reps):
        t = time.perf_counter()
        x = f(x)
        dispatch.append(time.perf_counter() - t)
        jax.block_until_ready(x)
        sync.append(time.perf_counter() - t)
        calls += 1
    chained = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(chain):
            x = f(x)
        jax.block_until_ready(x)
        chained.append((time.perf_counter() - t) / chain)
        calls += chain
    got = float(np.asarray(x)[0])
    want = calls * add
    if abs(got - want) > 1e-6 * want:
        raise SystemExit(f"probe_graph: N={n} donate={donate} weights={weights} extra={extra}: result {got} != {want}: the "
                         "program is wrong")
    us = lambda v: round(float(np.median(v)) * 1e6, 2)  # noqa: E731
    return {"nodes": n, "donate": donate, "weights": weights, "extra": extra, "compile_s": round(compile_s, 2), "dispatch_us": us(dispatch),
            "sync_us": us(sync), "chained_us": round(min(chained) * 1e6, 2), "calls": calls}


def slope(rows: list[dict], key: str) -> float | None:
    if len({r["nodes"] for r in rows}) < 2:
        return None
    a = np.polyfit([r["nodes"] for r in rows], [r[key] for r in rows], 1)
    return round(float(a[0]), 3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[50, 400])
    ap.add_argument("--width", type=int, default=1024, help="fp32 elements each kernel reads and writes")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--chain", type=int, default=32, help="calls in flight for the chained time")
    ap.add_argument("--cases", nargs="+", default=["none:donated", "none:kept", "separate:donated",
                                                    "stacked:donated"],
                    help="weights:donated|kept[:extra], weights one of " + ", ".join(WEIGHTS) + "; extra one of "
                         + ", ".join(e for e in EXTRAS if e))
    ap.add_argument("--markers", action="store_true",
                    help="print '=== case C N' to stderr before each measurement (to split XLA's VLOG by case)")
    ap.add_argument("--label", default=os.environ.get("XLA_FLAGS", "") or "default")
    ap.add_argument("--out", default="gpu_out/graph")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    interpret = jax.devices()[0].platform != "gpu"
    commit = os.environ.get("FNX_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    head = {"label": args.label, "device": jax.devices()[0].device_kind, "interpret": interpret,
            "allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"), "width": args.width,
            "chain": args.chain, "date": time.strftime("%Y-%m-%d"), "commit": commit, "jax": jax.__version__}
    cases = []
    for c in args.cases:
        weights, _, rest = c.partition(":")
        keep, _, extra = rest.partition(":")
        if weights not in WEIGHTS or keep not in ("donated", "kept") or extra not in EXTRAS:
            raise SystemExit(f"--cases {c!r}: weights:donated|kept[:extra], weights one of {', '.join(WEIGHTS)}, "
                             f"extra one of {', '.join(e for e in EXTRAS if e)}")
        cases.append((c, weights, keep == "donated", extra))
    path = os.path.join(args.out, "probe_graph.jsonl")
    rows = []
    for c, weights, donate, extra in cases:
        for n in args.nodes:
            if args.markers:
                print(f"=== case {c} {n}", file=sys.stderr, flush=True)
            r = measure(n, args.width, donate, args.reps, args.chain, interpret, weights, extra)
            rows.append(dict(r, case=c))
            rec = {**head, "part": "point", "case": c, **r}
            print(json.dumps(rec), flush=True)
            with open(path, "a") as f:
                f.write(json.dumps(rec) + "\n")
    fit = {"part": "slopes", **head}
    for c, *_ in cases:
        sub = [r for r in rows if r["case"] == c]
        for key in ("dispatch_us", "sync_us", "chained_us"):
            fit[f"{key}_per_node[{c}]"] = slope(sub, key)
    print(json.dumps(fit), flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(fit) + "\n")


if __name__ == "__main__":
    main()
