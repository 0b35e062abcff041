"""Benchmark cases for `gdn_recurrent` as `fnx.model.gdn` calls it (l2norm + scale inside, bf16 output, the gated
output norm passed along), at the released head shapes (16 key / 48 value heads of 128, fp32 state): decode T = 1
and MTP verify T = 5 (with the T+1 snapshots rollback keeps), B = 1, 8, 32. Implementations: the XLA reference,
the Pallas kernel with default tiles, BV = 32 / 64 with the norm after the kernel (XLA), and the norm fused
(BV = dv, 4 or 8 warps).

Floor (bytes one call must move): state read + write B*HV*dk*dv*4*2, q and k B*T*HK*dk*2*2 (bf16), v B*T*HV*dv*2,
g and beta B*T*HV*4*2, z B*T*HV*dv*2, o B*T*HV*dv*2 (bf16), and with snapshots B*(T+1)*HV*dk*dv*4."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fnx.pallas.bench import BenchCase, n_sets
from fnx.pallas.gdn import api
from fnx.pallas.gdn.pallas import StepTiles, Tiles, default_tiles
from fnx.model.gdn import CHUNK     # the model's prefill chunk

HK, HV, DK, DV = 16, 48, 128, 128


def floor_bytes(bsz: int, length: int, keep_steps: bool, hk=HK, hv=HV, dk=DK, dv=DV) -> int:
    state = bsz * hv * dk * dv * 4
    io = bsz * length * (2 * hk * dk * 2 + hv * dv * 2 + 2 * hv * 4 + 2 * hv * dv * 2) + dv * 2
    return 2 * state + io + (bsz * (length + 1) * hv * dk * dv * 4 if keep_steps else 0)


def flops(bsz: int, length: int, hv=HV, dk=DK, dv=DV) -> int:
    return bsz * length * hv * 7 * dk * dv      # decay 1, k^T S 2, rank-1 update 2, q^T S 2 per state element


def _args(key, bsz, length):
    ks = jax.random.split(key, 8)
    q = jax.random.normal(ks[0], (bsz, length, HK, DK), jnp.bfloat16)
    k = jax.random.normal(ks[1], (bsz, length, HK, DK), jnp.bfloat16)
    v = jax.random.normal(ks[2], (bsz, length, HV, DV), jnp.bfloat16)
    g = -0.5 * jax.nn.softplus(jax.random.normal(ks[3], (bsz, length, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (bsz, length, HV)))
    state = 0.1 * jax.random.normal(ks[5], (bsz, HV, DK, DV), jnp.float32)
    z = jax.random.normal(ks[6], (bsz, length, HV, DV), jnp.bfloat16)
    w = (1.0 + 0.1 * jax.random.normal(ks[7], (DV,))).astype(jnp.bfloat16)
    return q, k, v, g, beta, state, z, w


def _fn(impl, keep, tiles):
    def fn(q, k, v, g, beta, state, z, w):
        return api.gdn_recurrent(q, k, v, g, beta, state, keep_steps=keep, impl=impl, scale=DK ** -0.5,
                                 qk_l2norm=True, steps_with_initial=keep, out_dtype=jnp.bfloat16, tiles=tiles,
                                 norm=(z, w, 1e-6, "sigmoid"))
    return fn


TAPS = 4
CONV = 2 * HK * DK + HV * DV


def step_floor_bytes(bsz: int) -> int:
    """gdn_step: the state read + write, the conv window read + write, the conv weights, qkv, z, o, b, a."""
    return (2 * bsz * HV * DK * DV * 4 + 2 * bsz * (TAPS - 1) * CONV * 2 + CONV * TAPS * 2 + bsz * CONV * 2
            + 2 * bsz * HV * DV * 2 + 2 * bsz * HV * 2)


def _step_fn(impl, tiles):
    def fn(*a):
        return api.gdn_step(*a, impl=impl, key_heads=HK, eps=1e-6, act="sigmoid", tiles=tiles)
    return fn


def step_cases(quick: bool) -> list[BenchCase]:
    """gdn_step (one decode token: conv + gates + recurrence + norm) against the model's XLA ops, B = 1 and 8."""
    out = []
    for bsz in ((1,) if quick else (1, 8)):
        per_set = step_floor_bytes(bsz)
        sets = [_window_args(jax.random.key(i), bsz, 1) for i in range(n_sets(per_set))]
        shape = f"B={bsz} HK={HK} HV={HV} dk={DK} dv={DV} conv={TAPS}"
        tiles = [StepTiles(DV, 8)] if quick else [StepTiles(DV, 4), StepTiles(DV, 8), StepTiles(DV, 16),
                                                   StepTiles(64, 4), StepTiles(32, 4), StepTiles(32, 2)]
        out.append(BenchCase(kernel="gdn_step", shape=shape, impl="reference", fn=_step_fn("reference", None),
                             arg_sets=sets, bytes=per_set, extra={"B": bsz}))
        for t in tiles:
            out.append(BenchCase(kernel="gdn_step", shape=shape, impl="pallas", fn=_step_fn("pallas", t),
                                 arg_sets=sets, bytes=per_set,
                                 extra={"B": bsz, "block_v": t.block_v, "num_warps": t.num_warps}))
    return out


