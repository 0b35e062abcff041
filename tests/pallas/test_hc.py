"""Hyper-connection boundary: the Pallas kernel (interpret mode) against fnx.pallas.hc.reference, the model's
gated_residual / boundary through the kernel, and the CUDA lowering at the released shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.model import hyper
from fnx.pallas.hc import api, reference
from fnx.pallas.hc import pallas as kernel
from tests.pallas.kernel_mode import INTERPRET, KERNEL  # noqa: F401


def _ext(*values):
    """A parametrized case of a variant the served tiles do not take: an `extended` case (conftest.py)."""
    return pytest.param(*values, marks=pytest.mark.extended)


# x and inj: bf16 products and fp32 sums in another order (split-K) give a few ulp; H' is the same jnp ops.
TOL = {jnp.bfloat16: 2e-2, jnp.float32: 1e-5}


def _inputs(lead, s, d, r, dtype, seed, inject=True):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    n = lambda k, shape, sc=1.0: (sc * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    h = n(ks[0], lead + (s * d,), 3.0)
    y = n(ks[1], lead + (d,))
    inj = (2 * jax.nn.sigmoid(jax.random.normal(ks[2], lead + (s,)))).astype(dtype)
    p = {"hc_norm": n(ks[3], (s * d,), 0.1), "input_mix_weight_down": n(ks[4], (r, s * d), (s * d) ** -0.5),
         "input_mix_weight_up": n(ks[5], (s * d, r), r ** -0.5)}
    if inject:
        p["block_inject_weight"] = n(ks[6], (s, s * d), (s * d) ** -0.5)
    return h, y, inj, p


def _args(p, inject):
    return (p["hc_norm"], p["input_mix_weight_down"], p["input_mix_weight_up"],
            p["block_inject_weight"] if inject else None)


def _close(got, want, tol, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and np.all(np.isfinite(got)), what
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err < tol, (what, err)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("lead,with_y,inject,tiles", [
    ((1, 1), True, True, None),
    ((1, 5), True, True, kernel.Tiles(br=16, bk=16, ks=2, bd=16, bkr=16)),
    ((3,), False, False, None),
    # one token: the two M = 1 kernels (hc_boundary_m1), default and small tiles, with and without the combine
    ((1,), False, True, None),
    ((1, 1), True, False, kernel.Tiles1(bn=1, bd=16)),
    ((1, 1), True, True, kernel.Tiles1(bn=4, bd=32)),
    ((1, 1), True, True, kernel.Tiles1(pieces=False)),
])
def test_kernel_matches_reference(dtype, lead, with_y, inject, tiles):
    h, y, inj, p = _inputs(lead, 4, 64, 24, dtype, np.random.randint(1 << 30), inject)
    y, inj = (y, inj) if with_y else (None, None)
    want = jax.jit(lambda *a: reference.hc_boundary(*a, streams=4, eps=1e-6))(h, y, inj, *_args(p, inject))
    got = jax.jit(lambda *a: api.hc_boundary(*a, streams=4, eps=1e-6, impl=KERNEL, tiles=tiles))(
        h, y, inj, *_args(p, inject))
    _close(got[0], want[0], 1e-6, "H'")
    _close(got[1], want[1], TOL[dtype], "x")
    if inject:
        _close(got[2], want[2], TOL[dtype], "inj")
    else:
        assert got[2] is None


def test_model_wiring():
    """hyper.gated_residual / hyper.boundary through the kernel agree with their jnp reference paths."""
    h, y, inj, p = _inputs((1, 2), 4, 64, 24, jnp.bfloat16, np.random.randint(1 << 30))
    x_r, i_r = hyper.gated_residual(p, h, 4, 1e-6, impl="reference")
    x_k, i_k = jax.jit(lambda h: hyper.gated_residual(p, h, 4, 1e-6, impl=KERNEL))(h)
    _close(x_k, x_r, TOL[jnp.bfloat16], "x")
    _close(i_k, i_r, TOL[jnp.bfloat16], "inj")
    h_r = hyper.combine(h, y, inj)
    h_k, x_k, _ = jax.jit(lambda h, y, i: hyper.boundary(p, h, y, i, 4, 1e-6, impl=KERNEL))(h, y, inj)
    np.testing.assert_array_equal(np.asarray(h_k, np.float32), np.asarray(h_r, np.float32))
    _close(x_k, hyper.gated_residual(p, h_r, 4, 1e-6, impl="reference")[0], TOL[jnp.bfloat16], "x")


@pytest.mark.parametrize("pieces,fold,early,ssum", [(True, 0, 0, 0), (False, 0, 0, 0), (True, 1, 0, 0), (True, 0, 1, 0),
                                                    (False, 1, 1, 0), (True, 1, 1, 1), (False, 0, 0, 1)])
@pytest.mark.parametrize("d,r", [(128, 32), (320, 40)])
def test_one_token_kernels_match_reference_tightly_in_fp32(d, r, pieces, fold, early, ssum):
    """fp32 at M = 1: only the summation order differs from the reference (tolerance 1e-5), so a wrong index or
    a missed rounding step cannot hide in bf16's tolerance. D = 320 = 5 chunks of 64 and r = 40 are not powers
    of two (as the released D = 2560 and r = 320 are not): unmasked pieces (4 + 1 chunks, 32 + 8) or one padded,
    masked tile. fold 1: the stream's 1/rms on each row's sum instead of on Hn (where it multiplies differs);
    early 1: up1's loads before its arithmetic (the same values); ssum 1: up1 sums the stream partials from S loads
    (another order of the same fp32 sum)."""
    h, y, inj, p = _inputs((1, 1), 4, d, r, jnp.float32, np.random.randint(1 << 30))
    want = reference.hc_boundary(h, y, inj, *_args(p, True), streams=4, eps=1e-6)
    got = kernel.hc_boundary_m1(h, y, inj, *_args(p, True), streams=4, eps=1e-6, interpret=True,
                                tiles=kernel.Tiles1(bn=2, bd=16, pieces=pieces, fold=fold, early=early, ssum=ssum))
    for g, w, what in zip(got, want, ("H'", "x", "inj")):
        _close(g, w, 1e-5, what)


@pytest.mark.parametrize("m", [1, 32])
def test_lowers_for_cuda_released_shapes(m):
    """4 streams x 2560, rank 320, with injection."""
    sd, d, r = 10240, 2560, 320
    bf = jnp.bfloat16
    sds = [jax.ShapeDtypeStruct((m, sd), bf), jax.ShapeDtypeStruct((m, d), bf), jax.ShapeDtypeStruct((m, 4), bf),
           jax.ShapeDtypeStruct((sd,), bf), jax.ShapeDtypeStruct((r, sd), bf), jax.ShapeDtypeStruct((sd, r), bf),
           jax.ShapeDtypeStruct((4, sd), bf)]
    for fn in (kernel.hc_boundary, kernel.hc_boundary_m1) if m == 1 else (kernel.hc_boundary,):
        f = jax.jit(lambda *a, fn=fn: fn(*a, streams=4, eps=1e-6))
        text = f.trace(*sds).lower(lowering_platforms=("cuda",)).as_text()
        assert text.lower().count("triton") >= 2


def test_named_kernel_on_a_call_it_does_not_serve_raises():
    """More than 32 tokens at a rank the prefill kernels cannot tile (24: not a multiple of 16): auto runs the jnp
    path, a named kernel is an error (never a silent fallback)."""
    from fnx.pallas import dispatch
    h, _, _, p = _inputs((2, 20), 4, 64, 24, jnp.bfloat16, np.random.randint(1 << 30))
    hyper.gated_residual(p, h, 4, 1e-6)
    with pytest.raises(dispatch.NotApplicable, match="r=24 must be a multiple of 16"):
        hyper.gated_residual(p, h, 4, 1e-6, impl=KERNEL)


def _fp8(p):
    """Wdown and Wup as FP8 128x128 blocks (the online FP8 layout), Winj and the norm kept dense."""
    from fnx.model import quant
    return dict(p, input_mix_weight_down=quant.quantize_fp8_block(p["input_mix_weight_down"].astype(jnp.float32)),
                input_mix_weight_up=quant.quantize_fp8_block(p["input_mix_weight_up"].astype(jnp.float32)))


@pytest.mark.parametrize("dtype,pieces,wround,fold,ssum", [
    (jnp.bfloat16, True, 1, 0, 0), _ext(jnp.float32, True, 1, 0, 0), (jnp.float32, False, 1, 0, 0),
    _ext(jnp.bfloat16, True, 0, 0, 0), (jnp.float32, True, 0, 0, 0), _ext(jnp.float32, False, 0, 0, 0),
    _ext(jnp.bfloat16, True, 0, 1, 0), _ext(jnp.float32, True, 0, 1, 0), (jnp.bfloat16, True, 0, 1, 1),
    (jnp.float32, True, 0, 1, 1)])
def test_one_token_fp8_kernels_match_the_dequantized_reference(dtype, pieces, wround, fold, ssum):
    """FP8 Wdown / Wup (r = 160 and S*D = 1280: partial 128-row and 128-column blocks on both) against the
    reference on the weights the model uses (dequantized, rounded to the activation dtype); and the model's
    gated_residual / boundary wiring: one and two tokens through the kernels, more than 8 tokens through the
    reference (a named kernel raises there). `wround` 0 puts each block scale on the fp32 sum of its piece and
    rounds no weight: in fp32 only the order of operations differs (1e-5); in bf16 within the same bound."""
    from fnx.model import quant
    from fnx.pallas import dispatch
    h, y, inj, p = _inputs((1, 1), 4, 320, 160, dtype, np.random.randint(1 << 30))
    q = _fp8(p)
    wd, wu = (quant.dequantize(q[k], dtype) for k in ("input_mix_weight_down", "input_mix_weight_up"))
    want = reference.hc_boundary(h, y, inj, p["hc_norm"], wd, wu, p["block_inject_weight"], streams=4, eps=1e-6)
    got = jax.jit(lambda h, y, i: api.hc_boundary(
        h, y, i, p["hc_norm"], q["input_mix_weight_down"].w, q["input_mix_weight_up"].w, p["block_inject_weight"],
        streams=4, eps=1e-6, impl=KERNEL,
        tiles=kernel.Tiles1(bn=2, bd=16, pieces=pieces, wround=wround, fold=fold, early=fold, ssum=ssum),
        w_down_scale=q["input_mix_weight_down"].scale_inv, w_up_scale=q["input_mix_weight_up"].scale_inv))(h, y, inj)
    tol = 1e-5 if dtype == jnp.float32 else TOL[dtype]
    for g, w, what in zip(got, want, ("H'", "x", "inj")):
        _close(g, w, tol, what)
    with pytest.raises(ValueError, match="Tiles1"):      # the multi-token design has no FP8 path
        api.hc_boundary(h, y, inj, p["hc_norm"], q["input_mix_weight_down"].w, q["input_mix_weight_up"].w,
                        p["block_inject_weight"], streams=4, eps=1e-6, impl=KERNEL, tiles=kernel.Tiles(),
                        w_down_scale=q["input_mix_weight_down"].scale_inv,
                        w_up_scale=q["input_mix_weight_up"].scale_inv)
    x_k, i_k = jax.jit(lambda h: hyper.gated_residual(q, h, 4, 1e-6, impl=KERNEL))(h)
    x_r, i_r = hyper.gated_residual(q, h, 4, 1e-6, impl="reference")
    _close(x_k, x_r, tol, "x (model wiring)")
    _close(i_k, i_r, tol, "inj (model wiring)")
    h2 = jnp.concatenate([h, 2 * h], axis=1)              # two tokens: the few-token kernels
    x2_k, i2_k = jax.jit(lambda h: hyper.gated_residual(q, h, 4, 1e-6, impl=KERNEL))(h2)
    x2_r, i2_r = hyper.gated_residual(q, h2, 4, 1e-6, impl="reference")
    _close(x2_k, x2_r, tol, "x (two tokens)")
    _close(i2_k, i2_r, tol, "inj (two tokens)")
    h9 = jnp.concatenate([h] * 9, axis=1)                 # more than 8 tokens: no FP8 kernel
    hyper.gated_residual(q, h9, 4, 1e-6)
    with pytest.raises(dispatch.NotApplicable, match="FP8"):
        hyper.gated_residual(q, h9, 4, 1e-6, impl=KERNEL)


def test_one_token_fp8_kernels_lower_for_cuda_released_shapes():
    sd, d, r = 10240, 2560, 320
    bf, f8, f32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
    sds = [jax.ShapeDtypeStruct((1, sd), bf), jax.ShapeDtypeStruct((1, d), bf), jax.ShapeDtypeStruct((1, 4), bf),
           jax.ShapeDtypeStruct((sd,), bf), jax.ShapeDtypeStruct((r, sd), f8), jax.ShapeDtypeStruct((sd, r), f8),
           jax.ShapeDtypeStruct((4, sd), bf), jax.ShapeDtypeStruct((3, 80), f32), jax.ShapeDtypeStruct((80, 3), f32)]
    for tiles in (None, kernel.Tiles1(bn=2, bd=8, wround=0), kernel.Tiles1(bn=2, bd=8, wround=0, fold=1, early=1)):
        f = jax.jit(lambda *a: kernel.hc_boundary_m1(*a[:7], streams=4, eps=1e-6, w_down_scale=a[7],
                                                     w_up_scale=a[8], tiles=tiles))
        text = f.trace(*sds).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("hc_down1_fp8") and text.count("hc_up1_fp8")


@pytest.mark.parametrize("m,dtype,fp8,tokens,fold", [
    (2, jnp.float32, False, "grid", 0), (5, jnp.float32, True, "grid", 0), _ext(5, jnp.bfloat16, True, "grid", 0),
    (8, jnp.bfloat16, False, "grid", 0), _ext(2, jnp.float32, False, "loop", 0), _ext(5, jnp.float32, True, "loop", 0),
    (5, jnp.bfloat16, True, "loop", 0), _ext(5, jnp.float32, True, "grid", 1), (3, jnp.float32, True, "loop", 1)])
def test_few_token_kernels_match_reference(m, dtype, fp8, tokens, fold, monkeypatch):
    """2..8 tokens (an MTP verify window) through the one-token kernels (op "hc_boundary_few"), one program per
    token on a grid axis ("grid") or each program walking the tokens ("loop"), with the combine and the injection, bf16 or FP8 Wdown / Wup, D and r not powers of two:
    fp32 to 1e-5 (only the order of sums differs), bf16 within TOL. Auto takes the op on a GPU (its default design
    is the MMA one, few.py), and the multi-token MMA tiles still name the multi-token design. fold 1 (with early
    1: up1's loads first) puts the 1/rms on each down row's sum."""
    early = fold
    from fnx.model import quant
    from fnx.pallas import dispatch
    h, y, inj, p = _inputs((1, m), 4, 320, 40, dtype, np.random.randint(1 << 30))
    kw = {}
    wd, wu = p["input_mix_weight_down"], p["input_mix_weight_up"]
    if fp8:
        q = _fp8(p)
        wd, wu = q["input_mix_weight_down"].w, q["input_mix_weight_up"].w
        kw = {"w_down_scale": q["input_mix_weight_down"].scale_inv, "w_up_scale": q["input_mix_weight_up"].scale_inv}
        ref_w = [quant.dequantize(q[k], dtype) for k in ("input_mix_weight_down", "input_mix_weight_up")]
    else:
        ref_w = [wd, wu]
    want = reference.hc_boundary(h, y, inj, p["hc_norm"], *ref_w, p["block_inject_weight"], streams=4, eps=1e-6)
    run = lambda impl: jax.jit(lambda h, y, i: api.hc_boundary(  # noqa: E731
        h, y, i, p["hc_norm"], wd, wu, p["block_inject_weight"], streams=4, eps=1e-6, impl=impl,
        tiles=kernel.Tiles1(bn=2, bd=16, tokens=tokens, fold=fold, early=early), **kw))(h, y, inj)
    got = run(KERNEL)
    tol = 1e-5 if dtype == jnp.float32 else TOL[dtype]
    for g, w, what in zip(got, want, ("H'", "x", "inj")):
        _close(g, w, tol, what)
    assert api.choose(KERNEL, None, m, fp8)[0] == api.OP_FEW
    with dispatch.force(KERNEL):
        assert api.choose(None, None, m, fp8)[0] == api.OP_FEW
    # on a GPU, "auto" takes the op (its default is the MMA design, faster than XLA's boundary in the MTP round)
    monkeypatch.setattr(dispatch, "why_unavailable", lambda b: None if b in dispatch.BACKENDS else "unknown")
    monkeypatch.delenv("FNX_KERNELS", raising=False)
    assert api.OP_FEW in dispatch.VERIFIED_ON_GPU and api.OP_FEW not in dispatch.AUTO_KEEPS_REFERENCE
    assert api.choose(None, None, m, fp8) == (api.OP_FEW, "pallas")


def test_few_token_kernels_lower_for_cuda_released_shapes():
    sd, d, r, m = 10240, 2560, 320, 5
    bf, f8, f32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
    sds = [jax.ShapeDtypeStruct((1, m, sd), bf), jax.ShapeDtypeStruct((1, m, d), bf), jax.ShapeDtypeStruct((1, m, 4), bf),
           jax.ShapeDtypeStruct((sd,), bf), jax.ShapeDtypeStruct((r, sd), f8), jax.ShapeDtypeStruct((sd, r), f8),
           jax.ShapeDtypeStruct((4, sd), bf), jax.ShapeDtypeStruct((3, 80), f32), jax.ShapeDtypeStruct((80, 3), f32)]
    f = jax.jit(lambda *a: kernel.hc_boundary_m1(*a[:7], streams=4, eps=1e-6, w_down_scale=a[7], w_up_scale=a[8]))
    text = f.trace(*sds).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("hc_down1_fp8_few") and text.count("hc_up1_fp8_few")


BF, F32_ = jnp.bfloat16, jnp.float32


def _check_few(got, want, dtype):
    """(H', x, inj) against the reference's: fp32 to 1e-5, bf16 within TOL, H' bit for bit, inj absent together."""
    tol = 1e-5 if dtype == jnp.float32 else TOL[dtype]
    for g, w, what in zip(got, want, ("H'", "x", "inj")):
        if w is None:
            assert g is None, what
        else:
            _close(g, w, tol, what)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))


