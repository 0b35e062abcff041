"""fnx.pallas.gdn: the Pallas gated-delta-rule kernel (interpret mode) against the fp32 jnp reference.

Tolerances (fp32 state and outputs, bf16 q/k/v inputs): 512 decode steps fed one at a time stay within 2e-5
absolute / 1e-4 relative of the reference run over the same 512 tokens (measured < 1e-7 absolute: only the order
of the dk-sums differs). Verify-window snapshots equal step-by-step decoding to 1e-6. The fused gated output
norm: 1e-5 in fp32, 1.6e-2 (two rounding steps) in bf16. No output poisoning: every output is a fresh buffer of
the kernel (or, inplace, the state itself)."""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.pallas.gdn import api, reference
from fnx.pallas.gdn.bench import chunk_scan_args
from fnx.pallas.gdn.pallas import Tiles
from tests.pallas.kernel_mode import INTERPRET, KERNEL  # noqa: F401
from tests.pallas.verify_round import pallas_calls

B, HK, HV, DK, DV = 2, 2, 4, 32, 32
TILES = Tiles(block_v=16)           # two column tiles per head, so the tiling itself is exercised
KW = dict(scale=DK ** -0.5, qk_l2norm=True)


def inputs(key, length, bsz=B, hk=HK, hv=HV, dk=DK, dv=DV, dtype=jnp.bfloat16):
    """Model-like inputs: raw (un-normed) q/k, decays g = -softplus(.) * 0.5 <= 0, beta in (0, 1)."""
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (bsz, length, hk, dk), dtype)
    k = jax.random.normal(ks[1], (bsz, length, hk, dk), dtype)
    v = jax.random.normal(ks[2], (bsz, length, hv, dv), dtype)
    g = -0.5 * jax.nn.softplus(jax.random.normal(ks[3], (bsz, length, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (bsz, length, hv)))
    state = 0.1 * jax.random.normal(ks[5], (bsz, hv, dk, dv))
    return q, k, v, g, beta, state


_seed = int(os.environ.get("FNX_TEST_SEED") or np.random.SeedSequence().entropy % (2 ** 63))   # a failure reports it
_draws = np.random.default_rng(_seed)


def seed():
    """A fresh key per call, drawn from the module's `_seed` (FNX_TEST_SEED replays a failed run's draws)."""
    return jax.random.key(int(_draws.integers(2 ** 31)))


@pytest.fixture
def exact_scan(monkeypatch):
    """The chunked path's products at "tf32x3" (about fp32) rather than the default "tf32": a test holding a
    compiled kernel to an fp32 bound on a GPU (the interpreter computes every precision at fp32)."""
    from fnx.pallas.gdn import pallas as kernel
    monkeypatch.setenv(kernel.SCAN_TILES_ENV, "precision=tf32x3")


def test_512_steps_one_at_a_time():
    n = 512
    q, k, v, g, beta, s0 = inputs(seed(), n)

    @jax.jit
    def decode(s0, xs):
        def step(s, x):
            qt, kt, vt, gt, bt = (a[:, None] for a in x)
            o, s = api.gdn_recurrent(qt, kt, vt, gt, bt, s, impl=KERNEL, tiles=TILES, **KW)
            return s, o[:, 0]
        s, o = jax.lax.scan(step, s0, tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta)))
        return jnp.moveaxis(o, 0, 1), s

    o, s = decode(s0, None)
    o_ref, s_ref = reference.gdn_recurrent(q, k, v, g, beta, s0, **KW)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("length", [5, 11])   # 11 > Tiles.unroll: the in-kernel fori_loop
def test_verify_snapshots_equal_stepwise_decoding(length):
    q, k, v, g, beta, s0 = inputs(seed(), length)
    f = jax.jit(lambda *a: api.gdn_recurrent(*a, keep_steps=True, impl=KERNEL, tiles=TILES,
                                             steps_with_initial=True, out_dtype=jnp.bfloat16, **KW))
    o, s_fin, steps = f(q, k, v, g, beta, s0)
    assert o.dtype == jnp.bfloat16 and steps.shape == (B, length + 1, HV, DK, DV)
    one = jax.jit(lambda *a: api.gdn_recurrent(*a, impl=KERNEL, tiles=TILES, **KW))
    s = s0
    np.testing.assert_array_equal(np.asarray(steps[:, 0]), np.asarray(s0))
    for t in range(length):
        sl = slice(t, t + 1)
        o_t, s = one(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], s)
        np.testing.assert_allclose(np.asarray(steps[:, t + 1]), np.asarray(s), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(o[:, t], np.float32),
                                   np.asarray(o_t[:, 0].astype(jnp.bfloat16), np.float32), rtol=1e-2, atol=1e-2)
    # equal up to rounding: the interpreter lets XLA:CPU fuse the two stores of one value differently
    np.testing.assert_allclose(np.asarray(s_fin), np.asarray(steps[:, -1]), rtol=1e-6, atol=1e-6)
    o_ref, s_ref, steps_ref = reference.gdn_recurrent(q, k, v, g, beta, s0, True, steps_with_initial=True, **KW)
    np.testing.assert_allclose(np.asarray(steps), np.asarray(steps_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s_fin), np.asarray(s_ref), rtol=1e-5, atol=1e-6)


def test_masked_tokens_leave_the_state_exactly():
    """g = 0, beta = 0 is the identity: re-running a window with the rejected tokens masked is a rollback (exact
    in arithmetic; compared to 1e-6 because the interpreter's XLA:CPU fusions may round the two runs differently)."""
    length, keep = 5, np.array([2, 4])
    q, k, v, g, beta, s0 = inputs(seed(), length)
    f = jax.jit(lambda *a, **kw: api.gdn_recurrent(*a, impl=KERNEL, tiles=TILES, **KW, **kw),
                static_argnames=("keep_steps", "steps_with_initial", "want_o"))
    _, _, steps = f(q, k, v, g, beta, s0, keep_steps=True, steps_with_initial=True)
    mask = jnp.arange(length)[None, :, None] < jnp.asarray(keep)[:, None, None]
    o_m, s_m = f(q, k, v, jnp.where(mask, g, 0.0), jnp.where(mask, beta, 0.0), s0)
    for b in range(B):
        np.testing.assert_allclose(np.asarray(s_m[b]), np.asarray(steps[b, keep[b]]), rtol=1e-6, atol=1e-6)
    # n_keep: the same mask applied inside the kernel (rollback's replay), and by the reference backend
    nk = jnp.asarray(keep, jnp.int32)
    o_k, s_k = f(q, k, v, g, beta, s0, n_keep=nk)
    np.testing.assert_array_equal(np.asarray(s_k), np.asarray(s_m))
    np.testing.assert_array_equal(np.asarray(o_k), np.asarray(o_m))
    _, s_r = api.gdn_recurrent(q, k, v, g, beta, s0, impl="reference", n_keep=nk, **KW)
    np.testing.assert_allclose(np.asarray(s_r), np.asarray(s_m), rtol=1e-6, atol=1e-6)
    # the state alone (the replay discards o): the same state bits, no o computed or returned, on both backends
    o_s, s_s = f(q, k, v, g, beta, s0, n_keep=nk, want_o=False)
    assert o_s is None
    np.testing.assert_array_equal(np.asarray(s_s), np.asarray(s_k))
    o_s, s_rs = api.gdn_recurrent(q, k, v, g, beta, s0, impl="reference", n_keep=nk, want_o=False, **KW)
    assert o_s is None
    np.testing.assert_array_equal(np.asarray(s_rs), np.asarray(s_r))
    with pytest.raises(ValueError, match="want_o"):
        api.gdn_recurrent(q, k, v, g, beta, s0, impl=KERNEL, want_o=False,
                          norm=(v, jnp.ones((DV,), v.dtype), 1e-6, "silu"), **KW)
    # under vmap over a stack of layers (the scanned layout's rollback), n_keep shared by the layers
    stack = lambda a: jnp.stack([a, a[::-1]])  # noqa: E731
    _, s_v = jax.vmap(lambda *a: f(*a, n_keep=nk))(*(stack(a) for a in (q, k, v, g, beta, s0)))
    np.testing.assert_array_equal(np.asarray(s_v[0]), np.asarray(s_k))
    _, s_1 = f(*(a[::-1] for a in (q, k, v, g, beta, s0)), n_keep=nk)
    np.testing.assert_array_equal(np.asarray(s_v[1]), np.asarray(s_1))
    with pytest.raises(ValueError, match="n_keep"):
        api.gdn_recurrent(q, k, v, g, beta, s0, impl=KERNEL, n_keep=nk[:1], **KW)


def test_inplace_and_no_gqa():
    q, k, v, g, beta, s0 = inputs(seed(), 3, hk=HV)
    o_ref, s_ref = reference.gdn_recurrent(q, k, v, g, beta, s0, **KW)
    f = jax.jit(lambda *a: api.gdn_recurrent(*a, impl=KERNEL, inplace=True, **KW), donate_argnums=5)
    o, s = f(q, k, v, g, beta, jnp.array(s0))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,act,fuse", [(jnp.float32, "silu", True), (jnp.bfloat16, "sigmoid", True),
                                            (jnp.bfloat16, "silu", False)])
def test_fused_gated_norm(dtype, act, fuse):
    """norm=(z, w, eps, act): the kernel applies the GDN output norm itself (one head per program). fp32 to 1e-5;
    bf16 to one bf16 rounding step (the fp32 o differs from the reference's in its last bits before rounding)."""
    q, k, v, g, beta, s0 = inputs(seed(), 3, dtype=dtype)
    kz, kw = jax.random.split(seed())
    z = jax.random.normal(kz, v.shape, dtype)
    w = (1.0 + 0.1 * jax.random.normal(kw, (DV,))).astype(dtype)
    norm = (z, w, 1e-6, act)
    o_ref, s_ref = reference.gdn_recurrent(q, k, v, g, beta, s0, out_dtype=dtype, norm=norm, **KW)
    tiles = Tiles(block_v=DV, fuse_norm=True) if fuse else TILES
    o, s = jax.jit(lambda *a: api.gdn_recurrent(*a, impl=KERNEL, out_dtype=dtype, norm=norm, tiles=tiles,
                                                **KW))(q, k, v, g, beta, s0)
    assert o.dtype == dtype
    tol = 1e-5 if dtype == jnp.float32 else 1.6e-2
    np.testing.assert_allclose(np.asarray(o, np.float32), np.asarray(o_ref, np.float32), rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_ref), rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_clear_errors():
    q, k, v, g, beta, s0 = inputs(jax.random.key(0), 1)
    with pytest.raises(ValueError, match="state"):
        api.gdn_recurrent(q, k, v, g, beta, s0.astype(jnp.bfloat16), impl="reference")
    with pytest.raises(ValueError, match="multiple"):
        api.gdn_recurrent(q, k, v[:, :, :3], g[..., :3], beta[..., :3], s0[:, :3], impl="reference")


def test_non_power_of_two_heads():
    q, k, v, g, beta, s0 = inputs(jax.random.key(0), 1, dk=24, dv=24)
    with pytest.raises(NotImplementedError, match="power-of-two"):
        api.gdn_recurrent(q, k, v, g, beta, s0, impl=KERNEL)
    o, _ = api.gdn_recurrent(q, k, v, g, beta, s0, impl="auto")         # auto takes the reference here
    assert o.shape == (B, 1, HV, 24)


