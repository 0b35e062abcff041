"""Run a few decode kernels at the released shapes, a handful of times each, so that Nsight Compute (`ncu`) can read
their hardware counters: the MoE decode layer (fnx.pallas.moe.bench.layer, "fused": routing + gate/up + down) at
M = 1 and 5 tokens with NVFP4 or FP8 experts and a random router, and the FP8 / bf16 GEMV kernel at a few of the
model's projection shapes. Timing is not this script's job (ncu replays each kernel with its caches flushed);
what it gives is where a kernel's time goes: DRAM throughput against its peak, issue-slot use, warp stall reasons,
occupancy. scripts/gpu_session.sh's `ncu` part runs it under ncu and keeps the text report.

    python scripts/probe_ncu.py --cases moe5_nvfp4 moe1_nvfp4 gemv_fp8 --reps 3
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

BF16 = jnp.bfloat16
E, K, D, I_, IS = 512, 10, 2560, 640, 640
# GEMV shapes (N, K): a fused GDN in-projection (qkv + z: 2*2048 + 2*4096), an out-projection, the shared expert
GEMV_SHAPES = ((12288, 2560), (2560, 4096), (1280, 2560))
IMPL = "pallas"      # the GEMV cases' backend ("pallas_interpret": a CPU check of this script)


_EXPERTS: dict = {}     # format -> (gate_up, down): quantized once, shared by the cases of that format


def _moe_case(m: int, fmt: str, key):
    from fnx.pallas.moe import bench
    k_gu, k_dn, k_x, k_r, k_s = jax.random.split(key, 5)
    if fmt not in _EXPERTS:
        _EXPERTS[fmt] = (bench._quantize(jax.random.normal(k_gu, (E, 2 * I_, D), BF16) * 0.02, fmt),
                         bench._quantize(jax.random.normal(k_dn, (E, D, I_), BF16) * 0.03, fmt))
    gu, dn = _EXPERTS[fmt]
    ks = jax.random.split(k_s, 4)
    sh = lambda k, s: jax.random.normal(k, s, BF16) * 0.02
    args = (jax.random.normal(k_x, (m, D), BF16), jax.random.normal(k_r, (E, D), BF16) * 0.05,
            sh(ks[0], (IS, D)), sh(ks[1], (IS, D)), sh(ks[2], (D, IS)), sh(ks[3], (1, D)), gu, dn)
    fn = jax.jit(jax.tree_util.Partial(bench.layer, top_k=K, impl="fused"))
    return fn, args


def _gemv_case(m: int, fmt: str, n: int, k: int, key):
    from fnx.model import quant
    from fnx.pallas.gemv import api
    kw, kx = jax.random.split(key)
    w = jax.random.normal(kw, (n, k), BF16) * 0.02
    x = jax.random.normal(kx, (m, k), BF16)
    if fmt == "fp8":
        q = quant.quantize_fp8_block(w)
        fn = jax.jit(lambda x, w, s: api.linear(x, w, fmt="fp8", scale=s, impl=IMPL))
        return fn, (x, q.w, q.scale_inv)
    fn = jax.jit(lambda x, w: api.linear(x, w, impl=IMPL))
    return fn, (x, w)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["moe5_nvfp4", "moe1_nvfp4", "gemv_fp8"],
                    help="moe<M>_<nvfp4|fp8|bf16>, gemv_<fp8|bf16>[_m<M>]")
    ap.add_argument("--reps", type=int, default=3, help="calls per case after the compiling one")
    args = ap.parse_args()
    key = jax.random.key(0)
    for name in args.cases:
        key, sub = jax.random.split(key)
        runs = []
        if name.startswith("moe"):
            m, fmt = name[3:].split("_")
            runs.append((name, *_moe_case(int(m), fmt, sub)))
        elif name.startswith("gemv"):
            parts = name.split("_")
            m = int(parts[2][1:]) if len(parts) > 2 else 1
            for n, k in GEMV_SHAPES:
                runs.append((f"{name} N={n} K={k}", *_gemv_case(m, parts[1], n, k, sub)))
        else:
            raise SystemExit(f"probe_ncu: unknown case {name!r} (moe<M>_<fmt> or gemv_<fmt>[_m<M>])")
        for label, fn, a in runs:
            jax.block_until_ready(fn(*a))          # compile (and autotune) outside the profiled launches
            t0 = time.perf_counter()
            for _ in range(args.reps):
                jax.block_until_ready(fn(*a))
            print(f"probe_ncu {label}: {args.reps} calls in {time.perf_counter() - t0:.3f} s", flush=True)


if __name__ == "__main__":
    main()