def _few_case(m, dtype, fp8, with_y, inject):
    """A few-token boundary's inputs (S*D = 1280, r = 48), its weights as the kernels take them (FP8 blocks with
    their scales, or bf16) and the reference's outputs on the weights the model uses."""
    from fnx.model import quant
    h, y, inj, p = _inputs((1, m), 4, 320, 48, dtype, np.random.randint(1 << 30), inject)
    y, inj = (y, inj) if with_y else (None, None)
    wd, wu, kw = p["input_mix_weight_down"], p["input_mix_weight_up"], {}
    ref_w = [wd, wu]
    if fp8:
        q = _fp8(p)
        wd, wu = q["input_mix_weight_down"].w, q["input_mix_weight_up"].w
        kw = {"w_down_scale": q["input_mix_weight_down"].scale_inv, "w_up_scale": q["input_mix_weight_up"].scale_inv}
        ref_w = [quant.dequantize(q[k], dtype) for k in ("input_mix_weight_down", "input_mix_weight_up")]
    wi = p.get("block_inject_weight")
    want = reference.hc_boundary(h, y, inj, p["hc_norm"], *ref_w, wi, streams=4, eps=1e-6)
    return h, y, inj, p, wd, wu, wi, kw, want


@pytest.mark.parametrize("m,dtype,fp8,with_y,inject,up,glue", [(5, F32_, True, True, True, "mma", "pallas"),
                                                               (5, BF, True, True, True, "mma", "pallas"),
                                                               (5, BF, True, True, True, "gemv", "pallas"),
                                                               (5, BF, True, True, True, "gemv", "xla"),
                                                               (2, F32_, False, True, True, "mma", "pallas"),
                                                               (2, F32_, False, True, True, "mma", "xla"),
                                                               (8, BF, False, False, False, "gemv", "pallas"),
                                                               (8, BF, False, False, False, "gemv", "xla"),
                                                               (3, F32_, True, True, False, "mma", "pallas"),
                                                               (5, BF, True, True, True, "gemv", "xla1"),
                                                               (2, F32_, True, True, True, "gemv", "xla1"),
                                                               (8, BF, False, False, False, "gemv", "xla1")])
