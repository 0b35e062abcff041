"""Benchmark the PLE row store: rows/s and per-fetch latency of every mode, warm and cold, at decode and prefill
shapes; optionally the PLE stall per decode round end to end around a jitted step (`--e2e`).

    python scripts/bench_ple.py --quick                       # small synthetic table, every mode, ~1 min
    python scripts/bench_ple.py --table-gb 51.2 --dir /data   # full-size FP8 table (320,001,536 x 160 B)
    python scripts/bench_ple.py --table /ckpt/dir             # a real checkpoint or raw row file
    python scripts/bench_ple.py --quick --e2e                 # + callbacks and the pipeline vs device mode

Table: a synthetic FP8 raw row file (width 160, 16 heads, one global bf16 scale) written to --dir unless
--table is given; it is reused across runs when its size matches. Cold = the store's pages evicted before each
fetch (pageable: MADV_DONTNEED + posix_fadvise(DONTNEED); swap: MADV_PAGEOUT, which needs swap; direct has no
cache) with fresh random ids. Every result is one JSON line appended to --out; a summary table is printed.
Needs only numpy, ml_dtypes and jax (CPU or CUDA)."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import platform
import subprocess
import sys
import time
import traceback

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fnx.ple import NgramConstants, initial_context, ngram_ids  # noqa: E402
from fnx.ple import _linux as lx  # noqa: E402
from fnx.ple.store import MODES, open_store  # noqa: E402
from fnx.ple.table import RAW_HEADER, TableError, TableSource, from_raw, open_source, raw_header  # noqa: E402

WIDTH, HEADS = 160, 16
RELEASE_ROWS = 320_001_536


def _commit():
    if os.environ.get("FNX_COMMIT"):      # the device machine's copy of the tree may carry a stale .git
        return os.environ["FNX_COMMIT"]
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def synthetic_table(path: str, gib: float, seed: int = 0) -> str:
    """An FP8 raw row file of about `gib` GiB (exactly the release table at 51.2 GB / 47.68 GiB)."""
    import ml_dtypes
    rows = RELEASE_ROWS if gib * 2**30 >= RELEASE_ROWS * WIDTH * 0.999 else int(gib * 2**30) // WIDTH // 128 * 128
    need = RAW_HEADER + rows * WIDTH
    if os.path.exists(path) and os.path.getsize(path) == need:
        try:
            src = from_raw(path)
            if src.rows == rows and src.stored_fingerprint:
                print(f"reusing {path} ({need / 1e9:.2f} GB)", flush=True)
                return path
        except Exception:  # noqa: BLE001
            pass
    st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    if st.f_bavail * st.f_frsize < need + (1 << 30):
        raise SystemExit(f"not enough disk for a {need / 1e9:.1f} GB table in {os.path.dirname(path)}: "
                         f"{st.f_bavail * st.f_frsize / 1e9:.1f} GB free")
    print(f"writing a synthetic {rows}-row FP8 table ({need / 1e9:.2f} GB) to {path} ...", flush=True)
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, size=64 << 20, dtype=np.uint8)
    block[(block & 0x7F) == 0x7F] = 0  # no NaN codes
    scale = np.array(0.0123, dtype=ml_dtypes.bfloat16)
    meta = {"rows": rows, "width": WIDTH, "dtype": "F8_E4M3", "fingerprint": None, "scale_dtype": "BF16",
            "scale_hex": scale.tobytes().hex(), "buffers": {}}
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, raw_header(meta), 0)
        pos, end, i = RAW_HEADER, need, 0
        while pos < end:
            n = min(len(block), end - pos)
            os.pwrite(fd, np.roll(block, i)[:n].tobytes(), pos)  # rolled so blocks differ
            pos, i = pos + n, i + 7919
            if i % (7919 * 64) == 0:
                print(f"  {pos / 1e9:.1f} / {end / 1e9:.1f} GB ({(pos / 1e9) / (time.perf_counter() - t0):.2f} GB/s)",
                      flush=True)
        os.fsync(fd)
        meta["fingerprint"] = TableSource(from_raw(path).extents, rows, WIDTH, "F8_E4M3", scale).compute_fingerprint()
        os.pwrite(fd, raw_header(meta), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    print(f"  done in {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def from_raw_or_none(source):
    try:
        return from_raw(source)
    except (TableError, OSError):   # a checkpoint directory or safetensors file, not a raw row file
        return None


def bench_consts(rows: int) -> NgramConstants:
    """Hash constants for a table of `rows` rows: the release's when full size, else 16 equal head ranges."""
    if rows == RELEASE_ROWS:
        return NgramConstants.build(248320, 3, 8, 20_000_000, 128, 1234, 0, 248044)
    size = rows // HEADS
    return NgramConstants(multipliers=np.array([23703573157769, 20109073645365, 8052911324071]),
                          head_vocab_sizes=np.full(HEADS, size), head_offsets=np.arange(HEADS) * size,
                          num_rows=rows, ngram_size=3, heads_per_ngram=8, eos_token_id=248044)


