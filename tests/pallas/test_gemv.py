"""Weight-streaming GEMV kernels in Pallas interpret mode against the fp32 reference (fnx/pallas/gemv)."""

import dataclasses
import json
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.model import ops, quant
from fnx.pallas.gemv import api, reference, shapes
from fnx.pallas import dispatch, kernel_math
from fnx.pallas.gemv import pallas as gp
from tests.pallas.kernel_mode import INTERPRET, KERNEL, ops_outside_kernels  # noqa: F401

F32 = jnp.float32


def _weights(fmt, n, k, key):
    w = jax.random.normal(key, (n, k), F32) * (0.5 / np.sqrt(k))
    if fmt == "bf16":
        return w.astype(jnp.bfloat16), {}, w.astype(jnp.bfloat16)
    if fmt == "fp8":
        q = quant.quantize_fp8_block(w)
        return q.w, {"scale": q.scale_inv}, q
    q = quant.quantize_nvfp4(w)
    return q.w, {"scale": q.scale, "scale_2": q.scale_2}, q


# max error relative to max |reference|: one bf16 rounding of the output (2^-8 = 3.9e-3) plus fp32
# accumulation-order noise
TOL = 8e-3


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("name,n,k", shapes.TEST)
def test_kernel_matches_fp32_reference(fmt, name, n, k):
    seed = np.random.SeedSequence().entropy % (2**31)
    key = jax.random.PRNGKey(seed)
    w, extra, q = _weights(fmt, n, k, key)
    for m in (1, 5):
        x = jax.random.normal(jax.random.fold_in(key, m), (m, k), F32).astype(jnp.bfloat16)
        t = api.heuristic_tiles(fmt, n, k, m)
        assert t is not None, (fmt, n, k)
        # the kernel allocates its output (no buffer to poison): every element must be finite and match below
        y = gp.gemv(x, w, extra.get("scale"), extra.get("scale_2"), fmt=fmt, tiles=t, interpret=INTERPRET)
        assert y.shape == (m, n) and y.dtype == jnp.bfloat16
        ref = reference.linear_f32(x, quant.dequantize(q, F32) if fmt != "bf16" else w)
        err = np.abs(np.asarray(y, np.float32) - np.asarray(ref))
        scale = np.max(np.abs(np.asarray(ref)))
        assert np.all(np.isfinite(np.asarray(y, np.float32))), f"seed {seed}"
        assert err.max() <= TOL * scale, (fmt, name, m, err.max() / scale, f"seed {seed}")


def test_fp8_scales_ahead_give_the_same_bits(monkeypatch):
    """`Tiles.sahead` (the FP8 "loop" walk's block scales loaded a step ahead): the same bits as loading each step's
    scale in the step, at K steps of 64 (two steps a scale block), 128 and 256 (two blocks a step), split-K, both
    operand orders, bf16 and fp16 products, 5 tokens; the several-token knob sets it; a bad value is refused, and
    other formats ignore it."""
    n, k = 256, 1024
    w, extra, q = _weights("fp8", n, k, jax.random.PRNGKey(71))
    x = jax.random.normal(jax.random.PRNGKey(72), (5, k), F32).astype(jnp.bfloat16)
    run = lambda t: np.asarray(gp.gemv(x, w, extra["scale"], None, fmt="fp8", tiles=t, interpret=INTERPRET))  # noqa
    for t in (gp.Tiles(64, 64, 2), gp.Tiles(64, 128, 4, mma="f16"), gp.Tiles(128, 256, 2, mma="f16", tr=1),
              gp.Tiles(64, 128, 1)):
        np.testing.assert_array_equal(run(dataclasses.replace(t, sahead=1)).view(np.uint16), run(t).view(np.uint16),
                                      err_msg=str(t))
    assert "sahead=2" in gp.check_tiles("fp8", n, k, gp.Tiles(64, 128, 2, sahead=2))
    monkeypatch.setenv(api.MANY_TILES_ENV, "fp8:sahead=1")
    assert api.tiles_for("fp8", 2560, 16384, 5).sahead == 1 and api.tiles_for("bf16", 2560, 16384, 5).sahead == 0
    wb, _, _ = _weights("bf16", n, k, jax.random.PRNGKey(73))
    plain = gp.gemv(x, wb, None, None, fmt="bf16", tiles=gp.Tiles(64, 128, 2), interpret=INTERPRET)
    ahead = gp.gemv(x, wb, None, None, fmt="bf16", tiles=gp.Tiles(64, 128, 2, sahead=1), interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(ahead).view(np.uint16), np.asarray(plain).view(np.uint16))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_split_k_and_tile_choices_agree(fmt):
    """Every legal tiling gives the same numbers within accumulation-order noise (split-K sums fp32 partials)."""
    n, k = 128, 1024
    key = jax.random.PRNGKey(np.random.SeedSequence().entropy % (2**31))
    w, extra, q = _weights(fmt, n, k, key)
    x = jax.random.normal(key, (3, k), F32).astype(jnp.bfloat16)
    outs = []
    tilings = [gp.Tiles(64, 128, 1), gp.Tiles(32, 64, 4), gp.Tiles(16, 128, 8),
               gp.Tiles(128 if fmt != "fp8" else 64, 32 if fmt != "nvfp4" else 64, 2)]
    if fmt == "fp8":   # several 128-column blocks per step
        tilings += [gp.Tiles(64, 256, 2), gp.Tiles(32, 512, 1)]
    if fmt == "nvfp4":  # every decode variant
        tilings += [gp.Tiles(32, 256, 2, dec=d) for d in gp.DECODES]
    for t in tilings:
        assert gp.check_tiles(fmt, n, k, t) is None, t
        outs.append(np.asarray(gp.gemv(x, w, extra.get("scale"), extra.get("scale_2"), fmt=fmt, tiles=t,
                                       interpret=INTERPRET), np.float32))
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=2e-2, atol=2e-2 * np.abs(outs[0]).max())


def test_nvfp4_decodes_are_exact_and_agree_bit_for_bit():
    """The bf16 bit placement gives every E2M1 code its exact value, and the three NVFP4 decode variants (same
    tiles otherwise) produce the same bits: they differ only in how the exact weight reaches bf16."""
    codes = jnp.arange(16, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(gp._e2m1_bf16(codes), np.float32),
                                  np.asarray(reference.e2m1_to_f32(codes)))
    np.testing.assert_array_equal(np.asarray(kernel_math.e2m1_f16(codes), np.float32) * kernel_math.E2M1_F16_SCALE,
                                  np.asarray(reference.e2m1_to_f32(codes)))
    n, k = 64, 512
    key = jax.random.PRNGKey(np.random.SeedSequence().entropy % (2**31))
    w, extra, q = _weights("nvfp4", n, k, key)
    x = jax.random.normal(key, (5, k), F32).astype(jnp.bfloat16)
    outs = [np.asarray(gp.gemv(x, w, extra["scale"], extra["scale_2"], fmt="nvfp4",
                               tiles=gp.Tiles(32, 128, 2, dec=d), interpret=INTERPRET), np.float32)
            for d in gp.DECODES]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