def test_few_token_mma_design_matches_reference(m, dtype, fp8, with_y, inject, up, glue):
    """The few-token MMA design (`few.hc_boundary_few`, what op "hc_boundary_few" runs without Tiles1): the norm
    (glue "pallas": the pre kernel with the combine; "xla": the reference's jnp), the down kernel, the mid (the
    splits' sum, silu and inj: the mid kernel or XLA), the gates and mix ("mma": the up kernel; "gemv": the GEMV
    dispatch and XLA); S*D = 1280 and r = 48 (partial FP8 blocks, an up piece of 16), two 64-column chunks per down
    program (20 splits: a piece of 16 and one of 4 in the mid kernel). fp32 to 1e-5 (only the order of sums
    differs), bf16 within TOL; H' (the combine's two roundings, in both glues) bit for bit."""
    from fnx.pallas.hc import few
    h, y, inj, p, wd, wu, wi, kw, want = _few_case(m, dtype, fp8, with_y, inject)
    tiles = few.TilesFew(bn=16, chunks=2, bk=64, up=up, pre="xla" if glue == "xla1" else glue, mid=glue,
                         mid_bc=16 if m == 2 else 32)
    got = jax.jit(lambda h, y, i: api.hc_boundary(h, y, i, p["hc_norm"], wd, wu, wi, streams=4, eps=1e-6,
                                                  impl=KERNEL, tiles=tiles, **kw))(h, y, inj)
    _check_few(got, want, dtype)


@pytest.mark.parametrize("m,dtype,fp8,with_y,inject,up,mid,chunks", [
    (5, F32_, True, True, True, "gemv", "pallas", 1), (5, F32_, True, True, True, "gemv", "xla", 2),
    (5, BF, True, True, True, "gemv", "pallas", 1), (5, BF, True, True, True, "gemv", "xla1", 1),
    (2, F32_, False, True, True, "mma", "pallas", 2), (3, F32_, True, False, False, "mma", "xla", 1),
    (8, BF, False, True, False, "gemv", "pallas", 2)])
