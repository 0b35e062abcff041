"""Where the idle time of a decode step goes: launch gaps, graph splits and host syncs, on the GPU.

    python scripts/probe_launch.py --layers 4 --out gpu_out/probe            # released widths, 4 layers
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python scripts/probe_launch.py --label cb_off ...

For one decode step (M = 1) and one MTP round it prints the unprofiled median time, the kernels per call, and
from a profiler trace the gaps between consecutive device kernels: total, how many exceed 5 us, the largest
ones with the kernels on either side, and the gap time grouped by the kernel that precedes it. It also counts
the command buffers (CUDA graphs) in the compiled step's HLO and lists the ops left outside them. Each part is
one JSON line in --out/probe.jsonl; the trace and the HLO text stay in --out for a closer look."""

from __future__ import annotations

import argparse
import collections
import json
import gzip
import os
import re
import subprocess
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


def short(name: str) -> str:
    """A kernel name without its numeric suffixes, so repeated kernels of one kind group together."""
    return re.sub(r"(_\d+)+$", "", re.sub(r"\.\d+", "", name))[:60]


def parse_variants(spec: str) -> list[tuple[str, dict[str, str]]]:
    """--round-variants: fnx.pallas.bench.parse_variants (';'-separated 'LABEL: FNX_ENV=VALUE ...')."""
    from fnx.pallas.bench import parse_variants as parse
    return parse(spec, "--round-variants")


def variant_summary(rows: list[dict]) -> list[str]:
    """The variants' kernels and kernel time per program call, and each against the first variant; with chained
    timings (--variant-chain) also the step's and the round's wall time per call of back-to-back calls."""
    programs = [p for p in ("decode", "draft", "verify") if any(p in r["programs"] for r in rows)]
    programs += sorted({p for r in rows for p in r["programs"] if p.startswith("prefill")})   # --prefill-table
    head = f"{'variant':18s}" + "".join(f"{p + ' kernels / us':>24s}" for p in programs)
    both = "draft" in programs and "verify" in programs
    chained = all("chained_us_per_call" in v for r in rows for p, v in r["programs"].items()
                  if not p.startswith("prefill"))
    if both:
        head += f"{'round us':>12s}{'vs first':>10s}"
    if chained:   # wall time per call of back-to-back calls (--variant-chain): launch gaps and host time included
        head += f"{'step chained':>14s}{'vs first':>10s}" + (f"{'round chained':>15s}{'vs first':>10s}" if both else "")
    lines = [head]
    first, first_c = None, {}
    for r in rows:
        line = f"{r['variant'][:18]:18s}"
        for p in programs:
            v = r["programs"].get(p)
            line += f"{v['kernels_per_call']:>12.0f} / {v['busy_us_per_call']:9.1f}" if v else f"{'-':>24s}"
        if both:
            rnd = r["programs"]["draft"]["busy_us_per_call"] + r["programs"]["verify"]["busy_us_per_call"]
            first = rnd if first is None else first
            line += f"{rnd:12.1f}{rnd - first:+10.1f}"
        if chained:
            got = {"step": r["programs"]["decode"]["chained_us_per_call"] if "decode" in r["programs"] else None}
            if both:
                got["round"] = (r["programs"]["draft"]["chained_us_per_call"]
                                + r["programs"]["verify"]["chained_us_per_call"])
            for name, width in (("step", 14), ("round", 15)):
                if name not in got:
                    continue
                if got[name] is None:
                    line += f"{'-':>{width}s}{'':10s}"
                    continue
                first_c.setdefault(name, got[name])
                line += f"{got[name]:{width}.1f}{got[name] - first_c[name]:+10.1f}"
        lines.append(line)
    return lines


def gaps(kernels: list[dict], calls: int, top: int = 25) -> dict:
    """Gaps between consecutive kernels (end of one to start of the next), within the calls' span."""
    rows, by_prev = [], collections.Counter()
    end, prev = None, None
    for e in kernels:
        s, t = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        if end is not None and s > end:
            g = s - end
            rows.append((g, short(prev["name"]), short(e["name"])))
            by_prev[short(prev["name"])] += g
        if end is None or t > end:
            end, prev = t, e
    rows.sort(reverse=True)
    big = [r for r in rows if r[0] > 5.0]
    n = max(calls, 1)
    return {"gap_us_per_call": sum(r[0] for r in rows) / n, "gaps_over_5us_per_call": len(big) / n,
            "gap_us_over_5us_per_call": sum(r[0] for r in big) / n,
            "largest": [{"us": round(g, 1), "after": a, "before": b} for g, a, b in rows[:top]],
            "gap_us_by_previous_kernel": {k: round(v / n, 1) for k, v in by_prev.most_common(top)}}


