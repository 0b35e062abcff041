"""Decode MoE layer benchmark: router matmul + routing + routed experts + combine + sigmoid-gated shared expert,
the fused decode kernels ("fused", op moe_decode, with tile variants "fused:<DecodeTiles fields>") and the
router + weight-major expert kernels ("pallas") against the gather reference ("reference"), M = 1, 5 and 8 tokens,
random and skewed routers, bf16 / FP8 128x128-block / NVFP4 experts at the released shapes (E=512, top-10,
D=2560, I=640).

Floor: bytes = distinct experts touched x bytes per expert (gate_up + down, with their scales) + router [E, D]
+ shared expert (gate, up, down, gate vector) + x. The distinct count is computed on the host from each argument
set's routing (the same arithmetic the jitted layer runs) and averaged over the sets. FLOPs = 2 * M * (K * 3 *
D * I + E * D + 3 * D * I_shared): the routed work per token, not the weight-major kernel's padded rows.

The expert weights are one array per format shared by every set (512 experts are 5 GB in bf16); each set has its
own router, shared expert and tokens, so each set routes to different experts (the skewed router draws each
set's 16 hot experts afresh) and the rotation streams from HBM."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from fnx.pallas.bench import BenchCase, n_sets
from fnx.pallas.moe import api, reference
from fnx.pallas.moe.decode_pallas import DecodeTiles, default_tiles, tiles_override
from fnx.pallas.moe.experts_pallas import Tiles

F32 = jnp.float32
BF16 = jnp.bfloat16


# DecodeTiles fields in order: bn, cw, bn2, cw2, group, num_warps, num_warps2[, acc, e2m1, meta, hoist, tok,
# wround, gsum, tmajor, branch, dot, stages, flat]. Each list holds only the variants not yet measured against the current default
# (`decode_pallas.MEASURED` / `MEASURED_TOKENS`, the "fused" case; `_SWEEP_M5` serves 5 and 8 tokens), the most promising first, so a sweep cut by its
# time limit still reaches them. Each case compiles for about 40 s on the H200. The measured losers are in benchmarks/results/bench_kernels.jsonl:
# - one token, bf16 / FP8: 15 tile sets at b069eb2, fe1911e and 7c11243 (the FP8 winner 4,512,8,128,1,4,2, acc 1,
#   is the default), and the in-kernel combine with hoisted loads / slot metadata (0400fd0);
# - one token, NVFP4: 9 at e055557 and 7c11243 (the fp16-decode winner is the default);
# - five tokens: 5 narrower tile sets with integer e2m1, each 370-470 us against the default's 250-275 us, at
#   00a2dc9 and 2b161d1, two fp16-decode sets at 7c11243, and (bf16) the slot groups, metadata and hoisting at
#   0400fd0 / a616029, all slower than the default.
# - sixteenth session (89aa848 / 03d4ef5): unrounded weights (`wround` 0) won at one token (FP8 64.0 -> 55.4 us,
#   NVFP4 70.8 -> 62.9, and 56.3 with acc 1) and at five NVFP4 tokens (258.4 -> 236.6): the defaults now. With them,
#   NVFP4 at one token: bn 2 (64.2 us; with 2 warps 58.0), 8 warps (60.2), 256-wide loads (59.8), 16 down columns and
#   4 warps (60.4), 2 down columns (66.6), 4 down columns with 64-wide loads (62.1): all slower than the default
#   (54.6-55.9). 4 down columns with one warp gave 46.4 us once and 62.4 us when repeated next to the default: noise.
#   Five tokens: group 5 with hoisted loads 339.8, bn 2 270.6, one-warp 4-column down programs 215.1 / 228.7 (meta
#   0 / 1), against the default's 227.5.
# - seventeenth session (9a1f780): the E2M1 decode in inline PTX (e2m1 "asm") at five tokens 207.0 against 235.9 us
#   (meta 1 with "f16": 217.9), so "asm" is the five-token default (`MEASURED_TOKENS`); at one token 64.0 against
#   59.0 us, so one token keeps "f16".
# - eighteenth session (85747e6): group sums (gsum 1) with the PTX decode at one token 44.5 against 57.2 us for the
#   "f16" default (gsum 1 with "f16": 59.7), so "asm" + gsum is the one-token default; at five tokens gsum 1 with a
#   row reduction per chunk (acc 0) 218.1 and meta 1 with "asm" 203.0, against the default's 202.6.
# - nineteenth session (93f8284): at five tokens acc 1 (each token's partial sums kept as tiles, one row reduction at
#   the end) 183.3, with gsum 1 184.9, with gsum 1 and one-warp down programs 176.5 (the new default), against the
#   old default's 199.7; at one token e2m1 "hfma" 55.8 and "hfmab" 46.2 against "asm"'s 43.3 (all checked ok).
#   The second call repeated the one-token default at 64.7 us (43.3 in the first) and the five-token one at 190.3
#   (176.5): the spread between calls; one-warp down programs at one token 47.2, at five tokens without gsum 179.4,
#   two-warp gate/up programs 180.6 (none beyond that spread).
# - twentieth session (1ddebd7), five tokens, bracketed: tmajor 1 202.3, tmajor 1 with 16-column two-warp down
#   programs 196.2, against the default's 191.2 first and 201.6 at the end (inside the run's spread: tmajor stays 0).
# - twenty-first session (3839bd0), five tokens, bracketed: no per-token branches (branch 0) 295.6, in the down
#   kernel only (2) 240.6, in the gate/up kernel only (3) 245.2, against the default's 186.5 / 190.0: the kernels are
#   bound by their multiply-adds per weight on the CUDA cores.
# - twenty-third session (340c888), NVFP4, bracketed: the products on the tensor cores (dot 1: each owner slot's
#   dequantized tile times the token rows padded to 16; dot 2: the chunks looped, loads 3 deep) lost by 3-40x, all
#   checked ok: five tokens 1,932 us (4-warp programs), 7,582 (8-warp gate/up, 2-warp down), 4,377 (256-wide loads,
#   32-column down), 520 (dot 2) against the default's 187.3; one token 1,707 against 49.7 / 48.5. They stay
#   selectable (`DecodeTiles.dot`) and off; a tile that wide in registers per program is not what these kernels can
#   afford.
# - twenty-fourth session (6abfc64 / 95f10c8), five tokens, bracketed: flat slots (`DecodeTiles.flat`, each (token,
#   k) slot its own token with the one-token NVFP4 tiles) with 2-warp / 1-warp down programs / two slots per down
#   program: NVFP4 121.3 / 111.1 / 119.5 against the default's 182.1, FP8 148.8 / 146.0 / 140.0 against 235.2, bf16
#   171.7 / 168.1 / 177.6 against 280.6 (XLA's gather path 276.3 / 167.2 / 180.1): the several-token defaults now.
# - twenty-eighth session (d14da57), five NVFP4 tokens, bracketed: e2m1 "asmi" (the decode's shifts as integer
#   multiplies) 117.2 us against the default's 125.5 first and 117.6 / 105.9 after: inside the spread.
# Every fused case is checked against the reference layer on its first argument set ("check" in the record: a
# variant that computes something else says "mismatch"). (At five tokens FP8 runs these tiles too: e2m1 means
# nothing there, and dot 1 on FP8 needs 128-column chunks: those cases are refused with the reason.)
SWEEP_ENV = "FNX_MOE_SWEEP"    # "fields;fields;...": variants of each (format, M)'s defaults, e.g. "x2d=1;e2m1=asmq"
_FMT = {"bf16": "dense", "fp8": "fp8_block", "nvfp4": "nvfp4"}


def _env_variants(fmt: str, m: int, d: int, inter: int, inter_s: int) -> list:
    """`FNX_MOE_SWEEP`'s variants of the default tiles for this format and M (an e2m1 field only for NVFP4),
    then the default again (a bracket within the case list: the same program timed after the variants)."""
    specs = [p.strip() for p in os.environ.get(SWEEP_ENV, "").split(";") if p.strip()]
    out = []
    for spec in specs:
        over = tiles_override(spec, SWEEP_ENV)
        if "e2m1" in over and fmt != "nvfp4":
            continue
        out.append(("fused", dataclasses.replace(default_tiles(d, inter, inter_s, _FMT[fmt], m), **over)))
    return out + [("fused", AGAIN)] if out else out


AGAIN = object()    # in a variant's tiles slot: the default tiles timed again, after the variants (the bracket's end)


_SWEEP_M1: list = []
_SWEEP_M5: list = []
_SWEEP_NVFP4: list = []


def layer(x, router, se_gate, se_up, se_down, se_gate_vec, gate_up, down, *, top_k, impl, tiles=None):
    """One decode MoE layer, y [M, D]: the arithmetic of fnx.model.moe.moe_block. impl "fused": the router
    kernel and the two fused decode kernels (op moe_decode, `tiles`) after XLA's router and shared gate / up
    products; "pallas": the router and weight-major expert kernels, combine and shared expert in XLA."""
    lin = lambda a, w: jnp.dot(a, w.T, preferred_element_type=F32).astype(a.dtype)
    logits = lin(x, router)
    if impl == "fused":
        w, idx = api.route(logits, top_k, True, x.dtype, impl="pallas")
        return api.decode(x, w, idx, gate_up, down, lin(x, se_gate), lin(x, se_up), lin(x, se_gate_vec),
                          se_down, impl="pallas", tiles=tiles)
    w, idx = api.route(logits, top_k, True, x.dtype, impl=impl)
    outs = api.experts(gate_up, down, x, idx, impl=impl)
    routed = reference.combine(outs, w)
    s = lin(jax.nn.silu(lin(x, se_gate)) * lin(x, se_up), se_down)
    return routed + jax.nn.sigmoid(lin(x, se_gate_vec)) * s


def _quantize(w, fmt, chunk: int = 32):
    """Quantize [E, ...] experts `chunk` at a time (NVFP4's rounding search has 8x-sized fp32 temporaries)."""
    from fnx.model import quant  # the weight layouts live with the model; only the benchmark builds them here
    if fmt == "bf16":
        return w.astype(BF16)
    fn = jax.jit(quant.quantize_fp8_block if fmt == "fp8" else quant.quantize_nvfp4)
    parts = [fn(w[i:i + chunk]) for i in range(0, w.shape[0], chunk)]
    return jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def _expert_bytes(w) -> int:
    """Bytes of one expert's slice of a (possibly quantized) [E, ...] weight."""
    leaves = jax.tree.leaves(w)
    n_exp = leaves[0].shape[0]
    return sum(int(a.nbytes) // n_exp for a in leaves if a.ndim and a.shape[0] == n_exp)


def cases(quick: bool) -> list[BenchCase]:
    if quick:
        n_exp, top_k, d, inter, inter_s = 16, 4, 256, 128, 128
    else:
        n_exp, top_k, d, inter, inter_s = 512, 10, 2560, 640, 640
    key = jax.random.key(0)
    k_gu, k_dn, key = jax.random.split(key, 3)
    # fp32 masters are 7.5 GB at the released shapes: draw in bf16, quantize one matrix at a time
    gu_master = (jax.random.normal(k_gu, (n_exp, 2 * inter, d), BF16) * 0.02)
    dn_master = (jax.random.normal(k_dn, (n_exp, d, inter), BF16) * 0.03)
    fmts = ("bf16", "fp8", "nvfp4")
    weights = {f: (_quantize(gu_master, f), _quantize(dn_master, f)) for f in fmts}
    del gu_master, dn_master
    out = []
    for m in (1, 5, 8):     # 8: the verify window of k = 7 drafts, the most tokens the decode kernels take
        for router_kind in ("random", "skewed"):
            def make_set(i, m=m, router_kind=router_kind):
                ks = jax.random.split(jax.random.fold_in(key, 1000 * m + i + 500 * (router_kind == "skewed")), 6)
                x = jax.random.normal(ks[0], (m, d), BF16)
                router = jax.random.normal(ks[1], (n_exp, d), BF16) * 0.05
                if router_kind == "skewed":   # 16 hot experts per set: every token picks most of its k among them
                    hot = jax.random.permutation(ks[2], n_exp)[:16]
                    router = router + jnp.zeros((n_exp, d), BF16).at[hot].set(jnp.sum(x, 0) * 0.05)
                sh = lambda k, s: jax.random.normal(k, s, BF16) * 0.02
                return (x, router, sh(ks[3], (inter_s, d)), sh(ks[4], (inter_s, d)), sh(ks[5], (d, inter_s)),
                        sh(ks[2], (1, d)))

            def n_distinct(s_):
                logits = jnp.dot(s_[0], s_[1].T, preferred_element_type=F32).astype(BF16)
                return len(np.unique(np.asarray(reference.route(logits, top_k, True)[1])))

            sets = [make_set(i) for i in range(2)]
            dense = sum(int(a.nbytes) for a in sets[0])
            want = {}
            for fmt in fmts:
                per_expert = _expert_bytes(weights[fmt][0]) + _expert_bytes(weights[fmt][1])
                guess = np.mean([n_distinct(s_) for s_ in sets]) * per_expert + dense
                want[fmt] = 2 if quick else n_sets(int(guess))
            sets += [make_set(i) for i in range(2, max(want.values()))]
            distinct = [n_distinct(s_) for s_ in sets]
            for fmt in fmts:
                gu, dn = weights[fmt]
                per_expert = _expert_bytes(gu) + _expert_bytes(dn)
                mean_distinct = float(np.mean(distinct[:want[fmt]]))
                nbytes = int(mean_distinct * per_expert) + dense
                flops = 2 * m * (top_k * 3 * d * inter + n_exp * d + 3 * d * inter_s)
                # the default first, then the sweep's variants, then the baselines measured in every session
                variants = [("fused", None)]
                if router_kind == "random" and not quick:   # tiles of the fused kernels
                    sweep = _SWEEP_M5 if m > 1 else _SWEEP_NVFP4 if fmt == "nvfp4" else _SWEEP_M1
                    variants += [("fused", DecodeTiles(*t)) for t in sweep]
                    variants += _env_variants(fmt, m, d, inter, inter_s)
                variants += [("reference", None), ("pallas", None)]
                ref_layer = jax.tree_util.Partial(layer, top_k=top_k, impl="reference")   # one check per shape
                for impl, tiles in variants:
                    if tiles is AGAIN:
                        name, tiles = "fused(again)", None
                    else:
                        name = impl if tiles is None else "fused:" + ",".join(map(str, dataclasses.astuple(tiles)))
                    out.append(BenchCase(
                        kernel="moe_decode", shape=f"M={m} E={n_exp} K={top_k} D={d} I={inter} {fmt} {router_kind}",
                        impl=name, fn=jax.tree_util.Partial(layer, top_k=top_k, impl=impl, tiles=tiles),
                        # a tile variant's output against the reference layer's, on the first argument set: a
                        # variant that computes something else is flagged "mismatch", never only timed
                        check=ref_layer if impl == "fused" else None,
                        arg_sets=[s_ + (gu, dn) for s_ in sets[:want[fmt]]],   # one expert array, passed by reference
                        bytes=nbytes, flops=flops,
                        extra={"M": m, "format": fmt, "router": router_kind,
                               "distinct_experts": round(mean_distinct, 1), "bytes_per_expert": per_expert}))
    out += _prefill_cases(quick, weights, key, n_exp, top_k, d, inter)
    return out


# prefill grouped-matmul tiles (tensor-core tiles of the 64-row blocks)
PREFILL_TILES = {"t64": Tiles(block_n=64, block_k=64, block_n2=64, block_k2=64),
                 "t128": Tiles(block_n=128, block_k=64, block_n2=128, block_k2=64, num_warps=8),
                 # the act halves written in place by stage 1 (NVFP4: no XLA copy between the launches); the
                 # gate/up on fp16 tensor cores (`mma16`; FP8 with a whole 128-column block a K step: 366 SASS
                 # instructions a step against 2 x 354, stock sm_90 build); both
                 "t64s": Tiles(block_n=64, block_k=64, block_n2=64, block_k2=64, split_act=1),
                 "t64h": Tiles(block_n=64, block_k=64, block_n2=64, block_k2=64, mma16=1),
                 "t64hs": Tiles(block_n=64, block_k=64, block_n2=64, block_k2=64, mma16=1, split_act=1),
                 "t64hk": Tiles(block_n=64, block_k=128, block_n2=64, block_k2=64, mma16=1),
                 "t128h": Tiles(block_n=128, block_k=128, block_n2=128, block_k2=64, num_warps=8, mma16=1)}
PREFILL_TILE_FORMATS = {"t64s": ("nvfp4",), "t64h": ("nvfp4",), "t64hs": ("nvfp4",), "t64hk": ("nvfp4",),
                        "t128h": ("fp8",)}


def _grouped(x, router, gate_up, down, *, top_k, impl, tiles=None):
    """The routed experts of a prefill chunk, [M, K, D]: XLA's block-sparse grouped matmul ("grouped"), the same
    blocks through the Pallas kernels ("grouped_pallas"), or lax.ragged_dot ("ragged")."""
    from fnx.model import moe as model_moe   # the block sort lives with the model; the benchmark only calls it
    logits = jnp.dot(x, router.T, preferred_element_type=F32).astype(x.dtype)
    idx = reference.route(logits, top_k, True)[1]
    if impl == "ragged":
        return model_moe._expert_ragged(gate_up, down, x, idx)
    return model_moe._expert_grouped(gate_up, down, x, idx, kernel="pallas" if impl == "grouped_pallas" else None,
                                     tiles=tiles)


def _prefill_cases(quick, weights, key, n_exp, top_k, d, inter) -> list[BenchCase]:
    """Prefill chunks of M tokens through the routed experts: TFLOP/s against the bf16 ceiling; bytes = every
    expert's weights (at these M every expert is touched) + the tokens in and out."""
    out = []
    for m in ((64,) if quick else (1024, 4096)):
        sets = []
        for i in range(2):
            ks = jax.random.split(jax.random.fold_in(key, 7000 + 10 * m + i), 2)
            sets.append((jax.random.normal(ks[0], (m, d), BF16), jax.random.normal(ks[1], (n_exp, d), BF16) * 0.05))
        for fmt in ("bf16", "fp8", "nvfp4"):   # nvfp4: the served experts, whose prefill auto leaves on XLA
            gu, dn = weights[fmt]
            nbytes = n_exp * (_expert_bytes(gu) + _expert_bytes(dn)) + 2 * m * d * 2 * (1 + top_k)
            variants = [("grouped", None)] + [("grouped_pallas", t) for t in PREFILL_TILES
                                              if fmt in PREFILL_TILE_FORMATS.get(t, (fmt,))]
            if fmt == "bf16" and m <= 1024:
                variants.append(("ragged", None))
            for impl, tname in variants:
                out.append(BenchCase(
                    kernel="moe_prefill", shape=f"M={m} E={n_exp} K={top_k} D={d} I={inter} {fmt}",
                    impl=impl if tname is None else f"{impl}:{tname}",
                    fn=jax.tree_util.Partial(_grouped, top_k=top_k, impl=impl,
                                             tiles=PREFILL_TILES.get(tname)),
                    arg_sets=[s_ + (gu, dn) for s_ in sets], bytes=nbytes,
                    flops=2 * m * top_k * 3 * d * inter, extra={"M": m, "format": fmt}))
    return out