@pytest.mark.parametrize("bsz,length,keep,hk,hv,dk,dv", [(8, 1, False, 16, 48, 128, 128),
                                                         (1, 1, "norm", 16, 48, 128, 128),
                                                         (8, 5, True, 16, 48, 128, 128),
                                                         (1, 5, "n_keep", 16, 48, 128, 128),
                                                         (4, 5, "conv", 16, 48, 128, 128),
                                                         (2, 5, True, 2, 6, 8, 8)])    # tiny-d's heads
def test_lowers_for_cuda(bsz, length, keep, hk, hv, dk, dv):
    """The Pallas -> Triton lowering (compute capability 9.0) at the released heads (16 key / 48 value of 128)."""
    from fnx.pallas.gdn import pallas as kernel
    sds = jax.ShapeDtypeStruct
    args = (sds((bsz, length, hk, dk), jnp.bfloat16), sds((bsz, length, hk, dk), jnp.bfloat16),
            sds((bsz, length, hv, dv), jnp.bfloat16), sds((bsz, length, hv), jnp.float32),
            sds((bsz, length, hv), jnp.float32), sds((bsz, hv, dk, dv), jnp.float32))
    if keep == "norm":     # the fused gated RMSNorm variant
        args += (sds((bsz, length, hv, dv), jnp.bfloat16), sds((dv,), jnp.bfloat16))
        f = lambda *a: kernel.gdn_recurrent(*a[:6], False, out_dtype=jnp.bfloat16,  # noqa: E731
                                            tiles=Tiles(block_v=dv, num_warps=8, fuse_norm=True),
                                            norm=(a[6], a[7], 1e-6, "sigmoid"), **KW)
    elif keep == "n_keep":  # rollback's replay: the mask inside the kernel
        args += (sds((bsz,), jnp.int32),)
        f = lambda *a: kernel.gdn_recurrent(*a[:6], out_dtype=jnp.bfloat16, n_keep=a[6], want_o=False,  # noqa
                                            **KW)
    elif keep == "conv":    # the replay copying the conv state after the kept tokens (conv_dim 10240, 3 taps back)
        args += (sds((bsz,), jnp.int32), sds((bsz, 3 + length, 2 * hk * dk + hv * dv), jnp.bfloat16))
        f = lambda *a: kernel.gdn_recurrent(*a[:6], out_dtype=jnp.bfloat16, n_keep=a[6], want_o=False,  # noqa
                                            inplace=True, conv=(a[7], 3), **KW)
    else:
        f = lambda *a: kernel.gdn_recurrent(*a, keep, steps_with_initial=keep, inplace=not keep,  # noqa: E731
                                            out_dtype=jnp.bfloat16, scale=dk ** -0.5, qk_l2norm=True)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "gdn_recurrent" in text


# --- gdn_step: conv update + gates + recurrence + norm for one decode token, one kernel -------------------------

def step_inputs(key, bsz=3, hk=2, hv=4, dk=16, dv=8, taps=4, dtype=jnp.float32, n_valid=(1, 0, 1)):
    """One decode token's GDN core inputs at model-like scales (conv weights ~0.5, decays from A_log / dt_bias);
    slot 1 is padding by default. dk != dv, HV = 2 HK, as tiny-b has."""
    ks = jax.random.split(key, 10)
    c = 2 * hk * dk + hv * dv
    nrm = lambda i, shape, s=1.0: (s * jax.random.normal(ks[i], shape)).astype(dtype)  # noqa: E731
    return dict(qkv=nrm(0, (bsz, 1, c)), z=nrm(1, (bsz, 1, hv, dv)), b=nrm(2, (bsz, 1, hv)), a=nrm(3, (bsz, 1, hv)),
                conv_state=nrm(4, (bsz, taps - 1, c)), conv_w=nrm(5, (c, taps), 0.5), a_log=nrm(6, (hv,), 0.5),
                dt_bias=nrm(7, (hv,)), norm_w=(1.0 + nrm(8, (dv,), 0.1)).astype(dtype),
                rec=0.1 * jax.random.normal(ks[9], (bsz, hv, dk, dv)),
                n_valid=jnp.asarray(n_valid[:bsz], jnp.int32))


def _step(impl, kw, act="sigmoid", hk=2, tiles=None):
    return jax.jit(lambda d: api.gdn_step(**d, impl=impl, key_heads=hk, eps=1e-6, act=act,
                                          tiles=tiles if impl != "reference" else None))(kw)


@pytest.mark.parametrize("dtype,act,bv", [(jnp.float32, "sigmoid", None), (jnp.float32, "silu", 4),
                                          (jnp.bfloat16, "sigmoid", None), (jnp.bfloat16, "silu", 2)])
def test_step_equals_the_model_ops(dtype, act, bv):
    """The kernel against the reference (the model's decode ops). fp32: 1e-5 on o, 1e-6 on the states (only the
    order of the sums differs). The conv window is moved, not computed: exact in both dtypes. bf16: the kernel
    rounds sigmoid / silu to bf16 where the HLO does, and XLA:CPU's bf16 ops round differently, so both are held
    to the same computation in fp32 on the same inputs: o within 4x its own spread under 2^-8 input perturbations
    (below), the state within 0.03 (0.010 the most over 300 CPU runs; a wrong gate, conv tap or head is off by
    O(1)). bv: columns per program (dv = 8; < dv puts the norm after the kernel)."""
    from fnx.pallas.gdn.pallas import StepTiles
    kw = step_inputs(seed(), dtype=dtype)
    o_r, c_r, s_r = _step("reference", kw, act)
    o, c, s = _step(KERNEL, kw, act, tiles=None if bv is None else StepTiles(block_v=bv, num_warps=4))
    assert o.dtype == dtype and c.dtype == dtype and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(c, np.float32), np.asarray(c_r, np.float32))
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_r), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(s), np.asarray(s_r), rtol=1e-6, atol=1e-6)
        return
    f32 = {name: a.astype(jnp.float32) if a.dtype == dtype else a for name, a in kw.items()}
    o32, _, s32 = _step("reference", f32, act)
    # each output's own conditioning: how far the fp32 computation moves when the bf16 inputs move by 2^-8
    # (relative, random); the gated norm amplifies a cancellation in a head's core output, which a fixed bound
    # cannot follow (a run saw 0.168 where 300 others stayed under 0.10, the reference ops themselves 0.34)
    spread = np.zeros(o32.shape, np.float32)
    for i in range(4):
        ks = jax.random.split(jax.random.fold_in(seed(), i), len(f32))
        moved = {name: a * (1 + 2.0 ** -8 * jax.random.normal(kk, a.shape)) if kw[name].dtype == dtype else a
                 for (name, a), kk in zip(f32.items(), ks)}
        spread = np.maximum(spread, np.abs(np.asarray(_step("reference", moved, act)[0]) - np.asarray(o32)))
    # 4x that, the output's own bf16 rounding and 1e-3: every element of 60 random runs and of the three worst of
    # 300 was inside; a wrong activation or rolled heads put ~90 of the 96 outputs outside. Plus the bf16
    # reference's own distance from the fp32 value (the kernel no worse than the model's ops by more than the
    # above: the window kernel's test, 5x the outputs, drew a case where both were past the bound alone)
    bound = 4 * spread + 2.0 ** -7 * np.abs(np.asarray(o32)) + 1e-3 + np.abs(np.asarray(o_r, np.float32) -
                                                                          np.asarray(o32))
    err = np.abs(np.asarray(o, np.float32) - np.asarray(o32))
    assert (err <= bound).all(), f"{int((err > bound).sum())} outputs past their bound, worst {(err - bound).max()}"
    assert np.abs(np.asarray(s) - np.asarray(s32)).max() < 0.03


def _step_field_same_bits(dtype, bv, **fields):
    """The step kernel with StepTiles `fields` set against the default tiles (BV columns, or whole heads) on one
    draw: the same bits in o, the conv window and the state. Returns (inputs, default tiles, default's, variant's)."""
    from fnx.pallas.gdn.pallas import StepTiles
    kw = step_inputs(seed(), dtype=dtype)
    base = StepTiles(block_v=bv or kw["norm_w"].shape[0], num_warps=4)
    want = _step(KERNEL, kw, "silu", tiles=base)
    got = _step(KERNEL, kw, "silu", tiles=dataclasses.replace(base, **fields))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    return kw, base, want, got


@pytest.mark.parametrize("dtype,bv", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, 4)])
def test_step_early_loads_give_the_same_bits(dtype, bv, monkeypatch):
    """StepTiles.early (every operand loaded before the arithmetic) is the same arithmetic: the same bits as the
    default's o, conv window and state; FNX_GDN_STEP_TILES sets it on the default tiles (an unknown field is an
    error)."""
    from fnx.pallas.gdn import pallas as kernel
    from fnx.pallas.gdn.pallas import StepTiles
    _step_field_same_bits(dtype, bv, early=1)
    monkeypatch.setenv(kernel.STEP_TILES_ENV, "early=1")
    assert kernel.default_step_tiles(1, 48, 128) == StepTiles(block_v=128, num_warps=4, early=1,
                                                              cinplace=kernel.cinplace_default())
    monkeypatch.setenv(kernel.STEP_TILES_ENV, "erly=1")
    with pytest.raises(ValueError, match="not field=value"):
        kernel.default_step_tiles(1, 48, 128)