WIDE = [gp.Tiles(4, 64, 1, mode="fma"), gp.Tiles(16, 128, 1, mode="fma", num_warps=2),
        gp.Tiles(8, 128, 1, mode="fma", acc=1),   # one token: products kept as a tile (more tokens ignore acc)
        gp.Tiles(16, 256, 1, mode="dot"), gp.Tiles(32, 64, 1, mode="dot", num_warps=8),
        gp.Tiles(8, 128, 1, mode="fma", rows=2),  # two row tiles per program, the second's loads issued first
        gp.Tiles(8, 64, 2, mode="fma"), gp.Tiles(16, 64, 2, mode="dot", rows=2),   # K split over two programs
        gp.Tiles(16, 128, 1, mode="dot", tr=1)]   # the weights as the MMA's left operand


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("name,n,k", [s for s in shapes.TEST if s[0] != "deep"])   # (deep: only more chunks)
def test_whole_k_modes_match_fp32_reference(fmt, name, n, k):
    """The whole-K-per-program kernels ("fma" on CUDA cores, "dot" on tensor cores) at the ends of the M range
    they serve, each tile set that divides the shape; and their fused argmax."""
    seed = np.random.SeedSequence().entropy % (2**31)
    key = jax.random.PRNGKey(seed)
    w, extra, q = _weights(fmt, n, k, key)
    wf = quant.dequantize(q, F32) if fmt != "bf16" else w
    ran = 0
    for t in WIDE:
        if gp.check_tiles(fmt, n, k, t) is not None:
            continue
        ran += 1
        for m in ((1, gp.FMA_MAX_M) if t.mode == "fma" else (3, 32)):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), F32).astype(jnp.bfloat16)
            y = gp.gemv(x, w, extra.get("scale"), fmt=fmt, tiles=t, interpret=INTERPRET)
            ref = reference.linear_f32(x, wf)
            assert y.shape == (m, n) and y.dtype == jnp.bfloat16
            err = np.abs(np.asarray(y, np.float32) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max()
            assert err <= TOL, (fmt, name, t, m, err, f"seed {seed}")
        if t.split != 1:            # the fused argmax needs whole dot products per program
            continue
        x = jax.random.normal(key, (3, k), F32).astype(jnp.bfloat16)
        ids = gp.gemv(x, w, extra.get("scale"), fmt=fmt, tiles=t, interpret=INTERPRET, argmax=True)
        logits = np.asarray(reference.linear_f32(x, wf))
        top2 = np.sort(logits, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-3 * np.abs(logits).max()    # no near-tie for fp32 order to flip
        np.testing.assert_array_equal(np.asarray(ids)[clear], np.argmax(logits, -1)[clear])
    assert ran, f"no whole-K tile set divides {name} ({n} x {k})"


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_operand_order_gives_the_same_products(fmt):
    """`Tiles.tr` 1 (W . x^T, transposed before the store) against 0 (x . W^T) in the looped kernel, at five tokens
    and with the fused argmax: the same products (fp32 order noise at most), both within TOL of the reference."""
    n, k = 128, 1024
    seed = np.random.SeedSequence().entropy % (2**31)
    key = jax.random.PRNGKey(seed)
    w, extra, q = _weights(fmt, n, k, key)
    wf = quant.dequantize(q, F32) if fmt != "bf16" else w
    x = jax.random.normal(key, (5, k), F32).astype(jnp.bfloat16)
    ref = np.asarray(reference.linear_f32(x, wf))
    base = gp.Tiles(32, 256 if fmt == "fp8" else 128, 2)
    outs = []
    for tr in (0, 1):
        t = dataclasses.replace(base, tr=tr)
        assert gp.check_tiles(fmt, n, k, t) is None
        y = np.asarray(gp.gemv(x, w, extra.get("scale"), extra.get("scale_2"), fmt=fmt, tiles=t,
                               interpret=INTERPRET), np.float32)
        assert y.shape == (5, n)
        assert np.abs(y - ref).max() <= TOL * np.abs(ref).max(), (fmt, tr, f"seed {seed}")
        outs.append(y)
        ids = gp.gemv(x, w, extra.get("scale"), extra.get("scale_2"), fmt=fmt, interpret=INTERPRET, argmax=True,
                      tiles=dataclasses.replace(t, split=1))
        top2 = np.sort(ref, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-2 * np.abs(ref).max()
        np.testing.assert_array_equal(np.asarray(ids)[clear], np.argmax(ref, -1)[clear])
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-2, atol=1e-2 * np.abs(outs[0]).max())
    assert "tr=1" in gp.check_tiles(fmt if fmt != "nvfp4" else "bf16", n, k,
                                    gp.Tiles(16, 128, 1, mode="fma", tr=1))


def test_fp16_mma_matches_the_reference_per_token_row():
    """`Tiles.mma` "f16" (FP8 tiles on fp16 MMAs, each token row of a chunk prescaled by a power of two): every token
    row within TOL of the fp32 reference relative to that row's own size, with rows far outside fp16's range (1e6
    and 1e-6 times the others: without the prescale the first overflows and the second flushes), in the looped kernel
    (one and two 128-column blocks per step) and the whole-K "dot" mode, at one and five tokens; NVFP4 (code * scale
    in fp16) in the looped kernel with both scale layouts."""
    n, k = 128, 1024
    seed = np.random.SeedSequence().entropy % (2**31)
    key = jax.random.PRNGKey(seed)
    w, extra, q = _weights("fp8", n, k, key)
    wf = quant.dequantize(q, F32)
    x = jax.random.normal(key, (5, k), F32) * jnp.array([1.0, 1e6, 1e-6, 3.0, 0.0])[:, None]
    x = x.astype(jnp.bfloat16)
    ref = np.asarray(reference.linear_f32(x, wf))
    for t in (gp.Tiles(32, 128, 2, mma="f16"), gp.Tiles(64, 256, 1, mma="f16"), gp.Tiles(32, 128, 2, mma="f16", tr=1),
              gp.Tiles(16, 256, 2, mode="dot", mma="f16")):
        assert gp.check_tiles("fp8", n, k, t) is None, t
        for m in (1, 5):
            y = np.asarray(gp.gemv(x[:m], w, extra["scale"], fmt="fp8", tiles=t, interpret=INTERPRET), np.float32)
            assert np.all(np.isfinite(y)), (t, m, f"seed {seed}")
            for i in range(m):
                size = np.abs(ref[i]).max()
                assert np.abs(y[i] - ref[i]).max() <= TOL * size, (t, m, i, f"seed {seed}")
    wn, en, qn = _weights("nvfp4", n, k, key)       # NVFP4: code * scale formed in fp16, both decodes
    refn = np.asarray(reference.linear_f32(x, quant.dequantize(qn, F32)))
    for t in (gp.Tiles(32, 128, 2, mma="f16"), gp.Tiles(64, 256, 1, dec="f32g", mma="f16", tr=1)):
        assert gp.check_tiles("nvfp4", n, k, t) is None, t
        y = np.asarray(gp.gemv(x, wn, en["scale"], en["scale_2"], fmt="nvfp4", tiles=t, interpret=INTERPRET),
                       np.float32)
        assert np.all(np.isfinite(y)), (t, f"seed {seed}")
        for i in range(5):
            assert np.abs(y[i] - refn[i]).max() <= TOL * np.abs(refn[i]).max(), (t, i, f"seed {seed}")
    assert "mma='f16'" in gp.check_tiles("nvfp4", n, k, gp.Tiles(32, 128, 2, dec="bf16", mma="f16"))
    assert "mma='f16'" in gp.check_tiles("bf16", n, k, gp.Tiles(32, 128, 2, mma="f16"))
    assert "mma='f16'" in gp.check_tiles("fp8", n, k, gp.Tiles(16, 128, 1, mode="fma", mma="f16"))
    assert "mma='f32'" in gp.check_tiles("fp8", n, k, gp.Tiles(32, 128, 2, mma="f32"))


def test_fp8_takes_fp16_mmas_at_several_tokens_unless_an_entry_names_its_mma(monkeypatch):
    """FP8 tensor-core tiles run fp16 MMAs at M > 1 by default (`api.MANY_MMA`), bf16 at one token; bf16 weights
    keep bf16; a table entry that names its mma keeps it."""
    monkeypatch.setenv(api.MANY_TILES_ENV, "")
    n, k = 10240, 2560
    assert api.tiles_for("fp8", n, k, 5).mma == "f16" and api.tiles_for("fp8", n, k, 5).mode == "loop"
    assert api.tiles_for("fp8", n, k, 1).mma == "bf16"
    assert api.tiles_for("bf16", n, k, 5).mma == "bf16"
    assert api.tiles_for("fp8", 384, 512, 3).mma == "f16"            # heuristic tiles (no table entry) too
    named = {f"fp8:{n}:{k}:8": dict(dataclasses.asdict(gp.Tiles(64, 128, 4)), mma="bf16")}
    monkeypatch.setattr(api, "_tuned", lambda kind: named)
    assert api.tiles_for("fp8", n, k, 5) == gp.Tiles(64, 128, 4)
    unnamed = {key: {f: v for f, v in e.items() if f != "mma"} for key, e in named.items()}
    monkeypatch.setattr(api, "_tuned", lambda kind: unnamed)
    assert api.tiles_for("fp8", n, k, 5) == gp.Tiles(64, 128, 4, mma="f16")


def test_many_tiles_knob_changes_only_several_token_tiles(monkeypatch):
    """`FNX_GEMV_MANY_TILES` replaces fields of the tensor-core tiles at M > 1 (a benchmark knob), leaves one token's
    and "fma" tiles alone, and raises on a spec that makes the tiles invalid."""
    n, k = 10240, 2560
    plain = {m: api.tiles_for("fp8", n, k, m) for m in (1, 5)}
    monkeypatch.setenv(api.MANY_TILES_ENV, "tr=1")
    assert api.tiles_for("fp8", n, k, 1) == plain[1]
    assert api.tiles_for("fp8", n, k, 5) == dataclasses.replace(plain[5], tr=1) != plain[5]
    monkeypatch.setenv(api.MANY_TILES_ENV, "mma=f16,tr=1")
    assert api.tiles_for("fp8", n, k, 5) == dataclasses.replace(plain[5], tr=1, mma="f16")
    monkeypatch.setenv(api.MANY_TILES_ENV, "")
    bf16 = api.tiles_for("bf16", n, k, 5)
    monkeypatch.setenv(api.MANY_TILES_ENV, "mma=f16")        # bf16 weights take no fp16 MMAs: raises unscoped
    with pytest.raises(ValueError, match="FNX_GEMV_MANY_TILES.*takes FP8 or NVFP4"):
        api.tiles_for("bf16", n, k, 5)
    monkeypatch.setenv(api.MANY_TILES_ENV, "fp8+nvfp4:mma=f16")   # scoped: bf16 keeps its tiles
    assert api.tiles_for("bf16", n, k, 5) == bf16
    assert api.tiles_for("fp8", n, k, 5) == dataclasses.replace(plain[5], mma="f16")
    monkeypatch.setenv(api.MANY_TILES_ENV, "fp9:mma=f16")
    with pytest.raises(ValueError, match="unknown weight format"):
        api.tiles_for("fp8", n, k, 5)
    monkeypatch.setenv(api.MANY_TILES_ENV, "bn=48")
    with pytest.raises(ValueError, match="FNX_GEMV_MANY_TILES.*power of two"):
        api.tiles_for("fp8", n, k, 5)
    monkeypatch.setenv(api.MANY_TILES_ENV, "tx=1")
    with pytest.raises(ValueError, match="not field=value"):
        api.tiles_for("fp8", n, k, 5)


def test_shape_tiles_knob_replaces_one_shapes_tiles(monkeypatch):
    """`FNX_GEMV_TILES` replaces tile fields of one call shape ("fmt:N:K:Mbucket[:argmax]"), leaves every other
    shape, token bucket and the argmax heads alone, and raises on a malformed key or tiles that do not fit."""
    monkeypatch.delenv(api.SHAPE_TILES_ENV, raising=False)
    n, k = 2560, 6144
    plain = {m: api.tiles_for("fp8", n, k, m) for m in (1, 5)}
    other = api.tiles_for("fp8", 10240, 2560, 1)
    head = api.tiles_for("fp8", n, k, 1, argmax=True)
    monkeypatch.setenv(api.SHAPE_TILES_ENV, "fp8:2560:6144:1=bn=8,split=4 / bf16:256:512:8=split=2")
    assert api.tiles_for("fp8", n, k, 1) == dataclasses.replace(plain[1], bn=8, split=4) != plain[1]
    assert api.tiles_for("fp8", n, k, 5) == plain[5]
    assert api.tiles_for("fp8", 10240, 2560, 1) == other
    assert api.tiles_for("fp8", n, k, 1, argmax=True) == head
    assert api.tiles_for("bf16", 256, 512, 7).split == 2 and api.tiles_for("bf16", 256, 512, 4).split != 2
    for bad in ("fp8:2560:6144=split=1", "fp9:2560:6144:1=split=1", "fp8:2560:6144:3=split=1",
                "fp8:2560:6144:1:best=split=1", "fp8:2560:x:1=split=1", "fp8:2560:6144:1"):
        monkeypatch.setenv(api.SHAPE_TILES_ENV, bad)
        with pytest.raises(ValueError, match="FNX_GEMV_TILES.*is not"):
            api.tiles_for("fp8", n, k, 1)
    for spec, why, m, argmax in (("fp8:2560:6144:1=bn=48", "FNX_GEMV_TILES: fp8:2560:6144:1 tiles.*power of two", 1,
                                  False),
                                 ("fp8:2560:6144:1:argmax=split=2", "argmax needs split 1", 1, True),
                                 ("fp8:2560:6144:16=mode=fma,bk=512,bn=16,split=1,mma=bf16", "'fma' serves at most",
                                  16, False),
                                 ("fp8:2560:6144:1=tx=1", "not field=value", 1, False)):
        monkeypatch.setenv(api.SHAPE_TILES_ENV, spec)
        with pytest.raises(ValueError, match=why):
            api.tiles_for("fp8", n, k, m, argmax=argmax)


def test_shape_tiles_knob_reaches_the_kernel(monkeypatch):
    """The model's `linear` runs the tiles `FNX_GEMV_TILES` names: without and with split-K the same products within
    accumulation-order noise, and the split one leaves a sum after the kernel (what the knob's A/B measures)."""
    n, k = 128, 1024
    key = jax.random.PRNGKey(np.random.SeedSequence().entropy % (2**31))
    w, extra, q = _weights("fp8", n, k, key)
    x = jax.random.normal(key, (1, k), F32).astype(jnp.bfloat16)
    outs, sums = [], []
    for spec in ("fp8:128:1024:1=split=1,bk=512", "fp8:128:1024:1=split=2,bk=512"):
        monkeypatch.setenv(api.SHAPE_TILES_ENV, spec)
        f = lambda x: api.linear(x, w, fmt="fp8", scale=extra["scale"], impl=KERNEL)   # noqa: E731
        outs.append(np.asarray(f(x), np.float32))
        sums.append(ops_outside_kernels(f, x).count("reduce_sum"))
    assert sums == [0, 1]
    ref = np.asarray(reference.linear_f32(x, quant.dequantize(q, F32)))
    for o in outs:
        assert np.abs(o - ref).max() <= TOL * np.abs(ref).max()


def test_whole_k_modes_refuse_what_they_do_not_serve():
    n, k = 256, 512
    assert "split=4" in gp.check_tiles("bf16", n, k, gp.Tiles(16, 256, 4, mode="fma"))   # 128-column slices
    assert gp.check_tiles("bf16", n, k, gp.Tiles(16, 128, 2, mode="fma")) is None
    assert "streams" in gp.check_tiles("nvfp4", n, k, gp.Tiles(16, 128, 1, mode="fma"))
    assert "minimum" in gp.check_tiles("bf16", n, k, gp.Tiles(8, 128, 1, mode="dot"))
    assert "too many" in gp.check_tiles("fp8", 128, 128 * 65, gp.Tiles(16, 128, 1, mode="dot"))
    assert "unknown mode" in gp.check_tiles("bf16", n, k, gp.Tiles(16, 128, 1, mode="wide"))
    assert "do not divide" in gp.check_tiles("bf16", 48, k, gp.Tiles(16, 128, 1, mode="fma", rows=2))
    assert "whole-K modes" in gp.check_tiles("bf16", n, k, gp.Tiles(16, 128, 1, rows=2))
    x = jnp.ones((gp.FMA_MAX_M + 1, k), jnp.bfloat16)
    with pytest.raises(ValueError, match="M <= 8"):
        gp.gemv(x, jnp.ones((n, k), jnp.bfloat16), fmt="bf16", tiles=gp.Tiles(16, 128, 1, mode="fma"),
                interpret=True)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("mode", ["fma", "dot"])
def test_row_tiles_per_program_give_the_same_bits(fmt, mode):
    """`Tiles.rows` only changes which program computes a row tile and when its loads are issued: every output
    (and the fused argmax) has the bits of one row tile per program (16 row tiles: one program writes them all)."""
    n, k = 256, 512
    key = jax.random.PRNGKey(np.random.SeedSequence().entropy % (2**31))
    w, extra, _ = _weights(fmt, n, k, key)
    base = gp.Tiles(16, 128, 1, num_stages=1, mode=mode)
    for m in ((1, 3) if mode == "fma" else (2,)):
        x = jax.random.normal(jax.random.fold_in(key, m), (m, k), F32).astype(jnp.bfloat16)
        want = np.asarray(gp.gemv(x, w, extra.get("scale"), fmt=fmt, tiles=base, interpret=INTERPRET), np.float32)
        for rows in (2, 16):
            t = dataclasses.replace(base, rows=rows)
            got = np.asarray(gp.gemv(x, w, extra.get("scale"), fmt=fmt, tiles=t, interpret=INTERPRET), np.float32)
            np.testing.assert_array_equal(got, want, err_msg=f"{t} m={m}")
            ids = gp.gemv(x, w, extra.get("scale"), fmt=fmt, tiles=t, interpret=INTERPRET, argmax=True)
            np.testing.assert_array_equal(
                np.asarray(ids), np.asarray(gp.gemv(x, w, extra.get("scale"), fmt=fmt, tiles=base,
                                                    interpret=INTERPRET, argmax=True)))


@pytest.mark.parametrize("fmt", gp.WIDE_FORMATS)
def test_activations_first_give_the_same_bits(fmt, monkeypatch):
    """`Tiles.xfirst` only moves where each chunk's activations are loaded: the same bits as without it, in "fma"
    (one and three tokens, split-K, acc, row tiles) and "dot"; the tile choice sets it on whole-K tiles only
    (a loop's tiles keep theirs), `FNX_GEMV_XFIRST=0` leaves it off, another value is an error."""
    from fnx.pallas.gemv import api
    n, k = 256, 512
    key = jax.random.PRNGKey(np.random.SeedSequence().entropy % (2**31))
    w, extra, _ = _weights(fmt, n, k, key)
    wide = [gp.Tiles(16, 128, 1, num_stages=1, mode="fma"), gp.Tiles(8, 64, 2, mode="fma"),
            gp.Tiles(8, 128, 1, mode="fma", acc=1), gp.Tiles(8, 128, 1, mode="fma", rows=2),
            gp.Tiles(16, 256, 1, mode="dot"), gp.Tiles(16, 64, 2, mode="dot", rows=2)]
    for base in wide:
        assert gp.check_tiles(fmt, n, k, base) is None, base
        for m in ((1, 3) if base.mode == "fma" else (2,)):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), F32).astype(jnp.bfloat16)
            run = lambda t: np.asarray(gp.gemv(x, w, extra.get("scale"), extra.get("scale_2"), fmt=fmt,  # noqa
                                               tiles=t, interpret=INTERPRET), np.float32)
            np.testing.assert_array_equal(run(dataclasses.replace(base, xfirst=1)), run(base),
                                          err_msg=f"{base} m={m}")
    monkeypatch.delenv(api.XFIRST_ENV, raising=False)
    for m in (1, 5):          # on by default (measured), off with the knob at 0
        t = api.tiles_for("fp8", 2560, 6144, m)
        assert t.xfirst == (1 if t.mode in ("fma", "dot") else 0), t
        monkeypatch.setenv(api.XFIRST_ENV, "0")
        assert api.tiles_for("fp8", 2560, 6144, m).xfirst == 0
        monkeypatch.delenv(api.XFIRST_ENV)
    monkeypatch.setenv(api.XFIRST_ENV, "yes")
    with pytest.raises(ValueError, match="0 or 1"):
        api.tiles_for("fp8", 2560, 6144, 1)


