"""`fnx.pallas.dot_acc`: acc + a @ b in a Pallas kernel, the accumulator handed to the tensor-core product on the
Triton lowering when FNX_DOT_ACC=1. In a kernel (the interpreter here, the compiled kernel on a GPU) against the
fp32 product; the Triton IR it lowers to for CUDA (the accumulator into `tt.dot`, no separate add) on any machine;
its refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fnx.pallas import dot_acc as da
from fnx.pallas import triton_ir
from tests.pallas.kernel_mode import INTERPRET

F32 = jnp.float32


def _matmul(m, n, k, bk, trans_b, dt, interpret):
    """A K loop of dot_acc steps: x [m, k] @ w (w [n, k] with trans_b, else [k, n]), starting from c [m, n]."""
    def kernel(x_ref, w_ref, c_ref, o_ref):
        def step(i, acc):
            x = x_ref[:, pl.ds(i * bk, bk)]
            w = w_ref[:, pl.ds(i * bk, bk)] if trans_b else w_ref[pl.ds(i * bk, bk), :]
            return da.dot_acc(acc, x, w, trans_b=trans_b)
        o_ref[...] = jax.lax.fori_loop(0, k // bk, step, c_ref[...])
    params = {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=4, num_stages=3)}
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, n), F32), interpret=interpret, **params)


@pytest.mark.parametrize("fuse", ["0", "1"])
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float32])
def test_dot_acc_in_a_kernel_is_acc_plus_the_product(monkeypatch, fuse, trans_b, dt):
    monkeypatch.setenv(da.ENV, fuse)
    jax.clear_caches()
    rng = np.random.default_rng(7)
    m, n, k, bk = 32, 64, 128, 32
    x = jnp.asarray(rng.standard_normal((m, k)), dt)
    w = jnp.asarray(rng.standard_normal((n, k) if trans_b else (k, n)), dt)
    c = jnp.asarray(rng.standard_normal((m, n)), F32)
    out = _matmul(m, n, k, bk, trans_b, dt, INTERPRET)(x, w, c)
    wf = np.asarray(w, np.float64)
    ref = np.asarray(c, np.float64) + np.asarray(x, np.float64) @ (wf.T if trans_b else wf)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4)


def test_dot_acc_outside_a_kernel_and_under_vmap():
    rng = np.random.default_rng(3)
    acc = jnp.asarray(rng.standard_normal((3, 16, 8)), F32)
    a = jnp.asarray(rng.standard_normal((3, 16, 32)), F32)
    b = jnp.asarray(rng.standard_normal((3, 8, 32)), F32)
    got = jax.vmap(lambda c, x, y: da.dot_acc(c, x, y, trans_b=True))(acc, a, b)
    want = np.asarray(acc) + np.einsum("bmk,bnk->bmn", np.asarray(a, np.float64), np.asarray(b, np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    jitted = jax.jit(lambda c, x, y: da.dot_acc(c, x, y, trans_b=True))(acc[0], a[0], b[0])
    np.testing.assert_allclose(np.asarray(jitted), want[0], rtol=1e-5, atol=1e-5)


def _dot_lines(monkeypatch, fuse):
    monkeypatch.setenv(da.ENV, fuse)
    jax.clear_caches()
    sds = (jax.ShapeDtypeStruct((64, 128), jnp.bfloat16), jax.ShapeDtypeStruct((64, 128), jnp.bfloat16),
           jax.ShapeDtypeStruct((64, 64), F32))
    (launch,) = triton_ir.launches(jax.jit(_matmul(64, 64, 128, 32, True, jnp.bfloat16, False)).trace(*sds).lower(
        lowering_platforms=("cuda",)))
    return [ln.strip() for ln in launch[3].splitlines() if "tt.dot" in ln or "arith.addf" in ln]


def test_cuda_lowering_hands_the_accumulator_to_the_product(monkeypatch):
    fused = _dot_lines(monkeypatch, "1")
    assert len(fused) == 1 and "tt.dot" in fused[0], fused
    # the accumulator operand is the loop's carried value (a block argument), not a fresh zero
    assert fused[0].split("tt.dot")[1].split(":")[0].split(",")[2].strip().startswith("%arg"), fused
    plain = _dot_lines(monkeypatch, "0")
    assert len(plain) == 2 and "arith.addf" in plain[1], plain


def test_refusals(monkeypatch):
    f32 = jnp.zeros((4, 8), F32)
    with pytest.raises(ValueError, match="do not fit"):
        da.dot_acc(f32, jnp.zeros((4, 16), F32), jnp.zeros((8, 16), F32))          # b needs trans_b
    with pytest.raises(ValueError, match="fp32"):
        da.dot_acc(f32.astype(jnp.bfloat16), jnp.zeros((4, 16)), jnp.zeros((16, 8)))
    with pytest.raises(ValueError, match="2-D"):
        da.dot_acc(f32, jnp.zeros((1, 4, 16)), jnp.zeros((16, 8)))
    monkeypatch.setenv(da.ENV, "yes")
    with pytest.raises(ValueError, match=da.ENV):
        da.fused()
