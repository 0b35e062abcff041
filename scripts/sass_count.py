"""Instructions per kind of the MoE decode kernels' SASS, on a machine without a GPU.

The two Pallas kernels are lowered for CUDA on the CPU (`lowering_platforms=("cuda",)`) at the released shapes, the
Triton IR of each launch is printed as text, and a stock Triton wheel compiles it for sm_90 or `--arch` (its own
`ptxas`; no GPU is needed) in a separate interpreter; `cuobjdump` gives the SASS and the registers. The stock
Triton is not the one XLA embeds, so the counts show the shape of the code (what a change adds or removes), not
the device's bits. Each loop also gets a "pipeline" line read from the stock TTGIR (`pipeline_report`): the plain
loads left in it, its async copies and waits, and whether the next step's copies overlap anything.

Setup once (Triton stays out of the project's environment):
    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install triton==3.5.0
Run:
    python scripts/sass_count.py nvfp4 1                 # the served tiles at one token
    python scripts/sass_count.py nvfp4 5 x2d=1,e2m1=asmq # DecodeTiles fields replaced (`tiles_override` syntax)
    python scripts/sass_count.py fp8 5 mma=bf16 --gemv 16384x2560   # a GEMV: the tiles M runs (`tiles_for`),
                                                         # Tiles fields replaced; a K loop's body counted apart
    python scripts/sass_count.py fp8 5 --gemv 16384x2560 --pair 96   # the several-token pair (gemv_pair_many)
    python scripts/sass_count.py fp8 5 pre=fold,mid=pallas --hc-few  # the few-token HC boundary's kernels
    python scripts/sass_count.py fp8 1 --hc-m1           # the one-token HC boundary's kernels (Tiles1 fields)
    python scripts/sass_count.py fp8 2048 --hc-prefill   # the HC boundary over a prefill chunk (TilesPrefill fields)
    python scripts/sass_count.py fp8 2048 --hc-mix       # its gates and mix alone, column tiles (TilesMix fields)
    python scripts/sass_count.py bf16 2048 --hc-norm     # its combine and norm alone (TilesNorm fields)
    python scripts/sass_count.py fp8 1 programs=264 --hc-one  # the same in one launch (TilesOne fields; at m > 1
                                                         # tokens the few-token one, TilesFewOne fields)
    python scripts/sass_count.py bf16 5 early=1 --gdn-window --arch 120  # built for sm_120 (RTX PRO 6000)
    python scripts/sass_count.py bf16 1 --qsa             # a QSA layer's decode kernels (--route: the router;
                                                         # --ctx 131072: at 128K, the token choice in segments)
    python scripts/sass_count.py nvfp4 64 --moe-blocks    # the prefill grouped MoE kernels, blocks of 64 rows
    python scripts/sass_count.py fp8 2048 precision=tf32 --gdn-prep   # the chunked GDN's per-chunk kernel
    python scripts/sass_count.py fp8 2048 precision=tf32 --gdn-prep --maxnreg 168   # its spills under a cap
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fnx.model import quant  # noqa: E402
from fnx.pallas import triton_ir  # noqa: E402
from fnx.pallas.moe import decode_pallas  # noqa: E402

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
FMT = {"bf16": "dense", "fp8": "fp8_block", "nvfp4": "nvfp4"}
W = quant.abstract_weight

_COMPILE = """
import sys, triton
from triton.backends.compiler import GPUTarget
opts = {"num_warps": int(sys.argv[2]), "num_stages": int(sys.argv[4])}
if len(sys.argv) > 6 and sys.argv[6] != "0":
    opts["maxnreg"] = int(sys.argv[6])