def window_floor_bytes(bsz: int, length: int) -> int:
    """gdn_window: the state read and written, the conv window read and written, xcat written, the conv weights,
    qkv, z and o (bf16), b and a, and the rollback parts k, v (bf16), g and beta (fp32)."""
    hist = TAPS - 1
    return (2 * bsz * HV * DK * DV * 4 + bsz * (2 * hist + hist + length) * CONV * 2 + CONV * TAPS * 2
            + bsz * length * (CONV * 2 + 2 * HV * DV * 2 + 2 * HV * 2 + (HK * DK + HV * DV) * 2 + 2 * HV * 4))


def _window_args(key, bsz, length):
    ks = jax.random.split(key, 10)
    bf = jnp.bfloat16
    n = lambda i, shape, s=1.0: (s * jax.random.normal(ks[i], shape)).astype(bf)  # noqa: E731
    return (n(0, (bsz, length, CONV)), n(1, (bsz, length, HV, DV)), n(2, (bsz, length, HV)),
            n(3, (bsz, length, HV)), n(4, (bsz, TAPS - 1, CONV)), n(5, (CONV, TAPS), 0.5),
            n(6, (HV,), 0.5).astype(jnp.float32), n(7, (HV,)), (1.0 + n(8, (DV,), 0.1)).astype(bf),
            0.1 * jax.random.normal(ks[9], (bsz, HV, DK, DV)), jnp.full((bsz,), length, jnp.int32))


def window_cases(quick: bool) -> list[BenchCase]:
    """gdn_window (a verify window: conv + gates + recurrence + norm, and the rollback parts) against the model's
    XLA ops (`reference.conv_and_gates`, then the recurrence), T = 5 at B = 1 and 8: BV 32 / 64 with the norm after
    the kernel, whole heads (the norm inside) at 4 and 8 warps."""
    from fnx.pallas.gdn.pallas import WindowTiles
    out = []
    length = 5
    for bsz in ((1,) if quick else (1, 8)):
        per_set = window_floor_bytes(bsz, length)
        sets = [_window_args(jax.random.key(i), bsz, length) for i in range(n_sets(per_set))]
        shape = f"B={bsz} T={length} HK={HK} HV={HV} dk={DK} dv={DV} conv={TAPS}"
        fn = lambda impl, t: (lambda *a: api.gdn_window(*a, impl=impl, key_heads=HK, eps=1e-6,  # noqa: E731
                                                        act="sigmoid", tiles=t))
        out.append(BenchCase(kernel="gdn_window", shape=shape, impl="reference", fn=fn("reference", None),
                             arg_sets=sets, bytes=per_set, extra={"B": bsz, "T": length}))
        tiles = [WindowTiles(32, 4)] if quick else [WindowTiles(32, 4), WindowTiles(64, 4), WindowTiles(DV, 4),
                                                    WindowTiles(DV, 8), WindowTiles(16, 4)]
        for t in tiles:
            out.append(BenchCase(kernel="gdn_window", shape=shape, impl="pallas", fn=fn("pallas", t),
                                 arg_sets=sets, bytes=per_set,
                                 extra={"B": bsz, "T": length, "block_v": t.block_v, "num_warps": t.num_warps}))
    return out


def prefill_floor_bytes(bsz: int, tokens: int, hv=HV, dk=DK, dv=DV, c=CHUNK) -> int:
    """The chunk pass's fp32 operands read once (new values, k_cumdecay, q, k, the intra-chunk products, the chunk
    decays), its outputs written once, the state read and written."""
    n = tokens // c
    return bsz * hv * (n * c * (2 * dv + 3 * dk + c) * 4 + n * 4 + 2 * dk * dv * 4)


def chunk_scan_args(key, bsz, h, n, c, dk, dv):
    """Random fp32 operands of `api.gdn_chunk_scan` (N chunks of C tokens, H heads): lower-triangular intra-chunk
    products, chunk decays in (0.3, 1). Shared by the bench and the tests."""
    ks = jax.random.split(key, 7)
    f = lambda i, shape, s=0.1: s * jax.random.normal(ks[i], shape, jnp.float32)  # noqa: E731
    return (f(0, (bsz, h, n, c, dv), 1.0), f(1, (bsz, h, n, c, dk)), f(2, (bsz, h, n, c, dk)),
            jnp.tril(f(3, (bsz, h, n, c, c))), f(4, (bsz, h, n, c, dk)),
            jax.random.uniform(ks[5], (bsz, h, n), minval=0.3, maxval=1.0), f(6, (bsz, h, dk, dv), 1.0))


