"""Dispatch for the weight-streaming linear layers (op names "gemv_bf16", "gemv_fp8", "gemv_nvfp4").

`linear(x, w, fmt=..., ...)` takes raw arrays (fnx.model.ops unpacks its quantized dataclasses), so this
package imports nothing from the model. The Pallas kernel serves M <= MAX_M tokens with bf16 activations, 2-D
weights, FP8 in 128 x 128 blocks and NVFP4 in groups of 16, when tiles divide the shape; with impl=None anything
else runs the reference (prefill shapes are compute-bound and XLA's dot is the right tool there), and a named
impl="pallas" that does not apply raises.

Tiles come from `configs/<device kind>.json` (written by `scripts/bench_kernels.py --tune`), keyed by
"fmt:N:K:Mbucket"; a shape without an entry gets `heuristic_tiles`. `FNX_GEMV_CONFIG` names another table (a
file stem in configs/, e.g. nvidia_h200, or a path to a JSON file; read when a program is traced). A device
without a table of its own runs its sibling's (`SIBLING_TABLES`: an H100 the H200's), else the heuristic."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from fnx.pallas import dispatch, kernel_math, stacked
from fnx.pallas.gemv import dequant
from fnx.pallas.gemv import pallas as gp
from fnx.pallas.gemv import reference

log = logging.getLogger("fnx.pallas")

MAX_M = 32
FORMATS = ("bf16", "fp8", "nvfp4")
CONFIG_DIR = pathlib.Path(__file__).with_name("configs")
SMS = 132  # H200; the heuristic only needs the order of magnitude


def m_bucket(m: int) -> int:
    return max(1, 1 << (m - 1).bit_length()) if m <= 16 else 32


def _tuned(device_kind: str) -> dict:
    """The committed table of a device kind (configs/<kind, lower case, spaces as _>.json), {} without one."""
    path = CONFIG_DIR / (device_kind.lower().replace(" ", "_") + ".json")
    return _tuned_file(str(path)) if path.exists() else {}


CONFIG_ENV = "FNX_GEMV_CONFIG"
# a device kind without a table of its own runs its sibling's: the H100 (SXM, 2026-12-06) ran a 4-layer decode step
# in 608 us with the H200's table against 624 with the heuristic tiles, the MTP round in 1,754 against 1,766
SIBLING_TABLES = {"nvidia_h100": "nvidia_h200"}


def _table() -> dict:
    """The tuned tiles this process uses: FNX_GEMV_CONFIG's table when set (a configs/ stem or a JSON path; one
    that is not there is an error, not the heuristic), else the device kind's, else its sibling's (empty without
    either)."""
    name = os.environ.get(CONFIG_ENV, "").strip()
    if not name:
        kind = _device_kind()
        own = _tuned(kind)
        if own:
            return own
        stem = kind.lower().replace(" ", "_")
        sibling = next((t for prefix, t in SIBLING_TABLES.items() if stem.startswith(prefix)), None)
        return _tuned(sibling) if sibling else own
    path = pathlib.Path(name)
    if path.suffix != ".json":
        path = CONFIG_DIR / (name.lower().replace(" ", "_") + ".json")
    if not path.is_file():
        have = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        raise ValueError(f"{CONFIG_ENV}={name!r}: no such table ({path}); configs/ has {have}")
    return _tuned_file(str(path))


@functools.lru_cache(maxsize=None)
def _tuned_file(path: str) -> dict:
    """A table read once per process (tile lookups run at every trace)."""
    return json.loads(pathlib.Path(path).read_text())


def _device_kind() -> str:
    try:
        return jax.devices()[0].device_kind
    except Exception:  # pragma: no cover
        return "unknown"


def split_for(n: int, bn: int, k: int, bk: int, programs: int) -> int:
    """The smallest split of K (a divisor of K / bk) that gives at least `programs` programs, else the largest."""
    nkb = k // bk
    divs = [d for d in range(1, nkb + 1) if nkb % d == 0]
    return next((d for d in divs if (n // bn) * d >= programs), divs[-1])


# "fma" multiplies every weight once per token on the CUDA cores: the H200 tuner picked it for every released FP8
# shape with K >= 2048 at one token (BENCHMARKS.md, seventh session), but at five tokens (an MTP verify window) it
# lost to the looped tensor-core kernel: 16384 x 2560 56.7 vs 45.6 us per call, 2560 x 6144 60.0 vs 45.1, the HC
# down projection 320 x 10240 (20 programs) 76.2 vs 39.5 (`scripts/probe_gemv_m.py`, calls bound near 40 us by
# host dispatch); in the 48-layer MTP round one "fma" kernel took 12.9 ms in 99 launches (eleventh session). So
# beyond this many tokens it runs only where a tuned table entry for that token count names it.
FMA_AUTO_MAX_M = 1


def heuristic_tiles(fmt: str, n: int, k: int, m: int) -> gp.Tiles | None:
    """A tile set that divides (N, K). FP8 at M <= FMA_AUTO_MAX_M with K >= 2048: the whole-K "fma" mode (16 rows
    per program, K in chunks of up to 512), which the H200 tuner picked for every such released shape (BENCHMARKS.md,
    seventh session). Otherwise the looped kernel with K split so there are >= 2 programs per SM where K allows
    (a GEMV with fewer programs is latency-bound: each program walks its K slice one dependent load after
    another)."""
    if fmt == "fp8" and m <= FMA_AUTO_MAX_M and k >= 2048:
        bn = next((b for b in (16, 8, 4, 2, 1) if n % b == 0), 1)
        bk = next((b for b in (512, 256, 128) if k % b == 0), None)
        if bk is not None:
            t = gp.Tiles(bn, bk, 1, num_warps=4, num_stages=1, mode="fma")
            if gp.check_tiles(fmt, n, k, t) is None:
                return t
    bn = next((b for b in (64, 32, 16) if n % b == 0), None)
    if fmt == "nvfp4":
        bk = next((b for b in (256, 128, 64, 32) if k % b == 0), None)
    else:
        bk = next((b for b in (128, 64, 32) if k % b == 0), None)
    if bn is None or bk is None:
        return None
    t = gp.Tiles(bn, bk, split_for(n, bn, k, bk, 2 * SMS), num_warps=4, num_stages=3)
    return t if gp.check_tiles(fmt, n, k, t) is None else None


MANY_TILES_ENV = "FNX_GEMV_MANY_TILES"


def many_override(t: gp.Tiles | None, fmt: str, n: int, k: int, m: int) -> gp.Tiles | None:
    """`FNX_GEMV_MANY_TILES` ("field=value,...": Tiles fields; dec and mode as text) replaces fields of the tensor-core
    tiles ("loop" / "dot") chosen for several tokens (M > 1), read when a program is traced: a benchmark knob for
    an A/B of the whole step without a table change (e.g. "tr=1", "mma=f16"). A prefix "FMT+FMT:" limits it to
    those weight formats ("fp8+nvfp4:mma=f16" leaves bf16 GEMVs as tuned). Tiles it would make invalid raise,
    saying why."""
    spec = os.environ.get(MANY_TILES_ENV, "").strip()
    if ":" in spec:
        fmts, spec = (part.strip() for part in spec.split(":", 1))
        unknown = set(fmts.split("+")) - set(FORMATS)
        if unknown or not fmts:
            raise ValueError(f"{MANY_TILES_ENV}: unknown weight format(s) {sorted(unknown) or fmts!r} before ':' "
                             "(known: " + "+".join(FORMATS) + ")")
        if fmt not in fmts.split("+"):
            return t
    if not spec or t is None or m <= 1 or t.mode == "fma":
        return t
    new = dataclasses.replace(t, **dispatch.fields_override(spec, gp.Tiles, MANY_TILES_ENV, ("dec", "mode", "mma")))
    why = gp.check_tiles(fmt, n, k, new)
    if why:
        raise ValueError(f"{MANY_TILES_ENV}={spec!r} on {fmt} N={n} K={k} tiles {t}: {why}")
    return new


FINISH_ENV = "FNX_GEMV_FINISH"


def finish_pool():
    """The counter pool split-K calls take their in-kernel split sum's counters from (`FNX_GEMV_FINISH=1`, read when
    a program is traced: a benchmark knob; the model makes the pool once per decode program,
    `transformer.make_meta`), or None: the split sum stays an XLA reduction after the kernel."""
    from fnx.pallas import grid_sync
    return grid_sync.pool_if(FINISH_ENV)


XFIRST_ENV = "FNX_GEMV_XFIRST"
XFIRST_DEFAULT = "1"   # on since measured: H200, commit d9f4565, 2026-12-05, 4-layer round at 8K -15.6 us, step -19.0


SHAPE_TILES_ENV = "FNX_GEMV_TILES"
_shape_logged: set = set()


def shape_overrides(spec: str | None = None) -> dict:
    """`FNX_GEMV_TILES` ("KEY=field=value,.../KEY=...", KEY as in the tuned tables: "fmt:N:K:Mbucket", with
    ":argmax" for the fused-argmax heads; "/" between keys, as ";" separates a round sweep's variants) parsed into
    {KEY: {field: value}}: a benchmark knob that replaces tile
    fields of one call shape in a whole program (e.g. "fp8:2560:6144:1=bn=8,split=1": the GDN / QSA out_proj at one
    token without split-K, so no XLA sum follows it), read when a program is traced. A malformed key raises."""
    spec = os.environ.get(SHAPE_TILES_ENV, "") if spec is None else spec
    out: dict = {}
    for part in filter(None, (p.strip() for p in spec.split("/"))):
        key, eq, fields = part.partition("=")
        bits = key.strip().split(":")
        ok = eq and len(bits) in (4, 5) and bits[0] in FORMATS and all(b.isdigit() and int(b) > 0 for b in bits[1:4])
        if not ok or (len(bits) == 5 and bits[4] != "argmax") or int(bits[3]) != m_bucket(int(bits[3])):
            raise ValueError(f"{SHAPE_TILES_ENV}: {part!r} is not 'fmt:N:K:Mbucket[:argmax]=field=value,...' (fmt one "
                             f"of {', '.join(FORMATS)}; Mbucket 1, 2, 4, 8, 16 or 32)")
        out[key.strip()] = dispatch.fields_override(fields, gp.Tiles, SHAPE_TILES_ENV, ("dec", "mode", "mma"))
    return out


def shape_override(t: gp.Tiles | None, fmt: str, n: int, k: int, m: int, argmax: bool) -> gp.Tiles | None:
    """t with the fields `FNX_GEMV_TILES` names for this call's key replaced (checked: tiles that do not fit raise,
    saying why; logged once per key, so a sweep's log shows that the override took effect)."""
    over = shape_overrides()
    key = f"{fmt}:{n}:{k}:{m_bucket(m)}" + (":argmax" if argmax else "")
    if key not in over:
        return t
    if t is None:
        raise ValueError(f"{SHAPE_TILES_ENV}: {key} has no tile set to change (the kernel does not take this shape)")
    new = dataclasses.replace(t, **over[key])
    why = gp.check_tiles(fmt, n, k, new) or (
        "the fused argmax needs split 1" if argmax and new.split != 1 else None) or (
        f"mode 'fma' serves at most {gp.FMA_MAX_M} tokens" if new.mode == "fma" and m > gp.FMA_MAX_M else None)
    if why:
        raise ValueError(f"{SHAPE_TILES_ENV}: {key} tiles {new}: {why}")
    if key not in _shape_logged:
        _shape_logged.add(key)
        log.info("fnx gemv %s: tiles %s (%s)", key, new, SHAPE_TILES_ENV)
    return new


def tiles_for(fmt: str, n: int, k: int, m: int, argmax: bool = False) -> gp.Tiles | None:
    """Tuned tiles for this (fmt, N, K) at M's bucket, else at the nearest tuned bucket, else the heuristic (and
    `FNX_GEMV_MANY_TILES` over them at M > 1, then `FNX_GEMV_TILES` for this shape). `Tiles.xfirst` is set on every
    whole-K tile set ("fma", "dot"); `FNX_GEMV_XFIRST=0` (read when a program is traced: a benchmark knob) leaves
    it off."""
    t = many_override(_tiles_for(fmt, n, k, m, argmax), fmt, n, k, m)
    t = shape_override(t, fmt, n, k, m, argmax)
    flag = os.environ.get(XFIRST_ENV, "").strip() or XFIRST_DEFAULT
    if flag not in ("0", "1"):
        raise ValueError(f"{XFIRST_ENV}={flag!r}: 0 or 1")
    if flag == "1" and t is not None and t.mode in ("fma", "dot"):
        t = dataclasses.replace(t, xfirst=1)
    return t


def _tiles_for(fmt: str, n: int, k: int, m: int, argmax: bool = False) -> gp.Tiles | None:
    table = _table()
    suffix = ":argmax" if argmax else ""
    b = m_bucket(m)
    tuned = {int(key.split(":")[3]): v for key, v in table.items()
             if key.startswith(f"{fmt}:{n}:{k}:") and key.endswith(suffix) and (argmax or key.count(":") == 3)}
    if tuned:
        tb = min(tuned, key=lambda tb: (abs(tb - b), tb))
        t = gp.Tiles(**tuned[tb])
        if "mma" not in tuned[tb]:
            t = _many_mma(t, fmt, n, k, m)
        # an "fma" entry tuned at another token count serves up to FMA_AUTO_MAX_M tokens (measured slower beyond)
        fma_ok = m <= (gp.FMA_MAX_M if tb == b else FMA_AUTO_MAX_M)
        fits = not (argmax and t.split != 1) and not (t.mode == "fma" and not fma_ok)
        if gp.check_tiles(fmt, n, k, t) is None and fits:
            return t
    t = heuristic_tiles(fmt, n, k, m)
    if t is not None and argmax and t.split != 1:
        t = dataclasses.replace(t, split=1)
    return None if t is None else _many_mma(t, fmt, n, k, m)


# The MMA operand type of the tensor-core tiles at several tokens, per weight format, where a table entry does not
# name one. FP8 -> fp16 (one conversion instruction per two weights, activations prescaled per token row by a power
# of two): in the 48-layer MTP round at 8K the GEMV family went 2.342 -> 2.231 ms of kernel time and the 4-layer
# verify program 1.008 -> 0.957 ms (BENCHMARKS.md, thirtieth session). NVFP4 GEMVs keep bf16 (not measured in a
# model: the experts run in the MoE kernels).
MANY_MMA = {"fp8": "f16"}


def _many_mma(t: gp.Tiles, fmt: str, n: int, k: int, m: int) -> gp.Tiles:
    if m <= 1 or fmt not in MANY_MMA or t.mode not in ("loop", "dot"):
        return t
    new = dataclasses.replace(t, mma=MANY_MMA[fmt])
    return new if gp.check_tiles(fmt, n, k, new) is None else t


def kernel_applies(x_shape, x_dtype, fmt: str, w_shape, block=(128, 128), group: int = 16,
                   argmax: bool = False, w_dtype=None) -> str | None:
    """None when the Pallas kernel serves this call, else why not."""
    if fmt not in FORMATS:
        return f"unknown format {fmt!r}"
    if len(w_shape) != 2:
        return f"weight has leading axes {tuple(w_shape)}"
    if w_dtype is not None and fmt == "bf16" and jnp.dtype(w_dtype) != jnp.bfloat16:
        return f"dense weight is {jnp.dtype(w_dtype).name}, the kernel streams bfloat16"
    m = 1
    for d in x_shape[:-1]:
        m *= d
    if m > MAX_M:
        return f"{m} tokens > {MAX_M} (prefill shapes run the XLA dot)"
    if jnp.dtype(x_dtype) != jnp.bfloat16:
        return f"activations are {jnp.dtype(x_dtype).name}, the kernel takes bfloat16"
    if fmt == "fp8" and tuple(block) != (128, 128):
        return f"FP8 blocks {tuple(block)} (the kernel takes 128 x 128)"
    if fmt == "nvfp4" and group != 16:
        return f"NVFP4 group {group} (the kernel takes 16)"
    n = w_shape[0]
    k = x_shape[-1]
    if tiles_for(fmt, n, k, m, argmax) is None:
        return f"no tile set divides N={n} K={k}"
    return None


def linear(x: jax.Array, w: jax.Array, *, fmt: str = "bf16", scale=None, scale_2=None, block=(128, 128),
           group: int = 16, impl: str | None = None, x_cols: int | None = None) -> jax.Array:
    """y = x @ W.T for x [..., K] and W [N, K] in `fmt`; y [..., N] in x.dtype.

    "reference" rounds the fp32 dequantized weight to x.dtype, then an fp32-accumulated dot (the model's
    arithmetic); the kernel applies block scales to fp32 partial dots instead (one bf16 rounding of the
    weights apart; see reference.py). x_cols K (bf16 / FP8): x is [..., W >= K] and the input is its first K
    columns, which the kernel reads in place (the reference slices)."""
    if x_cols is not None and (fmt == "nvfp4" or not 0 < x_cols <= x.shape[-1]):
        raise ValueError(f"linear: x_cols={x_cols} of x {tuple(x.shape)} (bf16 / FP8 weights)")
    xk = x.shape if x_cols is None else (*x.shape[:-1], x_cols)
    why = kernel_applies(xk, x.dtype, fmt, w.shape, block, group, w_dtype=w.dtype)
    if why is None and x_cols is not None and dispatch.active_mesh() is not None:
        why = "a window of x on a mesh (the per-shard kernel takes whole rows)"
    backend = dispatch.resolve(f"gemv_{fmt}", impl, not_applicable=why)
    if backend == "reference":
        x = x if x_cols is None else x[..., :x_cols]
        if fmt == "fp8" and impl in (None, "auto") and math.prod(xk[:-1]) > MAX_M:
            # prefill-sized (at decode sizes XLA fuses the dequantization into its product): a kernel may write it
            dq = dispatch.resolve(dequant.OP, None, not_applicable=dequant.why_not(w.shape, block, w.dtype))
            if dq != "reference":
                return reference.linear(x, dequant.dequantize_fp8(w, scale, block, x.dtype,
                                                                  interpret=dispatch.interpret_flag(dq)))
        w, scale, scale_2 = (stacked.materialize(a) for a in (w, scale, scale_2))
        return reference.linear(x, reference.dequantize(fmt, w, scale, scale_2, block, group))
    lead, k = x.shape[:-1], xk[-1]
    x2 = x.reshape(-1, x.shape[-1])
    if dispatch.active_mesh() is not None:      # params on a mesh: the kernel per shard (gemv/mesh.py)
        from fnx.pallas.gemv import mesh as gm
        w, scale, scale_2 = (stacked.materialize(a) for a in (w, scale, scale_2))
        aux = (scale,) if fmt == "fp8" else (scale, scale_2) if fmt == "nvfp4" else ()
        return gm.partitioned(fmt, dispatch.interpret_flag(backend))(x2, w, *aux).reshape(*lead, -1)
    t = tiles_for(fmt, w.shape[0], k, x2.shape[0])
    pool = finish_pool() if t.split > 1 else None
    fin = {} if pool is None else {"counters": pool.buf, "finish_base": pool.take(w.shape[0] // t.bn)}
    y = gp.gemv(x2, w, scale, scale_2, fmt=fmt, tiles=t, interpret=dispatch.interpret_flag(backend),
                k=None if x_cols is None else k, **fin)
    return y.reshape(*lead, -1)


# "auto" and the FP8 argmax kernel: with looped tiles (K walked in steps, partial sums carried) it lost in the whole
# step, 1.060 ms against 0.955 with XLA's dequantize-and-dot (H200, commit c74db63); the whole-K ("fma") tiles of
# one token are the GEMV kernels the step's heads run (the 248,320-row head 166 us against XLA's 272)
ARGMAX_LOOP_REASON = ("FP8 head argmax with looped tiles: measured slower than XLA in the whole step (1.060 vs "
                      "0.955 ms, H200, commit c74db63); whole-K tiles take the kernel")


def argmax_auto_reason(fmt: str, n: int, k: int, m: int) -> str | None:
    """Why "auto" keeps XLA's head for this fused-argmax call (None: the kernel), given that the kernel applies."""
    if fmt == "fp8" and tiles_for(fmt, n, k, m, argmax=True).mode != "fma":
        return ARGMAX_LOOP_REASON
    return None


def linear_argmax(x: jax.Array, w: jax.Array, *, fmt: str = "bf16", scale=None, scale_2=None, block=(128, 128),
                  group: int = 16, impl: str | None = None) -> jax.Array:
    """Greedy ids argmax(x @ W.T) [...] int32 without writing the logits out (the lm_head / MTP draft head of
    greedy decoding). Ties go to the lowest id. The kernel compares fp32 logits; the reference compares the
    x.dtype-rounded logits the model returns, so near-ties closer than one bf16 step may pick differently."""
    why = kernel_applies(x.shape, x.dtype, fmt, w.shape, block, group, argmax=True, w_dtype=w.dtype)
    prefer = None if why else argmax_auto_reason(fmt, w.shape[0], x.shape[-1], int(np.prod(x.shape[:-1])))
    backend = dispatch.resolve(f"gemv_{fmt}_argmax", impl, not_applicable=why, prefer_reference=prefer)
    if backend == "reference":
        w, scale, scale_2 = (stacked.materialize(a) for a in (w, scale, scale_2))
        y = reference.linear(x, reference.dequantize(fmt, w, scale, scale_2, block, group))
        return reference.argmax_rows(y)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    t = tiles_for(fmt, w.shape[0], k, x2.shape[0], argmax=True)
    ids = gp.gemv(x2, w, scale, scale_2, fmt=fmt, tiles=t, interpret=dispatch.interpret_flag(backend),
                  argmax=True)
    return ids.reshape(lead)


PAIR_OP = "gemv_pair"


def _tokens(x_shape) -> int:
    m = 1
    for d in x_shape[:-1]:
        m *= d
    return m


def _pair_common(x_shape, x_dtype, w1_shape, w2_shape, w2_dtype) -> str | None:
    """What both pair kernels need: 2-D weights, no mesh, an FP8 product the GEMV kernel serves, a bf16 narrow one."""
    if len(w1_shape) != 2 or len(w2_shape) != 2:
        return "weights with leading axes"
    if dispatch.active_mesh() is not None:
        return "params on a mesh (each product runs its own per-shard kernel)"
    why = kernel_applies(x_shape, x_dtype, "fp8", w1_shape)
    if why:
        return f"the FP8 product: {why}"
    if jnp.dtype(w2_dtype) != jnp.bfloat16:
        return f"the narrow product's weight is {jnp.dtype(w2_dtype).name}, the kernel streams bfloat16"
    return None


def pair_applies(x_shape, x_dtype, w1_shape, w2_shape, w2_dtype) -> str | None:
    """None when `linear_pair`'s one-launch kernel serves this call, else why not."""
    why = _pair_common(x_shape, x_dtype, w1_shape, w2_shape, w2_dtype)
    if why:
        return why
    t = pair_tiles(tiles_for("fp8", w1_shape[0], x_shape[-1], _tokens(x_shape)))
    if t.mode == "loop":
        return "the FP8 product's tiles walk K in a loop (split-K): only whole-K tiles pair"
    why = gp.check_tiles("fp8", w1_shape[0], x_shape[-1], t)
    if why:
        return f"the FP8 product's tiles {t} without split-K: {why}"
    if w2_shape[1] != x_shape[-1] or gp.pair_side_tiles(w2_shape[0], x_shape[-1]) is None:
        return (f"the narrow product {tuple(w2_shape)}: at most {gp.PAIR_SIDE_MAX_N} rows of K={x_shape[-1]} in at "
                f"most 16 power-of-two chunks")
    return None


# At a few tokens (an MTP verify window) the FP8 product's own tiles loop over K with split-K, which the one-token
# pair cannot take: those calls are `gemv_pair_many`'s (below). Pairing the MoE's (shared gate / up 1280 x 2560 +
# router 513 rows) at five tokens with the one-token whole-K tiles lost: 26.1 us per layer against 18.7 for the four
# launches apart (the 4-layer verify program at 8K, H200, commit fb693e8 against 19088ee). The pair's narrow programs
# alone as one launch for the narrow product (a `gemv_narrow`, 139de24, reverted) lost too: 10.5 us per call for the
# router's 513 rows and for the GDN b / a's 96 at five tokens, against ~4.5 and ~4.2 us for XLA's split-K product and
# its sum (each program walks the five tokens' chunk sums one after another; the 4-layer verify program 1.067 against
# 1.012 ms). `gemv_pair_many` puts such programs inside the FP8 kernel's own launch instead, over its K slices.


def pair_tiles(t: gp.Tiles) -> gp.Tiles:
    """The FP8 product's tiles inside the pair kernel: whole-K tiles tuned with split-K (a grid axis the pair's
    one-axis grid does not have) run unsplit there; looped tiles stay as they are (the pair does not apply)."""
    return t if t.mode == "loop" or t.split == 1 else dataclasses.replace(t, split=1)


PAIR_MANY_OP = "gemv_pair_many"


def pair_op(x_shape, w1_shape) -> str:
    """Which pair op a call is for: "gemv_pair_many" for 2+ tokens whose FP8 tiles run on the tensor cores ("loop"
    or "dot": the several-token tiles), "gemv_pair" otherwise (one token; CUDA-core "fma" tiles)."""
    m = _tokens(x_shape)
    if m < 2 or len(w1_shape) != 2 or m > MAX_M:
        return PAIR_OP
    t = tiles_for("fp8", w1_shape[0], x_shape[-1], m)
    return PAIR_MANY_OP if t is not None and t.mode != "fma" else PAIR_OP


def pair_many_applies(x_shape, x_dtype, w1_shape, w2_shape, w2_dtype) -> str | None:
    """None when `gemv_pair_many` (the several-token pair) serves this call, else why not."""
    why = _pair_common(x_shape, x_dtype, w1_shape, w2_shape, w2_dtype)
    if why:
        return why
    m = _tokens(x_shape)
    t = tiles_for("fp8", w1_shape[0], x_shape[-1], m)
    if m < 2 or t.mode == "fma":
        return f"{m} token(s) with CUDA-core tiles {t}: the one-token pair's case ('gemv_pair')"
    if w2_shape[1] != x_shape[-1] or gp.pair_many_side(w2_shape[0], x_shape[-1], t.split) is None:
        return (f"the narrow product {tuple(w2_shape)}: at most {gp.PAIR_SIDE_MAX_N} rows, each K slice "
                f"(K={x_shape[-1]} / split {t.split}) in at most 64 power-of-two chunks")
    return None


def linear_pair(x: jax.Array, w1: jax.Array, scale1: jax.Array, w2: jax.Array, *, impl: str | None = None,
                windows: bool = False, partials: bool = False):
    """(x @ dequant(W1).T, x @ W2.T) for an FP8 W1 [N1, K] (128x128 block scales) and a narrow bf16 W2 [N2, K]:
    at decode shapes one launch; otherwise, and on the "reference" backend, the two products apart, each through
    `linear`'s own dispatch (the current kernels or XLA). One token (op "gemv_pair"): `pallas.gemv_pair`, the FP8
    whole-K kernel's programs, then a few programs for the narrow rows. Several tokens with tensor-core tiles (op
    "gemv_pair_many"): `pallas.gemv_pair_many`, the narrow rows inside the FP8 kernel's own (split-K) grid, both
    products columns of one buffer. With `windows` each product comes as (buffer, start column) (a window of that
    one buffer: no slice between the kernel and the kernels that read the products in place); with `partials` too,
    that buffer may be the kernel's split-K partials not yet summed (`kernel_math.Partials`, where the tiles split
    K), for consumers that sum them where they read them."""
    op = pair_op(x.shape, w1.shape)
    if op == PAIR_MANY_OP:
        why = pair_many_applies(x.shape, x.dtype, w1.shape, w2.shape, w2.dtype)
    else:
        why = pair_applies(x.shape, x.dtype, w1.shape, w2.shape, w2.dtype)
    backend = dispatch.resolve(op, impl, not_applicable=why)
    if backend == "reference":
        ys = linear(x, w1, fmt="fp8", scale=scale1), linear(x, w2, fmt="bf16")
        return tuple((y, 0) for y in ys) if windows else ys
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    interpret = dispatch.interpret_flag(backend)
    if op == PAIR_MANY_OP:
        n1 = w1.shape[0]
        t = tiles_for("fp8", n1, k, x2.shape[0])
        pool = finish_pool() if t.split > 1 else None
        if pool is not None:        # the split sum in the kernel: the product itself, windows of it
            tiles_n = n1 // t.bn + -(-w2.shape[0] // gp.PAIR_MANY_BN2)
            buf = gp.gemv_pair_many(x2, w1, scale1, w2, tiles=t, interpret=interpret, counters=pool.buf,
                                    finish_base=pool.take(tiles_n)).reshape(*lead, -1)
            if windows:
                return (buf, 0), (buf, n1)
            return buf[..., :n1], buf[..., n1:n1 + w2.shape[0]]
        if windows and partials and t.split > 1:
            raw = gp.gemv_pair_many(x2, w1, scale1, w2, tiles=t, interpret=interpret, partials=True)
            buf = kernel_math.Partials(raw, x2.shape[0], lead, x.dtype)
            return (buf, 0), (buf, n1)
        buf = gp.gemv_pair_many(x2, w1, scale1, w2, tiles=t, interpret=interpret).reshape(*lead, -1)
        if windows:
            return (buf, 0), (buf, n1)
        return buf[..., :n1], buf[..., n1:n1 + w2.shape[0]]
    t = pair_tiles(tiles_for("fp8", w1.shape[0], k, x2.shape[0]))
    y1, y2 = gp.gemv_pair(x2, w1, scale1, w2, tiles=t, interpret=interpret)
    ys = y1.reshape(*lead, -1), y2.reshape(*lead, -1)
    return tuple((y, 0) for y in ys) if windows else ys