k = triton.compile(sys.argv[1], target=GPUTarget("cuda", int(sys.argv[5]), 32), options=opts)
open(sys.argv[3], "wb").write(k.asm["cubin"])
open(sys.argv[3][:-len(".cubin")] + ".ttgir", "w").write(k.asm["ttgir"])
"""


def triton_kernels(fmt: str, m: int, tiles) -> list[tuple[str, int, int, str]]:
    """(name, num_warps, num_stages, Triton IR text) of each launch of `moe_decode` at the released shapes."""
    n_exp, top_k, d, inter = 512, 10, 2560, 640
    fn = functools.partial(decode_pallas.moe_decode, tiles=tiles)
    return _launches(jax.jit(fn).trace(
        S((m, d), BF16), S((m, top_k), BF16), S((m, top_k), jnp.int32), W((n_exp, 2 * inter, d), fmt),
        W((n_exp, d, inter), fmt), S((m, inter), BF16), S((m, inter), BF16), S((m, 1), BF16),
        W((d, inter), fmt)).lower(lowering_platforms=("cuda",)))


def gemv_kernels(fmt: str, m: int, n: int, k: int, tiles) -> list[tuple[str, int, int, str]]:
    """The same for `fnx.pallas.gemv.pallas.gemv` on a [N, K] weight of `fmt` (raw arrays) at M tokens."""
    from fnx.pallas.gemv import pallas as gp
    raw = {"bf16": [S((n, k), BF16)],
           "fp8": [S((n, k), jnp.float8_e4m3fn), S((-(-n // 128), -(-k // 128)), jnp.float32)],
           "nvfp4": [S((n, k // 2), jnp.uint8), S((n, k // 16), jnp.float8_e4m3fn), S((n,), jnp.float32)]}[fmt]
    fn = functools.partial(gp.gemv, fmt=fmt, tiles=tiles)
    return _launches(jax.jit(fn).trace(S((m, k), BF16), *raw).lower(lowering_platforms=("cuda",)))


def pair_kernels(m: int, n1: int, n2: int, k: int, tiles) -> list[tuple[str, int, int, str]]:
    """The same for `fnx.pallas.gemv.pallas.gemv_pair_many` (an FP8 [N1, K] product and a bf16 [N2, K] one)."""
    from fnx.pallas.gemv import pallas as gp
    raw = [S((n1, k), jnp.float8_e4m3fn), S((-(-n1 // 128), -(-k // 128)), jnp.float32), S((n2, k), BF16)]
    fn = functools.partial(gp.gemv_pair_many, tiles=tiles)
    return _launches(jax.jit(fn).trace(S((m, k), BF16), *raw).lower(lowering_platforms=("cuda",)))


def hc_few_kernels(fmt: str, m: int, tiles) -> list[tuple[str, int, int, str]]:
    """The same for `fnx.pallas.hc.few.hc_boundary_few` (the few-token HC boundary: S = 4, D = 2560, r = 320), with
    FP8 Wdown / Wup (fmt "fp8") or bf16 ones."""
    from fnx.pallas.hc import few
    fn = lambda *a: few.hc_boundary_few(*a[:7], streams=4, eps=1e-6, w_down_scale=a[7], w_up_scale=a[8],  # noqa
                                        tiles=tiles)
    return _launches(jax.jit(fn).trace(*_hc_args(fmt, m)).lower(lowering_platforms=("cuda",)))


def _hc_args(fmt: str, m: int) -> list:
    """An HC boundary's operands at the released widths (S = 4, D = 2560, r = 320) for m tokens: H, y, inj_prev,
    hc_norm, Wdown, Wup, Winj, and FP8 Wdown / Wup's block scales (None for bf16)."""
    sd, d, r = 10240, 2560, 320
    acts = [S((1, m, sd), BF16), S((1, m, d), BF16), S((1, m, 4), BF16), S((sd,), BF16)]
    if fmt == "fp8":
        return acts + [S((r, sd), jnp.float8_e4m3fn), S((sd, r), jnp.float8_e4m3fn), S((4, sd), BF16),
                       S((3, 80), jnp.float32), S((80, 3), jnp.float32)]
    return acts + [S((r, sd), BF16), S((sd, r), BF16), S((4, sd), BF16), None, None]


def hc_prefill_kernels(fmt: str, m: int, tiles) -> list[tuple[str, int, int, str]]:
    """The same for `fnx.pallas.hc.prefill.hc_boundary_prefill` (the HC boundary over an m-token prefill chunk)."""
    from fnx.pallas.hc import prefill
    fn = lambda *a: prefill.hc_boundary_prefill(*a[:7], streams=4, eps=1e-6, w_down_scale=a[7],  # noqa: E731
                                                w_up_scale=a[8], tiles=tiles)
    return _launches(jax.jit(fn).trace(*_hc_args(fmt, m)).lower(lowering_platforms=("cuda",)))


def hc_mix_kernels(fmt: str, m: int, tiles) -> list[tuple[str, int, int, str]]:
    """The same for `fnx.pallas.hc.prefill.hc_mix_prefill` (the gates and the mix over an m-token prefill chunk)."""
    from fnx.pallas.hc import prefill
    sd, r = 10240, 320
    wu = S((sd, r), jnp.float8_e4m3fn if fmt == "fp8" else BF16)
    sc = S((80, 3), jnp.float32) if fmt == "fp8" else None
    fn = lambda u, hn, w, s: prefill.hc_mix_prefill(u, hn, w, streams=4, w_up_scale=s, tiles=tiles)  # noqa: E731
    return _launches(jax.jit(fn).trace(S((1, m, r), BF16), S((1, m, sd), BF16), wu, sc).lower(
        lowering_platforms=("cuda",)))


