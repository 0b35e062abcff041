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
import dataclasses
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
    if os.environ.get("FNX_COMMIT"):
        return os.environ["FNX_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True).strip()
    except Exception:
        return os.environ.get("FNX_COMMIT", "unknown")


def wide_candidates(fmt: str, n: int, k: int) -> list:
    """Whole-K-per-program tiles (modes "fma" and "dot", bf16 and FP8): row tiles 4-32 ("dot" needs 16+), the
    widest K chunk of 512 / 256 / 128 that divides K, 4 warps; "fma" also with 2 or 4 row tiles per program, and
    with K split over 2 or 4 programs."""
    from fnx.pallas.gemv import pallas as gp
    if fmt not in gp.WIDE_FORMATS:
        return []
    bk = next((b for b in (512, 256, 128, 64) if k % b == 0), None)
    if bk is None:
        return []
    out = [gp.Tiles(bn, bk, 1, 4, 1, mode="fma") for bn in (4, 8, 16, 32)]
    out += [gp.Tiles(bn, bk, 1, 4, 1, mode="fma", acc=1) for bn in (4, 8, 16)]    # one row reduction per program
    out += [gp.Tiles(bn, bk, 1, 4, 1, mode="dot") for bn in (16, 32)]
    # several row tiles per program, the next tile's loads in flight during the current tile's arithmetic
    out += [gp.Tiles(bn, bk, 1, 4, 1, mode="fma", rows=r) for bn, r in ((8, 2), (16, 2), (8, 4))]
    # K split over 2 or 4 programs (fp32 partials, one XLA sum): more programs for layers with few rows
    out += [gp.Tiles(bn, bk, sp, 4, 1, mode="fma") for bn, sp in ((8, 2), (8, 4), (16, 2))]
    return [t for t in out if gp.check_tiles(fmt, n, k, t) is None]


def gemv_candidates(fmt: str, n: int, k: int, base=None, m: int = 1) -> list:
    """Tile candidates in two stages. Stage 1 (base None): the configured tiles (tuned or heuristic), the
    heuristic's row tile and split with each K step (128; FP8 also 256 and 512, as several 128-column blocks per
    step; NVFP4 256 and 512), for NVFP4 each decode variant, and the whole-K modes (`wide_candidates`). Stage 2 around the stage-1 best: for a looped best, row tiles 32/64/128 (16 too for
    narrow N), K split for about 1x, 2x and 4x the SM count in programs, 4 or 8 warps, 4 or 5 pipeline stages;
    for a whole-K best, half and double its row tile, 2 and 8 warps, the other K chunks, 1 / 2 / 4 row tiles per
    program and K split 1 / 2 / 4 / 8 ways. The configured and heuristic tiles are M's (what the model runs at M
    tokens without a new entry), and the M = 1 heuristic's too."""
    from fnx.pallas.gemv import api
    from fnx.pallas.gemv import pallas as gp
    heur = api.heuristic_tiles(fmt, n, k, 1)
    out = [] if heur is None else [heur]
    if base is None:
        for t in (api.heuristic_tiles(fmt, n, k, m), api.tiles_for(fmt, n, k, m)):
            if t is not None and t not in out:
                out.insert(0, t)
        if heur is not None:
            bks = {"nvfp4": (256, 512), "fp8": (128, 256, 512)}.get(fmt, (128, 256))
            for bk in bks:
                for dec in (gp.DECODES if fmt == "nvfp4" else ("f32",)):
                    if k % bk:
                        continue
                    t = gp.Tiles(heur.bn, bk, api.split_for(n, heur.bn, k, bk, 2 * api.SMS), 4, 3, dec)
                    if gp.check_tiles(fmt, n, k, t) is None and t not in out:
                        out.append(t)
        for c in list(out):     # the configured tiles on fp16 MMAs (FP8's default at M > 1): also on bf16 ones
            b = dataclasses.replace(c, mma="bf16")
            if c.mma == "f16" and b not in out and gp.check_tiles(fmt, n, k, b) is None:
                out.insert(out.index(c) + 1, b)
        tc = [c for c in out if c.mode != "fma" and not c.tr and c.mma == "bf16"]
        if m > 1:   # several tokens: each tensor-core candidate also with the weights as the MMA's left operand
            out += [t for t in (dataclasses.replace(c, tr=1) for c in tc)
                    if gp.check_tiles(fmt, n, k, t) is None and t not in out]
        if m > 1 or fmt == "nvfp4":     # and on fp16 MMAs (FP8, NVFP4: `Tiles.mma`; NVFP4 runs them at one token too)
            out += [t for t in (dataclasses.replace(c, mma="f16") for c in tc)
                    if gp.check_tiles(fmt, n, k, t) is None and t not in out]
        return out + [t for t in wide_candidates(fmt, n, k) if t not in out]
    out = []
    if base.mode != "loop":
        opts = [dataclasses.replace(base, num_warps=w) for w in (2, 8)]
        opts += [dataclasses.replace(base, bn=b) for b in (base.bn // 2, base.bn * 2)]
        opts += [dataclasses.replace(base, bk=b) for b in (128, 256, 512, 1024) if b != base.bk]
        opts += [dataclasses.replace(base, rows=r) for r in (1, 2, 4) if r != base.rows]
        opts += [dataclasses.replace(base, split=sp) for sp in (1, 2, 4, 8) if sp != base.split]
        if m > 1 and base.mode == "dot":
            opts[:0] = [dataclasses.replace(base, tr=1 - base.tr),
                        dataclasses.replace(base, mma="f16" if base.mma == "bf16" else "bf16")]
        return [t for t in opts if t.bn >= 1 and gp.check_tiles(fmt, n, k, t) is None]
    for bn in ((16, 32, 64, 128) if n <= 640 else (32, 64, 128)):
        if n % bn:
            continue
        for target in (api.SMS, 2 * api.SMS, 4 * api.SMS):
            for warps in ((4, 8) if target == 2 * api.SMS else (4,)):
                t = dataclasses.replace(base, bn=bn, split=api.split_for(n, bn, k, base.bk, target),
                                        num_warps=warps, num_stages=3)    # the best's other fields (tr, mma) kept
                if gp.check_tiles(fmt, n, k, t) is None and t not in out and t != base:
                    out.append(t)
    for bk in (base.bk * 2, base.bk * 4):   # more bytes per pipeline stage (several 128-column FP8 blocks a step),
        for stages in (2, 3):                # fewer stages to fit the shared memory
            sp = api.split_for(n, base.bn, k, bk, (n // base.bn) * base.split)
            t = dataclasses.replace(base, bk=bk, num_stages=stages, split=sp)
            if k % (bk * sp) == 0 and gp.check_tiles(fmt, n, k, t) is None and t not in out:
                out.append(t)
    for stages in (4, 5):   # deeper software pipelining: more loads in flight per program (latency-bound shapes)
        t = dataclasses.replace(base, num_stages=stages)
        if gp.check_tiles(fmt, n, k, t) is None and t not in out:
            out.append(t)
    flips = [dataclasses.replace(base, tr=1 - base.tr)] if m > 1 else []     # the other operand order and
    if m > 1 or fmt == "nvfp4":                                               # MMA type of the best
        flips.append(dataclasses.replace(base, mma="f16" if base.mma == "bf16" else "bf16"))
    for t in flips:
        if gp.check_tiles(fmt, n, k, t) is None and t not in out:
            out.insert(0, t)
    return out


def tune_gemv(out_path: pathlib.Path, quick: bool, log, budget_s: float = 200.0, fmts=("fp8", "bf16", "nvfp4"),
              layer_filter: str | None = None, m: int = 1, second: bool = False, workers: int = 4,
              min_apps: int = 64, clock=time.time) -> dict:
    """Time the candidates per (fmt, N, K) at M tokens (two stages, see gemv_candidates) and keep the fastest
    under M's bucket (other buckets use the nearest tuned one; M = 5, an MTP verify window, is bucket 8); stops at
    `budget_s`, leaving the rest to the heuristic. Entries already in the config file stay unless re-tuned; a
    stage-1 best that is already the tuned entry skips the second stage unless `second`. `workers` candidates
    are compiled at once (host threads), then timed one after another. A shape cut by the budget keeps the best
    of the candidates it timed (the configured tiles are the first), and says so. `min_apps`: time_case's.
    Returns the config dict written."""
    import re

    from concurrent.futures import ThreadPoolExecutor

    from fnx.pallas.bench import prepare_case, time_case
    from fnx.pallas.gemv import api, bench, shapes
    from fnx.pallas.gemv import pallas as gp
    best: dict = json.loads(out_path.read_text()) if out_path.exists() else {}
    t_start = clock()
    # the fused projections first: the served step runs them (a tune cut by its budget reached only the unfused
    # shapes at M = 5 in the nineteenth session)
    if workers < 1:
        raise ValueError(f"workers={workers}: at least one compile thread")
    pool = ThreadPoolExecutor(workers, thread_name_prefix="tune-compile")
    shape_list = shapes.TEST if quick else shapes.FUSED + shapes.RELEASED
    seen: set = set()      # (N, K) pairs shared by two layers (gdn.out_proj, qsa.o_proj) are tuned once
    shape_list = [s for s in shape_list if not ((s[1], s[2]) in seen or seen.add((s[1], s[2])))]
    if layer_filter:
        shape_list = [s for s in shape_list if re.search(layer_filter, s[0])]
    for fmt in fmts:
        for name, n, k in shape_list:
            if clock() - t_start > budget_s:
                log(f"tune: budget of {budget_s:.0f}s spent; {fmt} {name} and later keep the heuristic")
                break
            results = []

            def run(cands) -> bool:
                """Time `cands` in batches of `workers`: each batch compiled at once on host threads, then timed
                one by one with nothing compiling. False when the budget ran out before the last batch."""
                cands = list(cands)
                for i in range(0, len(cands), workers):
                    if clock() - t_start > budget_s:
                        log(f"tune: budget of {budget_s:.0f}s spent after {i} of {len(cands)} candidates of "
                            f"{fmt} {name}")
                        return False
                    batch = [(t, bench.cases(quick, fmts=(fmt,), ms=(m,), impls=("pallas",), tiles=t,
                                             only=(n, k))[0]) for t in cands[i:i + workers]]
                    futs = [pool.submit(prepare_case, c, min_apps) for _, c in batch]
                    for (t, c), fut in zip(batch, futs):
                        try:
                            r = time_case(c, iters=10, warmup=1, prepared=fut.result())
                        except Exception as e:  # a tile set that does not compile is skipped, and said
                            log(f"  skip {t}: {type(e).__name__}: {str(e)[:120]}")
                            continue
                        log(f"  {fmt} {name} {t}: {r['us']:.1f} us {r['tbps']:.3f} TB/s")
                        results.append((r["us"], t))
                return True

            key = f"{fmt}:{n}:{k}:{api.m_bucket(m)}"
            whole = run(gemv_candidates(fmt, n, k, m=m))
            if not results:
                continue
            first = min(results, key=lambda r: r[0])[1]
            if whole and (second or not (key in best and first == gp.Tiles(**best[key]))):   # a tuned best: no
                whole = run(gemv_candidates(fmt, n, k, base=first, m=m))                     # second stage
            us, t = min(results, key=lambda r: r[0])
            best[key] = dataclasses.asdict(t)
            heur = api.heuristic_tiles(fmt, n, k, m)
            h_us = next((u for u, tt in results if tt == heur), None)
            log(f"tune {key} ({name}): {us:.1f} us with {t}; heuristic {heur} "
                f"{'%.1f us' % h_us if h_us else 'not among candidates'} ({len(results)} candidates"
                f"{'' if whole else ', cut by the budget: the best of those timed, the configured tiles first'})")
            if name == "lm_head":  # the fused argmax needs split == 1
                r1 = [r for r in results if r[1].split == 1]
                if r1:
                    best[key + ":argmax"] = dataclasses.asdict(min(r1, key=lambda r: r[0])[1])
            out_path.parent.mkdir(parents=True, exist_ok=True)   # written after every shape: a cut run keeps it
            out_path.write_text(json.dumps(best, indent=1, sort_keys=True) + "\n")
    pool.shutdown()
    api._tuned_file.cache_clear()
    return best


def warm_up(seconds: float) -> float:
    """Dense bf16 matmuls for about `seconds` (synchronised each pass): the device at its working clocks before the
    first timed case. Returns the seconds spent."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((4096, 4096), jnp.bfloat16)
    f = jax.jit(lambda a: [a @ a for _ in range(8)][-1])
    t0 = time.time()
    jax.block_until_ready(f(a))
    while time.time() - t0 < seconds:
        jax.block_until_ready(f(a))
    return time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=list(FAMILIES), help=f"families among {FAMILIES}")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test, not a measurement")
    ap.add_argument("--tune", nargs="*", default=[], help="families to tune first (gemv)")
    ap.add_argument("--tune-budget", type=float, default=200.0, help="seconds the GEMV tuner may spend")
    ap.add_argument("--tune-fmts", nargs="*", default=["fp8", "bf16", "nvfp4"])
    ap.add_argument("--tune-layers", default=None, help="regex over layer names: tune only those shapes")
    ap.add_argument("--tune-m", type=int, default=1, help="tokens per call to tune at (its M bucket gets the entry)")
    ap.add_argument("--tune-second", action="store_true",
                    help="run the tuner's second stage even where the first stage's best is the tuned entry")
    ap.add_argument("--tune-workers", type=int, default=4,
                    help="tile candidates the GEMV tuner compiles at once (host threads) before timing them in turn")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--min-apps", type=int, default=64,
                    help="applications the slope spans (fewer compile faster: the longer program unrolls them)")
    ap.add_argument("--filter", default=None, help="regex: run only cases whose 'kernel impl shape extra' matches")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_kernels.jsonl"))
    ap.add_argument("--warm-s", type=float, default=None,
                    help="seconds of dense matmuls before the first case (default: 3 on a GPU, 0 elsewhere): the "
                         "first case of a freshly started machine measured 50%% slower than the same case later")
    ap.add_argument("--variants", default="",
                    help="';'-separated 'LABEL: FNX_ENV=VALUE ...': each selected case timed again per variant, its "
                         "programs traced under those settings (impl 'IMPL+LABEL', the settings in its record), "
                         "e.g. 'da: FNX_DOT_ACC=1;h: FNX_DOT_ACC=1 FNX_MOE_BLOCK_TILES=mma16=1'")
    ap.add_argument("--bracket", action="store_true",
                    help="time each family's first case again after its last: the record pair (\"bracket\": "
                         "\"first\" / \"again\") is the run's spread, below which differences are noise")
    args = ap.parse_args(argv)

    import jax

    from fnx.pallas.bench import fnx_settings, parse_variants, time_case
    variants = parse_variants(args.variants, "--variants") if args.variants else []

    dev = jax.devices()[0]
    meta = {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__, "commit": _commit(),
            "date": datetime.date.today().isoformat(), "quick": args.quick, "settings": fnx_settings()}
    print(f"# {meta}", flush=True)
    warm_s = args.warm_s if args.warm_s is not None else (3.0 if dev.platform == "gpu" else 0.0)
    if warm_s > 0:
        print(f"# warm-up: {warm_up(warm_s):.1f} s of matmuls", flush=True)
    if "gemv" in args.tune:
        from fnx.pallas.gemv import api
        name = dev.device_kind.lower().replace(" ", "_") + ".json"
        tune_gemv(api.CONFIG_DIR / name, args.quick, lambda s: print(s, flush=True), args.tune_budget,
                  tuple(args.tune_fmts), args.tune_layers, args.tune_m, args.tune_second, args.tune_workers,
                  args.min_apps)
    results = []
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sink = out.open("a")   # one JSON line per case as soon as it is timed: a run cut short keeps what it measured

    def record(r):
        results.append(r)
        sink.write(json.dumps(r) + "\n")
        sink.flush()

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
        if args.filter:
            import re
            rx = re.compile(args.filter)
            cs = [c for c in cs if rx.search(f"{c.kernel} {c.impl} {c.shape} {c.extra}")]
        if variants:   # each case, then its knob variants (the same arguments, programs traced under the knobs)
            cs = [v for c in cs for v in [c] + [dataclasses.replace(c, impl=f"{c.impl}+{label}", env=env)
                                               for label, env in variants]]
        print(f"# {fam}: {len(cs)} cases built in {time.time() - t0:.1f}s", flush=True)
        runs = [(c, None) for c in cs]
        if args.bracket and len(cs) > 1:
            runs = [(cs[0], "first")] + runs[1:] + [(cs[0], "again")]
        for c, bracket in runs:
            try:
                r = time_case(c, iters=args.iters if not args.quick else 2, warmup=1, min_apps=args.min_apps)
                if bracket:
                    r["bracket"] = bracket
            except Exception as e:
                r = {"kernel": c.kernel, "shape": c.shape, "impl": c.impl, "error": f"{type(e).__name__}: {e}"[:400]}
                print(f"{c.kernel:14s} {c.impl:10s} {c.shape:28s} ERROR {r['error'][:200]}", flush=True)
                record({**meta, **r, **({"settings": {**meta["settings"], **c.env}} if c.env else {})})
                continue
            r = {**meta, **r}
            if c.env:
                r["settings"] = {**meta["settings"], **c.env}
            record(r)
            extra = " ".join(f"{k}={r[k]}" for k in ("layer", "tiles", "block_v", "num_warps", "fuse_norm", "check",
                                                      "max_rel_err", "bracket") if k in r)
            flops = f" {r['tflops']:7.1f} TF/s" if "tflops" in r and r.get("frac_flops", 0) > 0.05 else ""
            print(f"{c.kernel:14s} {c.impl:10s} {c.shape:28s} {r['us']:9.2f} us {r['tbps']:6.3f} TB/s "
                  f"{r['frac_bw']:6.3f} of ceiling{flops} {extra}", flush=True)
    sink.close()
    print(json.dumps({"summary": "bench_kernels", "cases": len(results),
                      "errors": sum("error" in r for r in results), **meta}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