@pytest.mark.parametrize("dtype,bv", [(jnp.float32, None), (jnp.bfloat16, 4), (jnp.float32, 2)])
def test_step_conv_window_in_place_gives_the_same_bits(dtype, bv, monkeypatch):
    """StepTiles.cinplace: the conv window written over conv_state (aliased), a key head's q / k rows by the last of
    its HV/HK x dv/BV readers at a counter: the same bits as the default's o, conv window and state (and the
    reference's window). Under a decode program's counter pool it takes its counters there (a region per call);
    FNX_GDN_STEP_TILES=cinplace=1 sets it and makes the model's decode programs build that pool."""
    from fnx.pallas import dispatch, grid_sync
    from fnx.pallas.gdn import pallas as kernel
    from fnx.model import transformer
    kw, base, want, got = _step_field_same_bits(dtype, bv, cinplace=1)
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(_step("reference", kw, "silu")[1],
                                                                             np.float32))

    def pooled(d):
        pool = grid_sync.CounterPool(jnp.zeros((64,), jnp.int32))
        with grid_sync.counter_pool(pool):
            out = api.gdn_step(**d, impl=KERNEL, key_heads=2, eps=1e-6, act="silu",
                               tiles=dataclasses.replace(base, cinplace=1))
        assert pool.used == 3 * 2                               # B x key heads counters, taken at trace time
        return out
    for g, w in zip(jax.jit(pooled)(kw), want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    # by default only where the kernel runs compiled (a GPU), never on a mesh; the knob says either way
    assert kernel.conv_in_place() == (dispatch.why_unavailable("pallas") is None) == bool(kernel.cinplace_default())
    with dispatch.on_mesh(jax.make_mesh((1,), ("tp",))):
        assert kernel.cinplace_default() == 0
    with dispatch.force("reference"):
        assert kernel.cinplace_default() == 0 and not kernel.conv_in_place()
    monkeypatch.setenv(kernel.STEP_TILES_ENV, "early=1,cinplace=0")
    assert not kernel.conv_in_place() and transformer.counter_pool(1, 1) is None
    assert kernel.default_step_tiles(1, 48, 128).cinplace == 0
    monkeypatch.setenv(kernel.STEP_TILES_ENV, "cinplace=1")
    assert kernel.conv_in_place() and kernel.default_step_tiles(1, 48, 128).cinplace == 1
    assert isinstance(transformer.counter_pool(8, 1), grid_sync.CounterPool)    # one-token calls (8 slots)
    assert transformer.counter_pool(5, 5) is None                              # a verify window has no GDN step
    from fnx.config import ModelConfig
    def meta(**kw):
        return transformer.make_meta(ModelConfig(), jnp.zeros((1,), jnp.int32), 1, jnp.float32, **kw)
    assert isinstance(meta()["counters"], grid_sync.CounterPool)
    assert meta(gdn=False)["counters"] is None                               # the MTP layer's programs


def test_step_in_place_window_outside_a_pool_takes_enough_counters(monkeypatch):
    """Outside a decode program's counter pool the in-place window makes its own zeroed counters: one per (sequence,
    key head), in as many of grid_sync's zero blocks as that takes (a block of 4 here, so 3 x 2 counters need two
    blocks): the same bits as the window written to a new buffer."""
    from fnx.pallas import grid_sync
    from fnx.pallas.gdn.pallas import StepTiles
    kw = step_inputs(seed(), dtype=jnp.float32, bsz=3)
    tiles = StepTiles(block_v=kw["norm_w"].shape[0], num_warps=4)
    base = _step(KERNEL, kw, "silu", tiles=tiles)
    monkeypatch.setattr(grid_sync, "ZERO_BLOCK", 4)
    made = []
    counter = grid_sync.counter
    monkeypatch.setattr(grid_sync, "counter", lambda interpret, size: made.append(size) or counter(interpret, size))
    got = _step(KERNEL, kw, "silu", tiles=dataclasses.replace(tiles, cinplace=1))
    assert made == [8]
    for g, w in zip(got, base):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("impl", ["reference", KERNEL])
def test_step_reads_windows_of_wider_products(impl):
    """qkv, z, b and a as windows (buffer [B, 1, W], start) into products with other columns around them (the fused
    input projections' layout: qkv and z in one product, b and a in another), read in place: the same bits as
    the plain arrays; a window past its buffer is refused."""
    kw = step_inputs(seed())
    bsz, c = kw["qkv"].shape[0], kw["qkv"].shape[2]
    pad = jnp.full((bsz, 1, 3), 7.0, jnp.float32)
    big = jnp.concatenate([pad, kw["qkv"], kw["z"].reshape(bsz, 1, -1), pad], axis=2)    # qkv at 3, z at 3 + C
    ba = jnp.concatenate([kw["b"], pad, kw["a"]], axis=2)                                # b at 0, a at HV + 3
    hv = kw["b"].shape[2]
    want = _step(impl, kw)
    win = dict(kw, qkv=(big, 3), z=(big, 3 + c), b=(ba, 0), a=(ba, hv + 3))
    got = jax.jit(lambda bufs, d: api.gdn_step(
        **dict(d, qkv=(bufs[0], 3), z=(bufs[0], 3 + c), b=(bufs[1], 0), a=(bufs[1], hv + 3)), impl=impl,
        key_heads=2, eps=1e-6, act="sigmoid"))((big, ba), {k: v for k, v in kw.items() if k not in win or
                                                       not isinstance(win[k], tuple)})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="outside"):
        api.gdn_step(**dict(kw, a=(ba, hv + 4)), impl=impl, key_heads=2, eps=1e-6, act="sigmoid")


def test_model_decode_feeds_the_fused_products_to_the_step_kernel_unsliced():
    """With the GDN input projections fused (here all four in one product: one dtype), the decode path hands the
    product to gdn_step whole: no slice op between the product and the launch (each would be a copy kernel of its
    own on the GPU), and the same output as unfused."""
    from types import SimpleNamespace

    from fnx.model import fuse, gdn
    from fnx.pallas import dispatch
    hk, hv, dk, dv, d = 2, 4, 16, 8, 64            # tiny-b's GDN widths
    cfg = SimpleNamespace(linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                          linear_value_head_dim=dv, rms_norm_eps=1e-6, output_gate_type="sigmoid")
    kw = step_inputs(seed(), bsz=1, hk=hk, hv=hv, dk=dk, dv=dv, n_valid=(1,))
    c = kw["qkv"].shape[2]
    ks = jax.random.split(jax.random.key(5), 5)
    w = lambda k, n, m=d: jax.random.normal(k, (n, m)) * m ** -0.5  # noqa: E731
    p = {"in_proj_qkv": w(ks[0], c), "in_proj_z": w(ks[1], hv * dv), "in_proj_b": w(ks[2], hv),
         "in_proj_a": w(ks[3], hv), "conv1d": kw["conv_w"], "A_log": kw["a_log"], "dt_bias": kw["dt_bias"],
         "norm": kw["norm_w"], "out_proj": w(ks[4], d, hv * dv)}
    pf = fuse.fuse_sublayer(p, fuse.GROUPS["linear_attn"])
    assert any(k.startswith(fuse.PREFIX) for k in pf)
    x = jax.random.normal(jax.random.key(6), (1, 1, d))
    nv = jnp.ones((1,), jnp.int32)
    run = lambda q: gdn.gdn_layer(q, x, kw["conv_state"], kw["rec"], cfg, nv)[:3]   # noqa: E731
    with dispatch.force(KERNEL):
        for g, want in zip(run(pf), run(p)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-6)
        eqns = jax.make_jaxpr(lambda q: run(q)[0])(pf).jaxpr.eqns
    sliced = {id(v) for e in eqns if e.primitive.name in ("slice", "dynamic_slice") for v in e.outvars}
    calls = [e for e in eqns if e.primitive.name == "pallas_call"]
    assert len(calls) == 1
    assert not [v for e in calls for v in e.invars if id(v) in sliced]


def _fp8_gdn_verify_case():
    """A GDN layer with FP8 qkv + z and bf16 b / a (the online-FP8 layout), fused, and a bf16 verify window of 5
    tokens (rows of 5 and 3 valid): (params, fused params, layer(params) -> (y, conv, rec), the layer's jaxpr)."""
    from types import SimpleNamespace

    from fnx.model import fuse, gdn, quant
    hk, hv, dk, dv, d, length = 2, 4, 64, 32, 256, 5        # qkv 384 and z 128 rows: whole FP8 blocks
    cfg = SimpleNamespace(linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                          linear_value_head_dim=dv, rms_norm_eps=1e-6, output_gate_type="sigmoid")
    kw = step_inputs(seed(), bsz=2, hk=hk, hv=hv, dk=dk, dv=dv, n_valid=(5, 3), dtype=jnp.bfloat16)
    c = kw["qkv"].shape[2]
    ks = jax.random.split(jax.random.key(7), 5)
    w = lambda k, n, m=d: jax.random.normal(k, (n, m)) * m ** -0.5  # noqa: E731
    p = {"in_proj_qkv": quant.quantize_fp8_block(w(ks[0], c)), "in_proj_z": quant.quantize_fp8_block(w(ks[1], hv * dv)),
         "in_proj_b": w(ks[2], hv).astype(jnp.bfloat16), "in_proj_a": w(ks[3], hv).astype(jnp.bfloat16),
         "conv1d": kw["conv_w"], "A_log": kw["a_log"], "dt_bias": kw["dt_bias"], "norm": kw["norm_w"],
         "out_proj": w(ks[4], d, hv * dv).astype(jnp.bfloat16)}
    pf = fuse.fuse_sublayer(p, fuse.GROUPS["linear_attn"])
    assert sum(k.startswith(fuse.PREFIX) for k in pf) == 2
    x = jax.random.normal(jax.random.key(8), (2, length, d)).astype(jnp.bfloat16)
    nv = jnp.asarray([5, 3], jnp.int32)
    layer = lambda q: gdn.gdn_layer(q, x, kw["conv_state"], kw["rec"], cfg, nv, snapshots=True)[:3]  # noqa: E731
    return p, pf, layer


def _window_sources(eqns):
    """The eqns (through reshapes) whose outputs the gdn_window call reads."""
    made = {v: e for e in eqns for v in e.outvars}
    window = [e for e in eqns if e.primitive.name == "pallas_call" and "gdn_window" in str(e.params.get("name"))]
    out = []
    for v in window[0].invars:
        e = made.get(v)
        while e is not None and e.primitive.name == "reshape":
            e = made.get(e.invars[0])
        if e is not None:
            out.append(e)
    return out


def test_model_verify_window_reads_the_pair_product_in_place(monkeypatch):
    """The verify window of a GDN layer with FP8 qkv + z and bf16 b / a (the online-FP8 layout) in bf16: with the
    several-token pair on, the four input products come from one launch as windows of one buffer, that buffer
    reaches the window kernel unsliced, and the layer's outputs and states match the products apart."""
    p, pf, layer = _fp8_gdn_verify_case()
    run = jax.jit(layer)
    monkeypatch.setenv("FNX_KERNELS", f"gemv_pair_many={KERNEL},gdn_window={KERNEL},gemv_fp8={KERNEL}")
    jax.clear_caches()
    eqns = jax.make_jaxpr(lambda q: layer(q)[0])(pf).jaxpr.eqns
    names = list(pallas_calls(eqns))
    assert names.count("fnx_gemv_pair_many_fp8_loop") == 1 and "fnx_gemv_fp8" not in names, names
    # the window kernel's qkv / z / b / a operands: the pair's one (summed) product, through reshapes only
    sources = {id(e) for e in _window_sources(eqns) if "fnx_gemv_pair_many_fp8_loop" in list(pallas_calls([e]))}
    assert len(sources) == 1, names
    got = run(pf)
    monkeypatch.setenv("FNX_KERNELS", f"gemv_pair_many=reference,gdn_window={KERNEL},gemv_fp8={KERNEL}")
    jax.clear_caches()
    want = run(pf)
    for g, wnt in zip(got, want):
        g, wnt = np.asarray(g, np.float32), np.asarray(wnt, np.float32)
        assert np.abs(g - wnt).max() <= 3e-2 * np.abs(wnt).max(), np.abs(g - wnt).max() / np.abs(wnt).max()


@pytest.mark.parametrize("bv,early", [(32, 0), (16, 0), (16, 1)])
def test_window_sums_the_pair_partials_where_it_reads_them(monkeypatch, bv, early):
    """Op "gdn_window_parts": the verify window asks for its input products as the pair kernel's split-K partials
    (kernel_math.Partials) and the window kernel sums them where it loads them (z for a norm after the kernel: XLA
    adds fused into it), so no sum op runs between the two launches; the same bits as with the sum first (two
    splits: the same fp32 add, the same rounding), with whole heads per program (bv = dv = 32: z read by the
    kernel's norm) and with half heads (the norm after the kernel)."""
    from fnx.pallas.gdn.pallas import WINDOW_TILES_ENV
    p, pf, layer = _fp8_gdn_verify_case()
    monkeypatch.setenv(WINDOW_TILES_ENV, f"block_v={bv},early={early}")
    ops = f"gemv_pair_many={KERNEL},gdn_window={KERNEL},gemv_fp8={KERNEL}"
    monkeypatch.setenv("FNX_KERNELS", ops + f",gdn_window_parts={KERNEL}")
    jax.clear_caches()
    eqns = jax.make_jaxpr(lambda q: layer(q)[0])(pf).jaxpr.eqns
    src = _window_sources(eqns)
    pair = [e for e in src if "fnx_gemv_pair_many_fp8_loop" in list(pallas_calls([e]))]
    out = pair[0].outvars[0]
    assert out.aval.shape[0] == 2 and out.aval.dtype == jnp.float32, out.aval        # the unsummed partials
    assert not [e for e in eqns if e.primitive.name == "reduce_sum" and out in e.invars], "the pair's sum still runs"
    # op by op (not one jit): inside one CPU program XLA may drop the bf16 rounding of the summed product between
    # the sum and the interpreted kernel (excess precision), which a GPU, storing it for the custom call, keeps
    got = layer(pf)
    monkeypatch.setenv("FNX_KERNELS", ops + ",gdn_window_parts=reference")
    jax.clear_caches()
    want = layer(pf)
    for g, wnt in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(wnt, np.float32))