def hc_norm_kernels(m: int, tiles) -> list[tuple[str, int, int, str]]:
    """The same for `fnx.pallas.hc.prefill.hc_norm_prefill` (the combine and the norm over an m-token chunk)."""
    from fnx.pallas.hc import prefill
    fn = lambda h, y, i, w: prefill.hc_norm_prefill(h, y, i, w, streams=4, eps=1e-6, tiles=tiles)  # noqa: E731
    return _launches(jax.jit(fn).trace(S((1, m, 10240), BF16), S((1, m, 2560), BF16), S((1, m, 4), BF16),
                                       S((10240,), BF16)).lower(lowering_platforms=("cuda",)))


def hc_m1_kernels(fmt: str, tiles) -> list[tuple[str, int, int, str]]:
    """The same for `fnx.pallas.hc.pallas.hc_boundary_m1` (the one-token HC boundary, S = 4, D = 2560, r = 320)."""
    from fnx.pallas.hc import pallas as hp
    fn = lambda *a: hp.hc_boundary_m1(*a[:7], streams=4, eps=1e-6, w_down_scale=a[7], w_up_scale=a[8],  # noqa
                                      tiles=tiles)
    return _launches(jax.jit(fn).trace(*_hc_args(fmt, 1)).lower(lowering_platforms=("cuda",)))


def hc_one_kernels(fmt: str, tiles, m: int = 1) -> list[tuple[str, int, int, str]]:
    """The same for `fnx.pallas.hc.one.hc_boundary_one` (the one-token HC boundary in one launch, its grid barrier's
    counter an argument; TilesOne `tiles`, the served Tiles1), or at m > 1 tokens `hc_boundary_one_few`
    (TilesFewOne `tiles`)."""
    from fnx.pallas.hc import one
    run = one.hc_boundary_one if m == 1 else one.hc_boundary_one_few
    fn = lambda *a: run(*a[:7], streams=4, eps=1e-6, w_down_scale=a[7], w_up_scale=a[8],  # noqa: E731
                        tiles=tiles, sync=a[9])
    args = _hc_args(fmt, m) + [S((1,), jnp.int32)]
    return _launches(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)))


def gdn_step_kernels(tiles) -> list[tuple[str, int, int, str]]:
    """The same for `fnx.pallas.gdn.pallas.gdn_step` (one token, B = 1; 16 key heads, 48 value heads of 128; conv
    width 4)."""
    from fnx.pallas.gdn import pallas as gk
    fn = lambda *a: gk.gdn_step(*a, key_heads=16, eps=1e-6, act="silu", tiles=tiles, inplace=True)  # noqa: E731
    return _launches(jax.jit(fn).trace(*_gdn_args(1)).lower(lowering_platforms=("cuda",)))


def _gdn_args(length: int) -> list:
    """A GDN core's operands at the released widths, B = 1: qkv, z, b, a, conv state and weights, A_log, dt_bias,
    the norm's weight, the state, n_valid."""
    hk, hv, dk, dv, taps = 16, 48, 128, 128, 4
    cd = 2 * hk * dk + hv * dv
    f32 = jnp.float32
    return [S((1, length, cd), BF16), S((1, length, hv * dv), BF16), S((1, length, hv), BF16),
            S((1, length, hv), BF16), S((1, taps - 1, cd), BF16), S((cd, taps), BF16), S((hv,), f32), S((hv,), f32),
            S((dv,), BF16), S((1, hv, dk, dv), f32), S((1,), jnp.int32)]


def gdn_window_kernels(tiles, length: int = 5) -> list[tuple[str, int, int, str]]:
    """The same for `fnx.pallas.gdn.pallas.gdn_window` (the verify window: B = 1, `length` tokens; the released GDN
    widths)."""
    from fnx.pallas.gdn import pallas as gk
    fn = lambda *a: gk.gdn_window(*a, key_heads=16, eps=1e-6, act="silu", tiles=tiles)  # noqa: E731
    return _launches(jax.jit(fn).trace(*_gdn_args(length)).lower(lowering_platforms=("cuda",)))