def _ids_for(consts, rng, batch, length):
    tokens = rng.integers(0, 248320, size=(batch, length))
    ids, _ = ngram_ids(initial_context(batch, consts), tokens, consts)
    return ids.reshape(-1, HEADS)


def _zero_once_read(v):
    """0, known only once v (a gathered row's first value) is read: a data dependence on the rows, no effect."""
    import jax.numpy as jnp
    return (jnp.abs(v.astype(jnp.float32)) < 0).astype(jnp.int32)


def chained_gather_us(table, rows: int, ids, iters: int, chain: int = 64) -> list[float]:
    """Microseconds per gather of `table` (any handle with `gather(ids)`: a UvaTable, a RingTable), without the
    host's dispatch and wait: `chain` gathers in one jitted loop, each on ids moved by the previous rows' first
    value (a data dependence, so they run one after another and no two read the same lines), timed as a whole and
    divided; max(3, iters // 5) timings."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def loop(table, ids):
        def body(_, carry):
            ids, acc = carry
            got = table.gather(ids)
            bump = _zero_once_read(got.reshape(-1)[0])
            return (ids + 7919 + bump) % rows, acc + got.reshape(-1)[0].astype(jnp.float32)
        return jax.lax.fori_loop(0, chain, body, (ids, jnp.float32(0)))

    jax.block_until_ready(loop(table, ids))
    times = []
    for _ in range(max(3, iters // 5)):
        s = time.perf_counter()
        jax.block_until_ready(loop(table, ids))
        times.append((time.perf_counter() - s) / chain)
    return times


def _uva_in_jit(store, ids, mode: str, name: str, iters: int, chain: int = 64) -> dict:
    """The device time of one uva gather (or ring round trip): `chained_gather_us` over the store's table."""
    times = chained_gather_us(store.table, store.src.rows, ids, iters, chain)
    rec = {"mode": mode, "shape": name, "cache": f"device gather in-jit x{chain}", "rows": int(ids.size),
           **_stats(times)}
    rec["rows_per_s"] = ids.size / (rec["median_us"] * 1e-6)
    return rec


def _stats(times):
    t = np.asarray(times) * 1e6
    return {"median_us": float(np.median(t)), "p90_us": float(np.percentile(t, 90)), "min_us": float(t.min()),
            "n": len(t)}


