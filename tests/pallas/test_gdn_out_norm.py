"""The GDN prefill output norm from the chunk scan's layout (fnx/pallas/gdn/out_norm.py, op "gdn_out_norm")
against the model's ops (o rearranged to its tokens and rounded, then `reference.rms_norm_gated`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.pallas.gdn import out_norm
from tests.pallas.kernel_mode import INTERPRET, KERNEL  # noqa: F401

F32, BF16 = jnp.float32, jnp.bfloat16


def _inputs(bsz, h, n, c, dv, length, seed, width_extra=48):
    ks = jax.random.split(jax.random.key(seed), 3)
    o = jax.random.normal(ks[0], (bsz, h, n, c, dv), F32) * 3.0
    o = o.at[0, 0, 0, 1].set(0.0)                                   # an all-zero row: rsqrt(eps)
    zbuf = jax.random.normal(ks[1], (bsz, length, width_extra + h * dv + 16), F32).astype(BF16)
    w = (1.0 + 0.1 * jax.random.normal(ks[2], (dv,), F32)).astype(BF16)
    return o, (zbuf, width_extra), w


@pytest.mark.parametrize("length", [128, 100])
@pytest.mark.parametrize("act", ["sigmoid", "silu"])
def test_out_norm_matches_the_models_ops(length, act):
    """Whole programs (128 tokens) and a ragged last one (100 of 128 rows: masked loads and stores), z a window of a
    wider buffer, both gates: within one bf16 step of the model's ops (the kernel's exp, rsqrt and the mean's
    summation order are its own: the interpreter's compiled loop already differs from XLA's ops in the last fp32
    bit, which moves a bf16 rounding in about a quarter of the elements)."""
    o, z, w = _inputs(2, 3, 2, 64, 32, length, length)
    got = out_norm.out_norm_tokens(o, z, w, 1e-6, act, length, BF16, interpret=INTERPRET)
    want = out_norm.out_norm_reference(o, z, w, 1e-6, act, length, BF16)
    assert got.shape == want.shape == (2, length, 3, 32) and got.dtype == BF16
    g, r = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(g).all()
    np.testing.assert_allclose(g, r, rtol=2 ** -7, atol=1e-6)      # one bf16 step


def test_out_norm_dispatch_and_refusals(monkeypatch):
    """`out_norm` takes the kernel where FNX_KERNELS names it (the same values as out_norm_tokens), the reference's
    ops otherwise on the CPU; shapes it cannot serve are refused with the reason."""
    o, z, w = _inputs(1, 2, 1, 64, 32, 64, 5)
    monkeypatch.setenv("FNX_KERNELS", f"{out_norm.OP}={KERNEL}")
    jax.clear_caches()
    run = functools.partial(out_norm.out_norm, eps=1e-6, act="sigmoid", length=64, dtype=BF16)
    eqns = jax.make_jaxpr(lambda o, zb, w: run(o, (zb, z[1]), w))(o, z[0], w).eqns
    assert [e for e in eqns if e.primitive.name == "pallas_call"]
    monkeypatch.delenv("FNX_KERNELS")
    jax.clear_caches()
    assert "power of two" in out_norm.why_not((1, 2, 1, 64, 48), 48, "sigmoid")
    assert "multiple" in out_norm.why_not((1, 2, 1, 16, 32), 32, "sigmoid")
    assert "gate activation" in out_norm.why_not((1, 2, 1, 64, 32), 32, "tanh")
    with pytest.raises(ValueError, match="tokens"):
        out_norm.out_norm_tokens(o, z, w, 1e-6, "sigmoid", 65, BF16, interpret=True)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gdn_prefill_layer_through_the_kernel(monkeypatch, dtype):
    """The model's GDN prefill (a small layer, 70 tokens: a ragged last program; one sequence with padding) with its
    output norm through the kernel: the layer's output within rounding noise of the reference's ops, both states
    the same bits (the norm comes after them)."""
    from types import SimpleNamespace
    from fnx.model import gdn
    from tests.pallas.test_gdn import seed, step_inputs
    hk, hv, dk, dv, d, length = 2, 4, 16, 16, 64, 70
    cfg = SimpleNamespace(linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                          linear_value_head_dim=dv, rms_norm_eps=1e-6, output_gate_type="sigmoid")
    kw = step_inputs(seed(), bsz=2, hk=hk, hv=hv, dk=dk, dv=dv, n_valid=(1, 1))
    ks = jax.random.split(seed(), 6)
    w = lambda k, n, m=d: (jax.random.normal(k, (n, m)) * m ** -0.5).astype(dtype)  # noqa: E731
    p = {"in_proj_qkv": w(ks[0], kw["qkv"].shape[2]), "in_proj_z": w(ks[1], hv * dv), "in_proj_b": w(ks[2], hv),
         "in_proj_a": w(ks[3], hv), "conv1d": kw["conv_w"], "A_log": kw["a_log"], "dt_bias": kw["dt_bias"],
         "norm": kw["norm_w"], "out_proj": w(ks[4], d, hv * dv)}
    x = jax.random.normal(ks[5], (2, length, d)).astype(dtype)
    n_valid = jnp.array([length, 50], jnp.int32)
    conv_state = kw["conv_state"].astype(dtype)
    layer = jax.jit(lambda p, x: gdn.gdn_layer(p, x, conv_state, kw["rec"], cfg, n_valid)[:3])
    want = layer(p, x)
    monkeypatch.setenv("FNX_KERNELS", f"{out_norm.OP}={KERNEL}")
    jax.clear_caches()
    try:
        got = layer(p, x)
        n_kernels = sum(e.primitive.name == "pallas_call" and "gdn_out_norm" in str(e.params.get("name"))
                        for e in jax.make_jaxpr(lambda p, x: gdn.gdn_layer(p, x, conv_state, kw["rec"], cfg,
                                                                            n_valid)[:3])(p, x).jaxpr.eqns)
    finally:
        monkeypatch.delenv("FNX_KERNELS")
        jax.clear_caches()
    g, r = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
    bound = (2 ** -6 if dtype == BF16 else 1e-5) * float(np.abs(r).max())
    np.testing.assert_allclose(g, r, rtol=0, atol=bound)
    for a, b in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert n_kernels == 1, n_kernels


def test_out_norm_lowers_for_cuda():
    """The released shapes (48 value heads of 128, a 2,048-token chunk, z a window of the fused projection): one
    Triton launch."""
    from fnx.pallas import triton_ir
    S = jax.ShapeDtypeStruct
    fn = lambda o, zb, w: out_norm.out_norm_tokens(o, (zb, 4096), w, 1e-6, "sigmoid", 2048, BF16)  # noqa: E731
    lowered = jax.jit(fn).trace(S((1, 48, 32, 64, 128), F32), S((1, 2048, 16480), BF16),
                                S((128,), BF16)).lower(lowering_platforms=("cuda",))
    assert [name for name, *_ in triton_ir.launches(lowered)] == ["gdn_out_norm"]