def test_step_padding_slot_leaves_both_states_exactly():
    kw = step_inputs(seed(), n_valid=(0, 0, 1))
    _, c, s = _step(KERNEL, kw)
    for b in (0, 1):
        np.testing.assert_array_equal(np.asarray(c[b]), np.asarray(kw["conv_state"][b]))
        np.testing.assert_array_equal(np.asarray(s[b]), np.asarray(kw["rec"][b]))
    assert not np.array_equal(np.asarray(s[2]), np.asarray(kw["rec"][2]))
    np.testing.assert_array_equal(np.asarray(c[2, :-1]), np.asarray(kw["conv_state"][2, 1:]))  # the window moved
    np.testing.assert_array_equal(np.asarray(c[2, -1]), np.asarray(kw["qkv"][2, 0]))


def test_step_64_tokens_chained():
    """64 decode tokens, each step's states fed to the next, through the kernel and through the reference (fp32):
    the recurrences stay together (measured < 1e-6)."""
    kw = step_inputs(seed(), bsz=2, hk=2, hv=4, dk=16, dv=16, n_valid=(1, 1))
    xs = jax.random.normal(seed(), (64, 2, 1, kw["qkv"].shape[-1]))

    def run(impl):
        def body(carry, x):
            c, s = carry
            o, c, s = api.gdn_step(**dict(kw, qkv=x, conv_state=c, rec=s), impl=impl, key_heads=2, eps=1e-6,
                                   act="sigmoid")
            return (c, s), o
        return jax.jit(lambda: jax.lax.scan(body, (kw["conv_state"], kw["rec"]), xs))()

    (c_k, s_k), o_k = run(KERNEL)
    (c_r, s_r), o_r = run("reference")
    np.testing.assert_allclose(np.asarray(o_k), np.asarray(o_r), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(s_k), np.asarray(s_r), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(c_k), np.asarray(c_r))


def test_step_bad_inputs_are_clear_errors():
    kw = step_inputs(jax.random.key(0))
    call = lambda **over: api.gdn_step(**dict(kw, **over), impl="reference", key_heads=2, eps=1e-6,  # noqa: E731
                                       act="sigmoid")
    with pytest.raises(ValueError, match="one token"):
        call(qkv=jnp.concatenate([kw["qkv"]] * 2, axis=1))
    with pytest.raises(ValueError, match="conv_state"):
        call(conv_state=kw["conv_state"][:, :2])
    with pytest.raises(ValueError, match="fp32"):
        call(rec=kw["rec"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="act"):
        api.gdn_step(**kw, impl="reference", key_heads=2, eps=1e-6, act="relu")
    with pytest.raises(NotImplementedError, match="power-of-two"):
        api.gdn_step(**step_inputs(jax.random.key(0), dk=24), impl=KERNEL, key_heads=2, eps=1e-6, act="sigmoid")


@pytest.mark.parametrize("bsz,bv,early,cinplace", [(1, 128, 0, 0), (1, 32, 0, 0), (8, 128, 0, 0), (1, 128, 1, 0),
                                                  (1, 128, 0, 1), (8, 32, 0, 1)])
def test_step_lowers_for_cuda(bsz, bv, early, cinplace):
    """gdn_step's Triton lowering at the released GDN widths (16 key / 48 value heads of 128, conv of 4 taps); with
    cinplace the conv window's output aliases its input and the counters' atomic is in the kernel."""
    from fnx.pallas.gdn import pallas as kernel
    from fnx.pallas.gdn.pallas import StepTiles
    hk, hv, d, taps = 16, 48, 128, 4
    c = 2 * hk * d + hv * d
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = (sds((bsz, 1, c), bf), sds((bsz, 1, hv, d), bf), sds((bsz, 1, hv), bf), sds((bsz, 1, hv), bf),
            sds((bsz, taps - 1, c), bf), sds((c, taps), bf), sds((hv,), jnp.float32), sds((hv,), bf), sds((d,), bf),
            sds((bsz, hv, d, d), jnp.float32), sds((bsz,), jnp.int32))
    f = lambda *a: kernel.gdn_step(*a, key_heads=hk, eps=1e-6, act="sigmoid", inplace=True,  # noqa: E731
                                   tiles=StepTiles(block_v=bv, early=early, cinplace=cinplace))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "gdn_step" in text
    if cinplace:      # the conv window (argument 2) is also output 2; the counters' buffer comes from its own launch
        assert "fnx_grid_sync_init" in text


def test_model_decode_through_the_step_kernel(monkeypatch, tmp_path):
    """tiny-b (dk 16 != dv 8, 4 value heads on 2 key heads), fp32: prefill then 12 one-token calls with every GDN
    decode token through the gdn_step kernel, against the reference ops (measured: 4.6e-7 relative); with the conv
    window in place (FNX_GDN_STEP_TILES=cinplace=1, counters from the decode program's pool) the same logits."""
    import fnx
    from tests.conftest import load_script
    from tests.model.conftest import prefill_then_decode, rel_err
    d = load_script("make_tiny_checkpoint").write_checkpoint(tmp_path / "tiny-b", "tiny-b", seed=1)
    model = fnx.load(d, dtype=jnp.float32)
    ids = np.random.default_rng(0).integers(0, 200, (2, 20)).astype(np.int32)
    want = prefill_then_decode(model, ids, 8, 32)
    monkeypatch.setenv("FNX_KERNELS", f"gdn_step={KERNEL}")
    jax.clear_caches()
    got = prefill_then_decode(model, ids, 8, 32)
    monkeypatch.setenv("FNX_GDN_STEP_TILES", "cinplace=1")        # the conv window in place: the same values
    jax.clear_caches()
    np.testing.assert_array_equal(np.asarray(prefill_then_decode(model, ids, 8, 32)), np.asarray(got))
    monkeypatch.delenv("FNX_GDN_STEP_TILES")
    monkeypatch.delenv("FNX_KERNELS")
    jax.clear_caches()
    err = rel_err(got, want)
    print(f"tiny-b decode, gdn_step kernel vs reference ops: {err:.1e}")
    assert err < 1e-5


# ---- prefill: the chunks' sequential pass (op "gdn_prefill") -------------------------------------------------------

@pytest.mark.parametrize("bsz,h,n,c,dk,dv,bv,precision", [(1, 3, 5, 16, 32, 64, 32, "ieee"),
                                                          (2, 2, 1, 32, 16, 32, 16, "ieee"),
                                                          (1, 3, 5, 16, 32, 64, 32, "tf32x3"),
                                                          (1, 3, 5, 16, 32, 64, 32, "tf32")])
def test_chunk_scan_kernel_matches_reference(bsz, h, n, c, dk, dv, bv, precision):
    """One program per (sequence, head, value-column block) carries its state tile through every chunk: outputs and
    final state equal XLA's scan in fp32 (the order of the dk- and C-sums differs: 1e-5 relative). "tf32x3" (three
    tensor-core products per fp32 product) is held to the same bound on a GPU, "tf32" (one product of 10-bit
    mantissas, the default) to 5e-3 of the scale there; the interpreter computes each at fp32."""
    from fnx.pallas.gdn.pallas import ScanTiles
    args = chunk_scan_args(seed(), bsz, h, n, c, dk, dv)
    want_o, want_s = reference.chunk_scan(*args)
    tiles = ScanTiles(block_v=bv, precision=precision)
    got_o, got_s = jax.jit(lambda *a: api.gdn_chunk_scan(*a, impl=KERNEL, tiles=tiles))(*args)
    tol = 5e-3 if precision == "tf32" and not INTERPRET else 1e-5
    for got, want in ((got_o, want_o), (got_s, want_s)):
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol,
                                   atol=tol * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("bsz,n,length,dtype", [(2, 3, 150, jnp.bfloat16), (1, 2, 128, jnp.float32),
                                                 (2, 1, 1, jnp.bfloat16)])
def test_chunk_scan_stores_the_tokens_layout(bsz, n, length, dtype):
    """`ScanTiles.tokens_out`: asked for o as [B, L, H, dv] in a dtype (the model's layout), the kernel stores it
    so itself (rows past L masked off) with the same bits as its [B, H, N, C, dv] fp32 output rearranged and
    converted by XLA (the default), and close to the reference; L outside the chunks is refused."""
    from fnx.pallas.gdn.pallas import ScanTiles
    h, c, dk, dv = 3, 64, 32, 64
    args = chunk_scan_args(seed(), bsz, h, n, c, dk, dv)
    run = lambda tiles: jax.jit(lambda *a: api.gdn_chunk_scan(*a, impl=KERNEL, tiles=tiles,  # noqa: E731
                                                              tokens=(length, dtype)))(*args)
    o_xla, s_xla = run(ScanTiles(block_v=32))
    o_st, s_st = run(ScanTiles(block_v=32, tokens_out=1))
    assert o_st.shape == o_xla.shape == (bsz, length, h, dv) and o_st.dtype == o_xla.dtype == dtype
    assert bool(jnp.array_equal(o_st, o_xla)) and bool(jnp.array_equal(s_st, s_xla))
    want_o, want_s = api.gdn_chunk_scan(*args, impl="reference", tokens=(length, dtype))
    np.testing.assert_allclose(np.asarray(o_st, np.float32), np.asarray(want_o, np.float32),
                               rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5,
                               atol=(1e-2 if dtype == jnp.bfloat16 else 1e-5) * float(jnp.max(jnp.abs(want_o))))
    with pytest.raises(ValueError, match="tokens"):
        api.gdn_chunk_scan(*args, impl=KERNEL, tokens=(n * c + 1, dtype))


def test_chunked_prefill_through_the_kernel_matches_token_by_token(exact_scan):
    """The model's chunked form (fnx.model.gdn.delta_rule_chunked, 150 tokens: two chunks of 64 and a padded one)
    with the chunk pass in the kernel equals the token-by-token reference and the XLA scan; the op's refusals
    name their reason."""
    from fnx.model import gdn
    q, k, v, g, beta, state = inputs(seed(), 150, hk=HV, dtype=jnp.float32)
    q, k = reference.l2norm(q) * DK ** -0.5, reference.l2norm(k)
    want_o, want_s = reference.delta_rule_recurrent(q, k, v, g, beta, state)
    for impl in (KERNEL, "reference"):
        o, s = jax.jit(lambda *a, impl=impl: gdn.delta_rule_chunked(*a, impl=impl))(q, k, v, g, beta, state)
        np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(s), np.asarray(want_s), rtol=1e-4, atol=1e-4)
    bad = chunk_scan_args(seed(), 1, 1, 2, 16, 24, 32)                   # dk 24: not a power of two
    with pytest.raises(Exception, match="power-of-two"):
        api.gdn_chunk_scan(*bad, impl=KERNEL)
    with pytest.raises(ValueError, match="must be fp32"):
        api.gdn_chunk_scan(*(a.astype(jnp.bfloat16) for a in bad[:1]), *bad[1:], impl=KERNEL)


