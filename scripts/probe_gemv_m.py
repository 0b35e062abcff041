"""The FP8 GEMV kernel's modes at a few tokens: per-call time of one weight-streaming product, M tokens, each mode
("fma", "loop", and XLA's reference), over weight sets rotated beyond the 60 MB L2. A probe, not the tuner: it
answers which mode a verify window (M = k + 1) should take.

    python scripts/probe_gemv_m.py --ms 1,5 --shapes 16384x2560,2560x6144
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from fnx.pallas.gemv import api
from fnx.pallas.gemv import bench as gb
from fnx.pallas.gemv import pallas as gp

MODES = {"fma": lambda n, k: gp.Tiles(16 if n % 16 == 0 else 8, 512, 1, num_warps=4, num_stages=1, mode="fma"),
         "loop": lambda n, k: api.heuristic_tiles("fp8", n, k, 16)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,5")
    ap.add_argument("--shapes", default="16384x2560,2560x6144,1280x2560")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        sets = [gb.make_weight("fp8", n, k, jax.random.PRNGKey(i)) for i in range(max(2, 240_000_000 // (n * k)))]
        for m in map(int, args.ms.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(99), (m, k), jnp.float32).astype(jnp.bfloat16)
            for mode in ("fma", "loop", "reference"):
                if mode == "reference":
                    f = jax.jit(lambda x, w, s: api.linear(x, w, fmt="fp8", scale=s, impl="reference"))
                else:
                    t = MODES[mode](n, k)
                    f = jax.jit(lambda x, w, s, t=t: gp.gemv(x, w, s, fmt="fp8", tiles=t))

                def run():
                    for s in sets:
                        y = f(x, s["w"], s["scale"])
                    return y
                jax.block_until_ready(run())
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(args.iters):
                        y = run()
                    jax.block_until_ready(y)
                    best = min(best, (time.perf_counter() - t0) / (args.iters * len(sets)) * 1e6)
                rec = {"probe": "gemv_m", "fmt": "fp8", "M": m, "N": n, "K": k, "mode": mode,
                       "us_per_call": round(best, 2), "tbps": round(n * k / best / 1e6, 3),
                       "device": jax.devices()[0].device_kind}
                print(json.dumps(rec), flush=True)
                if args.out:
                    with open(args.out, "a") as fh:
                        fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
