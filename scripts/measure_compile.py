"""Trace and lower the jitted step at the released Flash-Next shapes (abstract: no weights are allocated) and
report how long it takes, per decode / prefill shape. Runs on the CPU; prints one JSON line per shape.

    python scripts/measure_compile.py [--capacity 8192] [--shapes 1x1,1x512,8x1] [--compile]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from functools import partial

import jax
import jax.numpy as jnp

from fnx.config import ModelConfig
from fnx.model.transformer import init_state, layer_plan, param_shapes, step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=int, default=8192, help="KV capacity of the state (tokens)")
    ap.add_argument("--shapes", default="1x1,1x512,8x1", help="comma-separated BATCHxTOKENS call shapes")
    ap.add_argument("--compile", action="store_true", help="also run XLA's compile for this machine's backend")
    ap.add_argument("--no-scan", action="store_true", help="every layer separate and unrolled (no lax.scan)")
    args = ap.parse_args()

    cfg = ModelConfig(scan_layers=not args.no_scan)  # the released shapes
    plan = layer_plan(cfg)
    print(f"# {cfg.summary()}")
    print("# plan: " + ", ".join(f"layers {s.start}-{s.layers[-1]} " + (f"scanned x{s.reps}" if s.scanned else "unrolled")
                                 for s in plan))
    params = param_shapes(cfg, jnp.bfloat16)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for shape in args.shapes.split(","):
        b, t = (int(v) for v in shape.split("x"))
        state = jax.eval_shape(partial(init_state, cfg, b, args.capacity, jnp.bfloat16))
        tokens = jax.ShapeDtypeStruct((b, t), jnp.int32)
        ple_ids = jax.ShapeDtypeStruct((b, t, cfg.ngram_heads), jnp.int32)
        fn = jax.jit(partial(step, cfg=cfg), donate_argnames=("state",))
        t0 = time.perf_counter()
        traced = fn.trace(params, state, tokens, ple_ids)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        n_ops = lowered.as_text().count("\n")
        compile_s = None
        if args.compile:
            t3 = time.perf_counter()
            lowered.compile()
            compile_s = round(time.perf_counter() - t3, 2)
        rec = {"shape": f"{b}x{t}", "capacity": args.capacity, "trace_s": round(t1 - t0, 2),
               "lower_s": round(t2 - t1, 2), "total_s": round(t2 - t0, 2), "stablehlo_lines": n_ops,
               "compile_s": compile_s, "scan_layers": cfg.scan_layers,
               "jax": jax.__version__, "machine": platform.node() or "cpu", "backend": jax.default_backend(),
               "commit": commit}
        print(json.dumps(rec))


if __name__ == "__main__":
    main()
