"""Benchmark cases for the weight-streaming linear layers over the released shapes (fnx/pallas/gemv/shapes.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fnx.pallas.bench import BenchCase, n_sets
from fnx.pallas.gemv import api, shapes

F32 = jnp.float32


def make_weight(fmt: str, n: int, k: int, key) -> dict:
    """Random raw arrays of one format, built directly (no quantizer pass, so large sets are cheap)."""
    k1, k2, k3 = jax.random.split(key, 3)
    if fmt == "bf16":
        return {"w": (jax.random.normal(k1, (n, k), jnp.bfloat16) * 0.02)}
    if fmt == "fp8":
        return {"w": jax.random.normal(k1, (n, k), jnp.bfloat16).astype(jnp.float8_e4m3fn),
                "scale": jax.random.uniform(k2, (-(-n // 128), -(-k // 128)), F32, 1e-3, 2e-3)}
    return {"w": jax.random.randint(k1, (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8),
            "scale": jax.random.uniform(k2, (n, k // 16), F32, 0.5, 2.0).astype(jnp.float8_e4m3fn),
            "scale_2": jax.random.uniform(k3, (n,), F32, 1e-3, 2e-3)}


def weight_bytes(raw: dict) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in raw.values())


@functools.lru_cache(maxsize=1)   # the tuner times many tilings of one shape: build its weight sets once
def weight_sets(fmt: str, n: int, k: int, quick: bool) -> tuple:
    """The distinct weight sets a case rotates through (enough to exceed the L2), kept for the next call with the
    same shape (the tuner builds one case per tile candidate)."""
    key = jax.random.PRNGKey(n * 7 + k)
    one = make_weight(fmt, n, k, key)
    count = 2 if quick else n_sets(weight_bytes(one))
    return (one,) + tuple(make_weight(fmt, n, k, jax.random.fold_in(key, i)) for i in range(1, count))


def cases(quick: bool = False, fmts=("bf16", "fp8", "nvfp4"), ms=(1, 8), impls=("pallas", "reference"),
          tiles=None, only=None) -> list[BenchCase]:
    """`tiles` (a Tiles) overrides the configured tiles for every case (used by the tuner). Without a GPU the
    "pallas" cases run in interpret mode (a smoke test of the harness, not a measurement)."""
    from fnx.pallas import dispatch
    if dispatch.why_unavailable("pallas") is not None:
        impls = tuple("pallas_interpret" if i == "pallas" else i for i in impls)
    out = []
    shape_list = shapes.TEST if quick else shapes.RELEASED + shapes.FUSED
    for fmt in fmts:
        for name, n, k in shape_list:
            if only is not None and (n, k) != tuple(only):
                continue
            key = jax.random.PRNGKey(n * 7 + k)
            sets = list(weight_sets(fmt, n, k, quick))
            per = weight_bytes(sets[0])
            for m in ms:
                x = jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, k), F32).astype(jnp.bfloat16)
                for impl in impls:
                    if impl != "reference" and api.kernel_applies(x.shape, x.dtype, fmt, (n, k), w_dtype=sets[0]["w"].dtype if fmt == "bf16" else None):
                        continue

                    def fn(x, raw, fmt=fmt, impl=impl):
                        if tiles is not None and impl != "reference":
                            from fnx.pallas.gemv import pallas as gp
                            return gp.gemv(x, raw["w"], raw.get("scale"), raw.get("scale_2"), fmt=fmt, tiles=tiles,
                                           interpret=impl == "pallas_interpret")
                        return api.linear(x, raw["w"], fmt=fmt, scale=raw.get("scale"), scale_2=raw.get("scale_2"),
                                          impl=impl)

                    t = tiles or api.tiles_for(fmt, n, k, m)
                    extra = {"fmt": fmt, "layer": name, "M": m, "N": n, "K": k}
                    if impl != "reference" and t is not None:
                        extra["tiles"] = [t.bn, t.bk, t.split, t.num_warps, t.num_stages, t.mode]
                    out.append(BenchCase(f"gemv_{fmt}", f"M={m} N={n} K={k}", impl, fn,
                                         [(x, s) for s in sets], per + 2 * m * (k + n), 2 * m * n * k, extra))
    if tiles is None and only is None and "fp8" in fmts:
        out += pair_cases(quick, impls, (1, 5))     # the decode step's and the MTP verify window's token counts
    return out


def pair_cases(quick: bool, impls, ms=(1,)) -> list[BenchCase]:
    """The pairs over `shapes.PAIRS` (quick: small stand-ins) at one token (`gemv_pair`) and at five (the MTP verify
    window, `gemv_pair_many`): "pallas" the one-launch pair, "reference" the two products apart through their own
    dispatch (today's FP8 kernel and XLA's bf16 dot, with its split-K sum)."""
    out = []
    pairs = [("pair.test", 256, 40, 2048)] if quick else shapes.PAIRS
    for name, n1, n2, k in pairs:
        key = jax.random.PRNGKey(n1 * 7 + n2)
        sets = [(make_weight("fp8", n1, k, jax.random.fold_in(key, i)), make_weight("bf16", n2, k,
                 jax.random.fold_in(key, 100 + i))) for i in range(2 if quick else n_sets(n1 * k + 2 * n2 * k))]
        for m in ms:
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), F32).astype(jnp.bfloat16)
            op = api.pair_op(x.shape, (n1, k))
            nbytes = n1 * k + 4 * (-(-n1 // 128)) * (k // 128) + 2 * n2 * k + 2 * m * (k + n1 + n2)
            for impl in impls:
                applies = api.pair_many_applies if op == api.PAIR_MANY_OP else api.pair_applies
                if impl != "reference" and applies(x.shape, x.dtype, (n1, k), (n2, k), jnp.bfloat16):
                    continue

                def fn(x, w, impl=impl):
                    a, b = w
                    return api.linear_pair(x, a["w"], a["scale"], b["w"], impl=impl)

                extra = {"layer": name, "M": m, "N1": n1, "N2": n2, "K": k}
                out.append(BenchCase(op, f"M={m} N1={n1} N2={n2} K={k}", impl, fn, [(x, w) for w in sets],
                                     nbytes, 2 * m * (n1 + n2) * k, extra))
    return out
