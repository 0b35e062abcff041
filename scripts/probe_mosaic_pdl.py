"""Can a kernel launched from JAX stream its weights before its predecessor ends?

Every fnx decode kernel pays ~3 us beyond its bytes (BENCHMARKS.md, forty-fourth and forty-seventh sessions): XLA
puts `griddepcontrol.wait` at the very start of each kernel it compiles, Pallas' Triton kernels included, so no
kernel can load a byte of its weights (which never depend on the kernel before) until its predecessor has ended.
Pallas' Mosaic GPU backend (`plgpu.kernel`) leaves the wait to the kernel (`plgpu.griddepcontrol_wait`). This
probe measures whether that helps inside a jitted chain: L kernels back to back, kernel i streaming its own weight
slab W_i (TMA copies into shared memory) and reading x_i, the previous kernel's output.

Modes (each a chain of the same kernels, one process):
- `none`: wait at the start, no trigger (what every fnx kernel does today);
- `trigger`: `launch_dependents` at the start, then wait (the next kernel may be resident early; fnx's
  `FNX_PDL_TRIGGER=1` for the Triton kernels); `trigger_late`: wait, copies, trigger (one kernel ahead at most);
- `prefetch`: issue the weight copies, then wait, then read x (weights stream during the predecessor's tail);
  `prefetch_trig`: the same with the trigger after the wait (so the next kernel's copies overlap this one's work,
  never more than one kernel ahead: a trigger before the wait would let every later kernel launch at once);
- `triton`: the same function as a Pallas kernel on the Triton lowering (today's path, for the per-kernel cost);
- `race`: trigger at the start and no wait at all: a wrong result says the kernels were launched with PDL and did
  overlap (the only direct evidence of the launch attribute this probe has); a right one says nothing for sure;
- `uses_pdl` variants: the same with `uses_pdl=True` added to the custom call's backend config (what XLA reads to
  launch an FFI custom call with programmatic stream serialization, where its version does): measured no effect;
- `pdl_attr` variants: the Mosaic module attribute `mosaic_gpu.uses_pdl` set, which jaxlib's own launch reads.

Per mode: the slope (us per kernel, from chains of L1 and L2 kernels, host-timed), its bytes floor at the measured
streaming rate of one large launch, whether the chain's output equals the jnp reference (a wait in the wrong place
reads a stale x), and from the profiler the device span per kernel of the longer chain (first start to last end
over the kernels), the mean kernel duration and how many kernels started before their predecessor ended (the
direct evidence of a PDL launch). JSON lines to --out. GPU only (sm_90+)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
from jax import lax

ROWS = 64           # rows of one TMA copy (a [ROWS, COLS] bf16 tile: 32 KB at COLS 256)
COLS = 256
LANES = 128         # one warpgroup; x and out carry 128 f32 values per CTA


def _uses_pdl_patch(on: bool):
    """Add uses_pdl=True to mosaic_gpu_v2 custom calls lowered while on (restored by calling the result)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    orig = mlir.custom_call

    def patched(call_target_name, *a, backend_config=None, **k):
        if call_target_name == "mosaic_gpu_v2" and isinstance(backend_config, dict):
            backend_config = dict(backend_config, uses_pdl=ir.BoolAttr.get(True))
        return orig(call_target_name, *a, backend_config=backend_config, **k)

    import jax.experimental.mosaic.gpu.core as core
    core_orig = core.mlir.custom_call
    if on:
        mlir.custom_call = patched
        core.mlir.custom_call = patched

    def undo():
        mlir.custom_call = orig
        core.mlir.custom_call = core_orig
    return undo


def _pdl_attr_patch(on: bool):
    """Set the module attribute `mosaic_gpu.uses_pdl` on every Mosaic GPU module serialized while on: jaxlib's
    launch lowering then launches the kernel with programmatic stream serialization (JAX 0.11.2's
    `_lower_as_gpu_kernel(uses_pdl=True)` sets the same attribute). Returns the undo."""
    import jax.experimental.mosaic.gpu.core as core
    from jax._src.lib.mlir import ir
    orig = core._run_serde_pass

    def patched(module, *a, serialize, **k):
        if serialize:
            module.operation.attributes["mosaic_gpu.uses_pdl"] = ir.UnitAttr.get()
        return orig(module, *a, serialize=serialize, **k)

    if on:
        core._run_serde_pass = patched

    def undo():
        core._run_serde_pass = orig
    return undo