def _prep_inputs(key, b, length, h, dk, dv, rep=1):
    ks = jax.random.split(key, 5)
    q = reference.l2norm(jax.random.normal(ks[0], (b, length, h // rep, dk))) * dk ** -0.5
    k = reference.l2norm(jax.random.normal(ks[1], (b, length, h // rep, dk)))
    v = jax.random.normal(ks[2], (b, length, h, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, length, h)))           # log decays, as the model's gates
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, length, h)))
    return q, k, v, g, beta


@pytest.mark.parametrize("b,length,h,dk,dv,rep,precision,loop", [(1, 150, 2, 32, 32, 1, "tf32x3", 0),
                                                                  (2, 64, 1, 16, 32, 1, "tf32x3", 1),
                                                                  (1, 40, 1, 128, 64, 1, "tf32x3", 0),
                                                                  (2, 90, 6, 16, 32, 3, "tf32x3", 1),
                                                                  (1, 150, 6, 128, 128, 3, "tf32", 0),
                                                                  (1, 150, 6, 128, 128, 3, "tf32", 1)])
def test_chunk_prep_kernel_matches_reference(b, length, h, dk, dv, rep, precision, loop, monkeypatch):
    """Op "gdn_chunk_prep": one program per (sequence, head, chunk) computes the chunked form's per-chunk operands
    on whole-chunk tiles (the unit-lower inverse doubled level by level as XLA's reference, its coupling blocks
    masked rather than sliced): every output equals `reference.chunk_prep` in fp32 within 1e-5 of its scale (the
    cumulative decay and the products summed in another order); a partial last chunk (150, 40 and 90 tokens) reads
    zeros past L;
    with rep 3 the kernel reads each key head for three value heads in place (the reference's q, k repeated).
    Its products take the chunk scan's precision: "tf32x3" held to the fp32 bound on a GPU, "tf32" (the default)
    to 5e-3 of the scale there; the interpreter computes both at fp32. `PrepTiles.loop` 1 (the column-block passes
    as loops in the kernel) is held to the same bounds."""
    from fnx.pallas.gdn import pallas as kernel
    from fnx.pallas.gdn import prep
    monkeypatch.setenv(kernel.SCAN_TILES_ENV, f"precision={precision}")
    monkeypatch.setenv(prep.PREP_TILES_ENV, f"loop={loop}")
    tol = 5e-3 if precision == "tf32" and not INTERPRET else 1e-5
    args = _prep_inputs(seed(), b, length, h, dk, dv, rep)
    q, k = (jnp.repeat(t, rep, axis=2) for t in args[:2])
    want = reference.chunk_prep(q, k, *args[2:], 64)
    got = jax.jit(lambda *a: api.gdn_chunk_prep(*a, 64, impl=KERNEL, rep=rep))(*args)
    assert jax.tree.all(jax.tree.map(lambda x, y: bool(jnp.array_equal(x, y)), want,
                                     api.gdn_chunk_prep(*args, 64, impl="reference", rep=rep)))
    for name, g_, w in zip(("new_values", "k_cumdecay", "q", "intra", "k", "chunk_decay"), got, want, strict=True):
        assert g_.shape == w.shape and g_.dtype == jnp.float32, (name, g_.shape, w.shape)
        np.testing.assert_allclose(np.asarray(g_), np.asarray(w), rtol=tol,
                                   atol=tol * float(jnp.max(jnp.abs(w))), err_msg=name)
    intra = np.asarray(got[3])
    assert not np.any(np.triu(intra, 1)), "intra is lower triangular (the causal pairs only)"


def test_chunked_prefill_through_the_prep_kernel(monkeypatch, exact_scan):
    """The model's chunked form with op "gdn_chunk_prep" named (FNX_KERNELS) runs the kernel, not XLA's products,
    and agrees with the token-by-token reference, with either chunk pass; "auto" on a CPU keeps XLA's products,
    and shapes the kernel cannot tile are refused with the reason."""
    from fnx.model import gdn
    from fnx.pallas.gdn import prep
    q, k, v, g, beta, state = inputs(seed(), 150, hk=HV, dtype=jnp.float32)
    q, k = reference.l2norm(q) * DK ** -0.5, reference.l2norm(k)
    want_o, want_s = reference.delta_rule_recurrent(q, k, v, g, beta, state)
    calls = []
    real = prep.chunk_prep
    monkeypatch.setattr(prep, "chunk_prep", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setenv("FNX_KERNELS", f"gdn_chunk_prep={KERNEL}")
    for impl in (KERNEL, "reference"):
        o, s = jax.jit(lambda *a, impl=impl: gdn.delta_rule_chunked(*a, impl=impl))(q, k, v, g, beta, state)
        np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(s), np.asarray(want_s), rtol=1e-4, atol=1e-4)
    assert len(calls) == 2
    monkeypatch.delenv("FNX_KERNELS")
    jax.make_jaxpr(lambda *a: gdn.delta_rule_chunked(*a, impl="reference"))(q, k, v, g, beta, state)
    assert len(calls) == 2, "auto keeps XLA's products on a CPU"
    bad = _prep_inputs(seed(), 1, 20, 1, 24, 32)                         # dk 24: not a power of two
    with pytest.raises(Exception, match="power-of-two"):
        api.gdn_chunk_prep(*bad, 64, impl=KERNEL)
    with pytest.raises(ValueError, match="must be"):
        api.gdn_chunk_prep(bad[0], bad[1], bad[2][:, :10], *bad[3:], 64, impl=KERNEL)
    with pytest.raises(ValueError, match="key heads x rep"):
        api.gdn_chunk_prep(*bad, 64, impl=KERNEL, rep=2)
    fine = _prep_inputs(seed(), 1, 20, 1, 16, 32)
    with pytest.raises(Exception, match="power-of-two chunk"):
        api.gdn_chunk_prep(*fine, 48, impl=KERNEL)                      # whole-chunk tiles: a power of two
    assert prep.prep_tiles() == prep.PrepTiles()
    monkeypatch.setenv(prep.PREP_TILES_ENV, "num_warps=4")
    assert prep.prep_tiles().num_warps == 4
    monkeypatch.setenv(prep.PREP_TILES_ENV, "warps=4")
    with pytest.raises(ValueError, match="FNX_GDN_PREP_TILES"):
        prep.prep_tiles()


@pytest.mark.parametrize("b,length,hk,rep,dk,dv,dtype,loop", [(2, 150, 2, 3, 32, 32, jnp.bfloat16, 0),
                                                              (2, 150, 2, 3, 32, 32, jnp.bfloat16, 1),
                                                              (1, 64, 1, 1, 16, 32, jnp.float32, 0)])
def test_chunk_prep_reads_the_conv_output_in_place(b, length, hk, rep, dk, dv, dtype, loop, monkeypatch, exact_scan):
    """`PrepTiles.in_place` (FNX_GDN_PREP_TILES=in_place=1): from the GDN conv output [B, L, 2 HK dk + HV dv] the
    kernel reads q, k and v as its column groups in place and l2-norms q and k itself (q then scaled): every
    output equals XLA's split, l2norm and scale followed by the reference prep within 1e-5 of its scale; without
    in_place the api makes q, k, v in XLA and runs the kernel as usual (within 1e-5 too); a conv width that is
    not 2 HK dk + HV dv is refused. With `PrepTiles.loop` 1 too (the l2norm's pass a loop in the kernel)."""
    from fnx.pallas.gdn import prep
    hv = hk * rep
    ks = jax.random.split(seed(), 3)
    conv = jax.nn.silu(jax.random.normal(ks[0], (b, length, 2 * hk * dk + hv * dv))).astype(dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[1], (b, length, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[2], (b, length, hv)))
    kw = dict(key_heads=hk, key_dim=dk, scale=dk ** -0.5)
    want = api.gdn_chunk_prep_conv(conv, g, beta, 64, impl="reference", **kw)
    calls = []
    real = prep.chunk_prep
    monkeypatch.setattr(prep, "chunk_prep", lambda *a, **k: calls.append(k.get("conv")) or real(*a, **k))
    for in_place in (1, 0):
        monkeypatch.setenv(prep.PREP_TILES_ENV, f"in_place={in_place},loop={loop}")
        calls.clear()
        got = jax.jit(lambda c, g_, b_: api.gdn_chunk_prep_conv(c, g_, b_, 64, impl=KERNEL, **kw))(conv, g, beta)
        assert len(calls) == 1 and (calls[0] is not None) == bool(in_place), calls
        for name, x, w in zip(("new_values", "k_cumdecay", "q", "intra", "k", "chunk_decay"), got, want, strict=True):
            assert x.shape == w.shape and x.dtype == jnp.float32, (name, x.shape, w.shape)
            np.testing.assert_allclose(np.asarray(x), np.asarray(w), rtol=1e-5,
                                       atol=1e-5 * float(jnp.max(jnp.abs(w))), err_msg=f"{name} in_place={in_place}")
    g6 = jnp.zeros((1, 16, 6))
    with pytest.raises(ValueError, match="not 2 x"):          # 2 x 2 x 16 + 6 x 16 is 160, not 161
        api.gdn_chunk_prep_conv(jnp.zeros((1, 16, 161)), g6, g6, 64, impl=KERNEL, key_heads=2, key_dim=16, scale=1.0)


def test_chunk_prep_auto_follows_the_products_precision(monkeypatch):
    """Where the compiled kernel can run (a GPU, simulated here), "auto" takes the one-launch chunk prep with "tf32"
    products (the default: 284 against XLA's 592 us a layer on the H100) and XLA's products with "tf32x3" or
    "ieee" (the kernel slower: 834 us), saying why; FNX_KERNELS still names either."""
    from fnx.pallas import dispatch
    from fnx.pallas.gdn import pallas as kernel
    from fnx.pallas.gdn import prep
    assert api.OP_CHUNK_PREP in dispatch.VERIFIED_ON_GPU and kernel.ScanTiles().precision == "tf32"
    assert api.chunk_prep_auto_reason("tf32") is None
    assert "slower" in api.chunk_prep_auto_reason("tf32x3") and "slower" in api.chunk_prep_auto_reason("ieee")
    monkeypatch.setattr(dispatch, "why_unavailable", lambda b: None if b in dispatch.BACKENDS else "unknown")
    calls = []
    real = prep.chunk_prep
    monkeypatch.setattr(prep, "chunk_prep", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    args = _prep_inputs(seed(), 1, 70, 6, 16, 16, 3)

    def used(spec, kernels=None):
        monkeypatch.setenv(kernel.SCAN_TILES_ENV, spec)
        if kernels:
            monkeypatch.setenv("FNX_KERNELS", kernels)
        else:
            monkeypatch.delenv("FNX_KERNELS", raising=False)
        calls.clear()
        jax.make_jaxpr(lambda *a: api.gdn_chunk_prep(*a, 64, rep=3))(*args)      # traced only: no GPU lowering
        return bool(calls)

    assert used("") and used("precision=tf32")
    assert not used("precision=tf32x3") and not used("precision=ieee")
    assert used("precision=tf32x3", "gdn_chunk_prep=pallas")
    assert not used("precision=tf32", "gdn_chunk_prep=reference")


def test_chunk_prep_lowers_for_cuda_at_the_released_shapes():
    """The kernel at the released GDN shapes (48 value heads of 128, a 2,048-token chunk, "tf32x3" products)
    lowers for CUDA: one launch per layer; in place from the conv output with "tf32" products too, its column-block
    passes unrolled and as loops."""
    from jax import lax

    from fnx.pallas.gdn import prep
    sds = jax.ShapeDtypeStruct
    b, length, h, d = 1, 2048, 48, 128
    f = jax.jit(lambda *a: prep.chunk_prep(*a, 64, precision=lax.DotAlgorithmPreset.TF32_TF32_F32_X3))
    text = f.trace(*(sds((b, length, h, d), jnp.float32),) * 3, *(sds((b, length, h), jnp.float32),) * 2).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("gdn_chunk_prep") >= 1
    conv = prep.ConvInput(key_heads=16, key_dim=d, scale=d ** -0.5, eps=1e-6)       # in place from the conv output
    for loop in (0, 1):     # PrepTiles.loop 1: the column-block passes as loops in the kernel
        f = jax.jit(lambda c, g, b_, loop=loop: prep.chunk_prep(
            c, None, None, g, b_, 64, rep=3, conv=conv, precision=lax.DotAlgorithmPreset.TF32_TF32_F32,
            tiles=prep.PrepTiles(in_place=1, loop=loop)))
        text = f.trace(sds((b, length, 2 * 16 * d + h * d), jnp.bfloat16), *(sds((b, length, h), jnp.float32),) * 2
                       ).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("gdn_chunk_prep") >= 1


def test_layer_prefill_takes_the_fnx_kernels_choice(monkeypatch, exact_scan):
    """gdn_layer's multi-token path leaves the chunk pass's backend to fnx.pallas.dispatch (impl None, as its
    decode ops), so FNX_KERNELS=gdn_prefill=... reaches gdn_chunk_scan: the reference and the kernel each run when
    named (70 tokens: two chunks; the second sequence padded after 50), with the same outputs and states (and the
    same bits with the kernel storing o in the layer's layout, `ScanTiles.tokens_out`), and a backend the op does
    not have is refused."""
    from types import SimpleNamespace

    from fnx.model import gdn
    from fnx.pallas.gdn import pallas as kernel
    hk, hv, dk, dv, d, length = 2, 4, 16, 16, 64, 70       # dk, dv: powers of two >= 16, which the kernel takes
    cfg = SimpleNamespace(linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                          linear_value_head_dim=dv, rms_norm_eps=1e-6, output_gate_type="sigmoid")
    kw = step_inputs(seed(), bsz=2, hk=hk, hv=hv, dk=dk, dv=dv, n_valid=(1, 1))
    ks = jax.random.split(seed(), 6)
    w = lambda k, n, m=d: jax.random.normal(k, (n, m)) * m ** -0.5  # noqa: E731
    p = {"in_proj_qkv": w(ks[0], kw["qkv"].shape[2]), "in_proj_z": w(ks[1], hv * dv), "in_proj_b": w(ks[2], hv),
         "in_proj_a": w(ks[3], hv), "conv1d": kw["conv_w"], "A_log": kw["a_log"], "dt_bias": kw["dt_bias"],
         "norm": kw["norm_w"], "out_proj": w(ks[4], d, hv * dv)}
    x = jax.random.normal(ks[5], (2, length, d))
    n_valid = jnp.array([length, 50], jnp.int32)
    calls = []
    for mod, name in ((kernel, "kernel"), (reference, "reference")):
        real = mod.chunk_scan
        monkeypatch.setattr(mod, "chunk_scan",
                            lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))

    def run(choice):
        monkeypatch.setenv("FNX_KERNELS", f"gdn_prefill={choice}")
        jax.clear_caches()                      # dispatch reads FNX_KERNELS when the layer is traced
        calls.clear()
        out = jax.jit(lambda p, x: gdn.gdn_layer(p, x, kw["conv_state"], kw["rec"], cfg, n_valid)[:3])(p, x)
        return out, list(calls)

    try:
        want, ref_calls = run("reference")
        got, kernel_calls = run(KERNEL)
        assert ref_calls == ["reference"] and kernel_calls == ["kernel"], (ref_calls, kernel_calls)
        for g, r in zip(got, want):            # y, the conv state (moved, not computed), the recurrent state
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))
        monkeypatch.setenv(kernel.SCAN_TILES_ENV, "precision=tf32x3,tokens_out=1")    # o stored by the kernel
        stored, _ = run(KERNEL)
        assert all(bool(jnp.array_equal(a, b)) for a, b in zip(stored, got)), "tokens_out: the same bits"
        from fnx.pallas.gdn import prep
        monkeypatch.setenv(prep.PREP_TILES_ENV, "in_place=1")        # the prep kernel reads the conv output
        monkeypatch.setenv("FNX_KERNELS", f"gdn_prefill={KERNEL},gdn_chunk_prep={KERNEL}")
        jax.clear_caches()
        in_place = jax.jit(lambda p, x: gdn.gdn_layer(p, x, kw["conv_state"], kw["rec"], cfg, n_valid)[:3])(p, x)
        for g, r in zip(in_place, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))
        with pytest.raises(ValueError, match="gdn_prefill supports"):
            run("triton")
    finally:
        monkeypatch.delenv("FNX_KERNELS")
        jax.clear_caches()


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "tf32"])
def test_chunk_scan_lowers_for_cuda_released_shapes(precision):
    """48 value heads of 128, 1K tokens in 16 chunks of 64: one launch through Pallas -> Triton, at each product
    precision; an unknown one is refused."""
    S = jax.ShapeDtypeStruct
    b, h, n, c, d = 1, 48, 16, 64, 128
    f32 = jnp.float32
    sds = [S((b, h, n, c, d), f32), S((b, h, n, c, d), f32), S((b, h, n, c, d), f32), S((b, h, n, c, c), f32),
           S((b, h, n, c, d), f32), S((b, h, n), f32), S((b, h, d, d), f32)]
    from fnx.pallas.gdn import pallas as kernel
    fn = functools.partial(kernel.chunk_scan, tiles=kernel.ScanTiles(precision=precision))
    text = jax.jit(fn).trace(*sds).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("gdn_chunk_scan") >= 1 and "__gpu$xla.gpu.triton" in text
    fn = functools.partial(kernel.chunk_scan, tiles=kernel.ScanTiles(precision=precision, tokens_out=1),
                           tokens=(1000, jnp.bfloat16))                 # o stored as [B, L, H, dv] bf16
    text = jax.jit(fn).trace(*sds).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("gdn_chunk_scan") >= 1
    with pytest.raises(ValueError, match="precision 'fp64'"):
        jax.jit(functools.partial(kernel.chunk_scan, tiles=kernel.ScanTiles(precision="fp64"))).trace(*sds)