def _pallas_grid(fn, *args):
    """The grid of the one pallas_call in fn's jaxpr."""
    def find(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                return e.params["grid_mapping"].grid
            for p in e.params.values():
                inner = getattr(p, "jaxpr", None)
                found = inner is not None and find(getattr(inner, "jaxpr", inner))
                if found:
                    return found
        return None
    return find(jax.make_jaxpr(fn)(*args).jaxpr)


@pytest.mark.parametrize("t,grid", [(gp.Tiles(16, 64, 1, mode="fma"), (16,)),
                                    (gp.Tiles(16, 64, 1, mode="fma", rows=4), (4,)),
                                    (gp.Tiles(16, 64, 2, mode="dot", rows=2), (8, 2)),
                                    (gp.Tiles(16, 64, 4), (16, 4))])
def test_grid_has_one_program_per_row_tiles_and_k_slice(t, grid):
    """N / (bn * rows) programs along the rows (in the interpreter an extra program's clamped loads and stores
    would rewrite the last tile with its own values: invisible in the outputs), times the K slices."""
    n, k = 256, 512
    x, w = jnp.ones((2, k), jnp.bfloat16), jnp.ones((n, k), jnp.bfloat16)
    assert _pallas_grid(lambda x, w: gp.gemv(x, w, fmt="bf16", tiles=t, interpret=True), x, w) == grid


def test_tuned_fma_tiles_are_not_used_beyond_their_token_count(monkeypatch):
    """A tuned "fma" entry (M bucket 1) serves one token (FMA_AUTO_MAX_M); more tokens get the heuristic's looped
    tiles (measured faster at five), unless an entry tuned at their own bucket names "fma"."""
    n, k = 2560, 2560
    entry = {"bn": 8, "bk": 512, "split": 1, "num_warps": 4, "num_stages": 1, "dec": "f32", "mode": "fma"}
    monkeypatch.setattr(api, "_tuned", lambda kind: {f"fp8:{n}:{k}:1": entry})
    fma = gp.Tiles(**entry, xfirst=1)         # whole-K tiles load their activations first (api.XFIRST_DEFAULT)
    assert api.tiles_for("fp8", n, k, 1) == fma
    for m in (2, 5, 16):
        t = api.tiles_for("fp8", n, k, m)
        assert t is not None and t.mode == "loop", m
    monkeypatch.setattr(api, "_tuned", lambda kind: {f"fp8:{n}:{k}:1": entry, f"fp8:{n}:{k}:8": entry})
    assert api.tiles_for("fp8", n, k, 5) == fma      # tuned at bucket 8 itself
    assert api.heuristic_tiles("fp8", 320, 10240, 1).mode == "fma"
    assert api.heuristic_tiles("fp8", 320, 10240, 5).mode == "loop"


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_fused_argmax_equals_argmax_of_fp32_logits(fmt):
    n, k = 512, 256
    key = jax.random.PRNGKey(np.random.SeedSequence().entropy % (2**31))
    w, extra, q = _weights(fmt, n, k, key)
    x = jax.random.normal(key, (4, k), F32).astype(jnp.bfloat16)
    ids = api.linear_argmax(x, w, fmt=fmt, impl=KERNEL, **extra)
    logits = reference.linear_f32(x, quant.dequantize(q, F32) if fmt != "bf16" else w)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(jnp.argmax(logits, -1)))