def host_events(trace: dict, calls: int, top: int = 30) -> dict:
    """Total duration per call of each named host-side event (dispatch, execute, thunks, copies), largest first."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    tot = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not re.search(r"/device:(GPU|TPU)", procs.get(e.get("pid"), "")):
            tot[e.get("name", "")[:80]] += float(e.get("dur", 0.0))
    return {k: round(v / 1e3 / max(calls, 1), 4) for k, v in tot.most_common(top)}


def hlo_report(compiled_text: str) -> dict:
    """Command-buffer computations in the optimized HLO and the instructions of the entry computation that are
    not inside one. On JAX 0.11 (H200 runs) XLA forms its command buffers (CUDA graphs) after the HLO passes, at
    the thunk level, so this count has been 0 in every run while the profile showed the step as one graph
    launch: read the trace (`gaps`) for what runs in a graph, and this for the launch list of the HLO."""
    comps = re.findall(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", compiled_text, re.M)
    cb = [c for c in comps if "command_buffer" in c]
    entry = compiled_text[compiled_text.find("\nENTRY "):]
    entry = entry[:entry.find("\n}\n")]
    outside = collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.search(r"=\s*\S+\s+([\w\-]+)\(", line)
        if not m:
            continue
        op = m.group(1)
        if op in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
            continue
        if op == "call" and "command_buffer" in line:
            outside["(command buffer call)"] += 1
            continue
        target = re.search(r'custom_call_target="([^"]+)"', line)
        outside[f"{op}:{target.group(1)}" if target else op] += 1
    return {"command_buffer_computations": len(cb), "entry_ops_outside_buffers": dict(outside.most_common(30))}


def hlo_fusions(text: str) -> dict:
    """Per instruction of an optimized HLO module that launches something (fusion, custom call, copy, ...): its
    op_name metadata, the opcodes of the computation it calls, and its result shape; keyed by the instruction name
    with '.' and '-' as '_' (the form kernel names take in a profile)."""
    bodies, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if m:
            cur = bodies.setdefault(m.group(1), collections.Counter())
            continue
        if line.startswith("}"):
            cur = None
            continue
        if cur is not None:
            op = re.search(r"=\s*\S+(?:\{[^}]*\})?\s+([\w\-]+)\(", line)
            if op and op.group(1) not in ("parameter", "constant", "bitcast", "get-tuple-element", "tuple"):
                cur[op.group(1)] += 1
    out = {}
    for line in text.splitlines():
        # the result shape: an array's, or a multi-output fusion's tuple "(f16[..]{..}, f16[..]{..})" (with spaces;
        # unmatched, such a kernel fell back to the instruction of its name without the digits, an unrelated one)
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^()]*\)|\S+) ([\w\-]+)\(", line)
        if not m or m.group(3) not in ("fusion", "custom-call", "copy", "dynamic-update-slice", "scatter", "sort",
                                       "reduce", "dot", "gather", "concatenate", "convolution", "all-reduce"):
            continue
        calls = re.search(r"calls=%?([\w.\-]+)", line)
        opname = re.search(r'op_name="([^"]*)"', line)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        body = bodies.get(calls.group(1)) if calls else None
        out[re.sub(r"[.\-]", "_", m.group(1))] = {
            "op": m.group(3) + (f":{target.group(1)}" if target else ""), "shape": m.group(2)[:60],
            "op_name": (opname.group(1) if opname else "")[-140:],
            "body": dict(body.most_common(8)) if body else {}}
    return out


def _instruction_of(name: str, args: dict | None, fusions: dict) -> tuple[str | None, dict]:
    """The HLO instruction a kernel event comes from: its name (matched as is, then without trailing digits or a
    profile's kernel suffix), else a string argument of the event naming one (the profiler's `hlo_op`: how a
    library kernel, a cuBLAS GEMM or its split-K reduce, is told apart). Returns (instruction or None, its info)."""
    key = re.sub(r"[.\-]", "_", name)
    for k in (key, re.sub(r"_\d+$", "", key), key.rsplit("_", 1)[0], key.split(":")[0]):
        if k in fusions:
            return None, fusions[k]
    for k, v in sorted((args or {}).items(), key=lambda kv: kv[0] != "hlo_op"):
        if isinstance(v, str):
            k2 = re.sub(r"[.\-]", "_", v.strip().lstrip("%"))
            if k2 in fusions:
                return v.strip().lstrip("%"), fusions[k2]
    return None, {}


def kernel_table(kernels: list[dict], calls: int, fusions: dict) -> list[dict]:
    """Device kernels grouped by name (and, for a kernel known by its event's `hlo_op` argument rather than by its
    name, by that instruction): launches and microseconds per call, in first-launch order, each with what
    `hlo_fusions` knows of the instruction it came from."""
    rows: dict[tuple, dict] = {}
    for e in kernels:
        name = e.get("name", "")
        inst, info = _instruction_of(name, e.get("args"), fusions)
        r = rows.setdefault((name, inst), {"kernel": name[:80], "n": 0, "us": 0.0, "info": info, "inst": inst})
        r["n"] += 1
        r["us"] += float(e.get("dur", 0.0))
    out = []
    for r in rows.values():
        row = {"kernel": r["kernel"], "per_call": r["n"] / calls, "us_per_call": round(r["us"] / calls, 2)}
        if r["inst"]:
            row["hlo_op"] = r["inst"]
        out.append({**row, **r["info"]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="tiny widths (a CPU smoke run)")
    ap.add_argument("--calls", type=int, default=5, help="profiled calls")
    ap.add_argument("--reps", type=int, default=30, help="unprofiled calls for the median")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024,
                    help="tokens already in the cache when the timed calls start (the KV capacity follows it): "
                         "the QSA layers' and the MTP layer's attention grow with it; issue 8's round target is at 8192")
    ap.add_argument("--label", default=os.environ.get("XLA_FLAGS", "") or "default")
    ap.add_argument("--out", default="gpu_out/probe")
    ap.add_argument("--no-round", action="store_true", help="the decode step only")
    ap.add_argument("--quant", default="bf16", choices=("bf16", "fp8", "fp8+nvfp4"),
                    help="weights: bf16, FP8 blocks for dense + experts, or FP8 dense + NVFP4 experts")
    ap.add_argument("--no-scan", action="store_true", help="every layer separate and unrolled (no lax.scan)")
    ap.add_argument("--unroll-stacked", action="store_true",
                    help="the scanned layout's stacked params, every layer unrolled through views of the stacks")
    ap.add_argument("--dispatch-only", action="store_true", help="only the unprofiled dispatch / chained timings")
    ap.add_argument("--chains", type=int, default=5, help="runs of --reps chained steps (their median is reported)")
    ap.add_argument("--fp8-head", action="store_true",
                    help="the lm_head in FP8 128x128 blocks too (online FP8 keeps it bf16): the FP8 GEMV's largest shape")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="the MTP drafter's head over a hot-token subset of N ids (as bench_decode.py; 0: the whole "
                         "vocabulary)")
    ap.add_argument("--draft-fp8", action="store_true", help="the MTP drafter's head in FP8 blocks (as bench_decode.py)")
    ap.add_argument("--fuse", action="store_true",
                    help="fuse each sublayer's input projections (fnx.model.fuse) in the target and MTP params")
    ap.add_argument("--kernel-table", action="store_true",
                    help="profile the decode step and list every kernel it launches (time per call, the HLO "
                         "instruction it comes from, its op_name and fused opcodes) to --out/kernel_table_*.jsonl; "
                         "without --no-round / --dispatch-only also the MTP round's draft and verify programs "
                         "(kernel_table_draft_* / kernel_table_verify_*)")
    ap.add_argument("--prefill-table", type=int, default=0, metavar="N",
                    help="also list every kernel of one N-token prefill chunk (the step at [1, N]) matched to its HLO "
                         "(kernel_table_prefill<N>_*.jsonl; needs --kernel-table); with --round-variants the chunk "
                         "is one more program of each variant")
    ap.add_argument("--save-hlo", action="store_true",
                    help="with --round-variants: each variant's programs' optimized HLO to "
                         "--out/variants/LABEL/hlo_<program>_<label>.txt.gz (the fusions a kernel table names)")
    ap.add_argument("--host-profile", action="store_true",
                    help="profile --calls decode steps and list the host-side events per call (launch, command "
                         "buffer update, thunks)")
    ap.add_argument("--host-top", type=int, default=60, help="how many host events --host-profile lists")
    ap.add_argument("--io", default="plain", choices=("plain", "stable", "both"),
                    help="stable: the step's per-call input (tokens) and outputs (logits, the greedy next tokens) live "
                         "in a donated buffer that every output aliases, so no buffer of the step's command buffer "
                         "moves between calls (XLA re-records a command buffer whose buffers moved: ~2 us per node); "
                         "the host reads the tokens through a separate one-kernel copy. both: plain, then stable")
    ap.add_argument("--addr-trace", type=int, default=0, metavar="N",
                    help="N decode calls after the timings, each output's device address recorded: which of the "
                         "step's buffers move between calls (a moved buffer makes XLA re-record the command buffer), "
                         "and the compiled step's temp / output / aliased bytes")
    ap.add_argument("--kernel-variants", default="",
                    help="';'-separated FNX_KERNELS values ('auto' for none) timed one after another in this "
                         "process (dispatch / step / chained), e.g. 'auto;reference;hc_boundary=reference'")
    ap.add_argument("--round-variants", default="",
                    help="';'-separated 'LABEL: FNX_ENV=VALUE ...' (no settings: the defaults), each run after the "
                         "other parts in this process: the step, draft and verify programs compiled afresh under "
                         "its settings, their kernels and kernel time per call (with --kernel-table, tables under "
                         "--out/variants/LABEL and a diff of each against the first variant), and a summary, e.g. "
                         "'base: ; pair: FNX_KERNELS=gemv_pair_many=pallas'")
    ap.add_argument("--variant-chain", type=int, default=20,
                    help="with --round-variants: each program also timed over N calls launched back to back (the "
                         "median of max(3, --chains) runs; launch gaps and host time included; 0: not timed)")
    ap.add_argument("--variant-check", type=int, default=8,
                    help="with --round-variants: the decode program run N steps (greedy tokens fed back) from one "
                         "saved state under each variant, its last-position logits against the first variant's "
                         "(max difference, argmax agreement): a variant that changes a result shows (0: skipped)")
    ap.add_argument("--only-variants", action="store_true",
                    help="with --round-variants: skip the other parts (the first variant is the baseline)")
    args = ap.parse_args()
    variants = parse_variants(args.round_variants) if args.round_variants else []
    if variants and args.dispatch_only:
        raise SystemExit("--round-variants profiles each program: drop --dispatch-only")
    if args.prefill_table and not args.kernel_table:
        raise SystemExit("--prefill-table lists a prefill chunk's kernels in a kernel table: add --kernel-table")
    if args.only_variants and not variants:
        raise SystemExit("--only-variants runs the --round-variants alone: give them")
    os.makedirs(args.out, exist_ok=True)
    # the files of runs with different layers or weights must not overwrite each other's
    tag = re.sub(r"[^\w]+", "_", f"{args.label}_{args.layers}l_{args.quant}{'_fused' if args.fuse else ''}"
                 f"{f'_ctx{args.context}' if args.context != 1024 else ''}"
                 f"{'_fp8head' if args.fp8_head else ''}"
                 f"{f'_draft{args.draft_vocab}' if args.draft_vocab else ''}{'_draftfp8' if args.draft_fp8 else ''}"
                 ).strip("_")[:60]

    import bench_decode as bd   # scripts/ is this script's folder on sys.path
    from fnx.engine.engine import _jit_draft, _jit_verify
    from fnx.engine.sampling import SamplingArrays, SamplingParams, row_keys
    from fnx.model.mtp import init_mtp_state, mtp_param_shapes
    from fnx.model.transformer import init_state, param_shapes, step
    from fnx.pallas import ledger
    from fnx.pallas.bench import fnx_settings, settings

    if args.unroll_stacked and args.no_scan:
        raise SystemExit("--unroll-stacked runs the scanned layout's stacks unrolled: drop --no-scan")
    compiles: dict[str, list] = {}       # XLA backend compiles by function name: [count, seconds] (the last record)

    def on_compile(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            c = compiles.setdefault(str(kw.get("fun_name", "?")), [0, 0.0])
            c[0], c[1] = c[0] + 1, c[1] + duration
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    cfg = bd.bench_config(args.layers, args.tiny, scan=not args.no_scan).replace(unroll_stacked=args.unroll_stacked)
    dtype = jnp.bfloat16
    params = bd.random_tree(param_shapes(cfg, dtype), jax.random.PRNGKey(0), dtype)
    mshapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), mtp_param_shapes(cfg),
                           is_leaf=lambda x: isinstance(x, tuple))
    mp = bd.random_tree(mshapes, jax.random.PRNGKey(1), dtype)
    if args.quant != "bf16":   # FP8 blocks (and NVFP4 experts): the GEMV kernels' formats, for a whole-step A/B
        params, mp = bd.quantize_tree(params, args.quant), bd.quantize_tree(mp, args.quant)
    if args.fp8_head:
        from fnx.model import quant as fq
        params = dict(params, lm_head=fq.quantize_fp8_block(params["lm_head"]))
    if args.fuse:
        from fnx.model.fuse import fuse_mtp, fuse_projections
        params, mp = fuse_projections(cfg, params), fuse_mtp(mp)
    hot, dhead = bd.draft_head_for(params["lm_head"], cfg.vocab_size, args.draft_vocab, args.draft_fp8, dtype)
    ctx, heads = args.context, cfg.ngram_heads
    # every call advances the positions: dispatch timings and chained steps, decode, draft and verify calls
    cap = ctx + 64 + ((3 + args.chains) * args.reps + 2 * args.calls + 8
                      + len(variants) * (2 * args.calls + 6 + (max(3, args.chains) + 1) * args.variant_chain)
                      ) * (args.k + 2) + args.variant_check
    state = init_state(cfg, 1, cap, dtype)
    step_j = jax.jit(partial(step, cfg=cfg, moe_impl="auto"), donate_argnames=("state",))
    one = jnp.ones((1, 1), jnp.int32)
    pid = jnp.zeros((1, 1, heads), jnp.int32) if cfg.ple_layer_ids else None
    state = dict(state, pos=jnp.full_like(state["pos"], ctx))
    hold = {"s": state}
    # --variant-check: every variant's decode program starts its checked steps from this state (a copy: the
    # programs donate the state they are given)
    check_from = jax.tree.map(jnp.copy, state) if variants and args.variant_check else None

    commit = os.environ.get("FNX_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()

    def emit(rec):
        rec = {"label": args.label, "layers": args.layers, "scan_layers": not args.no_scan,
               "unroll_stacked": args.unroll_stacked, "quant": args.quant,
               "fused_projections": args.fuse, "fp8_head": args.fp8_head, "draft_vocab": args.draft_vocab,
               "draft_fp8": args.draft_fp8, "context": ctx,
               "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d"),
               "commit": commit, "settings": fnx_settings(), **rec}
        print(json.dumps(rec), flush=True)
        with open(os.path.join(args.out, "probe.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")

    def phase(name: str):
        """A line before each group of timed calls: a log of XLA's (e.g. its command-buffer updates, on stderr
        into the same file) is split by these to count per group."""
        print(f"=== phase {name}", flush=True)

    def report_compiles():
        """The XLA compiles of the run by function (each program once per setting: a second compile of a program
        is device time spent twice)."""
        emit({"part": "compiles", "seconds": round(sum(v[1] for v in compiles.values()), 2),
              "by_function": {k_: [n, round(t, 2)]
                              for k_, (n, t) in sorted(compiles.items(), key=lambda kv: -kv[1][1])}})

    main_parts = not args.only_variants     # --only-variants: the setup, then the variants alone
    if main_parts:
        # compiled once: its HLO, and the executable every call below runs (a jitted call would compile it again)
        cstep = step_j.lower(params, hold["s"], one, pid).compile()
        text = cstep.as_text()
        with open(os.path.join(args.out, f"decode_hlo_{tag}.txt"), "w") as f:
            f.write(text)
        emit({"part": "decode hlo", **hlo_report(text)})

    def dec():   # positions advance (no per-call rewind: that would add a jitted op of host time to each call)
        logits, hold["s"], _, _ = cstep(params, hold["s"], one, pid)
        jax.block_until_ready(logits)

    timed = bd.timeit

    def profiled(name, fn):
        d = os.path.join(args.out, f"trace_{name}_{tag}")
        led = ledger.profile(fn, args.calls, log_dir=d)
        import glob
        import shutil
        path = sorted(glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
        shutil.copy(path, os.path.join(args.out, f"trace_{name}_{tag}.json.gz"))
        with gzip.open(path, "rt") as f:
            trace = json.load(f)
        g = gaps(ledger.device_kernels(trace), args.calls)
        g["host_ms_per_call_by_event"] = host_events(trace, args.calls)
        return led, g

    def stable_io_timings():
        """The step with every per-call buffer at a fixed address: tokens in, logits and the greedy next tokens out,
        all in `io`, donated and returned (so each output aliases an input: XLA keeps the address), the state
        donated as always. What an engine would pay: the step, then a one-kernel copy of the tokens to read."""
        def step_io(params, state, io, pid):
            logits, state, _, _ = step(params, state, io["tokens"], pid, cfg=cfg, moe_impl="auto")
            nxt = jnp.argmax(logits[:, -1].astype(jnp.float32), axis=-1).astype(jnp.int32)[:, None]
            return state, {"tokens": nxt, "logits": logits.astype(io["logits"].dtype)}
        # keep_unused: io["logits"] is only written; JAX drops an unused parameter otherwise, and then the logits
        # output is a fresh buffer every call (why this mode re-recorded every launch: BENCHMARKS.md, fortieth)
        fn = jax.jit(step_io, donate_argnames=("state", "io"), keep_unused=True)
        fetch = jax.jit(lambda io: io["tokens"] + 0)
        v = cfg.vocab_size
        io = {"tokens": jnp.ones((1, 1), jnp.int32), "logits": jnp.zeros((1, 1, v), dtype)}
        st = {"s": dict(hold["s"], pos=jnp.full_like(hold["s"]["pos"], ctx)), "io": io}
        jax.block_until_ready(st)
        compiled = fn.lower(params, st["s"], st["io"], pid).compile()
        emit({"part": "stable io hlo", **hlo_report(compiled.as_text())})
        disp, tot = [], []
        phase("stable sync")
        for i in range(args.reps + 2):
            t = time.perf_counter()
            st["s"], st["io"] = compiled(params, st["s"], st["io"], pid)
            t1 = time.perf_counter()
            toks = fetch(st["io"])
            jax.block_until_ready(toks)
            if i >= 2:
                disp.append(t1 - t)
                tot.append(time.perf_counter() - t)
        chains = []
        phase("stable chained")
        for _ in range(args.chains):
            t = time.perf_counter()
            for _ in range(args.reps):
                st["s"], st["io"] = compiled(params, st["s"], st["io"], pid)
            jax.block_until_ready(st["io"])
            chains.append((time.perf_counter() - t) / args.reps)
        emit({"part": "decode dispatch", "io": "stable",
              "dispatch_ms": float(np.median(disp)) * 1e3, "step_ms": float(np.median(tot)) * 1e3,
              "chained_ms_per_step": float(np.median(chains)) * 1e3,
              "chained_ms_all": [round(c * 1e3, 4) for c in chains],
              "param_leaves": len(jax.tree.leaves(params)), "state_leaves": len(jax.tree.leaves(st["s"]))})
        hold["s"] = st["s"]

    def dispatch_timings(step_fn, label=None):
        """Unprofiled: host time to dispatch one step, the step end to end, and steps kept in flight (each step's
        state feeds the next on the device, no host round trip between them: what an overlapped scheduler would
        get; the median of `chains` runs of `reps` steps). Positions restart at the probe's context."""
        st = {"s": dict(hold["s"], pos=jnp.full_like(hold["s"]["pos"], ctx))}
        jax.block_until_ready(st["s"])
        disp, tot = [], []
        phase("plain sync")
        for i in range(args.reps + 2):
            t = time.perf_counter()
            logits, st["s"], _, _ = step_fn(params, st["s"], one, pid)
            t1 = time.perf_counter()
            jax.block_until_ready(logits)
            if i >= 2:
                disp.append(t1 - t)
                tot.append(time.perf_counter() - t)
        chains, first = [], None
        phase("plain chained")
        for _ in range(args.chains):
            t = time.perf_counter()
            for _ in range(args.reps):
                logits, st["s"], _, _ = step_fn(params, st["s"], one, pid)
                if first is None:
                    first = logits
            jax.block_until_ready(logits)
            chains.append((time.perf_counter() - t) / args.reps)
        # a fingerprint of the first chained step's logits: the params are seeded and the step's position fixed.
        # Each process compiles and autotunes afresh, so two runs may differ in the sum (a fusion's or GEMM's
        # algorithm changes low bits) and still agree in the argmax: a check on gross errors, not on equality
        f32 = np.asarray(first, np.float32)
        emit({"part": "decode dispatch", **({"kernels": label} if label is not None else {}),
              "dispatch_ms": float(np.median(disp)) * 1e3, "step_ms": float(np.median(tot)) * 1e3,
              "chained_ms_per_step": float(np.median(chains)) * 1e3,
              "chained_ms_all": [round(c * 1e3, 4) for c in chains],
              "logits_fingerprint": [round(float(f32.sum()), 3), int(f32.argmax())],
              "param_leaves": len(jax.tree.leaves(params)), "state_leaves": len(jax.tree.leaves(st["s"]))})
        hold["s"] = st["s"]

    def address_trace(step_fn, n: int):
        """n calls, each result's buffer address read after it: the leaves (logits, the state's, the step's other
        outputs) whose address differs from the call before, and the compiled program's memory figures. A leaf
        that moves on most calls is a buffer the command buffer must re-record; XLA's temp allocation is not
        visible here (its size is)."""
        st = {"s": dict(hold["s"], pos=jnp.full_like(hold["s"]["pos"], ctx))}
        prev, moved, seen = None, {}, 0
        phase("addr trace")
        for _ in range(n):
            logits, st["s"], hid, aux = step_fn(params, st["s"], one, pid)
            flat = jax.tree_util.tree_flatten_with_path({"logits": logits, "state": st["s"], "hidden": hid,
                                                         "aux": aux})[0]
            addrs = {jax.tree_util.keystr(k): int(v.unsafe_buffer_pointer()) for k, v in flat
                     if isinstance(v, jax.Array) and v.size}
            seen = len(addrs)
            if prev is not None:
                for name, a in addrs.items():
                    if prev.get(name) != a:
                        moved[name] = moved.get(name, 0) + 1
            prev = addrs
        jax.block_until_ready(st["s"])
        # the same calls with every output but the state dropped at once (nothing of the last call alive when the
        # next one allocates): synchronous, then chained; the command-buffer log counts their re-records
        phase("dropped sync")
        for _ in range(n):
            st["s"] = step_fn(params, st["s"], one, pid)[1]
            jax.block_until_ready(st["s"])
        phase("dropped chained")
        for _ in range(n):
            st["s"] = step_fn(params, st["s"], one, pid)[1]
        jax.block_until_ready(st["s"])
        phase("done")
        hold["s"] = st["s"]
        mem = {}
        try:
            m = step_fn.memory_analysis()
            mem = {f: int(getattr(m, f)) for f in ("temp_size_in_bytes", "output_size_in_bytes",
                                                    "alias_size_in_bytes", "argument_size_in_bytes")
                   if hasattr(m, f)}
        except Exception as e:   # not every backend reports it
            mem = {"error": f"{type(e).__name__}: {e}"[:200]}
        emit({"part": "addresses", "calls": n, "leaves": seen, "moved_leaves": len(moved),
              "moved": dict(sorted(moved.items(), key=lambda kv: -kv[1])[:40]), "memory": mem})

    def dropped_timings(step_fn):
        """Chained steps that keep only the state: every other output (logits, hidden, aux) dropped before the next
        call, so the next call's outputs get the freed addresses and no buffer of the command buffer moves (an
        output still alive when the next call allocates moves it, and XLA re-records the graph)."""
        st = {"s": dict(hold["s"], pos=jnp.full_like(hold["s"]["pos"], ctx))}
        jax.block_until_ready(st["s"])
        for _ in range(3):
            st["s"] = step_fn(params, st["s"], one, pid)[1]
        jax.block_until_ready(st["s"])
        phase("dropped timed")
        chains = []
        for _ in range(args.chains):
            t = time.perf_counter()
            for _ in range(args.reps):
                st["s"] = step_fn(params, st["s"], one, pid)[1]
            jax.block_until_ready(st["s"])
            chains.append((time.perf_counter() - t) / args.reps)
        emit({"part": "decode dispatch", "io": "dropped", "chained_ms_per_step": float(np.median(chains)) * 1e3,
              "chained_ms_all": [round(c * 1e3, 4) for c in chains]})
        hold["s"] = st["s"]

    if args.io != "stable" and main_parts:
        dispatch_timings(cstep)
        if args.addr_trace:
            dropped_timings(cstep)
    if args.addr_trace and main_parts:
        address_trace(cstep, args.addr_trace)
    if args.io != "plain" and main_parts:
        stable_io_timings()
    if args.kernel_variants and main_parts:
        # A/B of the kernel choice in the whole step: each variant is one FNX_KERNELS value, traced afresh
        saved = os.environ.get("FNX_KERNELS")
        try:
            for variant in args.kernel_variants.split(";"):
                os.environ["FNX_KERNELS"] = "" if variant == "auto" else variant
                jax.clear_caches()
                fn = jax.jit(partial(step, cfg=cfg, moe_impl="auto"), donate_argnames=("state",))
                compiled = fn.lower(params, hold["s"], one, pid).compile()   # one compile: its HLO and its calls
                report = hlo_report(compiled.as_text())
                emit({"part": "variant hlo", "kernels": variant, **report})
                dispatch_timings(compiled, variant)
        finally:
            if saved is None:
                os.environ.pop("FNX_KERNELS", None)
            else:
                os.environ["FNX_KERNELS"] = saved
    def write_table(fn, hlo_text: str, name: str, program: str, top: int = 40, out_dir: str | None = None,
                    extra: dict | None = None):
        """Profile `args.calls` calls of fn and list every kernel they launch, matched to `hlo_text`'s
        instructions, to <out_dir or --out>/kernel_table_<name>.jsonl; print the `top` costliest. Returns the
        ledger."""
        out_dir = out_dir or args.out
        led = ledger.profile(fn, args.calls, log_dir=os.path.join(out_dir, f"trace_{name}"))
        with gzip.open(led["trace"], "rt") as f:
            trace = json.load(f)
        table = kernel_table(ledger.device_kernels(trace), args.calls, hlo_fusions(hlo_text))
        path = os.path.join(out_dir, f"kernel_table_{name}.jsonl")
        with open(path, "w") as f:
            for row in table:
                f.write(json.dumps(row) + "\n")
        matched = sum(1 for r in table if r.get("op"))
        emit({"part": "kernel table", "program": program, **(extra or {}), "kernels_per_call": led["launches_per_call"],
              "busy_ms_per_call": led["busy_ms_per_call"], "distinct_kernels": len(table),
              "matched_to_hlo": matched, "file": os.path.relpath(path, args.out)})
        for row in sorted(table, key=lambda r: -r["us_per_call"] * r["per_call"])[:top]:
            print(f"{row['us_per_call']:8.2f} us x{row['per_call']:.0f} {row['kernel'][:40]:40s} "
                  f"{row.get('op', '?'):22s} {row.get('op_name', '')[-70:]}", flush=True)
        return led

    def prefill_program(n: int):
        """One prefill chunk of `n` tokens (the step at [1, n], as the engine and bench_decode.py prefill), compiled
        under the present settings: (call, optimized HLO text). Its own state, positions 0, n, 2n, ... (one chunk
        after another, no rewind: room for --calls + 2 chunks)."""
        box = {"s": init_state(cfg, 1, n * (args.calls + 2) + 64, dtype)}
        toks = jnp.ones((1, n), jnp.int32)
        ids = jnp.zeros((1, n, heads), jnp.int32) if cfg.ple_layer_ids else None
        last = jnp.full((1,), n - 1, jnp.int32)     # the head on the chunk's last token, as the engine's prefill
        compiled = step_j.lower(params, box["s"], toks, ids, logits_at=last).compile()

        def pre(block=True):
            logits, box["s"], _, _ = compiled(params, box["s"], toks, ids, logits_at=last)
            if block:
                jax.block_until_ready(logits)
        return pre, compiled.as_text()

    def prefill_table(n: int):
        """Every kernel of one prefill chunk of `n` tokens matched to its HLO, to kernel_table_prefill<n>_<tag>.jsonl:
        where a prefill's "other XLA" time comes from."""
        pre, text = prefill_program(n)
        write_table(pre, text, f"prefill{n}_{tag}", "prefill", top=40, extra={"tokens": n})

    if args.kernel_table and main_parts:
        write_table(dec, text, tag, "decode")
    if args.prefill_table and main_parts:
        prefill_table(args.prefill_table)
    if args.host_profile and main_parts:
        # host-side events of one profiled decode step (XLA runs command buffers while profiling only with
        # --xla_enable_command_buffers_during_profiling=true in XLA_FLAGS: set it to see graph launch / update)
        led = ledger.profile(dec, args.calls, log_dir=os.path.join(args.out, f"trace_host_{tag}"))
        with gzip.open(led["trace"], "rt") as f:
            trace = json.load(f)
        emit({"part": "host profile", "kernels_per_call": led["launches_per_call"],
              "busy_ms_per_call": led["busy_ms_per_call"],
              "host_ms_per_call_by_event": host_events(trace, args.calls, top=args.host_top)})
    if args.dispatch_only:
        return report_compiles()

    def variant_programs() -> dict:
        """The programs under the present settings, each lowered and compiled once (the calls run the compiled
        executables): {name: (call, optimized HLO text)}. The draft runs once here, so verify has drafts."""
        sj = jax.jit(partial(step, cfg=cfg, moe_impl="auto"), donate_argnames=("state",))
        cs = sj.lower(params, hold["s"], one, pid).compile()

        def run_step(block=True):
            logits, hold["s"], _, _ = cs(params, hold["s"], one, pid)
            if block:
                jax.block_until_ready(logits)
            return logits if block else None     # (a chained call's outputs are dropped at once: see round_programs)
        progs = {"decode": (run_step, cs.as_text())}
        if check_from is not None:
            checked["logits"] = checked_steps(cs)
        if not args.no_round:
            progs.update(round_programs())
        if args.prefill_table:    # the chunk's kernels under each variant (no chained timing: its state fills up)
            progs[f"prefill{args.prefill_table}"] = prefill_program(args.prefill_table)
        return progs

    checked = {}

    def checked_steps(cs):
        """--variant-check steps of the compiled decode program from `check_from`, each step's greedy token fed
        to the next: the last-position logits [steps, V] in fp32."""
        s_ = jax.tree.map(jnp.copy, check_from)
        tok, out = one, []
        for _ in range(args.variant_check):
            logits, s_, _, _ = cs(params, s_, tok, pid)
            last = logits[:, -1].astype(jnp.float32)
            tok = jnp.argmax(last, axis=-1).astype(jnp.int32)[:, None]
            out.append(np.asarray(last[0]))
        return np.stack(out)

    def check_record(base_logits, logits) -> dict:
        """This variant's checked logits against the first variant's: the largest difference relative to the
        largest logit, whether they are the same bits, and on how many steps the greedy tokens agree."""
        scale = float(np.abs(base_logits).max()) or 1.0
        return {"steps": int(logits.shape[0]), "same_bits": bool(np.array_equal(base_logits, logits)),
                "max_rel_diff": round(float(np.abs(logits - base_logits).max()) / scale, 8),
                "argmax_agree": int((logits.argmax(-1) == base_logits.argmax(-1)).sum())}

    def round_programs() -> dict:
        """The draft and verify programs under the present settings, each lowered and compiled once:
        {name: (call, optimized HLO text)}. The draft runs once here, so verify has drafts."""
        def draft_program(params, mparams, m, hid, pt, cnt, sp, keys, head, hot):
            return _jit_draft(params, mparams, m, hid, pt, cnt, sp, keys, cfg, "auto", k, head=head, hot=hot,
                              greedy=True)
        dj = jax.jit(draft_program, donate_argnums=(2,))

        # every input made once: a fresh array per call (or an output held into the next call) is a buffer that
        # moves, and XLA re-records the program's CUDA graph before each launch in which one has
        const = {"pt": jnp.ones((1, k + 1), jnp.int32), "cnt": jnp.ones((1,), jnp.int32),
                 "ok": jnp.ones((1,), bool)}

        def dargs():
            return (params, mp, mh["m"], hid, const["pt"], const["cnt"], sp, keys, dhead, hot)
        cd = dj.lower(*dargs()).compile()

        def run_draft(block=True):
            m, drafts, q = cd(*dargs())
            mh["m"] = m
            if block:     # the drafts verify reads: kept from a waited-for call only (chained calls drop them)
                jax.block_until_ready(drafts)
                parts["d"], parts["q"] = drafts, q
                parts["v"] = jnp.concatenate([one, drafts], axis=1)
            return drafts if block else None
        run_draft()
        def verify_program(params, s, v, ok, pk, q, sp, keys):
            return _jit_verify(params, s, v, ok, pk, q, sp, keys, cfg, "auto", 0, greedy=True)
        vj = jax.jit(verify_program, donate_argnums=(1,))

        def vargs():
            return (params, hold["s"], parts["v"], const["ok"], pk, parts["q"], sp, keys)
        cv = vj.lower(*vargs()).compile()

        def run_verify(block=True):
            out = cv(*vargs())
            hold["s"] = out[0]
            if block:
                jax.block_until_ready(out[1])
            return out[1] if block else None
        return {"draft": (run_draft, cd.as_text()), "verify": (run_verify, cv.as_text())}

    def chained_timing(fn) -> dict:
        """`--variant-chain` calls of a program launched back to back (one wait, after the last), `max(3, --chains)`
        times: the median wall time per call, launch gaps and host time included (the kernel table's time leaves
        them out, and a variant that removes launches is judged by this), and every run's."""
        fn(block=True)                                           # warm (the executable is compiled already)
        runs = []
        for _ in range(max(3, args.chains)):
            t = time.perf_counter()
            for _ in range(args.variant_chain - 1):
                fn(block=False)
            fn(block=True)
            runs.append((time.perf_counter() - t) / args.variant_chain * 1e6)
        return {"chained_us_per_call": round(float(np.median(runs)), 2), "chained_us_all": [round(r, 2) for r in runs]}

    def run_variants():
        """--round-variants: each variant's programs compiled afresh under its settings (one compile each: the
        calls run the compiled executables), profiled, and summarized against the first variant."""
        import kernel_table_diff as ktd   # scripts/ is this script's folder on sys.path
        rows, tables = [], {}
        sweep = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"   # this run's variants (scripts/pick_winners.py)

        def variant_record(label, env):
            """One variant's programs compiled, profiled and summarized (its record, emitted)."""
            progs = variant_programs()
            rec = {"variant": label, "settings": env, "sweep": sweep, "base": variants[0][0], "programs": {}}
            if "logits" in checked:
                checked.setdefault("base", checked["logits"])
                rec["check"] = check_record(checked["base"], checked.pop("logits"))
            vdir = os.path.join(args.out, "variants", label)
            os.makedirs(vdir, exist_ok=True)
            for program, (fn, hlo_text) in progs.items():
                extra = {"variant": label}
                if args.save_hlo:
                    with gzip.open(os.path.join(vdir, f"hlo_{program}_{label}.txt.gz"), "wt") as f:
                        f.write(hlo_text)
                if args.kernel_table:
                    led = write_table(fn, hlo_text, f"{program}_{label}", program, top=0, out_dir=vdir,
                                      extra=extra)
                    tables.setdefault(program, {})[label] = os.path.join(vdir, f"kernel_table_{program}_{label}"
                                                                               ".jsonl")
                else:
                    led = ledger.profile(fn, args.calls)
                rec["programs"][program] = {
                    "hlo_launch_ops": len(hlo_fusions(hlo_text)),   # what could launch: changes on a CPU too
                    "kernels_per_call": led["launches_per_call"],
                    "busy_us_per_call": round(led["busy_ms_per_call"] * 1e3, 2),
                    "families": {f: [v["kernels_per_call"], round(v["ms_per_call"] * 1e3, 2)]
                                 for f, v in led["families"].items()}}
                if args.variant_chain and not program.startswith("prefill"):
                    rec["programs"][program].update(chained_timing(fn))
            emit({"part": "round variant", **rec})
            return rec

        for label, env in variants:
            with settings(env):   # the variant's FNX_ settings while its programs are traced, then restored
                jax.clear_caches()
                try:
                    rec = variant_record(label, env)
                except Exception as exc:  # noqa: BLE001 - a variant that cannot compile (e.g. tiles past the
                    # shared memory) is reported and the sweep goes on; the baseline's failure ends it
                    if label == variants[0][0]:
                        raise
                    checked.pop("logits", None)
                    for by_label in tables.values():     # no diff against a table it left half written
                        by_label.pop(label, None)
                    msg = (f"{type(exc).__name__}: {exc}".splitlines() or [""])[0][:400]
                    emit({"part": "round variant", "variant": label, "settings": env, "sweep": sweep,
                          "base": variants[0][0], "error": msg})
                    print(f"variant failed {label}: {msg}", flush=True)
                    continue
            rows.append(rec)
            print(f"variant done {label}: " + ", ".join(
                f"{p} {v['kernels_per_call']:.0f} kernels {v['busy_us_per_call']:.1f} us"
                + (f" (chained {v['chained_us_per_call']:.1f} us)" if "chained_us_per_call" in v else "")
                for p, v in rec["programs"].items())
                + (f"; check against {variants[0][0]}: {rec['check']}" if "check" in rec else ""), flush=True)
        jax.clear_caches()
        print("\n".join(variant_summary(rows)), flush=True)
        base = variants[0][0]
        for program, by_label in tables.items():
            for label, path in by_label.items():
                if label != base:
                    ktd.print_diff(f"{program}: {label} against {base}",
                                   ktd.diff(ktd.load(by_label[base]), ktd.load(path), top=15))

    if main_parts:
        ms = timed(dec, args.reps)
        led, g = profiled("decode", dec)
        emit({"part": "decode", "ms": ms, "kernels_per_call": led["launches_per_call"],
              "busy_ms_per_call": led["busy_ms_per_call"], **g})
    if args.no_round:
        if variants:
            run_variants()
        return report_compiles()
    k = args.k
    mstate = dict(init_mtp_state(cfg, 1, cap, dtype), pos=jnp.full((1,), ctx, jnp.int32))
    sp = SamplingArrays.stack([SamplingParams()])
    keys = row_keys(jnp.zeros((1,), jnp.uint32), jnp.zeros((1,), jnp.uint32))
    hid = jnp.zeros((1, k + 1, cfg.hc_dim), dtype)
    mh = {"m": mstate}
    pk = jnp.zeros((1, k + 1, heads), jnp.int32) if cfg.ple_layer_ids else None
    parts = {}

    if main_parts:   # the round's two programs, each compiled once (its calls and its kernel table's HLO)
        rp = round_programs()
        if args.kernel_table:
            write_table(rp["draft"][0], rp["draft"][1], f"draft_{tag}", "draft", top=25)
            write_table(rp["verify"][0], rp["verify"][1], f"verify_{tag}", "verify", top=40)
        for name in ("draft", "verify"):
            fn = rp[name][0]
            ms = timed(fn, args.reps)
            led, g = profiled(name, fn)
            emit({"part": name, "ms": ms, "kernels_per_call": led["launches_per_call"],
                  "busy_ms_per_call": led["busy_ms_per_call"],
                  "families": {f: round(v["ms_per_call"], 3) for f, v in led["families"].items()}, **g})
    if variants:
        run_variants()
    report_compiles()


if __name__ == "__main__":
    main()
