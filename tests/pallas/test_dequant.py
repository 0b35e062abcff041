"""The FP8 block dequantization kernel (fnx/pallas/gemv/dequant.py, op "dequant_fp8") against the reference
dequantizer: the same bits, in place from layer stacks, and wired into the prefill-sized products."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.model import quant
from fnx.pallas import dispatch, stacked
from fnx.pallas.gemv import api, dequant, reference
from tests.pallas.kernel_mode import INTERPRET, KERNEL, ops_outside_kernels  # noqa: F401

F32 = jnp.float32


def _fp8(n, k, seed, lead=()):
    w = jax.random.normal(jax.random.key(seed), (*lead, n, k), F32) * (0.5 / np.sqrt(k))
    w = w.at[..., 0, 0].set(3.0)            # one block's scale far from the others
    return quant.quantize_fp8_block(w)


def _want(q, dtype):
    return reference.dequantize("fp8", q.w, q.scale_inv, block=q.block).astype(dtype)


@pytest.mark.parametrize("n,k", [(320, 640), (640, 320), (256, 1024), (200, 48)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, F32])
def test_dequant_fp8_gives_the_reference_bits(n, k, dtype):
    """Partial scale blocks in rows (320: 2.5 blocks) and in columns, several column tiles a program (1024), small
    tiles (200 x 48: 8 x 16): every element the reference dequantizer's, rounded once to the output dtype."""
    q = _fp8(n, k, n + k)
    t = dequant.choose_tiles(n, k)
    assert t is not None and n % t.bn == 0 and k % (t.bk * t.cols) == 0, t
    got = dequant.dequantize_fp8(q.w, q.scale_inv, q.block, dtype, interpret=INTERPRET)
    assert got.shape == (n, k) and got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(_want(q, dtype), np.float32))


def test_dequant_fp8_reads_a_layer_of_a_stack_in_place():
    """A LayerRef (the stacked layout) dequantizes its own layer, with no slice of the stack outside the kernel."""
    q = _fp8(128, 256, 7, lead=(3,))
    ref_w, ref_s = stacked.LayerRef(q.w, 1), stacked.LayerRef(q.scale_inv, 1)
    fn = functools.partial(dequant.dequantize_fp8, block=q.block, dtype=jnp.bfloat16, interpret=INTERPRET)
    got = fn(ref_w, ref_s)
    want = reference.dequantize("fp8", q.w[1], q.scale_inv[1], block=q.block).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    outside = ops_outside_kernels(lambda w, s: fn(stacked.LayerRef(w, 1), stacked.LayerRef(s, 1)), q.w, q.scale_inv)
    assert "dynamic_slice" not in outside and "slice" not in outside, outside


def test_dequant_fp8_refuses_what_it_cannot_tile():
    q = _fp8(100, 50, 3)
    assert "no tile" in dequant.why_not(q.w.shape, q.block, q.w.dtype)
    with pytest.raises(NotImplementedError, match="no tile"):
        dequant.dequantize_fp8(q.w, q.scale_inv, q.block, interpret=True)
    assert "float8_e4m3fn" in dequant.why_not((128, 128), (128, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="do not divide"):
        dequant.dequantize_fp8(q.w[:96, :48], q.scale_inv[:1, :1], q.block, interpret=True,
                               tiles=dequant.DequantTiles(bn=64, bk=16, cols=1))


def test_prefill_products_take_the_kernel_where_named(monkeypatch):
    """A prefill-sized FP8 product (more rows than the GEMV kernels take) dequantizes through the kernel when
    FNX_KERNELS names dequant_fp8 (the same bits as the reference path), and through XLA under "auto" where the
    kernel is not taken by it (on the CPU: always; on a GPU while the op measured slower, AUTO_KEEPS_REFERENCE) or
    when the product's impl is "reference"."""
    q = _fp8(320, 640, 11)
    x = jax.random.normal(jax.random.key(12), (api.MAX_M + 8, 640), F32).astype(jnp.bfloat16)
    run = functools.partial(api.linear, fmt="fp8", scale=q.scale_inv, block=q.block)
    want = run(x, q.w, impl="reference")
    monkeypatch.setenv("FNX_KERNELS", f"{dequant.OP}={KERNEL}")
    jax.clear_caches()
    got = run(x, q.w)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    kernels = [e for e in jax.make_jaxpr(run)(x, q.w).eqns if e.primitive.name == "pallas_call"]
    assert len(kernels) == 1
    assert not [e for e in jax.make_jaxpr(functools.partial(run, impl="reference"))(x, q.w).eqns
                if e.primitive.name == "pallas_call"]
    small = x[:api.MAX_M]           # decode-sized: XLA's dequantize-and-dot (or the GEMV kernels), never this kernel
    assert not [e for e in jax.make_jaxpr(functools.partial(run, impl="auto"))(small, q.w).eqns
                if e.primitive.name == "pallas_call" and "dequant" in str(e.params.get("name", ""))]
    monkeypatch.delenv("FNX_KERNELS")
    jax.clear_caches()
    auto = jax.make_jaxpr(run)(x, q.w).eqns
    on_gpu = dequant.OP in dispatch.VERIFIED_ON_GPU and dequant.OP not in dispatch.AUTO_KEEPS_REFERENCE and \
        dispatch.why_unavailable("pallas") is None
    assert bool([e for e in auto if e.primitive.name == "pallas_call"]) == on_gpu


def test_dequant_fp8_lowers_for_cuda():
    """The released dense shapes (the GDN input projection, a hyper-connection Wup with its 2.5 column blocks):
    one Triton launch each."""
    from fnx.pallas import triton_ir
    S = jax.ShapeDtypeStruct
    for n, k in ((16384, 2560), (10240, 320), (2560, 6144)):
        t = dequant.choose_tiles(n, k)
        lowered = jax.jit(functools.partial(dequant.dequantize_fp8, block=(128, 128))).trace(
            S((n, k), jnp.float8_e4m3fn), S((-(-n // 128), -(-k // 128)), F32)).lower(lowering_platforms=("cuda",))
        launches = triton_ir.launches(lowered)
        assert [name for name, *_ in launches] == ["fnx_dequant_fp8"], (n, k, t)