# ---- gdn_window: a verify window's GDN core in one kernel (op "gdn_window") -----------------------------------------

def window_inputs(key, bsz=3, length=5, hk=2, hv=4, dk=16, dv=8, taps=4, dtype=jnp.float32, n_valid=(5, 0, 3)):
    """A verify window's GDN core inputs (`step_inputs` with T tokens); slot 1 padding, slot 2 a partial window."""
    ks = jax.random.split(key, 10)
    c = 2 * hk * dk + hv * dv
    nrm = lambda i, shape, s=1.0: (s * jax.random.normal(ks[i], shape)).astype(dtype)  # noqa: E731
    return dict(qkv=nrm(0, (bsz, length, c)), z=nrm(1, (bsz, length, hv, dv)), b=nrm(2, (bsz, length, hv)),
                a=nrm(3, (bsz, length, hv)), conv_state=nrm(4, (bsz, taps - 1, c)), conv_w=nrm(5, (c, taps), 0.5),
                a_log=nrm(6, (hv,), 0.5), dt_bias=nrm(7, (hv,)), norm_w=(1.0 + nrm(8, (dv,), 0.1)).astype(dtype),
                rec=0.1 * jax.random.normal(ks[9], (bsz, hv, dk, dv)),
                n_valid=jnp.asarray(n_valid[:bsz], jnp.int32))


def _window(impl, kw, act="sigmoid", tiles=None):
    return jax.jit(lambda d: api.gdn_window(**d, impl=impl, key_heads=2, eps=1e-6, act=act,
                                            tiles=tiles if impl != "reference" else None))(kw)


def _f32(a):
    return np.asarray(a, np.float32)


@pytest.mark.parametrize("act,bv,length", [("sigmoid", None, 5), ("silu", 8, 5), ("sigmoid", 2, 3),
                                           ("silu", 4, 8)])
def test_window_equals_the_model_ops(act, bv, length):
    """fp32: the kernel against the model's verify ops (conv_and_gates, the recurrence, the norm): o to 1e-5,
    the recurrent state, k, v, g and beta to 1e-6 (float error: XLA fuses the silu and the gates its own way); the
    conv state and xcat are the same bits (rows moved, not computed). bv: columns per program (dv = 8: whole heads fuse the norm, fewer put it
    after the kernel); windows of 3 to 8 tokens, a padding slot and a partial one."""
    from fnx.pallas.gdn.pallas import WindowTiles
    kw = window_inputs(seed(), length=length, n_valid=(length, 0, length - 2))
    o_r, c_r, s_r, p_r = _window("reference", kw, act)
    o, c, s, parts = _window(KERNEL, kw, act, None if bv is None else WindowTiles(block_v=bv))
    assert o.shape == o_r.shape and s.dtype == jnp.float32
    np.testing.assert_allclose(_f32(o), _f32(o_r), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(s), np.asarray(s_r), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(_f32(c), _f32(c_r))
    assert set(parts) == set(p_r) == {"conv_x", "k", "v", "g", "beta"}
    for name in p_r:
        assert parts[name].shape == p_r[name].shape and parts[name].dtype == p_r[name].dtype, name
        np.testing.assert_allclose(_f32(parts[name]), _f32(p_r[name]), rtol=1e-6, atol=1e-6, err_msg=name)
    np.testing.assert_array_equal(_f32(parts["conv_x"]), _f32(p_r["conv_x"]))


@pytest.mark.parametrize("dtype,bv,length", [(jnp.float32, None, 5), (jnp.bfloat16, 4, 5), (jnp.bfloat16, None, 3)])
def test_window_early_loads_give_the_same_bits(dtype, bv, length):
    """WindowTiles.early (the conv weights, every token's b and a, A_log and dt_bias loaded with the window rows)
    is the same arithmetic: every output the same bits as the default's, a padding slot and a partial one
    included."""
    from fnx.pallas.gdn.pallas import WindowTiles
    kw = window_inputs(seed(), length=length, n_valid=(length, 0, length - 2), dtype=dtype)
    base = WindowTiles(block_v=bv or kw["norm_w"].shape[0])
    want = _window(KERNEL, kw, "silu", base)
    got = _window(KERNEL, kw, "silu", dataclasses.replace(base, early=1))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(_f32(g), _f32(w))


def test_window_bf16_rounds_like_the_model():
    """bf16: the kernel rounds the conv, silu and sigmoid where the model's ops round; XLA:CPU keeps excess
    precision in places, so o is held to the fp32 computation within 4x its own spread under 2^-8 input
    perturbations (as the step kernel's test), a bf16 ulp of its head's scale and the bf16 reference's own distance
    from it, k and v within two bf16 roundings (the conv's, the silu's) of the reference, the moved rows (the conv
    state, xcat) exactly."""
    dtype = jnp.bfloat16
    kw = window_inputs(seed(), dtype=dtype)
    o, c, s, parts = _window(KERNEL, kw)
    o_r, c_r, s_r, p_r = _window("reference", kw)
    np.testing.assert_array_equal(_f32(c), _f32(c_r))
    np.testing.assert_array_equal(_f32(parts["conv_x"]), _f32(p_r["conv_x"]))
    for name in ("k", "v"):
        np.testing.assert_allclose(_f32(parts[name]), _f32(p_r[name]), rtol=2 ** -6, atol=1e-6, err_msg=name)
    f32 = {name: a.astype(jnp.float32) if a.dtype == dtype else a for name, a in kw.items()}
    o32, _, s32, _ = _window("reference", f32)
    spread = np.zeros(o32.shape, np.float32)
    for i in range(4):
        ks = jax.random.split(jax.random.fold_in(seed(), i), len(f32))
        moved = {name: a * (1 + 2.0 ** -8 * jax.random.normal(kk, a.shape)) if kw[name].dtype == dtype else a
                 for (name, a), kk in zip(f32.items(), ks)}
        spread = np.maximum(spread, np.abs(np.asarray(_window("reference", moved)[0]) - np.asarray(o32)))
    # plus the model's own bf16 error at that output: the roundings inside the gated norm add up to a few bf16 ulps
    # that the input perturbations do not show (a draw had the kernel equal to the bf16 reference, both 0.0092 from
    # the fp32 value, against a bound of 0.0077 without this term)
    # the bf16 ulp term is the head's (the gated norm's row): an element near zero in a row of larger ones carries
    # the row's roundings (a CI draw: kernel 0.0061 where fp32 has -0.0013, the head's largest 1.34, past a bound
    # built from the element's own ulp by 0.0016)
    head = np.abs(np.asarray(o32)).max(axis=-1, keepdims=True)
    bound = 4 * spread + 2.0 ** -7 * head + 1e-3 + np.abs(_f32(o_r) - np.asarray(o32))
    err = np.abs(_f32(o) - np.asarray(o32))
    assert (err <= bound).all(), f"{int((err > bound).sum())} outputs past their bound, worst {(err - bound).max()}"
    assert np.abs(np.asarray(s) - np.asarray(s32)).max() < 0.03


def test_window_reads_fused_products_in_place_and_keeps_the_input_state():
    """qkv and z as windows of one product, b and a of another (the fused projections' layout): the same bits as
    the plain arrays; the input recurrent state is left as it was (rollback replays from it)."""
    kw = window_inputs(seed())
    bsz, length, c = kw["qkv"].shape
    pad = jnp.full((bsz, length, 3), 7.0, jnp.float32)
    big = jnp.concatenate([pad, kw["qkv"], kw["z"].reshape(bsz, length, -1), pad], axis=2)
    ba = jnp.concatenate([kw["b"], pad, kw["a"]], axis=2)
    hv = kw["b"].shape[2]
    want = _window(KERNEL, kw)
    rec_before = np.asarray(kw["rec"]).copy()
    rest = {k: v for k, v in kw.items() if k not in ("qkv", "z", "b", "a")}
    got = jax.jit(lambda bufs, d: api.gdn_window(
        qkv=(bufs[0], 3), z=(bufs[0], 3 + c), b=(bufs[1], 0), a=(bufs[1], hv + 3), **d, impl=KERNEL, key_heads=2,
        eps=1e-6, act="sigmoid"))((big, ba), rest)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(kw["rec"]), rec_before)
    with pytest.raises(ValueError, match="outside"):
        api.gdn_window(**dict(kw, a=(ba, hv + 4)), impl=KERNEL, key_heads=2, eps=1e-6, act="sigmoid")