def test_pairs_at_a_few_tokens_run_apart():
    """At an MTP verify window's five tokens both pairs' FP8 products loop over K (split-K): the products run apart
    (pairing the MoE's with one-token tiles measured slower, api's note)."""
    k = 2560
    for n1, n2 in ((1280, 513), (16384, 96)):
        assert api.pair_applies((1, k), jnp.bfloat16, (n1, k), (n2, k), jnp.bfloat16) is None
        assert "loop" in api.pair_applies((5, k), jnp.bfloat16, (n1, k), (n2, k), jnp.bfloat16)


def test_auto_takes_the_fp8_argmax_kernel_only_with_whole_k_tiles():
    """"auto" runs the FP8 fused argmax where its tiles take whole K per program (the one-token heads: the MTP
    draft head) and keeps XLA's head where they loop over K (measured slower there)."""
    for n in (32768, 248320):
        assert api.tiles_for("fp8", n, 2560, 1, argmax=True).mode == "fma"
        assert api.argmax_auto_reason("fp8", n, 2560, 1) is None
        assert api.tiles_for("fp8", n, 2560, 5, argmax=True).mode == "loop"
        assert api.argmax_auto_reason("fp8", n, 2560, 5) == api.ARGMAX_LOOP_REASON
    assert api.argmax_auto_reason("nvfp4", 248320, 2560, 5) is None
    assert "gemv_fp8_argmax" not in dispatch.AUTO_KEEPS_REFERENCE and "gemv_fp8_argmax" in dispatch.VERIFIED_ON_GPU


def test_fused_argmax_ties_go_to_lowest_id():
    """Identical rows in different tiles and within one tile: the lowest id wins, as jnp.argmax."""
    n, k = 256, 128
    key = jax.random.PRNGKey(np.random.SeedSequence().entropy % (2**31))
    w = jax.random.normal(key, (n, k), F32) * 0.01
    best = jnp.ones((k,), F32) * 0.1
    w = w.at[200].set(best).at[70].set(best).at[77].set(best).astype(jnp.bfloat16)
    x = jnp.ones((2, k), jnp.bfloat16)
    ids = api.linear_argmax(x, w, impl=KERNEL)
    assert np.asarray(ids).tolist() == [70, 70]


def test_dispatch_reference_is_the_model_arithmetic():
    """impl='reference' reproduces ops.linear's pre-kernel arithmetic bit for bit (weights rounded to x.dtype)."""
    key = jax.random.PRNGKey(0)
    w = jax.random.normal(key, (256, 384), F32)
    x = jax.random.normal(key, (3, 384), F32).astype(jnp.bfloat16)
    for q in (quant.quantize_fp8_block(w), quant.quantize_nvfp4(w)):
        want = jax.lax.dot_general(x, quant.dequantize(q, x.dtype), (((1,), (1,)), ((), ())),
                                   precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32).astype(x.dtype)
        np.testing.assert_array_equal(np.asarray(ops.linear(x, q, impl="reference"), np.float32),
                                      np.asarray(want, np.float32))