def test_few_token_folded_norm_matches_reference(m, dtype, fp8, with_y, inject, up, mid, chunks):
    """pre "fold": no norm pass before the down kernel. It multiplies round(H' (1 + w)) and sums each split's H'^2;
    the mid (kernel or XLA) scales each stream's splits by its 1/rms; the mix forms Hn from H' and that rstd. fp32
    to 1e-5 (the order of sums and where 1/rms multiplies differ), bf16 within TOL (a rounding of H' (1 + w) instead
    of Hn's), H' bit for bit. S*D = 1280 in splits of 64 (5 per stream; the mid kernel's pieces of 4 and 1)."""
    from fnx.pallas.hc import few
    h, y, inj, p, wd, wu, wi, kw, want = _few_case(m, dtype, fp8, with_y, inject)
    tiles = few.TilesFew(bn=16, chunks=chunks, bk=64 // chunks, up=up, pre="fold", mid=mid, mid_bc=16)
    f = lambda h, y, i: api.hc_boundary(h, y, i, p["hc_norm"], wd, wu, wi, streams=4, eps=1e-6,  # noqa: E731
                                        impl=KERNEL, tiles=tiles, **kw)
    got = jax.jit(f)(h, y, inj)
    _check_few(got, want, dtype)

    def rsqrt_before_down(tiles):
        """Whether an rsqrt (the norm) comes before the first kernel launch of the boundary's jaxpr."""
        g = lambda h, y, i: api.hc_boundary(h, y, i, p["hc_norm"], wd, wu, wi, streams=4,  # noqa: E731
                                            eps=1e-6, impl=KERNEL, tiles=tiles, **kw)

        def walk(jaxpr):
            for e in jaxpr.eqns:
                if e.primitive.name == "pallas_call":
                    return False
                if e.primitive.name == "rsqrt":
                    return True
                for sub in ("jaxpr", "call_jaxpr"):
                    if sub in e.params:
                        found = walk(getattr(e.params[sub], "jaxpr", e.params[sub]))
                        if found is not None:
                            return found
            return None
        return walk(jax.make_jaxpr(g)(h, y, inj).jaxpr)
    assert rsqrt_before_down(tiles) is False
    if mid != "xla1":
        assert rsqrt_before_down(dataclasses.replace(tiles, pre="xla", chunks=2, bk=32)) is True


def test_few_token_mid_in_one_pass_gives_the_same_values_and_feeds_the_gemv_unsliced(monkeypatch):
    """mid "xla1": the splits' sum, / S, then silu on u's columns and inj's sigmoid on the rest as one elementwise
    pass (a single consumer of the sum), u's columns read by the up GEMV in place: the same x and inj as "xla", and
    no slice of that buffer before the GEMV launch."""
    from fnx.pallas.gemv import api as gemv_api
    from fnx.pallas.hc import few
    h, y, inj, p = _inputs((1, 5), 4, 320, 64, BF, 11, True)       # r = 64: GEMV tiles divide K
    q = _fp8(p)
    wd, wu = q["input_mix_weight_down"].w, q["input_mix_weight_up"].w
    kw = {"w_down_scale": q["input_mix_weight_down"].scale_inv, "w_up_scale": q["input_mix_weight_up"].scale_inv}
    wi = p.get("block_inject_weight")
    assert gemv_api.kernel_applies((5, 64), BF, "fp8", (1280, 64)) is None
    monkeypatch.setenv("FNX_KERNELS", f"gemv_fp8={KERNEL}")

    def run(mid):
        t = few.TilesFew(bn=16, chunks=2, bk=64, mid=mid)
        f = lambda h, y, i: api.hc_boundary(h, y, i, p["hc_norm"], wd, wu, wi, streams=4, eps=1e-6,  # noqa: E731
                                            impl=KERNEL, tiles=t, **kw)
        return jax.jit(f)(h, y, inj), jax.make_jaxpr(f)(h, y, inj)
    (got, jx1), (want, _) = run("xla1"), run("xla")
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))

    def slices_into_gemv(jaxpr):
        made = {}
        for e in jaxpr.eqns:
            for v in e.outvars:
                made[v] = e
            for sub in ("jaxpr", "call_jaxpr"):
                if sub in e.params and "fnx_gemv" in str(e.params[sub]):
                    return [made[v].primitive.name for v in e.invars if v in made
                            and made[v].primitive.name in ("slice", "dynamic_slice")]
            if sub := [x for x in ("jaxpr", "call_jaxpr") if x in e.params]:
                inner = slices_into_gemv(getattr(e.params[sub[0]], "jaxpr", e.params[sub[0]]))
                if inner is not None:
                    return inner
        return None
    assert slices_into_gemv(jx1.jaxpr) == []


def test_one_token_tiles_env_replaces_the_defaults(monkeypatch):
    """FNX_HC_M1_TILES (a benchmark knob) replaces fields of the one-token tiles; an unknown field is an error."""
    monkeypatch.delenv(kernel.M1_TILES_ENV, raising=False)
    base = kernel.choose_tiles1(4, 2560, 320)
    assert base.fold == 1 and base.early == 1     # the measured choice
    monkeypatch.setenv(kernel.M1_TILES_ENV, "fold=0,bd=4")
    assert kernel.choose_tiles1(4, 2560, 320) == dataclasses.replace(base, fold=0, bd=4)
    monkeypatch.setenv(kernel.M1_TILES_ENV, "folded=1")
    with pytest.raises(ValueError, match="not field=value"):
        kernel.choose_tiles1(4, 2560, 320)


def test_few_token_tiles_env_replaces_the_defaults(monkeypatch):
    """FNX_HC_FEW_TILES (a benchmark knob) replaces fields of the few-token defaults; a field it does not know, a
    value that is not an integer, a tile set that does not fit, or up=gemv where the GEMV kernels take no Wup are
    errors."""
    from fnx.pallas.hc import few
    monkeypatch.delenv(few.TILES_ENV, raising=False)
    assert few.default_tiles(4, 2560, 320) == few.TilesFew()
    monkeypatch.setenv(few.TILES_ENV, "up=mma,bd=32")
    assert few.default_tiles(4, 2560, 320) == few.TilesFew(up="mma", bd=32)
    monkeypatch.setenv(few.TILES_ENV, "pre=fold,mid=pallas")
    assert few.default_tiles(4, 2560, 320) == few.TilesFew(pre="fold", mid="pallas")
    for bad, why in (("upp=mma", "not field=value"), ("bd=x", "takes an integer"), ("bd=24,up=mma", "does not fit")):
        monkeypatch.setenv(few.TILES_ENV, bad)
        with pytest.raises(ValueError, match=why):
            few.default_tiles(4, 2560, 320)
    monkeypatch.setenv(few.TILES_ENV, "up=gemv")
    with pytest.raises(ValueError, match="take no Wup"):
        few.default_tiles(4, 2560, 320, gemv_up=False)