def stream_kernel(n_ctas: int, chunks: int, mode: str):
    """W [n_ctas * chunks * ROWS, COLS] bf16, x [n_ctas, LANES] f32 -> out [n_ctas, LANES] f32:
    out[b] = 0.5 * x[b] + sum_c f32(W[(b * chunks + c) * ROWS, :LANES])."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(w_ref, x_ref, o_ref, smem, bar):
        b = lax.axis_index("b")
        early = mode.startswith("prefetch")
        if mode in ("trigger", "race"):
            plgpu.griddepcontrol_launch_dependents()
        if not early and mode != "race":
            plgpu.griddepcontrol_wait()
        for c in range(chunks):
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds((b * chunks + c) * ROWS, ROWS)], smem.at[c], bar.at[c])
        if early:
            plgpu.griddepcontrol_wait()
        if mode in ("trigger_late", "prefetch_trig"):
            plgpu.griddepcontrol_launch_dependents()
        acc = x_ref[b, :] * 0.5
        for c in range(chunks):
            plgpu.barrier_wait(bar.at[c])
            acc = acc + smem[c, 0, pl.ds(0, LANES)].astype(jnp.float32)
        o_ref[b, :] = acc

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((n_ctas, LANES), jnp.float32),
        scratch_types=[plgpu.SMEM((chunks, ROWS, COLS), jnp.bfloat16),
                       plgpu.Barrier(num_arrivals=1, num_barriers=chunks)],
        grid=(n_ctas,), grid_names=("b",))


def triton_kernel(n_ctas: int, chunks: int, interpret: bool = False):
    """The same function as a Pallas kernel on the Triton lowering (XLA's wait at its start), each program loading
    its whole slab ([ROWS, COLS] per chunk) as fnx's GEMVs load their weight tiles; `sel` (-1 at run time) keeps
    every loaded element live without changing the result."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    def body(w_ref, x_ref, sel_ref, o_ref):
        b = pl.program_id(0)
        sel = sel_ref[0]
        rid = lax.broadcasted_iota(jnp.int32, (ROWS, LANES), 0)
        acc = x_ref[b, :] * 0.5
        for c in range(chunks):
            r0 = (b * chunks + c) * ROWS
            lo = w_ref[pl.ds(r0, ROWS), pl.ds(0, LANES)].astype(jnp.float32)
            hi = w_ref[pl.ds(r0, ROWS), pl.ds(LANES, LANES)].astype(jnp.float32)
            acc = acc + jnp.sum(jnp.where(rid == 0, lo, 0.0), axis=0) + jnp.sum(jnp.where(rid == sel, hi, 0.0), axis=0)
        o_ref[b, :] = acc

    call = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((n_ctas, LANES), jnp.float32), grid=(n_ctas,),
                          compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), interpret=interpret)
    sel = jnp.full((1,), -1, jnp.int32)
    return lambda w, x: call(w, x, sel)


def reference(ws, x, n_ctas, chunks):
    for w in ws:
        rows = w.reshape(n_ctas, chunks, ROWS, COLS)[:, :, 0, :LANES].astype(jnp.float32)
        x = x * 0.5 + rows.sum(axis=1)
    return x


def chain(kern, n):
    def f(ws, x):
        for i in range(n):
            x = kern(ws[i], x)
        return x
    return jax.jit(f)


def timed(fn, *args, reps=20):
    """The fastest of reps calls (us), each synchronous: the chain's device time plus one dispatch (the same for
    every chain length, so the slope between two lengths is the per-kernel time)."""
    out = fn(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t0) * 1e6)
    return min(ts), out