def test_named_backend_that_does_not_apply_raises():
    x = jnp.ones((64, 256), jnp.bfloat16)     # 64 tokens > MAX_M
    w = jnp.ones((128, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="does not apply"):
        api.linear(x, w, impl=KERNEL)
    if KERNEL != "pallas":   # without a GPU, naming the compiled backend is an error, not a fallback
        with pytest.raises(ValueError, match="cannot run here"):
            api.linear(x[:1], w, impl="pallas")


def test_model_linear_routes_through_the_kernel_when_asked():
    key = jax.random.PRNGKey(1)
    q = quant.quantize_fp8_block(jax.random.normal(key, (256, 256), F32))
    x = jax.random.normal(key, (2, 256), F32).astype(jnp.bfloat16)
    y = ops.linear(x, q, impl=KERNEL)
    ref = ops.linear(x, q, impl="reference")
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=3e-2,
                               atol=1e-2 * float(jnp.abs(ref.astype(F32)).max()))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_kernels_lower_for_cuda_at_released_shapes(fmt):
    """The Pallas->Triton lowering runs for every released shape (the GPU compile check CPU CI can make)."""
    for name, n, k in shapes.RELEASED:
        for m in (1, 5):
            t = api.tiles_for(fmt, n, k, m)
            assert t is not None, (fmt, name)
            x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
            if fmt == "bf16":
                args = (jax.ShapeDtypeStruct((n, k), jnp.bfloat16), None, None)
            elif fmt == "fp8":
                args = (jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
                        jax.ShapeDtypeStruct((-(-n // 128), -(-k // 128)), F32), None)
            else:
                args = (jax.ShapeDtypeStruct((n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((n, k // 16), jnp.float8_e4m3fn),
                        jax.ShapeDtypeStruct((n,), F32))
            f = lambda x, w, s, s2: gp.gemv(x, w, s, s2, fmt=fmt, tiles=t)
            text = jax.jit(f).trace(x, *args).lower(lowering_platforms=("cuda",)).as_text()
            assert "triton" in text


def test_tile_variants_lower_for_cuda():
    """The variants the tuner may pick lower too: FP8 steps of several 128-column blocks, every NVFP4 decode, the
    whole-K modes in bf16 and FP8."""
    n, k = 2560, 6144
    x = jax.ShapeDtypeStruct((5, k), jnp.bfloat16)
    fp8 = (jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((n // 128, k // 128), F32), None)
    nv = (jax.ShapeDtypeStruct((n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((n, k // 16), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((n,), F32))
    cases = [("fp8", gp.Tiles(64, 256, 4), fp8), ("fp8", gp.Tiles(128, 512, 1, 8), fp8)]
    cases += [(f, gp.Tiles(bn, 512, 1, 4, 1, mode=mode), a) for f, a in (("fp8", fp8), ("bf16", (fp8[0].update(
        dtype=jnp.bfloat16), None, None))) for bn, mode in ((8, "fma"), (32, "dot"))]
    cases += [("nvfp4", gp.Tiles(64, 256, 2, dec=d), nv) for d in gp.DECODES]
    cases += [("fp8", gp.Tiles(64, 128, 4, tr=1), fp8), ("fp8", gp.Tiles(128, 256, 2, tr=1), fp8),
              ("nvfp4", gp.Tiles(64, 256, 2, tr=1), nv), ("fp8", gp.Tiles(32, 512, 1, 4, 1, mode="dot", tr=1), fp8),
              ("fp8", gp.Tiles(64, 128, 4, mma="f16"), fp8), ("fp8", gp.Tiles(128, 256, 2, mma="f16", tr=1), fp8),
              ("fp8", gp.Tiles(32, 512, 1, 4, 1, mode="dot", mma="f16"), fp8),
              ("nvfp4", gp.Tiles(64, 256, 2, mma="f16"), nv),
              ("nvfp4", gp.Tiles(64, 256, 2, dec="f32g", mma="f16"), nv)]
    one = jax.ShapeDtypeStruct((1, k), jnp.bfloat16)     # "fma" with acc 1 keeps its tile at one token only
    cases = [(f, t, a, x) for f, t, a in cases] + [(f, gp.Tiles(8, 512, 1, 4, 1, mode="fma", acc=acc, rows=r), a, one)
                                                   for f, a in (("fp8", fp8), ("bf16", (fp8[0].update(
                                                       dtype=jnp.bfloat16), None, None)))
                                                   for acc, r in ((1, 1), (0, 2), (1, 4))]
    cases += [("fp8", gp.Tiles(8, 512, 3, 4, 1, mode="fma"), fp8, x), ("fp8", gp.Tiles(8, 512, 4, 4, 1, mode="fma",
                                                                                        rows=2), fp8, one)]
    for fmt, t, args, xs in cases:
        f = lambda x, w, s, s2: gp.gemv(x, w, s, s2, fmt=fmt, tiles=t)
        text = jax.jit(f).trace(xs, *args).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text, (fmt, t)
    assert "acc=1" in gp.check_tiles("fp8", n, k, gp.Tiles(64, 256, 4, acc=1))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_gpu_kernel_matches_reference_at_released_shapes(fmt):
    """On a GPU: the compiled kernel (tuned or heuristic tiles) against the fp32 reference, every released shape."""
    from fnx.pallas.gemv import bench
    for name, n, k in shapes.RELEASED:
        key = jax.random.PRNGKey(n + k)
        raw = bench.make_weight(fmt, n, k, key)
        wf = reference.dequantize(fmt, raw["w"], raw.get("scale"), raw.get("scale_2"))
        for m in (1, 5, 32):
            x = jax.random.normal(jax.random.fold_in(key, m), (m, k), F32).astype(jnp.bfloat16)
            y = api.linear(x, raw["w"], fmt=fmt, scale=raw.get("scale"), scale_2=raw.get("scale_2"), impl="pallas")
            ref = reference.linear_f32(x, wf)
            err = float(jnp.max(jnp.abs(y.astype(F32) - ref)) / jnp.max(jnp.abs(ref)))
            assert err < 1e-2, (fmt, name, m, err)
        if name == "lm_head":
            x = jax.random.normal(key, (4, k), F32).astype(jnp.bfloat16)
            ids = api.linear_argmax(x, raw["w"], fmt=fmt, scale=raw.get("scale"), scale_2=raw.get("scale_2"),
                                    impl="pallas")
            np.testing.assert_array_equal(np.asarray(ids), np.asarray(jnp.argmax(reference.linear_f32(x, wf), -1)))


# ---- gemv_pair: an FP8 product and a narrow bf16 one of the same x, one launch --------------------------------------

@pytest.mark.parametrize("m,n2,mode,rows", [(1, 96, "fma", 1), (1, 513, "fma", 1), (3, 13, "fma", 1),
                                            (2, 40, "dot", 1), (1, 96, "fma", 4), (5, 513, "fma", 2)])
def test_pair_equals_the_two_products(m, n2, mode, rows):
    """The FP8 half is the whole-K kernel's own body (the same bits as `gemv` with the same tiles); the narrow bf16
    half against the fp32 reference within one output rounding (its rows past N2 masked: 513 = the router + the
    shared expert's gate logit, 13 a row count below one tile)."""
    k, n1 = 1024, 256
    key = jax.random.PRNGKey(np.random.SeedSequence().entropy % (2**31))
    w1, extra, _ = _weights("fp8", n1, k, key)
    w2, _, _ = _weights("bf16", n2, k, jax.random.fold_in(key, 1))
    x = jax.random.normal(jax.random.fold_in(key, 2), (m, k), F32).astype(jnp.bfloat16)
    t = gp.Tiles(16 if mode == "fma" else 32, 512, 1, num_warps=4, num_stages=1, mode=mode, rows=rows)
    y1, y2 = gp.gemv_pair(x, w1, extra["scale"], w2, tiles=t, interpret=INTERPRET)
    assert y1.shape == (m, n1) and y2.shape == (m, n2) and y1.dtype == y2.dtype == jnp.bfloat16
    want1 = gp.gemv(x, w1, extra["scale"], fmt="fp8", tiles=t, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(want1, np.float32))
    ref2 = np.asarray(reference.linear_f32(x, w2.astype(F32)))
    err = np.abs(np.asarray(y2, np.float32) - ref2).max() / np.abs(ref2).max()
    assert np.all(np.isfinite(np.asarray(y2, np.float32))) and err <= TOL, err


def test_pair_dispatch_and_model_wiring(monkeypatch):
    """`ops.linear_pair` in either order: the kernel when FNX_KERNELS names it (one launch), the two products apart
    on the reference; a pair it does not serve (FP8 tiles that loop over K, a wide bf16 product) runs apart there
    and raises when the kernel is named by impl."""
    from fnx.pallas import dispatch
    k = 2048                                    # the heuristic's whole-K ("fma") tiles start at K = 2048
    key = jax.random.PRNGKey(3)
    q = quant.quantize_fp8_block(jax.random.normal(key, (256, k), F32) * k ** -0.5)
    wb = (jax.random.normal(jax.random.fold_in(key, 1), (96, k), F32) * k ** -0.5).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 2), (1, 1, k), F32).astype(jnp.bfloat16)
    want = (ops.linear(x, q), ops.linear(x, wb))
    monkeypatch.setenv("FNX_KERNELS", f"gemv_pair={KERNEL}")
    for order in ((q, wb), (wb, q)):
        jaxpr = jax.make_jaxpr(lambda x: ops.linear_pair(x, *order))(x)
        calls = [e for e in jaxpr.jaxpr.eqns if "pallas_call" in str(e)]
        assert len(calls) == 1, order
        got = ops.linear_pair(x, *order)
        got = got if order[0] is q else got[::-1]
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2,
                                       atol=2e-2 * float(jnp.abs(w.astype(F32)).max()))
    small = quant.quantize_fp8_block(jax.random.normal(key, (256, 512), F32))
    jaxpr = jax.make_jaxpr(lambda x: ops.linear_pair(x, small, wb[:, :512]))(x[..., :512])
    assert "fnx_gemv_pair" not in str(jaxpr)               # FNX_KERNELS names it, the call is not served: apart
    with pytest.raises(dispatch.NotApplicable, match="loop"):
        api.linear_pair(x[..., :512], small.w, small.scale_inv, wb[:, :512], impl=KERNEL)
    split = gp.Tiles(16, 512, 2, num_stages=1, mode="fma")       # a tuned split-K entry runs unsplit in the pair
    assert api.pair_tiles(split) == dataclasses.replace(split, split=1)
    with pytest.raises(ValueError, match="without split-K"):
        gp.gemv_pair(x[0], q.w, q.scale_inv, wb, tiles=split, interpret=True)
    with pytest.raises(dispatch.NotApplicable, match="narrow"):
        api.linear_pair(x, q.w, q.scale_inv, jnp.zeros((2048, k), jnp.bfloat16), impl=KERNEL)
    monkeypatch.setenv("FNX_KERNELS", "gemv_pair=reference")
    ys = ops.linear_pair(x, q, wb)
    for g, w in zip(ys, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_pair_lowers_for_cuda_at_released_shapes():
    """The GDN pair (qkv + z 16384 x 2560 FP8, b + a 96 x 2560 bf16) and the MoE pair (shared gate / up 1280 x 2560
    FP8, router + shared gate logit 513 x 2560 bf16) at one token, and the MoE pair at five with the one-token
    tiles (served by the kernel, not taken by the dispatch: measured slower)."""
    for n1, n2, m in ((16384, 96, 1), (1280, 513, 1), (1280, 513, 5)):
        k = 2560
        t = api.pair_tiles(api.tiles_for("fp8", n1, k, 1))
        assert t.mode != "loop", t
        args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n1, k), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((n1 // 128, k // 128), F32), jax.ShapeDtypeStruct((n2, k), jnp.bfloat16))
        text = jax.jit(lambda *a: gp.gemv_pair(*a, tiles=t)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "fnx_gemv_pair_fp8" in text


def test_fused_projections_take_the_pair_kernel(monkeypatch):
    """A GDN layer's input projections with FP8 qkv / z and bf16 b / a (the online-FP8 layout): `fuse_sublayer`
    makes two products (qkv + z, b + a) and `linear_windows` computes both in one launch when the pair kernel is
    on, each window equal to its own product."""
    from fnx.model import fuse
    k = 2048
    key = jax.random.PRNGKey(4)
    rnd = lambda i, n: jax.random.normal(jax.random.fold_in(key, i), (n, k), F32) * k ** -0.5  # noqa: E731
    p = {"in_proj_qkv": quant.quantize_fp8_block(rnd(0, 256)), "in_proj_z": quant.quantize_fp8_block(rnd(1, 128)),
         "in_proj_b": rnd(2, 4).astype(jnp.bfloat16), "in_proj_a": rnd(3, 4).astype(jnp.bfloat16)}
    names = fuse.GROUPS["linear_attn"]
    pf = fuse.fuse_sublayer(p, names)
    assert sum(k.startswith(fuse.PREFIX) for k in pf) == 2
    x = jax.random.normal(jax.random.fold_in(key, 9), (1, 1, k), F32).astype(jnp.bfloat16)
    want = [ops.linear(x, p[n]) for n in names]
    monkeypatch.setenv("FNX_KERNELS", f"gemv_pair={KERNEL}")
    assert "fnx_gemv_pair" in str(jax.make_jaxpr(lambda x: [w.get() for w in fuse.linear_windows(x, pf, names)])(x))
    for win, w in zip(fuse.linear_windows(x, pf, names), want):
        g = win.get()
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2,
                                   atol=2e-2 * float(jnp.abs(w.astype(F32)).max()))


def _sliced(jaxpr, targets) -> bool:
    """Whether a slice op takes one of `targets` (vars of `jaxpr`, followed through reshapes, converts and into
    nested jaxprs) as its operand."""
    targets = set(targets)
    for e in jaxpr.eqns:
        ins = [v for v in e.invars if not hasattr(v, "val")]          # variables (a Literal holds a value)
        if e.primitive.name in ("slice", "dynamic_slice") and ins and ins[0] in targets:
            return True
        if e.primitive.name in ("reshape", "convert_element_type") and ins and ins[0] in targets:
            targets.update(e.outvars)
        for sub in ("jaxpr", "call_jaxpr"):
            if sub in e.params:
                inner = getattr(e.params[sub], "jaxpr", e.params[sub])
                if _sliced(inner, [iv for iv, ov in zip(inner.invars, e.invars) if not hasattr(ov, "val")
                                   and ov in targets]):
                    return True
    return False


@pytest.mark.parametrize("fmt,tiles", [("fp8", gp.Tiles(64, 32, 2)), ("bf16", gp.Tiles(32, 64, 1, mode="dot")),
                                       ("fp8", gp.Tiles(16, 64, 1, num_stages=1, mode="fma"))])
def test_x_wider_than_k_reads_its_first_columns_in_place(fmt, tiles):
    """`k` / `x_cols`: the input is the first K columns of a wider x (a window of a buffer another op wrote: the
    few-token HC boundary's u beside inj's logits): the bits of the product of the slice, and no slice op before
    the launch; NVFP4 (x split into even / odd columns outside) and a K past x are refused."""
    n, k, m = 128, 320, 5
    w, extra, _ = _weights(fmt, n, k, jax.random.PRNGKey(9))
    xw = jax.random.normal(jax.random.PRNGKey(10), (m, k + 4), F32).astype(jnp.bfloat16)
    got = gp.gemv(xw, w, extra.get("scale"), fmt=fmt, tiles=tiles, interpret=INTERPRET, k=k)
    want = gp.gemv(xw[:, :k], w, extra.get("scale"), fmt=fmt, tiles=tiles, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))
    jx = jax.make_jaxpr(lambda x: api.linear(x, w, fmt=fmt, impl=KERNEL, x_cols=k, **extra))(xw).jaxpr
    assert "pallas_call" in str(jx) and not _sliced(jx, jx.invars)
    jx = jax.make_jaxpr(lambda x: api.linear(x[:, :k], w, fmt=fmt, impl=KERNEL, **extra))(xw).jaxpr
    assert _sliced(jx, jx.invars)                                      # (the check sees a slice where there is one)
    ref = api.linear(xw, w, fmt=fmt, impl="reference", x_cols=k, **extra)
    np.testing.assert_array_equal(np.asarray(ref, F32), np.asarray(api.linear(xw[:, :k], w, fmt=fmt,
                                                                              impl="reference", **extra), F32))
    with pytest.raises(ValueError, match="x_cols"):
        api.linear(xw, w, fmt=fmt, x_cols=k + 5, **extra)
    with pytest.raises(ValueError, match="k="):
        gp.gemv(xw, w, extra.get("scale"), fmt=fmt, tiles=tiles, interpret=True, k=k + 5)


# ---- gemv_pair_many: the pair at several tokens, the narrow rows inside the FP8 kernel's split-K grid -------------

def _pair_many_case(m, n1, n2, k, seed):
    key = jax.random.PRNGKey(seed)
    w1, extra, _ = _weights("fp8", n1, k, key)
    w2, _, _ = _weights("bf16", n2, k, jax.random.fold_in(key, 1))
    x = jax.random.normal(jax.random.fold_in(key, 2), (m, k), F32).astype(jnp.bfloat16)
    return x, w1, extra["scale"], w2


@pytest.mark.parametrize("m,n2,tiles", [
    (5, 96, gp.Tiles(64, 128, 2)),                       # the GDN pair's shape class (b + a: 96 rows), split 2
    (5, 513, gp.Tiles(32, 128, 8, mma="f16")),           # the MoE pair's: 513 rows, one 128-column chunk per slice
    (3, 13, gp.Tiles(64, 256, 2)),                       # fewer rows than one narrow program
    (8, 640, gp.Tiles(64, 128, 1)),                      # the QSA pair's indexer rows, unsplit (bf16 written)
    (2, 40, gp.Tiles(32, 128, 1, mode="dot")),           # whole-K tensor-core tiles
    (5, 40, gp.Tiles(32, 128, 4, mode="dot", mma="f16")),   # whole-K tiles with split-K
    (17, 96, gp.Tiles(64, 128, 2)),                      # 32 padded token rows
    (1, 96, gp.Tiles(64, 128, 2)),
])
def test_pair_many_equals_the_two_products(m, n2, tiles):
    """One product [M, N1 + N2p]: its FP8 columns have the bits of `gemv` with the same tiles (the same kernel body,
    the same split sum), its narrow columns the fp32 reference's values within one output rounding."""
    k, n1 = 1024, 256
    seed = int(np.random.SeedSequence().entropy % 2**31)
    x, w1, s1, w2 = _pair_many_case(m, n1, n2, k, seed)
    buf = gp.gemv_pair_many(x, w1, s1, w2, tiles=tiles, interpret=INTERPRET)
    assert buf.shape == (m, n1 + -(-n2 // 16) * 16) and buf.dtype == jnp.bfloat16
    want1 = gp.gemv(x, w1, s1, fmt="fp8", tiles=tiles, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(buf[:, :n1], F32), np.asarray(want1, F32))
    y2 = np.asarray(buf[:, n1:n1 + n2], F32)
    ref2 = np.asarray(reference.linear_f32(x, w2.astype(F32)))
    err = np.abs(y2 - ref2).max() / np.abs(ref2).max()
    assert np.all(np.isfinite(y2)) and err <= TOL, (err, f"seed {seed}")
    # against XLA's bf16 product (what runs apart): one rounding of each output at most
    xla = np.asarray(ops.linear(x, w2), F32)
    assert np.all(np.abs(y2 - xla) <= 2 ** -7 * np.abs(xla) + 1e-6 * np.abs(xla).max()), f"seed {seed}"


def test_pair_many_refuses_what_it_does_not_serve():
    x, w1, s1, w2 = _pair_many_case(5, 256, 96, 1024, 0)
    with pytest.raises(ValueError, match="tensor-core"):
        gp.gemv_pair_many(x, w1, s1, w2, tiles=gp.Tiles(16, 512, 1, num_stages=1, mode="fma"), interpret=True)
    with pytest.raises(ValueError, match="narrow"):
        gp.gemv_pair_many(x, w1, s1, w2.astype(F32), tiles=gp.Tiles(64, 128, 2), interpret=True)
    with pytest.raises(ValueError, match="narrow"):          # more rows than the few narrow programs are for
        gp.gemv_pair_many(x, w1, s1, jnp.zeros((2048, 1024), jnp.bfloat16), tiles=gp.Tiles(64, 128, 2),
                          interpret=True)
    with pytest.raises(ValueError, match="tokens"):
        gp.gemv_pair_many(jnp.zeros((33, 1024), jnp.bfloat16), w1, s1, w2, tiles=gp.Tiles(64, 128, 2),
                          interpret=True)
    assert gp.pair_many_side(96, 2560, 2) == 256 and gp.pair_many_side(513, 2560, 20) == 128
    assert gp.pair_many_side(96, 2560, 1) == 256             # an unsplit K of 2,560: ten chunks
    assert gp.pair_many_side(96, 24, 1) is None              # no power-of-two chunk of 16+ columns divides K


def test_pair_many_dispatch_and_model_wiring(monkeypatch):
    """At five tokens with tensor-core FP8 tiles `ops.linear_pair` is op "gemv_pair_many": one launch when FNX_KERNELS
    names it, both products as windows of its one buffer; the products apart on the reference (and under "auto"
    off a GPU; on one "auto" picks the kernel, whose compiled tests passed); the one-token op is not asked."""
    from fnx.model import fuse
    k = 1024
    key = jax.random.PRNGKey(11)
    q = quant.quantize_fp8_block(jax.random.normal(key, (256, k), F32) * k ** -0.5)
    wb = (jax.random.normal(jax.random.fold_in(key, 1), (96, k), F32) * k ** -0.5).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.fold_in(key, 2), (1, 5, k), F32).astype(jnp.bfloat16)
    want = (ops.linear(x, q), ops.linear(x, wb))
    assert api.pair_op(x.shape, q.w.shape) == "gemv_pair_many" and api.pair_op((1, 1, k), q.w.shape) == "gemv_pair"
    assert "gemv_pair_many" in dispatch.KNOWN_OPS and "gemv_pair_many" in dispatch.VERIFIED_ON_GPU
    monkeypatch.setenv("FNX_KERNELS", f"gemv_pair_many={KERNEL}")
    for order in ((q, wb), (wb, q)):
        jaxpr = jax.make_jaxpr(lambda x: ops.linear_pair(x, *order))(x)
        calls = [e for e in jaxpr.jaxpr.eqns if "pallas_call" in str(e)]
        assert len(calls) == 1 and "fnx_gemv_pair_many" in str(jaxpr), order
        got = ops.linear_pair(x, *order)
        got = got if order[0] is q else got[::-1]
        for g, w in zip(got, want):
            assert g.shape == w.shape
            np.testing.assert_allclose(np.asarray(g, F32), np.asarray(w, F32), rtol=2e-2,
                                       atol=2e-2 * float(jnp.abs(w.astype(F32)).max()))
    (b1, s1), (b2, s2) = ops.linear_pair(x, q, wb, windows=True)
    assert b1 is b2 and (s1, s2) == (0, 256) and b1.shape[:2] == (1, 5)
    # the fused GDN projections (qkv + z FP8, b + a bf16): every window into the one buffer
    rnd = lambda i, n: jax.random.normal(jax.random.fold_in(key, 20 + i), (n, k), F32) * k ** -0.5  # noqa: E731
    p = {"in_proj_qkv": quant.quantize_fp8_block(rnd(0, 256)), "in_proj_z": quant.quantize_fp8_block(rnd(1, 128)),
         "in_proj_b": rnd(2, 4).astype(jnp.bfloat16), "in_proj_a": rnd(3, 4).astype(jnp.bfloat16)}
    names = fuse.GROUPS["linear_attn"]
    pf = fuse.fuse_sublayer(p, names)
    wins = fuse.linear_windows(x, pf, names)
    assert len({id(w.buf) for w in wins}) == 1 and [w.start for w in wins] == [0, 256, 384, 388]
    for win, n in zip(wins, names):
        g, w = win.get(), ops.linear(x, p[n])
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g, F32), np.asarray(w, F32), rtol=2e-2,
                                   atol=2e-2 * float(jnp.abs(w.astype(F32)).max()))
    with pytest.raises(dispatch.NotApplicable, match="narrow"):
        api.linear_pair(x, q.w, q.scale_inv, jnp.zeros((2048, k), jnp.bfloat16), impl=KERNEL)
    monkeypatch.setenv("FNX_KERNELS", "gemv_pair_many=reference")
    for g, w in zip(ops.linear_pair(x, q, wb), want):
        np.testing.assert_array_equal(np.asarray(g, F32), np.asarray(w, F32))
    monkeypatch.delenv("FNX_KERNELS")
    # auto: the kernel on a GPU (its compiled tests passed), the reference's products apart elsewhere (on the GPU the
    # apart products would be GEMV kernels themselves, so the check names the pair kernel, not any pallas_call)
    auto = str(jax.make_jaxpr(lambda x: ops.linear_pair(x, q, wb))(x))
    assert ("fnx_gemv_pair_many" in auto) == (jax.default_backend() == "gpu")


def test_pair_many_lowers_for_cuda_at_released_shapes():
    """The three several-token pairs of the served model at five tokens (the GDN qkv + z with b + a, the QSA
    q / k / v with the indexer's projection, the MoE's shared gate / up with the router and shared gate logit),
    with the H200 table's tiles and with the heuristic's."""
    k = 2560
    table = api._tuned("nvidia_h200")
    for n1, n2 in ((16384, 96), (13312, 640), (1280, 513)):
        tuned = gp.Tiles(**table[f"fp8:{n1}:{k}:8"])
        for t in (api._many_mma(tuned, "fp8", n1, k, 5), api.tiles_for("fp8", n1, k, 5)):
            assert t.mode == "loop" and gp.pair_many_side(n2, k, t.split) is not None, t
            args = (jax.ShapeDtypeStruct((5, k), jnp.bfloat16), jax.ShapeDtypeStruct((n1, k), jnp.float8_e4m3fn),
                    jax.ShapeDtypeStruct((n1 // 128, k // 128), F32), jax.ShapeDtypeStruct((n2, k), jnp.bfloat16))
            text = jax.jit(lambda *a: gp.gemv_pair_many(*a, tiles=t)).trace(*args).lower(
                lowering_platforms=("cuda",)).as_text()
            assert "fnx_gemv_pair_many_fp8_loop" in text


@pytest.mark.parametrize("fmt,tiles", [("fp8", gp.Tiles(16, 512, 1, mode="fma")), ("fp8", gp.Tiles(16, 128, 1, mode="dot")),
                                       ("fp8", gp.Tiles(64, 128, 2)), ("nvfp4", gp.Tiles(64, 128, 2)),
                                       ("bf16", gp.Tiles(16, 128, 1, mode="dot"))])
def test_tokens_below_the_tile_need_no_padded_copy(fmt, tiles):
    """At M = 5 (the MTP verify window) the kernels read x's five rows themselves: the traced program holds no
    scatter or pad of x before the launch (each was one more XLA kernel per product), and the result is the
    product."""
    n, k, m = 128, 1024, 5
    key = jax.random.PRNGKey(7)
    w, extra, q = _weights(fmt, n, k, key)
    x = jax.random.normal(key, (m, k), F32).astype(jnp.bfloat16)
    f = lambda x: gp.gemv(x, w, extra.get("scale"), extra.get("scale_2"), fmt=fmt, tiles=tiles,  # noqa: E731
                          interpret=INTERPRET)
    jaxpr = str(jax.make_jaxpr(f)(x))
    assert "scatter" not in jaxpr and " pad[" not in jaxpr and "pad " not in jaxpr, jaxpr[:2000]
    ref = reference.linear_f32(x, quant.dequantize(q, F32) if fmt != "bf16" else w)
    y = np.asarray(f(x), np.float32)
    assert y.shape == (m, n)
    assert np.abs(y - np.asarray(ref)).max() <= TOL * np.abs(np.asarray(ref)).max()


@pytest.mark.parametrize("t,m", [(gp.Tiles(32, 128, 4), 3), (gp.Tiles(16, 256, 2, mode="fma", num_stages=1), 1),
                                 (gp.Tiles(16, 128, 2, mode="dot", num_stages=1, rows=2), 5),
                                 pytest.param(gp.Tiles(32, 128, 8), 1, marks=pytest.mark.extended)])
def test_split_sum_in_the_kernel_equals_the_split_order_sum(t, m):
    """Split-K tiles with the sum in the kernel (`finish_tile`: the last of a row tile's split programs, by an atomic
    count, sums the partials): the partials' sum in split order, exactly, for every tile mode; the counters it
    advances by S stay multiples of S for the next call; no XLA sum after the kernel."""
    n, k = 128, 1024
    key = jax.random.PRNGKey(np.random.SeedSequence().entropy % (2**31))
    w, extra, q = _weights("fp8", n, k, key)
    x = jax.random.normal(key, (m, k), F32).astype(jnp.bfloat16)
    ctr = jnp.zeros((64,), jnp.int32)
    base = 7
    f = lambda x, c: gp.gemv(x, w, extra["scale"], fmt="fp8", tiles=t, interpret=INTERPRET, counters=c,  # noqa
                             finish_base=base)
    got = np.asarray(f(x, ctr), np.float32)
    assert "reduce_sum" not in ops_outside_kernels(f, x, ctr)
    parts = np.asarray(jax.jit(lambda x: _partials("fp8", x, w, extra, t))(x), np.float32)
    want = parts[0]
    for p_ in parts[1:]:
        want = want + p_
    np.testing.assert_array_equal(got, np.asarray(jnp.asarray(want[:m]).astype(jnp.bfloat16), np.float32))
    with pytest.raises(ValueError, match="split-K tiles"):
        gp.gemv(x, w, extra["scale"], fmt="fp8", tiles=dataclasses.replace(t, split=1), interpret=INTERPRET,
                counters=ctr, finish_base=0)
    with pytest.raises(ValueError, match=r"int32 counters \[63 \+ "):
        gp.gemv(x, w, extra["scale"], fmt="fp8", tiles=t, interpret=INTERPRET, counters=ctr, finish_base=63)


def _partials(fmt, x, w, extra, t):
    """The kernel's split partials [S, Mp, N] fp32 (the sum left undone), for the tests' own split-order sum."""
    from fnx.pallas.gemv.pallas import _kernel, _padded_m, _wide_kernel
    import functools as ft
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt
    m, k = x.shape
    n = w.shape[0]
    mp = _padded_m(m, t.mode)
    kern = ft.partial(_kernel, fmt=fmt, t=t, k=k, out_dtype=F32, argmax=False, mp=mp) if t.mode == "loop" else \
        ft.partial(_wide_kernel, fmt=fmt, t=t, k=k, m=m, out_dtype=F32, argmax=False)
    params = {} if INTERPRET else {"compiler_params": plt.CompilerParams(num_warps=t.num_warps,
                                                                         num_stages=t.num_stages)}
    return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((t.split, mp, n), F32),
                          grid=(n // (t.bn * t.rows), t.split), interpret=INTERPRET, **params)(
        x, w, extra["scale"].astype(F32))


def test_split_sum_in_the_kernel_through_the_api(monkeypatch):
    """`FNX_GEMV_FINISH=1` with a counter pool in scope (the model's, per program): `linear` and the several-token
    pair run their split sums in the kernel, each call on counters of its own (the pool hands out regions), the
    values those of the XLA sum within its order; without the knob, or without a pool, the XLA sum as before."""
    from fnx.pallas import grid_sync
    n, k = 256, 1024
    key = jax.random.PRNGKey(np.random.SeedSequence().entropy % (2**31))
    w, extra, q = _weights("fp8", n, k, key)
    w2 = (jax.random.normal(key, (40, k), F32) * 0.03).astype(jnp.bfloat16)
    x = jax.random.normal(key, (5, k), F32).astype(jnp.bfloat16)
    monkeypatch.setenv(api.SHAPE_TILES_ENV, "fp8:256:1024:8=bn=32,bk=128,split=4,mode=loop")

    def run(x):
        pool = grid_sync.CounterPool(grid_sync.counter(INTERPRET, 1024))
        with grid_sync.counter_pool(pool):
            y = api.linear(x, w, fmt="fp8", scale=extra["scale"], impl=KERNEL)
            a, b = api.linear_pair(x, w, extra["scale"], w2, impl=KERNEL)
        return (y, a, b), pool.used
    monkeypatch.setenv(api.FINISH_ENV, "0")
    want, used0 = run(x)
    sums0 = ops_outside_kernels(lambda x: run(x)[0], x).count("reduce_sum")
    monkeypatch.setenv(api.FINISH_ENV, "1")
    got, used1 = run(x)
    sums1 = ops_outside_kernels(lambda x: run(x)[0], x).count("reduce_sum")
    assert used0 == 0 and used1 == 256 // 32 + 256 // 32 + 3 and sums1 == 0 < sums0
    for g, w_ in zip(got, want):
        g, w_ = np.asarray(g, np.float32), np.asarray(w_, np.float32)
        assert g.shape == w_.shape
        np.testing.assert_allclose(g, w_, rtol=0, atol=2 ** -7 * np.abs(w_).max())
    with pytest.raises(ValueError, match="counter pool exhausted"):
        grid_sync.CounterPool(jnp.zeros((8,), jnp.int32)).take(9)
    monkeypatch.setenv(api.FINISH_ENV, "2")
    with pytest.raises(ValueError, match="FNX_GEMV_FINISH='2'"):
        api.finish_pool()


def test_gemm_out_knob(monkeypatch):
    """FNX_GEMM_OUT=x: the reference linear asks for its product in x's dtype (no separate conversion after it; a GPU
    knob), within a bf16 step of the default's fp32 product rounded after; fp32 inputs unchanged; "auto" (the
    default) keeps fp32 on the CPU and takes x on a GPU from AUTO_X_ROWS rows only; a bad value is refused."""
    from fnx.pallas.gemv import reference as gr
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 256)), jnp.float32)
    monkeypatch.delenv(gr.OUT_ENV, raising=False)
    base = gr.linear(x, w)

    def ops(f):     # a fresh function each time: traces are cached per function, and the knob is read when tracing
        jaxpr = jax.make_jaxpr(lambda a, b: f(a, b))(x, w)
        return [(e.primitive.name, e.params.get("preferred_element_type")) for e in jaxpr.eqns]
    assert [p for name, p in ops(gr.linear) if name == "dot_general"] == [jnp.dtype(jnp.float32)]
    monkeypatch.setenv(gr.OUT_ENV, "x")
    got = gr.linear(x, w)
    assert got.dtype == jnp.bfloat16
    dots = [p for name, p in ops(gr.linear) if name == "dot_general"]
    assert dots == [jnp.dtype(jnp.bfloat16)] and ("convert_element_type", None) not in ops(gr.linear)[1:]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(base, np.float32),
                               rtol=2 ** -7, atol=2 ** -7 * float(jnp.abs(base.astype(jnp.float32)).max()))
    assert not gr.out_in_x_dtype(jnp.float32)
    # "auto": a GPU and enough rows (the backend is asked when tracing; faked here)
    monkeypatch.setenv(gr.OUT_ENV, "auto")
    for backend, rows, want in (("cpu", 4096, False), ("gpu", gr.AUTO_X_ROWS, True), ("gpu", gr.AUTO_X_ROWS - 1, False),
                                ("gpu", None, False)):
        monkeypatch.setattr(gr.jax, "default_backend", lambda b=backend: b)
        assert gr.out_in_x_dtype(jnp.bfloat16, rows) is want, (backend, rows)
        assert not gr.out_in_x_dtype(jnp.float32, rows)
    monkeypatch.undo()
    monkeypatch.setenv(gr.OUT_ENV, "bf16")
    with pytest.raises(ValueError, match=gr.OUT_ENV):
        gr.linear(x, w)


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="the library's bf16 product on a GPU (compiled)")
@pytest.mark.parametrize("m", [1, 5, 32, 512, 2048])
def test_gemm_out_x_same_bits_on_gpu(monkeypatch, m):
    """On a GPU, the product asked for in bf16 (FNX_GEMM_OUT=x) gives the same bits as the fp32 product rounded
    after at the model's projection shapes, from 5 rows up (the "auto" default takes it from AUTO_X_ROWS rows);
    at one row the library's bf16 product is another kernel with other bits (an H100, 2026-12-06), so there the
    test asks only that "auto" keeps fp32's bits."""
    from fnx.pallas.gemv import reference as gr
    rng = np.random.default_rng(m)
    for n, k in ((16384, 2560), (2560, 6144), (320, 10240), (48, 2560), (2560, 1280)):
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((n, k)) * k ** -0.5, jnp.float32)
        monkeypatch.setenv(gr.OUT_ENV, "f32")
        base = jax.jit(lambda a, b: gr.linear(a, b))(x, w)
        monkeypatch.setenv(gr.OUT_ENV, "x" if m > 1 else "auto")
        got = jax.jit(lambda a, b: gr.linear(a, b))(x, w)
        diff = np.asarray(got, np.float32) != np.asarray(base, np.float32)
        assert not diff.any(), f"M={m} N={n} K={k}: {int(diff.sum())} of {diff.size} outputs differ"


def test_gemv_config_knob_names_another_devices_table(monkeypatch, tmp_path):
    """FNX_GEMV_CONFIG: the tiles of another device's table (a configs/ stem, or a JSON path) where this device has
    none; unset, the device kind's own, else its sibling's (an H100: the H200's), else none (the CPU: the
    heuristic); a table that is not there is an error."""
    from fnx.pallas.gemv import api
    n, k = 2560, 6144
    monkeypatch.delenv(api.CONFIG_ENV, raising=False)
    monkeypatch.setattr(api, "_device_kind", lambda: "cpu")   # a device without a table (on a GPU too)
    assert api._table() == {}
    want = dataclasses.replace(gp.Tiles(**api._tuned("nvidia_h200")[f"fp8:{n}:{k}:1"]), xfirst=1)   # "fma": xfirst
    assert api.tiles_for("fp8", n, k, 1) != want               # the heuristic differs here (split 4 in the table)
    monkeypatch.setenv(api.CONFIG_ENV, "nvidia_h200")
    assert api.tiles_for("fp8", n, k, 1) == want
    path = tmp_path / "mine.json"
    entry = dict(dataclasses.asdict(gp.Tiles(16, 512, 4)), mode="fma", dec="f32", split=2)
    path.write_text(json.dumps({f"fp8:{n}:{k}:1": entry}))
    monkeypatch.setenv(api.CONFIG_ENV, str(path))
    assert api.tiles_for("fp8", n, k, 1) == dataclasses.replace(gp.Tiles(**entry), xfirst=1)
    monkeypatch.setenv(api.CONFIG_ENV, "nvidia_h999")
    with pytest.raises(ValueError, match="FNX_GEMV_CONFIG='nvidia_h999': no such table"):
        api.tiles_for("fp8", n, k, 1)
    # unset: an H100 (no table of its own) runs the H200's; an unknown device the heuristic
    monkeypatch.delenv(api.CONFIG_ENV)
    monkeypatch.setattr(api, "_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    assert api.tiles_for("fp8", n, k, 1) == want
    monkeypatch.setattr(api, "_device_kind", lambda: "NVIDIA B200")
    assert api._table() == {}