def test_few_token_mma_design_checks_its_tiles_and_lowers_for_cuda():
    from fnx.pallas.hc import few
    h, y, inj, p = _inputs((1, 2), 4, 320, 48, jnp.bfloat16, 3)
    for bad, why in ((few.TilesFew(bn=8), "bn=8"), (few.TilesFew(chunks=3), "chunks=3"),
                     (few.TilesFew(bd=24, up="mma"), "bd=24"), (few.TilesFew(up="xla"), "up='xla'"),
                     (few.TilesFew(pre="cuda"), "pre='cuda'"), (few.TilesFew(mid="jnp"), "mid='jnp'"),
                     (few.TilesFew(mid="xla1", up="mma"), "mid='xla1'"), (few.TilesFew(pre="xla1"), "pre='xla1'"),
                     (few.TilesFew(mid_bc=48), "mid_bc=48"), (few.TilesFew(pre="fold"), "lie in one stream")):
        with pytest.raises(ValueError, match=why):
            few.hc_boundary_few(h, y, inj, *_args(p, True), streams=4, eps=1e-6, interpret=True, tiles=bad)
    with pytest.raises(ValueError, match="1..8 tokens"):
        few.hc_boundary_few(jnp.concatenate([h] * 5, axis=1), None, None, *_args(p, True), streams=4, eps=1e-6,
                            interpret=True)
    sd, d, r, m = 10240, 2560, 320, 5
    bf, f8, f32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
    acts = [jax.ShapeDtypeStruct((1, m, sd), bf), jax.ShapeDtypeStruct((1, m, d), bf),
            jax.ShapeDtypeStruct((1, m, 4), bf), jax.ShapeDtypeStruct((sd,), bf)]
    inj_w = jax.ShapeDtypeStruct((4, sd), bf)
    f = jax.jit(lambda *a: few.hc_boundary_few(*a[:7], streams=4, eps=1e-6, w_down_scale=a[7], w_up_scale=a[8],
                                               tiles=few.TilesFew(up="mma", pre="pallas", mid="pallas")))
    text = f.trace(*acts, jax.ShapeDtypeStruct((r, sd), f8), jax.ShapeDtypeStruct((sd, r), f8), inj_w,
                   jax.ShapeDtypeStruct((3, 80), f32), jax.ShapeDtypeStruct((80, 3), f32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("hc_down_few_fp8") and text.count("hc_up_few_fp8")
    assert text.count("hc_pre_few") and text.count("hc_mid_few")
    f = jax.jit(lambda *a: few.hc_boundary_few(*a[:7], streams=4, eps=1e-6, w_down_scale=a[7], w_up_scale=a[8],
                                               tiles=few.TilesFew(up="mma", pre="fold", mid="pallas")))
    text = f.trace(*acts, jax.ShapeDtypeStruct((r, sd), f8), jax.ShapeDtypeStruct((sd, r), f8), inj_w,
                   jax.ShapeDtypeStruct((3, 80), f32), jax.ShapeDtypeStruct((80, 3), f32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("hc_down_few_fp8") and text.count("hc_mid_few") and text.count("hc_up_few_fp8")
    assert not text.count("hc_pre_few")   # fold: no norm pass
    for up in ("gemv", "mma"):
        f = jax.jit(lambda *a: few.hc_boundary_few(*a, streams=4, eps=1e-6, tiles=few.TilesFew(up=up)))
        text = f.trace(*acts, jax.ShapeDtypeStruct((r, sd), bf), jax.ShapeDtypeStruct((sd, r), bf), inj_w).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("hc_down_few") and text.count("hc_up_few") == (2 if up == "mma" else 0)


@pytest.mark.parametrize("m,dtype,fp8,with_y,inject", [_ext(40, F32_, True, True, True), (40, BF, True, True, True),
                                                       _ext(33, BF, False, True, True), (64, F32_, False, False, False),
                                                       _ext(17, BF, True, False, True)])   # off by default: measured
def test_prefill_kernels_match_reference(m, dtype, fp8, with_y, inject):
    """The prefill boundary (`prefill.hc_boundary_prefill`, op "hc_boundary_prefill"): the combine, the norm and
    the Wdown / Winj products in one launch per (row block, stream), XLA's mid, the gates and the mix in another;
    S*D = 1280 and r = 48 (pieces of 32 and 16), row counts that leave a partial row block. fp32 to 1e-5, bf16
    within TOL, H' bit for bit, inj absent together."""
    from fnx.pallas.hc import prefill
    h, y, inj, p, wd, wu, wi, kw, want = _few_case(m, dtype, fp8, with_y, inject)
    tiles = prefill.TilesPrefill(bm=16, bk=64, bd=64)
    got = jax.jit(lambda h, y, i: prefill.hc_boundary_prefill(h, y, i, p["hc_norm"], wd, wu, wi, streams=4,
                                                              eps=1e-6, interpret=INTERPRET, tiles=tiles,
                                                              **kw))(h, y, inj)
    _check_few(got, want, dtype)


def _tiles_env_replaces_fields(monkeypatch, env, tiles, fields):
    """The tiles' environment knob replaces the fields it names; an unknown field is an error naming the knob."""
    monkeypatch.setenv(env, ",".join(f"{k}={v}" for k, v in fields.items()))
    t = tiles()
    assert {k: getattr(t, k) for k in fields} == fields
    monkeypatch.setenv(env, "rows=8")
    with pytest.raises(ValueError, match=env):
        tiles()
    monkeypatch.delenv(env)


def test_prefill_kernels_refuse_tiles_they_cannot_take_and_lower_for_cuda(monkeypatch):
    """Tiles that do not divide the dims are refused with the reason; the default tiles by token count and D, and
    FNX_HC_PREFILL_TILES over them; at the released shapes (S = 4, D = 2,560, r = 320, FP8 Wdown / Wup) a
    2,048-token boundary lowers to the two Triton launches."""
    from fnx.pallas.hc import prefill
    assert "bk=256" in prefill.why_not(4, 2560, 320, prefill.TilesPrefill(bk=256))
    assert "bd=48" in prefill.why_not(4, 2560, 320, prefill.TilesPrefill(bd=48))
    assert "r=40" in prefill.why_not(4, 2560, 40, prefill.TilesPrefill())
    assert prefill.why_not(4, 2560, 320, prefill.TilesPrefill()) is None
    assert (prefill.default_tiles(2560, 2048).bm, prefill.default_tiles(2560, 512).bm,
            prefill.default_tiles(2560, 40).bm) == (64, 32, 16)
    assert (prefill.default_tiles(320, 2048).bk, prefill.default_tiles(320, 2048).bd) == (64, 64)
    _tiles_env_replaces_fields(monkeypatch, prefill.TILES_ENV, lambda: prefill.default_tiles(2560, 2048),
                               {"bm": 32, "num_warps": 4})
    S = jax.ShapeDtypeStruct
    m, sd, r = 2048, 10240, 320
    fp8 = jnp.float8_e4m3fn
    text = jax.jit(lambda h, y, i, w, wd, sd_, wu, su, wi: prefill.hc_boundary_prefill(
        h, y, i, w, wd, wu, wi, streams=4, eps=1e-6, w_down_scale=sd_, w_up_scale=su)).trace(
        S((1, m, sd), jnp.bfloat16), S((1, m, sd // 4), jnp.bfloat16), S((1, m, 4), jnp.bfloat16),
        S((sd,), jnp.bfloat16), S((r, sd), fp8), S((3, 80), jnp.float32), S((sd, r), fp8), S((80, 3), jnp.float32),
        S((4, sd), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize("fp8", [False, True])
def test_prefill_boundary_through_the_model_only_where_named(fp8, monkeypatch):
    """hyper.boundary / gated_residual over a prefill chunk (40 tokens): the reference under auto (the kernel has
    not passed its compiled tests), the two launches where FNX_KERNELS names "hc_boundary_prefill", with FP8 (as
    the model quantizes them) or bf16 Wdown / Wup; the same values within TOL, H' bit for bit. A rank the kernels
    cannot tile keeps the reference even where named."""
    h, y, inj, p = _inputs((1, 40), 4, 64, 32, jnp.bfloat16, np.random.randint(1 << 30))
    if fp8:
        h, y, inj, p = _inputs((1, 40), 4, 128, 32, jnp.bfloat16, np.random.randint(1 << 30))
        p = _fp8(p)
    monkeypatch.delenv("FNX_KERNELS", raising=False)
    # fresh functions for every trace: jit (and make_jaxpr) keep a function's trace, knobs are read while tracing
    count = lambda f: str(jax.make_jaxpr(lambda h: f(h))(h)).count("pallas_call")   # noqa: E731
    bnd = lambda h: hyper.boundary(p, h, y, inj, 4, 1e-6)              # noqa: E731
    res = lambda h: hyper.gated_residual(p, h, 4, 1e-6)                # noqa: E731
    assert count(bnd) == 0 and count(res) == 0
    want_b, want_r = jax.jit(lambda h: bnd(h))(h), jax.jit(lambda h: res(h))(h)
    monkeypatch.setenv("FNX_KERNELS", f"hc_boundary_prefill={KERNEL}")
    assert count(bnd) == 2 and count(res) == 2
    got_b, got_r = jax.jit(lambda h: hyper.boundary(p, h, y, inj, 4, 1e-6))(h), \
        jax.jit(lambda h: hyper.gated_residual(p, h, 4, 1e-6))(h)
    np.testing.assert_array_equal(np.asarray(got_b[0], np.float32), np.asarray(want_b[0], np.float32))
    for g, w, what in ((got_b[1], want_b[1], "x"), (got_b[2], want_b[2], "inj"), (got_r[0], want_r[0], "x"),
                       (got_r[1], want_r[1], "inj")):
        _close(g, w, TOL[jnp.bfloat16], what)
    _, _, _, p8 = _inputs((1, 40), 4, 64, 24, jnp.bfloat16, 1)           # r = 24: no power-of-two pieces of 16
    assert str(jax.make_jaxpr(lambda h: hyper.gated_residual(p8, h, 4, 1e-6))(h[..., :256])).count(
        "pallas_call") == 0


def test_one_token_prefetch_lowers_with_wup_loads_and_sink():
    """Tiles1.prefetch: down1 (one token, FP8) takes Wup and its scales as extra operands and each program loads one
    slice of each with the evict_last policy, consumed by a side-effecting asm after its stores; up1 unchanged;
    without it, neither. At the released shapes, lowered for CUDA."""
    from fnx.pallas import triton_ir
    sd, d, r = 10240, 2560, 320
    bf, f8, f32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
    sds = [jax.ShapeDtypeStruct((1, sd), bf), jax.ShapeDtypeStruct((1, d), bf), jax.ShapeDtypeStruct((1, 4), bf),
           jax.ShapeDtypeStruct((sd,), bf), jax.ShapeDtypeStruct((r, sd), f8), jax.ShapeDtypeStruct((sd, r), f8),
           jax.ShapeDtypeStruct((4, sd), bf), jax.ShapeDtypeStruct((3, 80), f32), jax.ShapeDtypeStruct((80, 3), f32)]
    base = kernel.choose_tiles1(4, d, r)
    got = {}
    for pf in (0, 1):
        tiles = dataclasses.replace(base, prefetch=pf)
        f = jax.jit(lambda *a: kernel.hc_boundary_m1(*a[:7], streams=4, eps=1e-6, w_down_scale=a[7],
                                                     w_up_scale=a[8], tiles=tiles))
        got[pf] = {name: text for name, _, _, text in triton_ir.launches(f.trace(*sds).lower(
            lowering_platforms=("cuda",)))}
    assert set(got[0]) == set(got[1]) == {"hc_down1_fp8", "hc_up1_fp8"}
    assert got[1]["hc_up1_fp8"] == got[0]["hc_up1_fp8"]
    for pf, n in ((0, 0), (1, 2)):
        down = got[pf]["hc_down1_fp8"]
        assert down.count("evict_last") == n and down.count('"mov.b32 $0, $1;"') == n, pf
        lines = down.splitlines()
        if n:       # the sinks after the program's last store
            last_store = max(i for i, ln in enumerate(lines) if "tt.store" in ln)
            assert all(i > last_store for i, ln in enumerate(lines) if "mov.b32" in ln)


@pytest.mark.gpu
def test_one_token_prefetch_same_bits():
    """Tiles1.prefetch changes no result, compiled: the same bits as without it (the loads and the sink feed nothing
    the kernel writes). GPU only: interpret mode skips the prefetch, so on a CPU both runs are one program."""
    h, y, inj, p = _inputs((1, 1), 4, 256, 32, jnp.bfloat16, 5)
    q = _fp8(p)
    wd, wu = q["input_mix_weight_down"], q["input_mix_weight_up"]
    base = kernel.choose_tiles1(4, 256, 32)

    def run(pf):
        return kernel.hc_boundary_m1(h, y, inj, p["hc_norm"], wd.w, wu.w, p["block_inject_weight"], streams=4,
                                     eps=1e-6, interpret=INTERPRET, tiles=dataclasses.replace(base, prefetch=pf),
                                     w_down_scale=wd.scale_inv, w_up_scale=wu.scale_inv)
    for a, b in zip(run(0), run(1)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("m,dtype,fp8,inject", [(40, jnp.bfloat16, True, True), (70, jnp.float32, False, False),
                                                (40, jnp.float32, True, False),
                                                _ext(33, jnp.bfloat16, False, True),
                                                _ext(100, jnp.float32, True, True)])
def test_mix_prefill_through_the_model_only_where_named(m, dtype, fp8, inject, monkeypatch):
    """Op "hc_mix_prefill" (`prefill.hc_mix_prefill`, measured level, off under auto): over a prefill chunk the
    model's gated residual (and a boundary) keeps XLA's norm and Wdown / Winj products and runs the gates and the
    mix in one launch where FNX_KERNELS names it; S*D = 512 (D = 128) and r = 48, FP8 Wdown / Wup as the model
    quantizes them (the codes go into the kernel), or dense ones. fp32 to 1e-5, bf16 within TOL; inj and H' the
    same jnp ops (bit for bit)."""
    h, y, inj, p = _inputs((1, m), 4, 128, 48, dtype, np.random.randint(1 << 30), inject)
    if fp8:
        p = _fp8(p)
    monkeypatch.delenv("FNX_KERNELS", raising=False)
    count = lambda f: str(jax.make_jaxpr(lambda h: f(h))(h)).count("pallas_call")   # noqa: E731
    res = lambda h: hyper.gated_residual(p, h, 4, 1e-6, inject)        # noqa: E731
    bnd = lambda h: hyper.boundary(p, h, y, inj, 4, 1e-6, inject)       # noqa: E731
    assert count(res) == 0 and count(bnd) == 0
    want_r, want_b = jax.jit(lambda h: res(h))(h), jax.jit(lambda h: bnd(h))(h)
    monkeypatch.setenv("FNX_KERNELS", f"hc_mix_prefill={KERNEL}")
    assert count(res) == 1 and count(bnd) == 1
    kernel_in = [e for e in jax.make_jaxpr(lambda h: res(h))(h).eqns if e.primitive.name == "pallas_call"]
    assert any(v.aval.dtype == jnp.float8_e4m3fn for v in kernel_in[0].invars) == fp8
    got_r = jax.jit(lambda h: hyper.gated_residual(p, h, 4, 1e-6, inject))(h)
    got_b = jax.jit(lambda h: hyper.boundary(p, h, y, inj, 4, 1e-6, inject))(h)
    tol = TOL[dtype]
    if inject:
        _close(got_r[0], want_r[0], tol, "x")
        np.testing.assert_array_equal(np.asarray(got_r[1], np.float32), np.asarray(want_r[1], np.float32))
        np.testing.assert_array_equal(np.asarray(got_b[2], np.float32), np.asarray(want_b[2], np.float32))
    else:
        _close(got_r, want_r, tol, "x")
        assert got_b[2] is None and want_b[2] is None
    np.testing.assert_array_equal(np.asarray(got_b[0], np.float32), np.asarray(want_b[0], np.float32))
    _close(got_b[1], want_b[1], tol, "boundary x")
    # decode sizes: not this op (the same launches as without it: on a GPU the decode HC kernels may run there)
    small = lambda: count(lambda h: hyper.gated_residual(p, h[:, :32], 4, 1e-6, inject))   # noqa: E731
    named = small()
    monkeypatch.delenv("FNX_KERNELS")
    assert named == small()


@pytest.mark.parametrize("bm,bd,warps", [(16, 16, 1), (16, 32, 4), (32, 16, 4), (64, 128, 8)])
def test_mix_prefill_kernel_tiles_and_partial_row_blocks(bm, bd, warps):
    """The mix kernel alone at several tiles against the reference's gates and mix (fp32, FP8 Wup): a partial last
    row block (masked), one column tile of every stream at bd = D."""
    from fnx.model import quant
    from fnx.pallas.hc import prefill
    m, s, d, r = 75, 4, 128, 48
    h, _, _, p = _inputs((1, m), s, d, r, jnp.float32, 7, False)
    wq = quant.quantize_fp8_block(p["input_mix_weight_up"].astype(jnp.float32))
    hn = reference.grouped_rms_norm(h, p["hc_norm"], 1e-6, d)
    u = jax.nn.silu(jax.random.normal(jax.random.PRNGKey(8), (1, m, r), jnp.float32))
    mg = jax.nn.sigmoid(reference._linear(u, quant.dequantize(wq, jnp.float32)))
    want = jnp.mean(mg.reshape(1, m, s, d) * hn.reshape(1, m, s, d), axis=-2)
    got = prefill.hc_mix_prefill(u, hn, wq.w, streams=s, interpret=INTERPRET, w_up_scale=wq.scale_inv,
                                 tiles=prefill.TilesMix(bm=bm, bd=bd, num_warps=warps))
    _close(got, want, 1e-5, "x")


def test_mix_prefill_refuses_what_it_does_not_take_and_lowers_for_cuda(monkeypatch):
    """Tiles and shapes the mix kernel cannot take are refused with the reason (FNX_KERNELS naming the op leaves
    such a call on XLA's path, as for every op; an impl naming the kernel for it is an error); the default tiles
    and FNX_HC_MIX_TILES over them; at the released shapes (S = 4, D = 2,560, r = 320, FP8 Wup) a 2,048-token
    chunk lowers to one Triton launch."""
    from fnx.pallas import dispatch
    from fnx.pallas.hc import prefill
    assert "bd=48" in prefill.mix_why_not(4, 2560, 320, prefill.TilesMix(bd=48))
    assert "bm=8" in prefill.mix_why_not(4, 2560, 320, prefill.TilesMix(bm=8))
    assert "r=40" in prefill.mix_why_not(4, 2560, 40, prefill.TilesMix())
    assert prefill.mix_why_not(4, 2560, 320, prefill.mix_tiles(2560, 2048)) is None
    t = prefill.mix_tiles(2560, 2048)
    assert (t.bm, t.bd) == (128, 32) and prefill.mix_tiles(2560, 100).bm == 32
    assert prefill.mix_tiles(80, 2048).bd == 16
    _tiles_env_replaces_fields(monkeypatch, prefill.MIX_TILES_ENV, lambda: prefill.mix_tiles(2560, 2048),
                               {"bd": 64, "num_warps": 4})
    _tiles_env_replaces_fields(monkeypatch, prefill.NORM_TILES_ENV, lambda: prefill.norm_tiles(2560),
                               {"bm": 8, "num_warps": 8})
    bf = jnp.bfloat16
    with pytest.raises(ValueError, match="not \\[S\\*D, r\\]"):
        prefill.hc_mix_prefill(jnp.zeros((40, 48), bf), jnp.zeros((40, 512), bf), jnp.zeros((512, 32), bf),
                               streams=4, interpret=True)
    with pytest.raises(ValueError, match="do not agree on the tokens"):
        prefill.hc_mix_prefill(jnp.zeros((39, 48), bf), jnp.zeros((40, 512), bf), jnp.zeros((512, 48), bf),
                               streams=4, interpret=True)
    with pytest.raises(NotImplementedError, match="r=24"):
        prefill.hc_mix_prefill(jnp.zeros((40, 24), bf), jnp.zeros((40, 512), bf), jnp.zeros((512, 24), bf),
                               streams=4, interpret=True)
    _, _, _, p = _inputs((1, 40), 4, 64, 24, bf, 1)                    # r = 24: no power-of-two pieces of 16
    monkeypatch.setenv("FNX_KERNELS", f"hc_mix_prefill={KERNEL}")      # named for every call: this one keeps XLA's
    assert str(jax.make_jaxpr(lambda h: hyper.gated_residual(p, h, 4, 1e-6))(jnp.zeros((1, 40, 256), bf))).count(
        "pallas_call") == 0
    monkeypatch.delenv("FNX_KERNELS")
    with pytest.raises(dispatch.NotApplicable, match="r=24"):          # named for this call: an error
        hyper._mix_prefill(p, jnp.zeros((1, 40, 24), bf), jnp.zeros((1, 40, 256), bf), 4, KERNEL)
    S = jax.ShapeDtypeStruct
    text = jax.jit(lambda u, hn, w, sc: prefill.hc_mix_prefill(u, hn, w, streams=4, w_up_scale=sc)).trace(
        S((1, 2048, 320), bf), S((1, 2048, 10240), bf), S((10240, 320), jnp.float8_e4m3fn),
        S((80, 3), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "hc_mix_prefill" in text


@pytest.mark.parametrize("m,dtype,with_y,bm,bk", [(45, jnp.bfloat16, True, 4, 32), (45, jnp.float32, False, 2, 64),
                                                  (33, jnp.float32, True, 8, 128)])
def test_norm_prefill_kernel_matches_reference(m, dtype, with_y, bm, bk):
    """`prefill.hc_norm_prefill` (op "hc_norm_prefill"): the combine bit for bit and the grouped norm within an ulp
    of the reference's in bf16, a few in fp32 (its sum of squares in another order) over S*D = 512, a partial last
    row block, with and without the combine; refused tiles and mismatched operands raise with the reason."""
    from fnx.pallas.hc import prefill
    h, y, inj, p = _inputs((1, m), 4, 128, 48, dtype, np.random.randint(1 << 30))
    y, inj = (y, inj) if with_y else (None, None)
    h2, hn = prefill.hc_norm_prefill(h, y, inj, p["hc_norm"], streams=4, eps=1e-6, interpret=INTERPRET,
                                     tiles=prefill.TilesNorm(bm=bm, bk=bk))
    want_h2 = reference.combine(h, y, inj) if with_y else h
    np.testing.assert_array_equal(np.asarray(h2, np.float32), np.asarray(want_h2, np.float32))
    want = np.asarray(reference.grouped_rms_norm(want_h2, p["hc_norm"], 1e-6, 128), np.float32)
    got = np.asarray(hn, np.float32)
    ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -20    # fp32: rstd a few ulp apart
    assert np.all(np.abs(got - want) <= ulp * np.abs(want) + 1e-30), np.abs(got - want).max()
    assert "bk=48" in prefill.norm_why_not(128, prefill.TilesNorm(bk=48))
    assert "chunks" in prefill.norm_why_not(2560, prefill.TilesNorm(bk=16))
    assert prefill.norm_tiles(2560).bk == 512 and prefill.norm_tiles(128).bk == 128
    with pytest.raises(ValueError, match="come together"):
        prefill.hc_norm_prefill(h, y if y is not None else h[..., :128], None, p["hc_norm"], streams=4, eps=1e-6)
    with pytest.raises(NotImplementedError, match="bk=48"):
        prefill.hc_norm_prefill(h, None, None, p["hc_norm"], streams=4, eps=1e-6, interpret=True,
                                tiles=prefill.TilesNorm(bk=48))


@pytest.mark.parametrize("fp8", [False, True])
def test_norm_and_mix_prefill_through_the_model_only_where_named(fp8, monkeypatch):
    """Ops "hc_norm_prefill" and "hc_mix_prefill" together over a 40-token chunk: a boundary is two launches (the
    combine + norm, the gates + mix) around XLA's Wdown / Winj products, a gated residual without a combine the same;
    H' bit for bit, x and inj within TOL of XLA's path; the norm alone is one launch. At the released shapes a
    2,048-token boundary lowers to the two Triton launches."""
    h, y, inj, p = _inputs((1, 40), 4, 128, 32, jnp.bfloat16, np.random.randint(1 << 30))
    if fp8:
        p = _fp8(p)
    monkeypatch.delenv("FNX_KERNELS", raising=False)
    count = lambda f, h=h: str(jax.make_jaxpr(lambda h: f(h))(h)).count("pallas_call")   # noqa: E731
    bnd = lambda h: hyper.boundary(p, h, y, inj, 4, 1e-6)              # noqa: E731
    res = lambda h: hyper.gated_residual(p, h, 4, 1e-6)                # noqa: E731
    want_b, want_r = jax.jit(lambda h: bnd(h))(h), jax.jit(lambda h: res(h))(h)
    monkeypatch.setenv("FNX_KERNELS", f"hc_norm_prefill={KERNEL}")
    assert count(bnd) == 1 and count(res) == 1
    monkeypatch.setenv("FNX_KERNELS", f"hc_norm_prefill={KERNEL},hc_mix_prefill={KERNEL}")
    assert count(bnd) == 2 and count(res) == 2
    got_b = jax.jit(lambda h: hyper.boundary(p, h, y, inj, 4, 1e-6))(h)
    got_r = jax.jit(lambda h: hyper.gated_residual(p, h, 4, 1e-6))(h)
    np.testing.assert_array_equal(np.asarray(got_b[0], np.float32), np.asarray(want_b[0], np.float32))
    for g, w, what in ((got_b[1], want_b[1], "x"), (got_b[2], want_b[2], "inj"), (got_r[0], want_r[0], "x"),
                       (got_r[1], want_r[1], "inj")):
        _close(g, w, TOL[jnp.bfloat16], what)
    # decode sizes: not these ops (the same launches as without them: on a GPU the decode HC kernels may run there)
    small = lambda: count(lambda h: hyper.gated_residual(p, h[:, :32], 4, 1e-6))   # noqa: E731
    named = small()
    monkeypatch.delenv("FNX_KERNELS")
    assert named == small()
    from fnx.pallas.hc import prefill
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    text = jax.jit(lambda h, y, i, w: prefill.hc_norm_prefill(h, y, i, w, streams=4, eps=1e-6)).trace(
        S((1, 2048, 10240), bf), S((1, 2048, 2560), bf), S((1, 2048, 4), bf), S((10240,), bf)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "hc_norm_prefill" in text


@pytest.mark.parametrize("dtype,fp8", [(jnp.bfloat16, True), (jnp.float32, False)])
def test_joint_down_product_over_a_prefill_chunk(dtype, fp8, monkeypatch):
    """FNX_HC_JOINT_DOWN=1 (on by default): a gated residual with the injection over a prefill chunk (more than 32
    tokens) runs its Wdown and Winj products as one product of the stacked weights (one dot fewer in the program);
    x and inj as the two products give them (fp32 to 1e-5, bf16 within TOL), the boundary's H' bit for bit; decode
    sizes and calls without the injection keep two products / one; a bad value is refused."""
    h, y, inj, p = _inputs((1, 40), 4, 128, 48, dtype, np.random.randint(1 << 30))
    if fp8:
        p = _fp8(p)
    monkeypatch.delenv("FNX_KERNELS", raising=False)

    def dots(f, h=h):       # dot_general equations, each call's inner jaxprs counted
        def walk(jaxpr):
            n = 0
            for e in jaxpr.eqns:
                n += e.primitive.name == "dot_general"
                for v in e.params.values():
                    inner = getattr(v, "jaxpr", v)
                    n += walk(inner) if hasattr(inner, "eqns") else 0
            return n
        return walk(jax.make_jaxpr(lambda h: f(h))(h).jaxpr)     # a new function: no trace of an earlier setting
    res = lambda h: hyper.gated_residual(p, h, 4, 1e-6)                # noqa: E731
    bnd = lambda h: hyper.boundary(p, h, y, inj, 4, 1e-6)              # noqa: E731
    monkeypatch.delenv(hyper.JOINT_DOWN_ENV, raising=False)
    assert hyper.joint_down_on()                                # on by default
    monkeypatch.setenv(hyper.JOINT_DOWN_ENV, "0")
    want_r, want_b, n_r = jax.jit(lambda h: res(h))(h), jax.jit(lambda h: bnd(h))(h), dots(res)
    small = lambda h: hyper.gated_residual(p, h[:, :32], 4, 1e-6)      # noqa: E731
    plain = lambda h: hyper.gated_residual(p, h, 4, 1e-6, False)       # noqa: E731
    n_small, n_plain = dots(small), dots(plain)
    monkeypatch.setenv(hyper.JOINT_DOWN_ENV, "1")
    assert dots(res) == n_r - 1 and dots(small) == n_small and dots(plain) == n_plain
    got_r, got_b = jax.jit(lambda h: res(h))(h), jax.jit(lambda h: bnd(h))(h)
    for g, w, what in ((got_r[0], want_r[0], "x"), (got_r[1], want_r[1], "inj"), (got_b[1], want_b[1], "boundary x"),
                       (got_b[2], want_b[2], "boundary inj")):
        _close(g, w, TOL[dtype], what)
    np.testing.assert_array_equal(np.asarray(got_b[0], np.float32), np.asarray(want_b[0], np.float32))
    monkeypatch.setenv(hyper.JOINT_DOWN_ENV, "yes")
    with pytest.raises(ValueError, match=hyper.JOINT_DOWN_ENV):
        hyper.joint_down_on()


def test_linear_stacked_is_the_products_apart():
    """`ops.linear_stacked` (one product of the stacked, dequantized weights, split): each part has its weight's
    output width and the values of `linear` with that weight alone (fp32 to 1e-6 of the scale; bf16 within an ulp of
    it), FP8 and dense weights mixed, leading dims kept."""
    from fnx.model import ops, quant
    k = jax.random.split(jax.random.PRNGKey(5), 3)
    wd = quant.quantize_fp8_block(jax.random.normal(k[0], (48, 256), jnp.float32))
    wi = jax.random.normal(k[1], (4, 256), jnp.float32)
    for dtype, tol in ((jnp.float32, 1e-6), (jnp.bfloat16, 2 ** -8)):
        x = jax.random.normal(k[2], (2, 40, 256), jnp.float32).astype(dtype)
        a, b = ops.linear_stacked(x, wd, wi.astype(dtype))
        assert a.shape == (2, 40, 48) and b.shape == (2, 40, 4) and a.dtype == b.dtype == dtype
        _close(a, ops.linear(x, wd), tol, "first")
        _close(b, ops.linear(x, wi.astype(dtype)), tol, "second")