def device_spans(fn, calls: int, kernels_per_call: int) -> dict:
    """The chain's kernels under the profiler (`fnx.pallas.ledger`): per call (calls split at gaps > 30 us), the span
    from the first kernel's start to the last one's end over the kernels, the mean kernel duration, and how many
    kernels started before their predecessor ended (PDL overlap; CUPTI records it). Medians over the calls."""
    import glob
    import gzip
    import tempfile

    from fnx.pallas import ledger
    jax.block_until_ready(fn())
    d = tempfile.mkdtemp(prefix="fnx_mosaic_pdl_")
    with jax.profiler.trace(d, create_perfetto_trace=True):
        for _ in range(calls):
            jax.block_until_ready(fn())
    path = sorted(glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True))[-1]
    with gzip.open(path, "rt") as f:
        ks = ledger.device_kernels(json.load(f))
    groups, cur = [], []
    for e in ks:
        if cur and float(e["ts"]) - max(float(c["ts"]) + float(c.get("dur", 0)) for c in cur[-4:]) > 30:
            groups.append(cur)
            cur = []
        cur.append(e)
    groups.append(cur)
    rows = []
    for g in groups:
        if len(g) < kernels_per_call:
            continue
        ends = [float(e["ts"]) + float(e.get("dur", 0)) for e in g]
        rows.append(dict(span_us=(max(ends) - float(g[0]["ts"])) / len(g),
                         dur_us=statistics.mean(float(e.get("dur", 0)) for e in g),
                         overlaps=sum(float(b["ts"]) < ea for b, ea in zip(g[1:], ends))))
    if not rows:
        return dict(profile_error=f"no call of >= {kernels_per_call} kernels in {len(ks)} kernels")
    return dict(span_us_per_kernel=round(statistics.median(r["span_us"] for r in rows), 2),
                dur_us_per_kernel=round(statistics.median(r["dur_us"] for r in rows), 2),
                overlapping_kernels=statistics.median(r["overlaps"] for r in rows), profiled_calls=len(rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctas", type=int, default=132)
    ap.add_argument("--chunks", type=int, default=6, help="32 KB copies per CTA (6: 25 MB a kernel at 132 CTAs)")
    ap.add_argument("--lengths", default="64,256")
    ap.add_argument("--modes", default="triton,none,race,none+pdl_attr,trigger_late+pdl_attr,"
                    "prefetch+pdl_attr,prefetch_trig+pdl_attr,race+pdl_attr")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--profile", type=int, default=3, help="calls of the longer chain under the profiler (0: none)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    l1, l2 = (int(v) for v in a.lengths.split(","))
    dev = jax.devices()[0]
    print(f"# {dev.device_kind} jax {jax.__version__} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}", flush=True)
    try:
        import jax.experimental.mosaic.gpu.core as core
        import inspect
        import jax._src.pallas.mosaic_gpu.lowering as plow
        import jax._src.pallas.mosaic_gpu.core as pcore
        for mod in (core, plow, pcore):
            for i, ln in enumerate(inspect.getsource(mod).splitlines()):
                if "pdl" in ln.lower():
                    print(f"# {mod.__name__}:{i + 1}: {ln.strip()[:150]}", flush=True)
    except Exception as e:          # noqa: BLE001 - a probe: report and go on
        print("# mosaic core source:", e)
    n, ch = a.ctas, a.chunks
    kb = n * ch * ROWS * COLS * 2
    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (n * ch * ROWS, COLS), jnp.bfloat16) for i in range(l2)]
    x0 = jax.random.normal(key, (n, LANES), jnp.float32)
    ref = {m: reference(ws[:m], x0, n, ch) for m in (l1, l2)}
    # the streaming rate of one launch over every slab at once (its own per-launch cost spread over l2 slabs)
    big = jnp.concatenate(ws, axis=0)
    t_big, _ = timed(jax.jit(stream_kernel(n * l2, ch, "none")), big, jnp.zeros((n * l2, LANES), jnp.float32),
                     reps=a.reps)
    rate = kb * l2 / t_big / 1e6
    print(f"# one launch over {l2} slabs ({kb * l2 / 1e9:.2f} GB): {t_big:.1f} us, {rate:.2f} TB/s; "
          f"a slab {kb / 1e6:.1f} MB -> floor {kb / rate / 1e6:.2f} us", flush=True)
    fns, rows = {}, {}
    for mode in a.modes.split(","):       # compile each chain under its patch, and check it
        base, _, flag = mode.partition("+")
        undo = _uses_pdl_patch(flag == "uses_pdl")
        undo2 = _pdl_attr_patch(flag == "pdl_attr")
        try:
            kern = triton_kernel(n, ch) if base == "triton" else stream_kernel(n, ch, base)
            ok = True
            for m in (l1, l2):
                fns[mode, m] = chain(kern, m)
                out = jax.block_until_ready(fns[mode, m](ws[:m], x0))
                ok &= bool(jnp.allclose(out, ref[m], rtol=1e-5, atol=1e-4))
            rows[mode] = dict(mode=mode, correct=ok)
        except Exception as e:      # noqa: BLE001 - a probe: one mode failing must not lose the others
            rows[mode] = dict(mode=mode, error=f"{type(e).__name__}: {str(e)[:300]}")
            print(json.dumps(rows[mode]), flush=True)
            for m in (l1, l2):
                fns.pop((mode, m), None)
        finally:
            undo()
            undo2()
    best = {}
    for _ in range(a.rounds):            # interleaved rounds: drift hits every mode alike
        for (mode, m), fn in fns.items():
            t, _ = timed(fn, ws[:m], x0, reps=a.reps)
            best[mode, m] = min(best.get((mode, m), t), t)
    for mode, row in rows.items():
        if "error" in row:
            continue
        t = {m: best[mode, m] for m in (l1, l2)}
        row.update(us_per_kernel=round((t[l2] - t[l1]) / (l2 - l1), 2), floor_us=round(kb / rate / 1e6, 2),
                   chain_us={str(k): round(v, 1) for k, v in t.items()})
        if a.profile:
            try:
                row.update(device_spans(lambda fn=fns[mode, l2]: fn(ws[:l2], x0), a.profile, l2))
            except Exception as e:      # noqa: BLE001 - a probe: the timings above stand without it
                row["profile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(row), flush=True)
    rows = list(rows.values())
    if a.out:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = ""
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(probe="mosaic_pdl", device=dev.device_kind, jax=jax.__version__,
                                        commit=os.environ.get("FNX_COMMIT") or commit,
                                        date=datetime.date.today().isoformat(), ctas=n, chunks=ch,
                                        xla_flags=os.environ.get("XLA_FLAGS", ""),
                                        slab_mb=round(kb / 1e6, 2), rate_tbps=round(rate, 3), **r)) + "\n")


if __name__ == "__main__":
    main()