def test_window_rollback_equals_a_shorter_window():
    """What the model's rollback computes from the kernel's parts (`rec_after` from the input state, the conv rows
    by `window_after`) after keeping n tokens equals the states of a window whose n_valid is n, for every n of
    the window (0 .. T), and a padding slot leaves both states exactly."""
    from fnx.model.gdn import rec_after
    kw = window_inputs(seed(), n_valid=(5, 0, 5))
    _, _, _, parts = _window(KERNEL, kw)
    hist = kw["conv_state"].shape[1]
    for n in range(6):
        n_keep = jnp.asarray([n, 0, 5 - n], jnp.int32)
        rec = jax.jit(rec_after)(dict(parts, rec0=kw["rec"]), n_keep)
        conv = reference.window_after(parts["conv_x"], n_keep, hist)
        _, c_n, s_n, _ = _window(KERNEL, dict(kw, n_valid=n_keep))
        np.testing.assert_allclose(np.asarray(rec), np.asarray(s_n), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(conv), np.asarray(c_n))
    _, c0, s0, p0 = _window(KERNEL, dict(kw, n_valid=jnp.zeros((3,), jnp.int32)))
    np.testing.assert_array_equal(np.asarray(c0), np.asarray(kw["conv_state"]))
    np.testing.assert_array_equal(np.asarray(s0), np.asarray(kw["rec"]))
    assert not np.asarray(p0["g"]).any() and not np.asarray(p0["beta"]).any()


def test_replay_copies_the_conv_rows_after_the_kept_tokens(monkeypatch):
    """Op "gdn_replay_conv": the rollback replay's programs also copy the conv state after n_keep (the rows
    [n_keep, n_keep + W) of the window's conv input), with the bits of `window_after`, for every n_keep of the
    window and a padding slot; the replayed state is the one without the copy. Under "auto" the copy stays the
    separate gather until the kernel's compiled tests pass."""
    from fnx.model.gdn import rec_after
    from fnx.pallas import dispatch
    kw = window_inputs(seed(), n_valid=(5, 0, 5))
    _, _, _, parts = _window(KERNEL, kw)
    hist = kw["conv_state"].shape[1]
    aux = dict(parts, rec0=kw["rec"])
    assert "gdn_replay_conv" in dispatch.KNOWN_OPS and "gdn_replay_conv" not in dispatch.VERIFIED_ON_GPU
    monkeypatch.setenv("FNX_KERNELS", f"gdn_decode={KERNEL},gdn_replay_conv={KERNEL}")
    jax.clear_caches()
    fold = jax.jit(lambda a, n: rec_after(a, n, hist))
    text = str(jax.make_jaxpr(lambda a, n: rec_after(a, n, hist))(aux, jnp.zeros((3,), jnp.int32)))
    assert "gather" not in text and "dynamic_slice" not in text          # the copy is in the kernel
    for n in range(6):
        n_keep = jnp.asarray([n, 0, 5 - n], jnp.int32)
        rec, conv = fold(aux, n_keep)
        np.testing.assert_array_equal(np.asarray(conv), np.asarray(reference.window_after(parts["conv_x"], n_keep,
                                                                                        hist)))
        np.testing.assert_array_equal(np.asarray(rec), np.asarray(jax.jit(rec_after)(aux, n_keep)))
    monkeypatch.setenv("FNX_KERNELS", f"gdn_decode={KERNEL},gdn_replay_conv=reference")
    jax.clear_caches()
    assert "gather" in str(jax.make_jaxpr(lambda a, n: rec_after(a, n, hist))(aux, jnp.zeros((3,), jnp.int32)))
    with pytest.raises(ValueError, match="conv"):
        api.gdn_recurrent(parts["k"], parts["k"], parts["v"], parts["g"], parts["beta"], kw["rec"], impl=KERNEL,
                          conv=(parts["conv_x"], hist))                  # the copy needs n_keep