def qsa_kernels(m: int, ctx: int = 8192) -> list[tuple[str, int, int, str]]:
    """The same for a QSA layer's decode kernels at m tokens and `ctx` context: the prep (norms, RoPE, cache
    writes), the indexer's block top-k and its one-launch token choice (`qsa_select`, which replaces the top-k and
    XLA's scores where it runs), the sparse attention over the selection (2,048 + 3 slots) with its gated
    combine (24 q heads, 2 KV heads of 256)."""
    from fnx.pallas.qsa import bench as qb
    from fnx.pallas.qsa import pallas as qk
    hkv, hd, di, cr = qb.HKV, qb.HD, qb.DI, qb.CR
    st = {"k": S((1, hkv, ctx, hd), BF16), "v": S((1, hkv, ctx, hd), BF16),
          "idx_blocks": S((1, ctx // cr, di), BF16), "idx_ring": S((1, cr, di), BF16)}
    prep_args = (S((1, m, sum(qb.PREP_SIZES)), BF16), tuple(S((n,), BF16) for n in (di, di, hd, hd)), st,
                 S((1,), jnp.int32))
    out = _launches(jax.jit(lambda *a: qb.prep_call(*a, "pallas")).trace(*prep_args).lower(
        lowering_platforms=("cuda",)))
    nb = ctx // 4 + 74          # the compressed blocks plus the tail (2,122 at 8K, as the served model's)
    out += _launches(jax.jit(lambda sc: qk.qsa_block_topk(sc, 512)).trace(S((m, nb), jnp.float32)).lower(
        lowering_platforms=("cuda",)))
    from fnx.pallas.qsa import select
    sel_args = (S((1, m, 4, di), BF16), S((1, nb, di), BF16), S((1, m), jnp.int32))
    out += _launches(jax.jit(lambda q, b, p: select.qsa_select(q, b, p, ctx, cr, 512)).trace(*sel_args).lower(
        lowering_platforms=("cuda",)))
    sds = [S((1, m, 24, 256), BF16), S((1, 2, ctx, 256), BF16), S((1, 2, ctx, 256), BF16), S((1, m, 2051), jnp.int32),
           S((m, 24 * 512 + 2 * 256 * 2 + 4 * 128 + 128), BF16)]
    fn = lambda q, k, v, i, g: qk.qsa_decode_attention(q, k, v, i, gate=(g, 640), fused_combine=True)  # noqa: E731
    return out + _launches(jax.jit(fn).trace(*sds).lower(lowering_platforms=("cuda",)))


def qsa_prefill_kernels(tiles, m: int, ctx: int = 8192) -> list[tuple[str, int, int, str]]:
    """The same for the QSA prefill attention (op "qsa_prefill_attention") over an m-token chunk at `ctx`."""
    from fnx.pallas.qsa import prefill
    sds = [S((1, m, 2, 12, 256), BF16), S((1, 2, ctx, 256), BF16), S((1, 2, ctx, 256), BF16),
           S((1, m, ctx), jnp.bool_), S((1, m), jnp.int32)]
    fn = lambda *a: prefill.qsa_prefill_attention(*a, tiles=tiles)  # noqa: E731
    return _launches(jax.jit(fn).trace(*sds).lower(lowering_platforms=("cuda",)))


def moe_blocks_kernels(fmt: str, b: int, tiles, n_blocks: int = 832, gather: bool = False
                       ) -> list[tuple[str, int, int, str]]:
    """The same for the prefill grouped matmul's blocks (`experts_pallas.experts_blocks`, op "moe_grouped"):
    n_blocks blocks of b rows at the released expert shapes; with `gather` the blocks' rows read by index from
    2,048 token rows (`row_of`: the model's default, `FNX_MOE_KERNEL_GATHER`)."""
    from fnx.pallas.moe import experts_pallas
    n_exp, d, inter = 512, 2560, 640
    args = [S((n_blocks,), jnp.int32), W((n_exp, 2 * inter, d), fmt), W((n_exp, d, inter), fmt)]
    if gather:
        fn = lambda x, e, gu, dn, ro: experts_pallas.experts_blocks(  # noqa: E731
            gu, dn, x, e, tiles=tiles, row_of=ro)
        args = [S((2048, d), BF16), *args, S((n_blocks, b), jnp.int32)]
    else:
        fn = lambda xb, e, gu, dn: experts_pallas.experts_blocks(gu, dn, xb, e, tiles=tiles)  # noqa: E731
        args = [S((n_blocks, b, d), BF16), *args]
    return _launches(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)))


def gdn_prep_kernels(m: int, precision: str, tiles) -> list[tuple[str, int, int, str]]:
    """The same for the chunked GDN's per-chunk kernel (op "gdn_chunk_prep") over an m-token chunk at the released
    shapes (48 value heads over 16 key heads of 128, chunks of 64), its products at `precision`, `tiles` a PrepTiles."""
    from fnx.pallas.gdn import pallas as gk
    from fnx.pallas.gdn import prep
    f32 = jnp.float32
    if tiles.in_place:      # q, k, v read from the conv output [1, m, 2 x 16 x 128 + 48 x 128] bf16
        conv = prep.ConvInput(key_heads=16, key_dim=128, scale=128 ** -0.5, eps=1e-6)
        fn = lambda c, g, b: prep.chunk_prep(c, None, None, g, b, 64, tiles=tiles, rep=3, conv=conv,  # noqa: E731
                                             precision=gk.scan_precision(precision, False))
        return _launches(jax.jit(fn).trace(S((1, m, 10240), BF16), S((1, m, 48), f32), S((1, m, 48), f32)).lower(
            lowering_platforms=("cuda",)))
    fn = lambda *a: prep.chunk_prep(*a, 64, precision=gk.scan_precision(precision, False),  # noqa: E731
                                    tiles=tiles, rep=3)
    return _launches(jax.jit(fn).trace(S((1, m, 16, 128), f32), S((1, m, 16, 128), f32), S((1, m, 48, 128), f32),
                                       S((1, m, 48), f32), S((1, m, 48), f32)).lower(lowering_platforms=("cuda",)))


def dequant_kernels(n: int, k: int) -> list[tuple[str, int, int, str]]:
    """The same for the FP8 block dequantization kernel (op "dequant_fp8") of an [n, k] weight."""
    from fnx.pallas.gemv import dequant
    fn = lambda w, s: dequant.dequantize_fp8(w, s, (128, 128), BF16)  # noqa: E731
    return _launches(jax.jit(fn).trace(S((n, k), jnp.float8_e4m3fn), S((-(-n // 128), -(-k // 128)), jnp.float32))
                     .lower(lowering_platforms=("cuda",)))


def route_kernels(m: int) -> list[tuple[str, int, int, str]]:
    """The same for the MoE router (512 experts, top 10, renormalized) at m tokens, with the warps api.route reads
    (FNX_MOE_ROUTE_WARPS)."""
    from fnx.pallas.moe import routing_pallas
    fn = lambda lg: routing_pallas.route(lg, 10, True, BF16, num_warps=routing_pallas.default_warps())  # noqa: E731
    return _launches(jax.jit(fn).trace(S((m, 512), BF16)).lower(lowering_platforms=("cuda",)))


_launches = triton_ir.launches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("fmt", choices=sorted(FMT))
    ap.add_argument("m", type=int)
    ap.add_argument("fields", nargs="?", default="", help="DecodeTiles (or with --gemv, Tiles) fields to replace: "
                                                           "name=value,...")
    ap.add_argument("--gemv", default=None, metavar="NxK", help="count a GEMV kernel of this weight shape instead")
    ap.add_argument("--pair", default=None, type=int, metavar="N2",
                    help="with --gemv (fp8): the several-token pair with a bf16 product of N2 rows instead")
    ap.add_argument("--hc-few", action="store_true",
                    help="count the few-token HC boundary's kernels (fields: TilesFew's, e.g. pre=fold,mid=pallas)")
    ap.add_argument("--hc-prefill", action="store_true",
                    help="count the HC boundary's prefill kernels over m tokens (TilesPrefill fields)")
    ap.add_argument("--hc-mix", action="store_true",
                    help="count the HC gates-and-mix kernel over m prefill tokens (TilesMix fields)")
    ap.add_argument("--hc-norm", action="store_true",
                    help="count the HC combine + norm kernel over m prefill tokens (TilesNorm fields)")
    ap.add_argument("--hc-m1", action="store_true",
                    help="count the one-token HC boundary's kernels (fields: Tiles1's, e.g. bd=4; m is ignored)")
    ap.add_argument("--hc-one", action="store_true",
                    help="count the HC boundary in one launch (fields: TilesOne's, e.g. programs=264; at m > 1 tokens "
                         "the few-token one's, TilesFewOne)")
    ap.add_argument("--gdn-step", action="store_true",
                    help="count the one-token GDN kernel (fields: StepTiles', e.g. block_v=32; m and fmt ignored)")
    ap.add_argument("--gdn-window", action="store_true",
                    help="count the verify window's GDN kernel at m tokens (fields: WindowTiles', e.g. early=1)")
    ap.add_argument("--arch", type=int, default=90, help="the SM version to build for: 90 (H200), 120 (RTX PRO 6000)")
    ap.add_argument("--qsa", action="store_true", help="count a QSA layer's decode kernels at m tokens, 8K context "
                    "(fields: the combine's CombineTiles', e.g. bd=8,early=1)")
    ap.add_argument("--ctx", type=int, default=8192, help="with --qsa: the context (past 65,536 the token choice "
                    "runs in segments, qsa_select_long)")
    ap.add_argument("--route", action="store_true", help="count the MoE router kernel at m tokens")
    ap.add_argument("--dequant", default=None, metavar="NxK", help="count the FP8 block dequantization kernel of "
                    "an NxK weight (fmt and m ignored)")
    ap.add_argument("--qsa-prefill", action="store_true", help="count the QSA prefill attention over an m-token "
                    "chunk at 8K context (fields: PrefillTiles', e.g. bk=32)")
    ap.add_argument("--moe-blocks", action="store_true", help="count the prefill grouped MoE kernels over blocks of "
                    "m rows (fields: experts_pallas.Tiles', e.g. block_n=128)")
    ap.add_argument("--gather", action="store_true", help="with --moe-blocks: the blocks' rows read by index from "
                    "the token rows (the model's default)")
    ap.add_argument("--gdn-prep", action="store_true", help="count the chunked GDN's per-chunk kernel over an m-token "
                    "chunk (fields: precision=tf32|tf32x3|ieee and PrepTiles', e.g. in_place=1,loop=1)")
    ap.add_argument("--maxnreg", type=int, default=0, help="cap the registers a thread (the stock Triton's maxnreg "
                    "option; 0: ptxas chooses): what fewer registers would cost in spills")
    ap.add_argument("--python", default="/tmp/tvenv/bin/python", help="an interpreter with the triton wheel")
    ap.add_argument("--dump", default=None, help="a folder: each kernel's SASS, Triton IR and "
                    "stock TTGIR (its layouts) written there as <name>.sass / .ttir / .ttgir")
    args = ap.parse_args()
    if args.qsa or args.route:
        tiles = "(the served defaults)"
        if args.qsa and args.fields:        # the combine reads its knob when traced
            from fnx.pallas.qsa import pallas as qk
            os.environ[qk.COMBINE_TILES_ENV] = args.fields
            tiles = str(qk.combine_tiles())
        launches = qsa_kernels(args.m, args.ctx) if args.qsa else route_kernels(args.m)
    elif args.gdn_prep:
        from fnx.pallas import dispatch
        from fnx.pallas.gdn import pallas as gk
        from fnx.pallas.gdn import prep
        kv = dict(item.split("=", 1) for item in args.fields.split(",") if item)
        precision = kv.pop("precision", gk.ScanTiles().precision)
        tiles = dataclasses.replace(prep.PrepTiles(), **dispatch.fields_override(
            ",".join(f"{k}={v}" for k, v in kv.items()), prep.PrepTiles, "--gdn-prep fields (and precision)"))
        launches = gdn_prep_kernels(args.m, precision, tiles)
        tiles = {"precision": precision, **dataclasses.asdict(tiles)}
    elif args.dequant:
        from fnx.pallas.gemv import dequant
        n, k = (int(v) for v in args.dequant.lower().split("x"))
        tiles = dequant.choose_tiles(n, k)
        launches = dequant_kernels(n, k)
    elif args.moe_blocks:
        from fnx.model import quant as q
        from fnx.pallas import dispatch
        from fnx.pallas.moe import experts_pallas as ep
        tiles = ep.default_tiles(2560, 640, ep.block_tiles(q.abstract_weight((512, 1280, 2560), args.fmt)))
        if args.fields:
            tiles = dataclasses.replace(tiles, **dispatch.fields_override(args.fields, ep.Tiles, "fields"))
        launches = moe_blocks_kernels(args.fmt, args.m, tiles, gather=args.gather)
    elif args.qsa_prefill:
        from fnx.pallas import dispatch
        from fnx.pallas.qsa import prefill
        tiles = prefill.PrefillTiles()
        if args.fields:
            tiles = dataclasses.replace(tiles, **dispatch.fields_override(args.fields, prefill.PrefillTiles, "fields"))
        launches = qsa_prefill_kernels(tiles, args.m)
    elif args.gdn_window:
        from fnx.pallas import dispatch
        from fnx.pallas.gdn import pallas as gk
        tiles = gk.default_window_tiles(128)
        if args.fields:
            tiles = dataclasses.replace(tiles, **dispatch.fields_override(args.fields, gk.WindowTiles, "fields"))
        launches = gdn_window_kernels(tiles, args.m)
    elif args.gdn_step:
        from fnx.pallas import dispatch
        from fnx.pallas.gdn import pallas as gk
        tiles = gk.default_step_tiles(1, 48, 128)
        if args.fields:
            tiles = dataclasses.replace(tiles, **dispatch.fields_override(args.fields, gk.StepTiles, "fields"))
        launches = gdn_step_kernels(tiles)
    elif args.hc_m1:
        from fnx.pallas import dispatch
        from fnx.pallas.hc import pallas as hp
        tiles = hp.choose_tiles1(4, 2560, 320)
        if args.fields:
            tiles = dataclasses.replace(tiles, **dispatch.fields_override(args.fields, hp.Tiles1, "fields",
                                                                         ("tokens",)))
        launches = hc_m1_kernels(args.fmt, tiles)
    elif args.hc_one:
        from fnx.pallas import dispatch
        from fnx.pallas.hc import one
        cls = one.TilesOne if args.m == 1 else one.TilesFewOne
        tiles = cls(programs=264)
        if args.fields:
            tiles = dataclasses.replace(tiles, **dispatch.fields_override(args.fields, cls, "fields"))
        launches = hc_one_kernels(args.fmt, tiles, args.m)
    elif args.hc_prefill:
        from fnx.pallas import dispatch
        from fnx.pallas.hc import prefill
        tiles = prefill.default_tiles(2560, args.m)
        if args.fields:
            tiles = dataclasses.replace(tiles, **dispatch.fields_override(args.fields, prefill.TilesPrefill,
                                                                         "fields"))
        launches = hc_prefill_kernels(args.fmt, args.m, tiles)
    elif args.hc_mix:
        from fnx.pallas import dispatch
        from fnx.pallas.hc import prefill
        tiles = prefill.mix_tiles(2560, args.m)
        if args.fields:
            tiles = dataclasses.replace(tiles, **dispatch.fields_override(args.fields, prefill.TilesMix, "fields"))
        launches = hc_mix_kernels(args.fmt, args.m, tiles)
    elif args.hc_norm:
        from fnx.pallas import dispatch
        from fnx.pallas.hc import prefill
        tiles = prefill.norm_tiles(2560)
        if args.fields:
            tiles = dataclasses.replace(tiles, **dispatch.fields_override(args.fields, prefill.TilesNorm, "fields"))
        launches = hc_norm_kernels(args.m, tiles)
    elif args.hc_few:
        from fnx.pallas.hc import few
        tiles = dataclasses.replace(few.TilesFew(), **few.tiles_override(args.fields)) if args.fields else \
            few.TilesFew()
        launches = hc_few_kernels(args.fmt, args.m, tiles)
    elif args.gemv:
        from fnx.pallas import dispatch
        from fnx.pallas.gemv import api
        from fnx.pallas.gemv import pallas as gp
        n, k = (int(v) for v in args.gemv.lower().split("x"))
        tiles = api.tiles_for(args.fmt, n, k, args.m)
        if tiles is None:
            raise SystemExit(f"no GEMV tiles for {args.fmt} N={n} K={k}")
        if args.fields:
            tiles = dataclasses.replace(tiles, **dispatch.fields_override(args.fields, gp.Tiles, "fields",
                                                                         ("dec", "mode", "mma")))
        launches = (gemv_kernels(args.fmt, args.m, n, k, tiles) if args.pair is None
                    else pair_kernels(args.m, n, args.pair, k, tiles))
    else:
        tiles = decode_pallas.default_tiles(2560, 640, 640, FMT[args.fmt], args.m)
        tiles = dataclasses.replace(tiles, **decode_pallas.tiles_override(args.fields, "fields"))
        launches = triton_kernels(args.fmt, args.m, tiles)
    bin_dir = subprocess.run([args.python, "-c", "import os, triton; print(os.path.join(os.path.dirname("
                              "triton.__file__), 'backends', 'nvidia', 'bin'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    print(tiles)
    with tempfile.TemporaryDirectory() as tmp:
        for name, warps, stages, text in launches:
            src, cubin = os.path.join(tmp, f"{name}.ttir"), os.path.join(tmp, f"{name}.cubin")
            with open(src, "w") as f:
                f.write(text)
            subprocess.run([args.python, "-c", _COMPILE, src, str(warps), cubin, str(stages), str(args.arch),
                            str(args.maxnreg)], check=True)
            sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True,
                                  text=True, check=True).stdout
            res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                                 text=True, check=True).stdout
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                with open(os.path.join(args.dump, f"{name}.sass"), "w") as f:
                    f.write(sass)
                shutil.copy(src, os.path.join(args.dump, f"{name}.ttir"))
                shutil.copy(cubin[:-len(".cubin")] + ".ttgir", os.path.join(args.dump, f"{name}.ttgir"))
            ops = opcodes(sass)
            regs = re.search(r"REG:(\d+)", res)
            kinds = ", ".join(f"{k} {n}" for k, n in collections.Counter(ops).most_common(12))
            print(f"{name}: {len(ops)} instructions, {regs.group(1) if regs else '?'} registers, {warps} warps; "
                  f"{kinds}")
            late, loads, spills = load_order(ops)
            print(f"  global loads after the first barrier: {late} of {loads}; spills: {spills}; load groups: "
                  f"{load_groups(ops)}")
            for start, end, body in loop_bodies(sass):
                kinds = ", ".join(f"{k} {n}" for k, n in collections.Counter(body).most_common(12))
                print(f"  loop /*{start:04x}*/-/*{end:04x}*/: {len(body)} instructions per trip; {kinds}")
            with open(cubin[:-len(".cubin")] + ".ttgir") as f:
                for line in pipeline_report(f.read()):
                    print(line)


def pipeline_report(ttgir: str) -> list[str]:
    """What the stock Triton's software pipeliner made of each `scf.for` loop of a kernel, from its TTGIR: the plain
    `tt.load`s left inside the loop (too small for cp.async, or address-dependent: each is a memory round trip the
    step waits on unless its value is only used a step later; those placed before the loop's first `async_wait`
    are issued at the step's top), the async copies and the `async_wait`s' `num`
    (how many copy groups stay in flight), and whether the copies for the next step are issued only after the
    step's first product. Copies issued after the product and every wait at num 0 means no overlap: the next step
    waits for its copies at once (the QSA decode and prefill attention at 2 stages, 2026-12-07). One line a loop."""
    lines = ttgir.splitlines()
    out = []
    for at, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        end = next((j for j in range(at + 1, len(lines)) if lines[j].startswith(" " * indent + "}")
                    and len(lines[j]) - len(lines[j].lstrip()) == indent), len(lines))
        body = lines[at + 1:end]
        plain = [j for j, ln in enumerate(body) if "tt.load " in ln]
        first_wait = next((j for j, ln in enumerate(body) if "async_wait" in ln), len(body))
        copies = [j for j, ln in enumerate(body) if "async_copy_global_to_local" in ln]
        waits = [int(m) for ln in body for m in re.findall(r"async_wait.*\{num = (\d+) : i32\}", ln)]
        dots = [j for j, ln in enumerate(body) if re.search(r"\btt\.dot\b|ttng\.warp_group_dot\b", ln)]
        late = bool(copies and dots and min(copies) > min(dots))
        if not copies:
            verdict = "no async copies (the loop's loads are plain)"
        elif late and all(w == 0 for w in waits):
            verdict = "NO OVERLAP: the next step's copies go out after its product and are waited on at once"
        else:
            verdict = "copies in flight across steps"
        out.append(f"  pipeline (TTGIR line {at + 1}): {len(plain)} plain loads in the loop "
                   f"({sum(1 for j in plain if j < first_wait)} before its first wait), {len(copies)} async copies, "
                   f"waits num {sorted(set(waits)) or '-'}; {verdict}")
    return out


def load_order(ops: list[str]) -> tuple[int, int, int]:
    """(global loads issued after the first CTA barrier, global loads, local spill loads and stores) of a kernel's
    opcodes in order. A load after a barrier waits for the arithmetic before it: a memory round trip on the
    program's critical path that the loads issued first would have overlapped."""
    first = ops.index("BAR") if "BAR" in ops else len(ops)
    return (sum(1 for op in ops[first:] if op == "LDG"), ops.count("LDG"),
            sum(1 for op in ops if op in ("LDL", "STL")))


def load_groups(ops: list[str]) -> int:
    """Runs of global loads that a barrier or a global store separates, over the whole listing (every branch of a
    kernel with several): a load after a store or barrier is issued only once the work before it is, so each run
    is up to one memory round trip in a row on a program's path. (A kernel whose programs take different branches
    adds its branches' runs: read it against the same kernel's other settings. A lower bound: a load that ptxas
    places after arithmetic waiting on an earlier load's data is also issued only when that data arrives, and
    counts in the same run; the MoE one-token gate/up kernel with x2d 1 shows one group so.)"""
    groups, open_run = 0, False
    for op in ops:
        if op == "LDG" and not open_run:
            groups, open_run = groups + 1, True
        elif op in ("BAR", "STG"):
            open_run = False
    return groups


def opcodes(sass: str) -> list[str]:
    """Each instruction's opcode in a cuobjdump SASS listing, in order (addresses of 4 hex digits or more: a kernel
    past 64 KB of code has 5-digit ones)."""
    return re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M)


def loop_bodies(sass: str) -> list[tuple[int, int, list[str]]]:
    """(first, last address, opcodes) of each backward branch's body in a cuobjdump SASS listing: a loop's
    instructions per trip (the static count of a kernel with a loop is not what it executes)."""
    ins = [(int(a, 16), op) for a, op in
           re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M)]
    out = []
    for addr, target in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?(?:\.L_x_\d+|0x)?"
                                   r"([0-9a-f]+)", sass, re.M):
        a, t = int(addr, 16), int(target, 16)
        if t < a:
            out.append((t, a, [op for x, op in ins if t <= x <= a]))
    return out


if __name__ == "__main__":
    main()