def prefill_cases(quick: bool) -> list[BenchCase]:
    """The prefill's pass over the chunks (op gdn_prefill): XLA's scan against the one-launch kernel, 1K and 8K
    tokens of one sequence (16 / 128 chunks of 64): tf32x3 products at BV 32 / 64 and 8 warps, tf32, and the
    measured "ieee" products at BV 32."""
    from fnx.pallas.gdn.pallas import ScanTiles
    out = []
    for tokens in ((256,) if quick else (1024, 8192)):
        per_set = prefill_floor_bytes(1, tokens)
        sets = [chunk_scan_args(jax.random.key(i), 1, HV, tokens // CHUNK, CHUNK, DK, DV)
                for i in range(n_sets(per_set))]
        shape = f"B=1 tokens={tokens} HV={HV} dk={DK} dv={DV} chunk={CHUNK}"
        fl = tokens * HV * (6 * DK * DV + 2 * CHUNK * DV)        # 3 [C x dk] x [dk x dv] and 1 [C x C] x [C x dv]
        out.append(BenchCase(kernel="gdn_prefill", shape=shape, impl="reference",
                             fn=lambda *a: api.gdn_chunk_scan(*a, impl="reference"), arg_sets=sets, bytes=per_set,
                             flops=fl, extra={"tokens": tokens}))
        # the tensor-core variants first (never measured), then the measured "ieee" one at BV 32
        variants = ([ScanTiles(block_v=32, precision="tf32x3")] if quick else
                    [ScanTiles(block_v=32, precision="tf32x3"), ScanTiles(block_v=64, precision="tf32x3"),
                     ScanTiles(block_v=16, precision="tf32x3"),     # 384 programs at 48 heads: 2.9 waves of 132 SMs
                     ScanTiles(block_v=32, precision="tf32x3", num_warps=8), ScanTiles(block_v=32, precision="tf32"),
                     ScanTiles(block_v=32)])
        for t in variants:
            out.append(BenchCase(kernel="gdn_prefill", shape=shape,
                                 impl=f"pallas:{t.precision},bv{t.block_v},w{t.num_warps}",
                                 fn=lambda *a, _t=t: api.gdn_chunk_scan(*a, impl="pallas", tiles=_t),
                                 arg_sets=sets, bytes=per_set, flops=fl,
                                 extra={"tokens": tokens, "block_v": t.block_v, "precision": t.precision,
                                        "num_warps": t.num_warps}))
    return out


def chunk_prep_cases(quick: bool) -> list[BenchCase]:
    """The chunked form's per-chunk part (op gdn_chunk_prep) over one prefill chunk of one sequence: XLA's batched
    products (the model's reference, fp32) against the one-launch kernel (its products "tf32x3", the scan's
    default, and "tf32"), q and k per key head (16 of the 48 value heads' 3 each). Bytes: q, k per key head, v,
    g, beta read once; the fp32 outputs written once (the floor of a memory-bound kernel); checked against the
    reference before timing (every output within 1e-4 of its scale, "tf32" products within 1e-2)."""
    out = []
    for tokens in ((128,) if quick else (2048, 512)):
        n = -(-tokens // CHUNK)
        per_set = 4 * tokens * (2 * HK * DK + HV * DV + 2 * HV) + 4 * HV * n * (CHUNK * (DV + 3 * DK + CHUNK) + 1)

        def make(i, _t=tokens):
            ks = jax.random.split(jax.random.key(i), 5)
            q = jax.random.normal(ks[0], (1, _t, HK, DK))
            q = q / jnp.linalg.norm(q, axis=-1, keepdims=True) * DK ** -0.5
            k = jax.random.normal(ks[1], (1, _t, HK, DK))
            k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
            return (q, k, jax.random.normal(ks[2], (1, _t, HV, DV)),
                    -jax.nn.softplus(jax.random.normal(ks[3], (1, _t, HV))),
                    jax.nn.sigmoid(jax.random.normal(ks[4], (1, _t, HV))))
        sets = [make(i) for i in range(n_sets(per_set))]
        shape = f"B=1 tokens={tokens} HK={HK} HV={HV} dk={DK} dv={DV} chunk={CHUNK}"
        ref = lambda *a: api.gdn_chunk_prep(*a, CHUNK, impl="reference", rep=HV // HK)  # noqa: E731
        out.append(BenchCase(kernel="gdn_chunk_prep", shape=shape, impl="reference", fn=ref, arg_sets=sets,
                             bytes=per_set, extra={"tokens": tokens}))
        for precision in ("tf32x3",) if quick else ("tf32x3", "tf32"):
            def fn(*a, _p=precision):
                from fnx.pallas.gdn import pallas as scan_kernel
                from fnx.pallas.gdn import prep
                from fnx.pallas import dispatch
                return prep.chunk_prep(*a, CHUNK, precision=scan_kernel.scan_precision(_p, False), rep=HV // HK,
                                       interpret=dispatch.why_unavailable("pallas") is not None)
            out.append(BenchCase(kernel="gdn_chunk_prep", shape=shape, impl=f"pallas:{precision}", fn=fn,
                                 arg_sets=sets, bytes=per_set, extra={"tokens": tokens, "precision": precision},
                                 check=ref, check_tol=1e-4 if precision == "tf32x3" else 1e-2))
        if quick:
            continue
        # from the conv output (bf16 [1, L, 2 HK dk + HV dv], as the layer's prefill hands it over): XLA's split,
        # l2norm and products, the kernel after XLA's split and l2norm, and the kernel reading it in place
        conv_bytes = 2 * tokens * (2 * HK * DK + HV * DV) + 8 * tokens * HV + 4 * HV * n * (
            CHUNK * (DV + 3 * DK + CHUNK) + 1)

        def make_conv(i, _t=tokens):
            ks = jax.random.split(jax.random.key(i), 3)
            conv = jax.nn.silu(jax.random.normal(ks[0], (1, _t, 2 * HK * DK + HV * DV))).astype(jnp.bfloat16)
            return (conv, -jax.nn.softplus(jax.random.normal(ks[1], (1, _t, HV))),
                    jax.nn.sigmoid(jax.random.normal(ks[2], (1, _t, HV))))
        conv_sets = [make_conv(i) for i in range(n_sets(conv_bytes))]
        kw = dict(key_heads=HK, key_dim=DK, scale=DK ** -0.5)
        conv_ref = lambda *a, _kw=kw: api.gdn_chunk_prep_conv(*a, CHUNK, impl="reference", **_kw)  # noqa: E731
        out.append(BenchCase(kernel="gdn_chunk_prep", shape=shape + " from conv", impl="reference", fn=conv_ref,
                             arg_sets=conv_sets, bytes=conv_bytes, extra={"tokens": tokens, "conv": True}))
        for label, in_place in (("pallas", 0), ("pallas:in_place", 1)):
            def conv_fn(*a, _kw=kw):
                from fnx.pallas import dispatch
                impl = "pallas" if dispatch.why_unavailable("pallas") is None else "pallas_interpret"
                return api.gdn_chunk_prep_conv(*a, CHUNK, impl=impl, **_kw)
            out.append(BenchCase(kernel="gdn_chunk_prep", shape=shape + " from conv", impl=label, fn=conv_fn,
                                 arg_sets=conv_sets, bytes=conv_bytes, check=conv_ref, check_tol=1e-2,
                                 env={"FNX_GDN_PREP_TILES": f"in_place={in_place}"},
                                 extra={"tokens": tokens, "conv": True, "in_place": in_place}))
    return out


def cases(quick: bool) -> list[BenchCase]:
    out = step_cases(quick) + window_cases(quick) + prefill_cases(quick) + chunk_prep_cases(quick)
    batches = (1,) if quick else (1, 8, 32)
    for bsz in batches:
        for length in (1, 5):
            keep = length > 1
            nbytes = floor_bytes(bsz, length, keep)
            per_set = bsz * HV * DK * DV * 4 + bsz * length * (2 * HK * DK + 2 * HV * DV) * 2
            sets = [_args(jax.random.key(i), bsz, length) for i in range(n_sets(per_set))]
            shape = f"B={bsz} T={length} HK={HK} HV={HV} dk={DK} dv={DV}" + (" snapshots" if keep else "")
            variants = [("reference", None)]
            tile_opts = [None] if quick else [None, Tiles(block_v=32), Tiles(block_v=64),
                                              Tiles(block_v=DV, num_warps=4, fuse_norm=True),
                                              Tiles(block_v=DV, num_warps=8, fuse_norm=True)]
            variants += [("pallas", t) for t in tile_opts]
            for impl, tiles in variants:
                t = tiles or default_tiles(bsz, HV, DV, norm=True)
                extra = {"B": bsz, "T": length, "flops": flops(bsz, length)}
                if impl == "pallas":
                    extra.update(block_v=t.block_v, num_warps=t.num_warps, fuse_norm=t.fuse_norm,
                                 tiles="default" if tiles is None else "explicit")
                out.append(BenchCase(kernel="gdn_decode", shape=shape, impl=impl, fn=_fn(impl, keep, tiles),
                                     arg_sets=sets, bytes=nbytes, extra=extra))
    return out
