"""fnx.pallas.gdn: the Pallas gated-delta-rule kernel (interpret mode) against the fp32 jnp reference.

Tolerances (fp32 state and outputs, bf16 q/k/v inputs): 512 decode steps fed one at a time stay within 2e-5
absolute / 1e-4 relative of the reference run over the same 512 tokens (measured < 1e-7 absolute: only the order
of the dk-sums differs). Verify-window snapshots equal step-by-step decoding to 1e-6. The fused gated output
norm: 1e-5 in fp32, 1.6e-2 (two rounding steps) in bf16. No output poisoning: every output is a fresh buffer of
the kernel (or, inplace, the state itself)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.pallas.gdn import api, reference
from fnx.pallas.gdn.pallas import Tiles
from tests.pallas.kernel_mode import INTERPRET, KERNEL  # noqa: F401

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


def seed():
    return jax.random.key(np.random.SeedSequence().entropy % (2 ** 31))


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
                static_argnames=("keep_steps", "steps_with_initial"))
    _, _, steps = f(q, k, v, g, beta, s0, keep_steps=True, steps_with_initial=True)
    mask = jnp.arange(length)[None, :, None] < jnp.asarray(keep)[:, None, None]
    o_m, s_m = f(q, k, v, jnp.where(mask, g, 0.0), jnp.where(mask, beta, 0.0), s0)
    for b in range(B):
        np.testing.assert_allclose(np.asarray(s_m[b]), np.asarray(steps[b, keep[b]]), rtol=1e-6, atol=1e-6)


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
    else:
        f = lambda *a: kernel.gdn_recurrent(*a, keep, steps_with_initial=keep, inplace=not keep,  # noqa: E731
                                            out_dtype=jnp.bfloat16, scale=dk ** -0.5, qk_l2norm=True)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "gdn_recurrent" in text