def bench_mode(mode, source, consts, args, emit):
    t0 = time.perf_counter()
    store = open_store(source, mode, consts=consts, **({"check_memory": False} if mode == "swap" and
                                                        args.force_swap else {}))
    open_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    shapes = [(f"decode b{b} k{args.k}", b, args.k + 1) for b in args.batch]
    shapes += [(f"prefill {args.prefill}", 1, args.prefill)]
    try:
        for name, b, length in shapes:
            iters = args.iters if length <= 64 else max(3, args.iters // 10)
            ids = _ids_for(consts, rng, b, length)
            store.rows(ids)
            warm = []
            for _ in range(iters):
                s = time.perf_counter()
                store.rows(ids)
                warm.append(time.perf_counter() - s)
            rec = {"mode": mode, "shape": name, "cache": "warm", "rows": int(ids.size), "open_s": round(open_s, 3),
                   **_stats(warm)}
            rec["rows_per_s"] = ids.size / (rec["median_us"] * 1e-6)
            emit(rec)
            if store.device_path:   # the rows read by the GPU (uva: from the pinned table; ring: the ring)
                import jax
                dev = jax.numpy.asarray(ids, jax.numpy.int32)
                jax.block_until_ready(store.rows_device(dev))
                times = []
                for _ in range(iters):
                    s = time.perf_counter()
                    jax.block_until_ready(store.rows_device(dev))
                    times.append(time.perf_counter() - s)
                rec = {"mode": mode, "shape": name, "cache": "device gather", "rows": int(ids.size),
                       **_stats(times)}
                rec["rows_per_s"] = ids.size / (rec["median_us"] * 1e-6)
                emit(rec)
                emit(_uva_in_jit(store, dev, mode, name, iters))
            if mode in ("device", "pinned", "uva"):
                continue  # no cache to be cold in
            if store.device_path:   # ring: a jitted step's post + wait with the backing store's pages evicted
                import jax
                cold = []
                for _ in range(max(3, iters // 2)):
                    ids = _ids_for(consts, rng, b, length)
                    store.evict(ids)
                    dev = jax.numpy.asarray(ids, jax.numpy.int32)
                    s = time.perf_counter()
                    jax.block_until_ready(store.rows_device(dev))
                    cold.append(time.perf_counter() - s)
                rec = {"mode": mode, "shape": name, "cache": "device cold", "rows": int(ids.size), **_stats(cold)}
                rec["rows_per_s"] = ids.size / (rec["median_us"] * 1e-6)
                emit(rec)
            store.evict()   # once whole (pages cached by the table's write sit in large folios), then per round
            for ahead in (None, args.ahead_ms):   # only the rows about to be fetched
                cold = []
                for _ in range(max(3, iters // 2)):
                    ids = _ids_for(consts, rng, b, length)
                    store.evict(ids)
                    if ahead is not None:  # prefetch issued `ahead` ms before the fetch (overlap with layer 0)
                        store.prefetch(ids)
                        time.sleep(ahead / 1e3)
                    s = time.perf_counter()
                    store.rows(ids)
                    cold.append(time.perf_counter() - s)
                rec = {"mode": mode, "shape": name,
                       "cache": "cold" if ahead is None else f"cold, pf {ahead:g}ms",
                       "rows": int(ids.size), **_stats(cold)}
                rec["rows_per_s"] = ids.size / (rec["median_us"] * 1e-6)
                emit(rec)
    finally:
        stats = store.stats
        store.close()
    emit({"mode": mode, "shape": "stats", "store_stats": stats})


# ---- end to end: the PLE stall per decode round around a jitted step ------------------------------------------


def bench_first_touch(source, consts, args, emit):
    """Where a pageable fetch of rows this process has never touched goes (what every decode step of a server
    does: new tokens, new rows). Per decode shape, over --first-touch-trials sets of fresh random rows: the fetch
    itself ("fresh") split into MADV_WILLNEED, MADV_POPULATE_READ and the copy (StoreStats); the same rows again
    ("again": mapped and cached); and other fresh rows first read with pread(2) (page cache filled, nothing mapped in
    this process) and then fetched ("after pread"): so page-cache misses (disk) and first mappings (page faults)
    are told apart. Also the fraction of the table resident in the page cache (mincore on a sample)."""
    store = open_store(source, "pageable", consts=consts)
    try:
        ext = store.src.extents
        fds = {e.path: os.open(e.path, os.O_RDONLY) for e in ext}
        starts = np.cumsum([0] + [e.rows for e in ext[:-1]])
        rb = store.src.row_bytes
        emit({"mode": "first-touch", "shape": "residency", "resident_fraction": store.resident_fraction()})
        rng = np.random.default_rng(17)
        for b in args.batch:
            length = args.k + 1
            t = {"fresh": [], "again": [], "pread": [], "after pread": []}
            phases = {"willneed_seconds": 0.0, "populate_seconds": 0.0, "copy_seconds": 0.0}
            for _ in range(args.first_touch_trials):
                ids = _ids_for(consts, rng, b, length)
                before = store.stats
                s0 = time.perf_counter()
                store.fetch(ids)
                t["fresh"].append(time.perf_counter() - s0)
                after = store.stats
                for k in phases:
                    phases[k] += after[k] - before[k]
                s0 = time.perf_counter()
                store.fetch(ids)
                t["again"].append(time.perf_counter() - s0)
                ids2 = _ids_for(consts, rng, b, length)
                uniq = np.unique(ids2)
                e_idx = np.searchsorted(starts, uniq, side="right") - 1
                s0 = time.perf_counter()
                for r, e in zip(uniq.tolist(), e_idx.tolist()):
                    os.pread(fds[ext[e].path], rb, ext[e].offset + (r - int(starts[e])) * rb)
                t["pread"].append(time.perf_counter() - s0)
                s0 = time.perf_counter()
                store.fetch(ids2)
                t["after pread"].append(time.perf_counter() - s0)
            n = args.first_touch_trials
            rec = {"mode": "first-touch", "shape": f"decode b{b} k{args.k}", "rows": int(ids.size), "trials": n,
                   **{f"{k.replace(' ', '_')}_median_us": float(np.median(v)) * 1e6 for k, v in t.items()},
                   **{f"fresh_{k.replace('_seconds', '')}_us": v / n * 1e6 for k, v in phases.items()}}
            emit(rec)
            print(f"{'first-touch':>22} b{b} k{args.k} ({rec['rows']} rows): fresh {rec['fresh_median_us']:.0f} us "
                  f"(willneed {rec['fresh_willneed_us']:.0f}, populate {rec['fresh_populate_us']:.0f}, copy "
                  f"{rec['fresh_copy_us']:.0f}), again {rec['again_median_us']:.0f} us, pread of fresh rows "
                  f"{rec['pread_median_us']:.0f} us then fetch {rec['after_pread_median_us']:.0f} us", flush=True)
        for fd in fds.values():
            os.close(fd)
    finally:
        store.close()


def bench_e2e(source, consts, args, emit):
    """A stand-in step: program A (embedding + layer 0: `a_layers` matmuls) and program B (PLE projection of the
    rows + `b_layers` matmuls). Variants differ only in how the rows reach B; stall = round time - device."""
    import jax
    import jax.numpy as jnp

    from fnx.ple.pipeline import CALLBACKS, PrefetchPipeline, fetch_rows_in_graph

    hid = args.hidden
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (max(args.a_layers + args.b_layers, 1), hid, hid), jnp.bfloat16) * (hid ** -0.5)
    wp = jax.random.normal(key, (HEADS * WIDTH, hid), jnp.bfloat16) * 0.01
    emb = jax.random.normal(key, (4096, hid), jnp.bfloat16)

    # the weights are arguments, not closed-over constants: XLA folds constants into the program, and compiling
    # ~100 MB of them took over a minute per variant on the H200
    wts = (w, wp, emb)

    def part_a(tokens, wts=wts):
        w, _, emb = wts
        x = emb[tokens % 4096]
        for i in range(args.a_layers):
            x = jnp.tanh(x @ w[i])
        return x

    def part_b(x, rows, wts=wts):
        w, wp, _ = wts
        x = x + rows.astype(x.dtype) @ wp
        for i in range(args.b_layers):
            x = jnp.tanh(x @ w[args.a_layers + i])
        return x.sum(axis=-1)

    rng = np.random.default_rng(3)
    results = {}
    for b in args.batch:
        length = args.k + 1
        tokens_seq = [rng.integers(0, 248320, size=(b, length)) for _ in range(args.iters + 3)]
        variants = {}

        dev = None
        if "device" in args.e2e_variants:
            # the device baseline's cost does not depend on the table's size (a gather of 16 rows per token), so
            # a table larger than --e2e-device-gib is stood in for by a synthetic one of that size: copying 51 GB
            # into HBM takes minutes and measures nothing the round depends on
            dsrc, dconsts = source, consts
            if from_raw_or_none(source) is not None and args.table_bytes > args.e2e_device_gib * 2**30 * 1.01:
                dsrc = synthetic_table(os.path.join(args.dir, f"ple_synthetic_{args.e2e_device_gib:g}g.raw"),
                                       args.e2e_device_gib)
                dconsts = bench_consts(from_raw(dsrc).rows)
                emit({"mode": "e2e note", "shape": f"decode b{b} k{args.k}",
                      "note": f"device baseline on a {args.e2e_device_gib:g} GiB stand-in table"})
            dev = open_store(dsrc, "device", consts=dconsts)
        if dev is not None:
            table = dev.table

            @jax.jit
            def whole_device(tbl, tokens, ids, wts):
                return part_b(part_a(tokens, wts), dev.gather(tbl, ids), wts)

            def run_device(ctx, tokens, dconsts=dconsts):
                ids, ctx = ngram_ids(ctx, tokens, dconsts)
                out = whole_device(table, jnp.asarray(tokens, jnp.int32), jnp.asarray(ids, jnp.int32), wts)
                return out, ctx
            variants["device"] = run_device

        host = open_store(source, args.e2e_mode, consts=consts)
        for method in CALLBACKS:
            if f"callback-{method}" not in args.e2e_variants:
                continue

            def make(method=method):
                @jax.jit
                def whole_cb(tokens, ids, wts):
                    return part_b(part_a(tokens, wts), fetch_rows_in_graph(host, ids, method), wts)

                def run(ctx, tokens):
                    ids, ctx = ngram_ids(ctx, tokens, consts)
                    return whole_cb(jnp.asarray(tokens, jnp.int32), jnp.asarray(ids, jnp.int32), wts), ctx
                return run
            variants[f"callback-{method}"] = make()

        ja, jb = jax.jit(part_a), jax.jit(part_b)
        if "sync" in args.e2e_variants:
            def run_sync(ctx, tokens):  # fetch on the host, then launch: no overlap
                ids, ctx = ngram_ids(ctx, tokens, consts)
                rows = jax.device_put(host.rows(ids.reshape(-1, HEADS)).reshape(b, length, -1))
                return jb(ja(jnp.asarray(tokens, jnp.int32), wts), rows, wts), ctx
            variants["sync"] = run_sync
        pipe = PrefetchPipeline(host) if "pipeline" in args.e2e_variants else None
        if pipe is not None:
            def run_pipe(ctx, tokens):  # two programs: A runs while the thread fetches
                t = pipe.submit_tokens(ctx, tokens)
                x = ja(jnp.asarray(tokens, jnp.int32), wts)
                r = pipe.take(t)
                return jb(x, r.rows, wts), r.new_context
            variants["pipeline"] = run_pipe

        # the host-side variants first, the in-graph callbacks (slow on a GPU, GPU_NOTES.md) last; each variant
        # gets --e2e-variant-s seconds of timed rounds, so one slow variant cannot starve the others
        order = ["device", "sync", "pipeline"] + [f"callback-{m}" for m in CALLBACKS]
        for name in sorted(variants, key=lambda v: order.index(v) if v in order else len(order)):
            fn = variants[name]
            # a variant that stalls (a fetch blocked in the kernel, a deadlock) prints every thread's stack
            # instead of dying silently under the caller's timeout
            print(f"# e2e {name} b{b}: starting", file=sys.stderr, flush=True)
            faulthandler.dump_traceback_later(max(60.0, 4 * args.e2e_variant_s), repeat=True, file=sys.stderr)
            try:
                ctx = initial_context(b, consts)
                times = []
                budget_end = None
                if args.e2e_cold and name != "device":
                    host.evict()    # once whole, then each round's rows (see bench_mode)
                for i, tokens in enumerate(tokens_seq):
                    if args.e2e_cold and name != "device":   # this round's rows only, not the whole table
                        host.evict(ngram_ids(ctx, tokens, consts)[0].reshape(-1, HEADS))
                    s = time.perf_counter()
                    out, ctx = fn(ctx, tokens)
                    np.asarray(out)  # the round ends when its result is on the host (the next tokens)
                    if i >= 3:
                        times.append(time.perf_counter() - s)
                        budget_end = budget_end or time.perf_counter() + args.e2e_variant_s
                        if time.perf_counter() > budget_end and len(times) >= 5:
                            break
                results[(b, name)] = rec = {"mode": f"e2e {name}", "store": args.e2e_mode,
                                            "cache": "cold" if args.e2e_cold else "warm",
                                            "shape": f"decode b{b} k{args.k}", "rounds": len(times),
                                            **_stats(times)}
                emit(rec)
            except Exception as exc:  # noqa: BLE001 - report and go on with the other variants
                emit({"mode": f"e2e {name}", "shape": f"decode b{b} k{args.k}", "error": repr(exc),
                      "trace": traceback.format_exc(limit=3)})
            finally:
                faulthandler.cancel_dump_traceback_later()
        if pipe is not None:
            pipe.close()
        host.close()
        if dev is not None:
            dev.close()
        base = results.get((b, "device"))
        if base:
            for name in variants:
                r = results.get((b, name))
                if r and name != "device":
                    emit({"mode": f"e2e stall {name}", "shape": f"decode b{b} k{args.k}",
                          "stall_us": r["median_us"] - base["median_us"], "device_round_us": base["median_us"]})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--table", help="checkpoint dir, safetensors file or raw row file (default: synthetic)")
    p.add_argument("--table-gb", type=float, default=None,
                   help="synthetic table size in GiB (default 1, --quick 0.5; >= 47.7 gives the release's 51.2 GB)")
    p.add_argument("--dir", default="/tmp/fnx_ple_bench",
                   help="where the synthetic table goes (outside the repo; needs table size + 1 GB free)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    p.add_argument("--batch", default="1,16", help="decode batch sizes (rows per token: 16)")
    p.add_argument("--k", type=int, default=3, help="MTP drafts: decode fetches (k+1) tokens per sequence")
    p.add_argument("--prefill", type=int, default=2048, help="prefill chunk length")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--ahead-ms", type=float, default=1.0,
                   help="cold runs also time a fetch whose prefetch was issued this long before it")
    p.add_argument("--quick", action="store_true", help="small table, fewer iterations (< 3 min on the GPU host)")
    p.add_argument("--first-touch", action="store_true",
                   help="diagnose fetches of never-touched rows (pageable): disk reads vs first mappings")
    p.add_argument("--first-touch-trials", type=int, default=30)
    p.add_argument("--e2e", action="store_true", help="also time a jitted step per variant (stall vs device mode)")
    p.add_argument("--e2e-variants", default="device,sync,pipeline,callback-pure,callback-io,callback-buffer")
    p.add_argument("--e2e-mode", default="pageable", help="host store for the e2e variants")
    p.add_argument("--e2e-variant-s", type=float, default=15.0,
                   help="seconds of timed rounds per e2e variant (at least 5 rounds)")
    p.add_argument("--e2e-device-gib", type=float, default=4.0,
                   help="the e2e device baseline uses a synthetic table of at most this size (its round does not "
                        "depend on the table size)")
    p.add_argument("--e2e-cold", action="store_true", help="evict the host store's pages before every round")
    p.add_argument("--hidden", type=int, default=None, help="e2e stand-in width (default 2560 on GPU, 512 on CPU)")
    p.add_argument("--a-layers", type=int, default=2, help="matmuls before the PLE layer (embedding + layer 0)")
    p.add_argument("--b-layers", type=int, default=None, help="matmuls after it (default 94 on GPU, 8 on CPU)")
    p.add_argument("--force-swap", action="store_true", help="run swap mode even without RAM + swap for the table")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_ple.jsonl"))
    p.add_argument("--note", default="", help="free text stored in every record")
    args = p.parse_args(argv)

    import jax
    backend = jax.default_backend()
    if args.quick:
        args.iters = min(args.iters, 50)
    args.batch = [int(x) for x in args.batch.split(",") if x]
    args.e2e_variants = [v for v in args.e2e_variants.split(",") if v]
    args.hidden = args.hidden or (2560 if backend == "gpu" else 512)
    args.b_layers = args.b_layers if args.b_layers is not None else (94 if backend == "gpu" else 8)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {MODES}")

    if args.table:
        source = args.table
        src = open_source(source)
        consts = bench_consts(src.rows) if src.rows % HEADS == 0 or src.rows == RELEASE_ROWS else None
    else:
        gib = args.table_gb if args.table_gb is not None else (0.5 if args.quick else 1.0)
        os.makedirs(args.dir, exist_ok=True)
        source = synthetic_table(os.path.join(args.dir, f"ple_synthetic_{gib:g}g.raw"), gib)
        src = from_raw(source)
        consts = bench_consts(src.rows)
    table_bytes = args.table_bytes = src.nbytes

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    common = {"bench": "ple", "date": datetime.date.today().isoformat(), "commit": _commit(),
              "host": platform.node(), "backend": backend, "jax": jax.__version__,
              "device": str(jax.devices()[0].device_kind), "cpus": os.cpu_count(),
              "ram_gib": round(lx.meminfo().get("MemTotal", 0) / 2**30, 1), "table_bytes": table_bytes,
              "table": os.path.basename(str(source)), "note": args.note}
    rows_out = []

    def emit(rec):
        rec = {**common, **rec}
        rows_out.append(rec)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        if "median_us" in rec:
            extra = f"  {rec['rows_per_s'] / 1e6:7.2f} M rows/s" if "rows_per_s" in rec else ""
            print(f"{rec['mode']:>22} {rec['shape']:>18} {rec['cache']:>15}  median {rec['median_us']:9.1f} us  "
                  f"p90 {rec['p90_us']:9.1f} us{extra}", flush=True)
        elif "stall_us" in rec:
            print(f"{rec['mode']:>22} {rec['shape']:>18}  stall {rec['stall_us']:9.1f} us vs device round "
                  f"{rec['device_round_us']:.1f} us", flush=True)
        elif "error" in rec:
            print(f"{rec['mode']:>22} {rec.get('shape', ''):>18}  ERROR {rec['error']}", flush=True)

    print(f"PLE bench: {src.describe()}; backend {backend}; results -> {args.out}", flush=True)
    for mode in modes:
        free = lx.meminfo().get("MemAvailable", 0)
        if mode in ("pinned", "swap") and table_bytes > free and not (mode == "swap" and args.force_swap):
            emit({"mode": mode, "shape": "skipped", "error": f"needs {table_bytes / 2**30:.1f} GiB RAM, "
                  f"{free / 2**30:.1f} GiB available"})
            continue
        try:
            bench_mode(mode, source, consts, args, emit)
        except Exception as exc:  # noqa: BLE001 - one failing mode must not hide the others
            emit({"mode": mode, "shape": "failed", "error": repr(exc), "trace": traceback.format_exc(limit=4)})
    if args.first_touch:
        try:
            bench_first_touch(source, consts, args, emit)
        except Exception as exc:  # noqa: BLE001
            emit({"mode": "first-touch", "shape": "failed", "error": repr(exc),
                  "trace": traceback.format_exc(limit=4)})
    if args.e2e:
        try:
            bench_e2e(source, consts, args, emit)
        except Exception as exc:  # noqa: BLE001
            emit({"mode": "e2e", "shape": "failed", "error": repr(exc), "trace": traceback.format_exc(limit=4)})


if __name__ == "__main__":
    main()