def test_window_bad_inputs_are_clear_errors():
    kw = window_inputs(jax.random.key(0))
    call = lambda **over: api.gdn_window(**dict(kw, **over), impl="reference", key_heads=2, eps=1e-6,  # noqa
                                         act="sigmoid")
    with pytest.raises(ValueError, match="z"):
        call(z=kw["z"][:, :2])
    with pytest.raises(ValueError, match="conv_state"):
        call(conv_state=kw["conv_state"][:, :2])
    with pytest.raises(ValueError, match="fp32"):
        call(rec=kw["rec"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\[B, T, C\]"):
        call(qkv=kw["qkv"][0])
    with pytest.raises(NotImplementedError, match="power-of-two"):
        api.gdn_window(**window_inputs(jax.random.key(0), dk=24), impl=KERNEL, key_heads=2, eps=1e-6,
                       act="sigmoid")


@pytest.mark.parametrize("bsz,length,bv,early", [(1, 5, 32, 0), (1, 5, 128, 0), (4, 8, 128, 0), (1, 5, 32, 1)])
def test_window_lowers_for_cuda(bsz, length, bv, early):
    """gdn_window's Triton lowering at the released GDN widths (16 key / 48 value heads of 128, conv of 4 taps)."""
    from fnx.pallas.gdn import pallas as kernel
    from fnx.pallas.gdn.pallas import WindowTiles
    hk, hv, d, taps = 16, 48, 128, 4
    c = 2 * hk * d + hv * d
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    args = (sds((bsz, length, c), bf), sds((bsz, length, hv, d), bf), sds((bsz, length, hv), bf),
            sds((bsz, length, hv), bf), sds((bsz, taps - 1, c), bf), sds((c, taps), bf), sds((hv,), jnp.float32),
            sds((hv,), bf), sds((d,), bf), sds((bsz, hv, d, d), jnp.float32), sds((bsz,), jnp.int32))
    f = lambda *a: kernel.gdn_window(*a, key_heads=hk, eps=1e-6, act="sigmoid",  # noqa: E731
                                     tiles=WindowTiles(block_v=bv, early=early))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "gdn_window" in text
    # the four products as windows of the pair kernel's split-K partials [2, 16, 16480] (qkv + z, then b + a)
    from fnx.pallas.kernel_math import Partials

    def g(raw, *rest):
        buf = Partials(raw, bsz * length, (bsz, length), bf)
        starts = (0, c, hv * d + c, hv * d + c + hv)
        return kernel.gdn_window(*((buf, st) for st in starts), *rest, key_heads=hk, eps=1e-6, act="sigmoid",
                                 tiles=WindowTiles(block_v=bv, early=early))
    text = jax.jit(g).trace(sds((2, 16, c + hv * d + 2 * hv), jnp.float32), *args[4:]).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "gdn_window" in text


def test_partials_sum_as_the_split_sum_and_check_their_windows():
    """kernel_math.Partials: a window of the summed product is the sum in split order in fp32, rounded once, sliced
    to the window (for 2 and 3 splits; with 2, also the bits of gemv's own reduce); operands are checked against
    their leading axes."""
    from fnx.pallas.kernel_math import Partials, take_window, window_operand
    for splits in (2, 3):
        raw = jax.random.normal(jax.random.key(splits), (splits, 16, 40), jnp.float32)
        buf = Partials(raw, 10, (2, 5), jnp.bfloat16)
        seq = raw[0, :10]
        for i in range(1, splits):
            seq = seq + raw[i, :10]
        want = seq.astype(jnp.bfloat16).reshape(2, 5, 40)
        if splits == 2:     # a reduce over two values adds them in the one order there is
            np.testing.assert_array_equal(np.asarray(want, np.float32), np.asarray(
                jnp.sum(raw[:, :10], axis=0).astype(jnp.bfloat16).reshape(2, 5, 40), np.float32))
        np.testing.assert_array_equal(np.asarray(buf.window(), np.float32), np.asarray(want, np.float32))
        np.testing.assert_array_equal(np.asarray(take_window(buf, 7, 9), np.float32),
                                      np.asarray(want[..., 7:16], np.float32))
        assert window_operand((buf, 7), 9, (2, 5))[0] is buf
        with pytest.raises(ValueError, match="partials"):
            window_operand((buf, 35), 9, (2, 5))
        with pytest.raises(ValueError, match="partials"):
            window_operand((buf, 0), 9, (1, 10))
        leaves, tree = jax.tree_util.tree_flatten(buf)              # a pytree: it crosses jit boundaries
        assert len(leaves) == 1 and jax.tree_util.tree_unflatten(tree, leaves).lead == (2, 5)


def test_model_verify_and_rollback_through_the_window_kernel(monkeypatch, tmp_path):
    """tiny-b (dk 16 != dv 8, 4 value heads on 2 key heads), fp32: a prompt, then a five-token verify window
    (`snapshots=True`) and `rollback` to 2 and 5 kept tokens, with every GDN layer's window through the
    gdn_window kernel and the rollback's replay through the recurrence kernel (in place over the input state),
    against the reference ops: the logits and the rolled-back states agree (float error; measured ~1e-7)."""
    from tests.pallas.verify_round import tiny_verify_round
    run = tiny_verify_round(tmp_path, seed=1, rng_seed=0, prompt_len=7, n_valid=[5, 5], n_keep=[2, 5])
    want_lg, want_st = run()
    # the conv state after the kept tokens copied by the replay kernel (op gdn_replay_conv) too
    monkeypatch.setenv("FNX_KERNELS", f"gdn_window={KERNEL},gdn_decode={KERNEL},gdn_replay_conv={KERNEL}")
    got_lg, got_st = run()
    monkeypatch.delenv("FNX_KERNELS")
    jax.clear_caches()
    scale = float(np.abs(np.asarray(want_lg)).max())
    err = float(np.abs(np.asarray(got_lg) - np.asarray(want_lg)).max()) / scale
    print(f"tiny-b verify window, gdn_window kernel vs reference ops: {err:.1e}")
    assert err < 1e-5
    for a, b in zip(jax.tree.leaves(got_st), jax.tree.leaves(want_st), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-5)


def test_window_tiles_knob(monkeypatch):
    """The window kernel's default tiles are BV = 32 at every batch (whole heads measured 8x slower on the H200);
    `FNX_GDN_WINDOW_TILES` replaces fields when a program is traced (whole heads: the norm in the kernel, the same
    values); a malformed or impossible spec is a clear error."""
    from fnx.pallas.gdn import pallas as kernel
    from fnx.pallas.gdn.pallas import WindowTiles
    assert kernel.default_window_tiles(128) == WindowTiles(block_v=32, num_warps=4)
    monkeypatch.setenv("FNX_GDN_WINDOW_TILES", "block_v=128,num_warps=8")
    assert kernel.default_window_tiles(128) == WindowTiles(block_v=128, num_warps=8)
    kw = window_inputs(seed())
    monkeypatch.setenv("FNX_GDN_WINDOW_TILES", "block_v=8")              # dv = 8: whole heads, norm in the kernel
    whole = _window(KERNEL, kw)
    monkeypatch.setenv("FNX_GDN_WINDOW_TILES", "block_v=2")
    split = _window(KERNEL, kw)
    np.testing.assert_allclose(_f32(whole[0]), _f32(split[0]), rtol=1e-5, atol=1e-5)
    for spec, msg in (("block_v=3", "power of two"), ("bv=8", "not field=value"), ("num_warps=x", "integer")):
        monkeypatch.setenv("FNX_GDN_WINDOW_TILES", spec)
        with pytest.raises(ValueError, match=msg):
            kernel.default_window_tiles(8)


def test_window_after_one_sequence_equals_the_batched_gather():
    """One sequence takes a dynamic slice, several a vmapped gather: the same rows for every n (0, inside, the
    whole call, and past it, where both clamp to the last window), the batch's first row as that row alone."""
    rng = np.random.default_rng(7)
    xcat = jnp.asarray(rng.standard_normal((3, 3 + 10, 5)), jnp.bfloat16)
    for n in (0, 4, 10, 12):
        batched = reference.window_after(xcat, jnp.array([n, 1, 10], jnp.int32), 3)
        alone = reference.window_after(xcat[:1], jnp.array([n], jnp.int32), 3)
        assert alone.shape == (1, 3, 5)
        np.testing.assert_array_equal(np.asarray(alone, np.float32), np.asarray(batched[:1], np.float32))
        np.testing.assert_array_equal(np.asarray(alone, np.float32), np.asarray(xcat[:1, min(n, 10):min(n, 10) + 3],
                                                                                np.float32))


@pytest.mark.parametrize("length", [2, 3, 10])
def test_window_of_equals_the_window_of_the_concatenation(length):
    """`window_of(state, x, n, w)` (no whole concatenation for one sequence of at least w tokens) has the bits of
    `window_after(cat(state, x), n, w)` for every n from 0 to the call's length (and past it), one sequence and a
    batch, fp32 state rounded to x's dtype as the concatenation rounds it."""
    rng = np.random.default_rng(11)
    w = 3
    state = jnp.asarray(rng.standard_normal((2, w, 6)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, length, 6)), jnp.bfloat16)
    xcat = jnp.concatenate([state.astype(x.dtype), x], axis=1)
    for n in range(0, length + 2):
        want = reference.window_after(xcat[:1], jnp.array([n], jnp.int32), w)
        got = reference.window_of(state[:1], x[:1], jnp.array([n], jnp.int32), w)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        nb = jnp.array([n, max(length - n, 0)], jnp.int32)
        np.testing.assert_array_equal(np.asarray(reference.window_of(state, x, nb, w), np.float32),
                                      np.asarray(reference.window_after(xcat, nb, w), np.float32))


def test_intra_precision_knob(monkeypatch):
    """FNX_GDN_INTRA picks the chunked form's intra-chunk product precision (fp32 by default; TF32 x3, a GPU knob,
    reaches every batched product of the traced program, the UT inverse's included); a bad value is refused."""
    from fnx.model import gdn
    q, k, v, g, beta, state = (jnp.zeros(s, jnp.float32) for s in ((1, 70, 2, 8), (1, 70, 2, 8), (1, 70, 2, 8),
                                                                    (1, 70, 2), (1, 70, 2), (1, 2, 8, 8)))

    def precisions():   # a fresh function each time: traces are cached per function; the knob is read when tracing
        eqns = []

        def walk(jaxpr):
            for e in jaxpr.eqns:
                if e.primitive.name == "dot_general":
                    eqns.append(e.params["precision"])
                for p in e.params.values():
                    inner = getattr(p, "jaxpr", None)
                    if inner is not None:
                        walk(getattr(inner, "jaxpr", inner))
        walk(jax.make_jaxpr(lambda *a: gdn.delta_rule_chunked(*a, impl="reference"))(q, k, v, g, beta, state).jaxpr)
        return eqns
    base = precisions()
    assert base and all(p == (jax.lax.Precision.HIGHEST,) * 2 for p in base[:6]), base
    monkeypatch.setenv(gdn.INTRA_ENV, "tf32x3")
    fast = precisions()
    x3 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    assert len(fast) == len(base) and sum(x3 in (p if isinstance(p, tuple) else (p,)) for p in fast) >= 6, fast
    monkeypatch.setenv(gdn.INTRA_ENV, "tf32")
    with pytest.raises(ValueError, match=gdn.INTRA_ENV):
        gdn.intra_precision()


def test_scan_tiles_knob(monkeypatch):
    """FNX_GDN_SCAN_TILES replaces fields of the chunk scan's default tiles (block_v 32, or dv when smaller); an
    unknown field is refused."""
    from fnx.pallas.gdn import pallas as kernel
    assert kernel.scan_tiles(128) == kernel.ScanTiles(block_v=32, precision="tf32")
    assert kernel.scan_tiles(16).block_v == 16
    monkeypatch.setenv(kernel.SCAN_TILES_ENV, "block_v=16,precision=tf32")
    assert kernel.scan_tiles(128) == kernel.ScanTiles(block_v=16, precision="tf32")
    monkeypatch.setenv(kernel.SCAN_TILES_ENV, "bv=16")
    with pytest.raises(ValueError, match=kernel.SCAN_TILES_ENV):
        kernel.scan_tiles(128)


def test_split_dots_knob(monkeypatch):
    """FNX_GDN_SPLIT_DOTS (on by default) puts the second product of each pair sharing an operand behind an
    optimization barrier (two of them), with the same values as without ("0"); a bad value is refused."""
    from fnx.model import gdn
    rng = np.random.default_rng(11)
    shapes = ((1, 70, 2, 8), (1, 70, 2, 8), (1, 70, 2, 8), (1, 70, 2), (1, 70, 2), (1, 2, 8, 8))
    q, k, v, g, beta, state = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes)
    g, beta = -jnp.abs(g) * 0.1, jax.nn.sigmoid(beta)
    q, k = q / jnp.linalg.norm(q, axis=-1, keepdims=True), k / jnp.linalg.norm(k, axis=-1, keepdims=True)

    def run():          # a fresh function each time: traces are cached per function; the knob is read when tracing
        f = lambda *a: gdn.delta_rule_chunked(*a, impl="reference")     # noqa: E731
        barriers = sum(e.primitive.name == "optimization_barrier"
                       for e in jax.make_jaxpr(f)(q, k, v, g, beta, state).jaxpr.eqns)
        return barriers, jax.jit(f)(q, k, v, g, beta, state)
    monkeypatch.setenv(gdn.SPLIT_ENV, "0")
    n0, (o0, s0) = run()
    monkeypatch.delenv(gdn.SPLIT_ENV, raising=False)
    n1, (o1, s1) = run()
    assert (n0, n1) == (0, 2)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o0))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s0))
    monkeypatch.setenv(gdn.SPLIT_ENV, "yes")
    with pytest.raises(ValueError, match=gdn.SPLIT_ENV):
        gdn.split_dots()


@pytest.mark.parametrize("length,taps,dilation", [(1, 4, 1), (2, 4, 1), (70, 4, 1), (5, 4, 3), (1, 4, 3)])
def test_conv_shifts_knob_same_bits(length, taps, dilation, monkeypatch):
    """FNX_CONV_SHIFTS (on by default): each tap's window its own concatenation of the state's tail and x's head
    (so XLA can fuse it into the conv): the same conv output and concatenation, bit for bit, for calls shorter and
    longer than the state, dilated (the PLE's) or not; a bad value is refused."""
    rng = np.random.default_rng(length * 10 + dilation)
    c, width = 24, (taps - 1) * dilation
    x = jnp.asarray(rng.standard_normal((2, length, c)), jnp.bfloat16)
    state = jnp.asarray(rng.standard_normal((2, width, c)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((c, taps)), jnp.bfloat16)
    monkeypatch.delenv(reference.CONV_SHIFTS_ENV, raising=False)
    assert reference.conv_shifts()                              # on by default
    monkeypatch.setenv(reference.CONV_SHIFTS_ENV, "0")
    want, want_cat = jax.jit(lambda *a: reference.causal_conv(*a, dilation=dilation))(x, state, w)
    monkeypatch.setenv(reference.CONV_SHIFTS_ENV, "1")
    got, got_cat = jax.jit(lambda *a: reference.causal_conv(*a, dilation=dilation))(x, state, w)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(got_cat, np.float32), np.asarray(want_cat, np.float32))
    # the token-by-token definition: out[t] = sum_j w[:, j] x_cat[t + j * dilation]
    xcat = np.concatenate([np.asarray(state, np.float32), np.asarray(x, np.float32)], axis=1)
    wf = np.asarray(w, np.float32)
    ref = sum(xcat[:, j * dilation:j * dilation + length] * wf[:, j] for j in range(taps))
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=2 ** -7, atol=2 ** -7 * np.abs(ref).max())
    monkeypatch.setenv(reference.CONV_SHIFTS_ENV, "2")
    with pytest.raises(ValueError, match=reference.CONV_SHIFTS_ENV):
        reference.conv_shifts()
