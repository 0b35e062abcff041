"""The `fnx` command line.

    fnx convert SRC DST [--quant fp8|fp8-head] [--dtype bfloat16]   HF safetensors -> orbax param tree (fast restore)
"""

from __future__ import annotations

import argparse
import sys
import time


def convert(src: str, dst: str, quant: str | None = None, dtype: str = "bfloat16", progress: bool = True) -> dict:
    """Load `src` (HF safetensors) as `fnx.load` would, then save the converted tree to `dst` with orbax."""
    import jax.numpy as jnp
    from fnx.checkpoint import load_checkpoint
    from fnx.checkpoint.orbax_io import save
    t0 = time.perf_counter()
    loaded = load_checkpoint(src, dtype=jnp.dtype(dtype), quant=quant, progress=progress)
    t1 = time.perf_counter()
    save(loaded, dst, source=str(src), quant=quant)
    return {"load_seconds": t1 - t0, "save_seconds": time.perf_counter() - t1}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fnx", description="fnx: a JAX inference engine for Qwen3.8-Flash-Next")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="convert an HF checkpoint into an orbax param tree that fnx.load restores")
    c.add_argument("src", help="HF checkpoint directory (config.json + safetensors)")
    c.add_argument("dst", help="output directory")
    c.add_argument("--quant", choices=["fp8", "fp8-head"], default=None,
                   help="online weight-only quantization: fp8 (the dense projections and experts in 128x128 "
                        "blocks), fp8-head (those and the lm_head)")
    c.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    c.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.command == "convert":
        from fnx.checkpoint import CheckpointError
        try:
            t = convert(args.src, args.dst, args.quant, args.dtype, progress=not args.no_progress)
        except (CheckpointError, ValueError) as exc:
            print(f"fnx convert: {exc}", file=sys.stderr)
            return 1
        print(f"converted {args.src} -> {args.dst}: load {t['load_seconds']:.1f} s, save {t['save_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
