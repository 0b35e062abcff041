"""Time every fnx kernel against its reference at the released shapes; print a line per case and append JSON
lines to benchmarks/results/bench_kernels.jsonl.

    python scripts/bench_kernels.py                      # all kernel families
    python scripts/bench_kernels.py --only gemv moe      # some families
    python scripts/bench_kernels.py --quick              # tiny shapes (a smoke test; runs on the CPU too)
    python scripts/bench_kernels.py --tune gemv          # sweep GEMV tiles, write fnx/pallas/gemv/configs/<device>.json

Each family lives in fnx/pallas/<family>/bench.py and returns BenchCase objects; fnx.pallas.bench.time_case
rotates distinct weight sets (more than twice the 60 MB L2) inside one jitted program, so a case's time is HBM
streaming, and reports TB/s and the fraction of the 4.3 TB/s measured ceiling."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILIES = ("gemv", "moe", "gdn", "qsa", "hc")


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        return os.environ.get("FNX_COMMIT", "unknown")


def tune_gemv(out_path: pathlib.Path, quick: bool, log) -> dict:
    """Sweep tile sets per (fmt, N, K, M bucket) and keep the fastest; returns the config dict written."""
    import jax
    from fnx.pallas.bench import time_case
    from fnx.pallas.gemv import api, bench, shapes
    from fnx.pallas.gemv import pallas as gp
    best: dict = {}
    shape_list = shapes.TEST if quick else shapes.RELEASED
    for fmt in ("bf16", "fp8", "nvfp4"):
        for name, n, k in shape_list:
            for m in (1, 8, 16):
                cands = []
                for bn in (16, 32, 64, 128):
                    for bk in ((32, 64, 128) if fmt == "fp8" else (64, 128, 256)):
                        for split in (1, 2, 4, 8, 16):
                            for warps in (4, 8):
                                t = gp.Tiles(bn, bk, split, warps, 3)
                                if gp.check_tiles(fmt, n, k, t) is None and (n // bn) * split <= 8192 \
                                        and k // (bk * split) >= 1:
                                    cands.append(t)
                # prune: keep the combos whose program count is in a sane band
                cands = [t for t in cands if 66 <= (n // t.bn) * t.split <= 4096] or cands
                results = []
                for t in cands[: (6 if quick else 40)]:
                    c = bench.cases(quick, fmts=(fmt,), ms=(m,), impls=("pallas",), tiles=t)
                    c = [x for x in c if x.extra["N"] == n and x.extra["K"] == k]
                    if not c:
                        continue
                    try:
                        r = time_case(c[0], iters=10, warmup=1)
                    except Exception as e:  # a tile set that does not compile is skipped, and said
                        log(f"  skip {t}: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    results.append((r["us"], t))
                if results:
                    us, t = min(results, key=lambda r: r[0])
                    key = f"{fmt}:{n}:{k}:{api.m_bucket(m)}"
                    best[key] = {"bn": t.bn, "bk": t.bk, "split": t.split, "num_warps": t.num_warps,
                                 "num_stages": t.num_stages}
                    log(f"tune {key} ({name}): {us:.1f} us with {t} over {len(results)} candidates")
                    # the argmax variant needs split == 1
                    if name == "lm_head":
                        r1 = [r for r in results if r[1].split == 1]
                        if r1:
                            t1 = min(r1, key=lambda r: r[0])[1]
                            best[key + ":argmax"] = dict(best[key], bn=t1.bn, bk=t1.bk, split=1,
                                                         num_warps=t1.num_warps)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(best, indent=1, sort_keys=True) + "\n")
    api._tuned.cache_clear()
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=list(FAMILIES), help=f"families among {FAMILIES}")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test, not a measurement")
    ap.add_argument("--tune", nargs="*", default=[], help="families to tune first (gemv)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_kernels.jsonl"))
    args = ap.parse_args(argv)

    import jax
    from fnx.pallas.bench import time_case

    dev = jax.devices()[0]
    meta = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__, "commit": _commit(),
            "date": datetime.date.today().isoformat(), "quick": args.quick}
    print(f"# {meta}", flush=True)
    if "gemv" in args.tune:
        from fnx.pallas.gemv import api
        name = dev.device_kind.lower().replace(" ", "_") + ".json"
        tune_gemv(api.CONFIG_DIR / name, args.quick, lambda s: print(s, flush=True))
    results = []
    for fam in args.only:
        if fam not in FAMILIES:
            raise SystemExit(f"unknown family {fam!r}; choose from {FAMILIES}")
        try:
            mod = importlib.import_module(f"fnx.pallas.{fam}.bench")
        except ModuleNotFoundError as e:
            print(f"# {fam}: no benchmark module ({e})", flush=True)
            continue
        t0 = time.time()
        cs = mod.cases(args.quick)
        print(f"# {fam}: {len(cs)} cases built in {time.time() - t0:.1f}s", flush=True)
        for c in cs:
            try:
                r = time_case(c, iters=args.iters if not args.quick else 2, warmup=1)
            except Exception as e:
                r = {"kernel": c.kernel, "shape": c.shape, "impl": c.impl, "error": f"{type(e).__name__}: {e}"[:400]}
                print(f"{c.kernel:14s} {c.impl:10s} {c.shape:28s} ERROR {r['error'][:200]}", flush=True)
                results.append({**meta, **r})
                continue
            r = {**meta, **r}
            results.append(r)
            extra = " ".join(f"{k}={r[k]}" for k in ("layer", "tiles") if k in r)
            flops = f" {r['tflops']:7.1f} TF/s" if "tflops" in r and r.get("frac_flops", 0) > 0.05 else ""
            print(f"{c.kernel:14s} {c.impl:10s} {c.shape:28s} {r['us']:9.2f} us {r['tbps']:6.3f} TB/s "
                  f"{r['frac_bw']:6.3f} of ceiling{flops} {extra}", flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    print(json.dumps({"summary": "bench_kernels", "cases": len(results),
                      "errors": sum("error" in r for r in results), **meta}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
