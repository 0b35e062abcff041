"""Benchmark cases for the hyper-connection boundary at decode: M = 1, 5 (MTP verify), 32 tokens; 4 streams x
2560, rank 320, with injection (a layer boundary: combine, then the next gated residual).

Bytes floor = weights (Wdown + Wup + Winj + hc_norm) + activations (H, y, inj_prev in; H', x, inj out).
FLOPs = 2 M (2 r + S) S D.

At M = 1 the cases also run with FP8 Wdown / Wup (128x128 blocks, the model's online FP8 layout: what a decode step
runs); bytes then count 1 byte per weight plus the scales.

FNX_HC_SWEEP=1 replaces the cases by a sweep of the kernels' tiles (one field changed at a time from the default,
plus a few pairs): the one-token kernels' Tiles1 at M = 1 (bf16 and FP8 weights, and the references), the
few-token MMA design's TilesFew at M = 5 (bf16 and FP8): what the defaults should be, by measurement."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from fnx.pallas.bench import BenchCase, n_sets
from fnx.pallas.hc import api

# the few-token MMA design (few.TilesFew), swept at M = 5 with bf16 and FP8 weights
SWEEP_FEW = ({}, {"up": "mma"}, {"bn": 32}, {"bn": 128}, {"bn": 16}, {"chunks": 2}, {"bk": 64}, {"num_warps": 2},
             {"num_warps": 8}, {"up": "mma", "bd": 32}, {"up": "mma", "num_warps": 8})

# the one-token kernels (Tiles1), swept at M = 1 (wround 1: the FP8 weights rounded as before a9d89fd; with the
# per-weight rounding gone, each program's normalisation of its stream is a larger share of its work: bn 4 halves it)
SWEEP1 = ({}, {"bd": 4}, {"bd": 2}, {"num_warps": 2}, {"num_warps": 8}, {"bn": 1}, {"wround": 1}, {"bd": 2, "num_warps": 2},
          {"bn": 1, "num_warps": 2}, {"pieces": False})


def _fp8_sets(arg_sets):
    """The same inputs with Wdown and Wup as FP8 128x128 blocks (the model's online FP8 layout): (h, y, inj,
    hc_norm, Wdown8, Wup8, Winj, Wdown scales, Wup scales)."""
    from fnx.model import quant
    out = []
    for h, y, inj, norm, wd, wu, wi in arg_sets:
        qd, qu = (quant.quantize_fp8_block(w.astype(jnp.float32)) for w in (wd, wu))
        out.append((h, y, inj, norm, qd.w, qu.w, wi, qd.scale_inv, qu.scale_inv))
    return out


def _fp8_case(m, s, d, r, arg_sets, impl, change=None, label=None, tiles=None):
    from fnx.pallas.hc import pallas as kernel
    sd = s * d
    nbytes = 2 * r * sd + 2 * 4 * (-(-r // 128)) * (-(-sd // 128)) + (s * sd + sd) * 2 + (2 * sd + 2 * d + 2 * s) * 2
    if change is not None:
        tiles = dataclasses.replace(tiles or kernel.choose_tiles1(s, d, r), **change)
    extra = {"M": m, "weights": "fp8"}
    if change is not None:
        extra["tiles"] = ",".join(f"{k}={v}" for k, v in change.items()) or "default"
    return BenchCase(
        kernel="hc_boundary", shape=f"M={m} S={s} D={d} r={r} fp8", impl=label or impl,
        fn=lambda *a: api.hc_boundary(*a[:7], streams=s, eps=1e-6, impl=impl, tiles=tiles, w_down_scale=a[7],
                                      w_up_scale=a[8]),
        arg_sets=arg_sets, bytes=nbytes, flops=2 * m * (2 * r + s) * sd, extra=extra)


def cases(quick: bool) -> list[BenchCase]:
    s, d, r = (4, 256, 32) if quick else (4, 2560, 320)
    sd = s * d
    dt = jnp.bfloat16
    el = jnp.dtype(dt).itemsize
    w_bytes = (2 * r * sd + s * sd + sd) * el
    out = []
    for m in ((1, 5) if quick else (1, 5, 32)):
        act_bytes = (2 * m * sd + 2 * m * d + 2 * m * s) * el
        nbytes = w_bytes + act_bytes
        flops = 2 * m * (2 * r + s) * sd
        sets = 2 if quick else n_sets(nbytes)
        key = jax.random.PRNGKey(m)
        arg_sets = []
        for _ in range(sets):
            ks = jax.random.split(key, 8)
            key = ks[7]
            arg_sets.append((
                jax.random.normal(ks[0], (m, sd), dt), jax.random.normal(ks[1], (m, d), dt),
                (2 * jax.nn.sigmoid(jax.random.normal(ks[2], (m, s)))).astype(dt),
                (0.1 * jax.random.normal(ks[3], (sd,))).astype(dt),
                (jax.random.normal(ks[4], (r, sd)) * sd ** -0.5).astype(dt),
                (jax.random.normal(ks[5], (sd, r)) * r ** -0.5).astype(dt),
                (jax.random.normal(ks[6], (s, sd)) * sd ** -0.5).astype(dt)))
        if os.environ.get("FNX_HC_SWEEP") and m == 5:    # the few-token MMA design's tiles, bf16 and FP8 weights
            from fnx.pallas.hc import few
            for change in SWEEP_FEW:
                t = dataclasses.replace(few.TilesFew(), **change)
                if few.check(s, d, r, t):
                    continue
                label = ",".join(f"{k}={v}" for k, v in change.items()) or "default"
                out.append(BenchCase(
                    kernel="hc_boundary", shape=f"M={m} S={s} D={d} r={r}", impl="few-mma",
                    fn=lambda *a, _t=t: api.hc_boundary(*a, streams=s, eps=1e-6, impl="pallas", tiles=_t),
                    arg_sets=arg_sets, bytes=nbytes, flops=flops, extra={"M": m, "tiles": label}))
                c = _fp8_case(m, s, d, r, _fp8_sets(arg_sets), "pallas", label="few-mma", tiles=t)
                c.extra["tiles"] = label
                out.append(c)
            out.append(BenchCase(
                kernel="hc_boundary", shape=f"M={m} S={s} D={d} r={r}", impl="reference",
                fn=lambda *a: api.hc_boundary(*a, streams=s, eps=1e-6, impl="reference"),
                arg_sets=arg_sets, bytes=nbytes, flops=flops, extra={"M": m}))
            out.append(_fp8_case(m, s, d, r, _fp8_sets(arg_sets), "reference"))
            continue
        if os.environ.get("FNX_HC_SWEEP") and m == 1:   # the one-token kernels (Tiles1), the reference beside them
            from fnx.pallas.hc import pallas as kernel
            base, sweep = kernel.choose_tiles1(s, d, r), SWEEP1
            fits = lambda t: not (r % t.bn or s % t.bn or d % t.bd)  # noqa: E731
            for change in sweep:
                t = dataclasses.replace(base, **change)
                if not fits(t):
                    continue
                out.append(BenchCase(
                    kernel="hc_boundary", shape=f"M={m} S={s} D={d} r={r}", impl="pallas",
                    fn=lambda *a, _t=t: api.hc_boundary(*a, streams=s, eps=1e-6, impl="pallas", tiles=_t),
                    arg_sets=arg_sets, bytes=nbytes, flops=flops,
                    extra={"M": m, "tiles": ",".join(f"{k}={v}" for k, v in change.items()) or "default"}))
            out.append(BenchCase(
                kernel="hc_boundary", shape=f"M={m} S={s} D={d} r={r}", impl="reference",
                fn=lambda *a: api.hc_boundary(*a, streams=s, eps=1e-6, impl="reference"),
                arg_sets=arg_sets, bytes=nbytes, flops=flops, extra={"M": m}))
            f8 = _fp8_sets(arg_sets)       # FP8 Wdown / Wup: what the model runs (online FP8)
            out += [_fp8_case(m, s, d, r, f8, "pallas", change) for change in sweep
                    if fits(dataclasses.replace(base, **change))]
            out.append(_fp8_case(m, s, d, r, f8, "reference"))
            continue
        from fnx.pallas.hc import pallas as kernel
        # "pallas" at M > 1 is the multi-token MMA design (its Tiles); "few" the one-token kernels with a program
        # per token (op hc_boundary_few, Tiles1), "few-loop" each program walking the tokens; both take FP8 weights
        variants = [("pallas", None if m == 1 else kernel.choose_tiles(d, r)), ("reference", None)]
        if 1 < m <= api.MAX_FEW_TOKENS:
            t1 = kernel.choose_tiles1(s, d, r)
            from fnx.pallas.hc import few
            variants += [("few-mma", few.TilesFew()), ("few", t1), ("few-loop", dataclasses.replace(t1, tokens="loop"))]
        if m == 1:      # the one-launch boundary (op hc_boundary_one; FP8 Wdown / Wup as the model runs them):
            # P = two programs per SM (the default), three, four, and every down task its own program (<= 5 per SM)
            from fnx.pallas import dispatch, grid_sync
            from fnx.pallas.hc import one
            interp = dispatch.why_unavailable("pallas") is not None
            # each argument set with its barrier counter, as the model's calls take one from the program's pool (a
            # counter made inside the timed function would add its launch to every application)
            f8 = [a + (grid_sync.counter(interp),) for a in _fp8_sets(arg_sets)]
            nb = _fp8_case(m, s, d, r, f8, "pallas").bytes
            # its x against the two kernels' (the same task code: 0 unless the barrier let a program read too early)
            two = lambda *a: api.hc_boundary(*a[:7], streams=s, eps=1e-6, impl="pallas_interpret" if interp  # noqa
                                             else "pallas", w_down_scale=a[7], w_up_scale=a[8])[1]
            sms = one.sm_count() or 0
            tasks = (r + s) // kernel.choose_tiles1(s, d, r).bn * s
            for per_sm in ((0, 3, 4, 5) if sms else (0,)):
                t = one.TilesOne(programs=min(per_sm * sms, tasks)) if per_sm else one.TilesOne()
                out.append(BenchCase(
                    kernel="hc_boundary", shape=f"M={m} S={s} D={d} r={r} fp8", impl="one",
                    fn=lambda *a, _t=t: one.hc_boundary_one(*a[:7], streams=s, eps=1e-6, tiles=_t, interpret=interp,
                                                            w_down_scale=a[7], w_up_scale=a[8], sync=a[9])[1],
                    arg_sets=f8, bytes=nb, flops=flops, check=two, check_tol=0.0,
                    extra={"M": m, "weights": "fp8", "tiles": f"programs={t.programs or 'default'}"}))
        if 1 < m <= api.MAX_FEW_TOKENS:     # the few-token boundary in one launch (op hc_boundary_few_one), FP8
            from fnx.pallas import dispatch, grid_sync
            from fnx.pallas.hc import one
            interp = dispatch.why_unavailable("pallas") is not None
            f8 = [a + (grid_sync.counter(interp),) for a in _fp8_sets(arg_sets)]     # (as the one-token cases)
            ref = lambda *a: api.hc_boundary(*a[:7], streams=s, eps=1e-6, impl="reference",  # noqa: E731
                                             w_down_scale=a[7], w_up_scale=a[8])[1]
            for change in ({}, {"split": 1}, {"kc": 2}, {"bn": 128}, {"bd": 32}):
                t = dataclasses.replace(one.few_tiles(d, r), **change)
                out.append(BenchCase(
                    kernel="hc_boundary", shape=f"M={m} S={s} D={d} r={r} fp8", impl="few-one",
                    fn=lambda *a, _t=t: one.hc_boundary_one_few(*a[:7], streams=s, eps=1e-6, tiles=_t,
                                                                interpret=interp, w_down_scale=a[7],
                                                                w_up_scale=a[8], sync=a[9])[1],
                    arg_sets=f8, bytes=_fp8_case(m, s, d, r, f8, "pallas").bytes, flops=flops, check=ref,
                    extra={"M": m, "weights": "fp8",
                           "tiles": ",".join(f"{k}={v}" for k, v in change.items()) or "default"}))
        for impl, tiles in variants:
            run = "pallas" if impl.startswith("few") else impl
            out.append(BenchCase(
                kernel="hc_boundary", shape=f"M={m} S={s} D={d} r={r}", impl=impl,
                fn=lambda *a, _impl=run, _t=tiles: api.hc_boundary(*a, streams=s, eps=1e-6, impl=_impl, tiles=_t),
                arg_sets=arg_sets, bytes=nbytes, flops=flops, extra={"M": m}))
            if m == 1 or impl != "pallas":       # FP8 Wdown / Wup: what the model runs (online FP8)
                out.append(_fp8_case(m, s, d, r, _fp8_sets(arg_sets), run, label=impl,
                                     change={"tokens": "loop"} if impl == "few-loop" else None,
                                     tiles=tiles if impl == "few-mma" else None))
    return out
