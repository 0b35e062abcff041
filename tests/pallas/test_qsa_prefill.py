"""The QSA prefill attention in one launch (fnx/pallas/qsa/prefill.py, op "qsa_prefill_attention"): against the
model's masked dense arithmetic on fresh random inputs (several batches, query tiles cut by the length, positions
early, late and past the capacity), through the model's QSA layer, its refusals, and the CUDA lowering at the
released shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.model import qsa
from fnx.pallas import dispatch
from fnx.pallas.qsa import api, prefill
from tests.pallas.kernel_mode import INTERPRET, KERNEL  # noqa: F401

TOL = {jnp.bfloat16: 2e-2, jnp.float32: 1e-5}      # bf16: the probabilities rounded before / after the division


def _reference(qh, kc, vc, mask):
    """The model's whole-axis masked attention (fnx.model.qsa.qsa_layer's dense branch; its dt x dt -> fp32
    products as fp32 products of the dt values, which the CPU runs at every batch size)."""
    dt, hd, f32 = qh.dtype, qh.shape[-1], jnp.float32
    s = jnp.einsum("blgrd,bgtd->bgrlt", qh.astype(f32), kc.astype(f32),
                   precision=jax.lax.Precision.HIGHEST).astype(dt)
    s = (s.astype(f32) * hd ** -0.5).astype(dt).astype(f32)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    probs = jax.nn.softmax(s, axis=-1).astype(dt)
    return jnp.einsum("bgrlt,bgtd->blgrd", probs.astype(f32), vc.astype(f32),
                      precision=jax.lax.Precision.HIGHEST).astype(dt)


def _inputs(rng, bsz, length, hkv, grp, hd, cap, pos0, dt):
    qh = jnp.asarray(rng.standard_normal((bsz, length, hkv, grp, hd)), dt)
    kc = jnp.asarray(2 * rng.standard_normal((bsz, hkv, cap, hd)), dt)
    vc = jnp.asarray(rng.standard_normal((bsz, hkv, cap, hd)), dt)
    positions = jnp.asarray(np.asarray(pos0)[:, None] + np.arange(length)[None, :], jnp.int32)
    tok = np.arange(cap)
    keep = rng.random((bsz, length, cap)) < 0.4
    pos = np.asarray(positions)[..., None]
    mask = (tok <= pos) & (keep | (tok == np.minimum(pos, cap - 1)))     # causal, sparse, each row its own key
    return qh, kc, vc, jnp.asarray(mask), positions


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bsz,length,pos0,heads", [(1, 48, (0,), 1), (2, 40, (70, 3), 1), (1, 24, (120,), 1),
                                                   (2, 40, (70, 3), 2), (1, 24, (50,), 4)])
def test_prefill_attention_matches_the_masked_dense_path(bsz, length, pos0, heads, dtype):
    """Query tiles of 16 rows (40 queries: the last tile cut), key tiles of 32 over 128 keys: a first chunk, a batch
    at two depths, and positions past the capacity (every key visible; the tiles clipped to the cache); 2 or 4 of
    a KV head's 4 query heads in one program (their rows side by side, sharing the mask's rows)."""
    rng = np.random.default_rng(np.random.randint(1 << 30))
    qh, kc, vc, mask, positions = _inputs(rng, bsz, length, 2, 4, 32, 128, pos0, dtype)
    want = _reference(qh, kc, vc, mask)
    got = prefill.qsa_prefill_attention(qh, kc, vc, mask, positions, interpret=INTERPRET,
                                        tiles=prefill.PrefillTiles(bq=16 // heads, bk=32, heads=heads, num_warps=4))
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape and np.all(np.isfinite(got))
    assert np.abs(got - want).max() <= TOL[dtype] * np.abs(want).max(), np.abs(got - want).max()


def test_prefill_attention_refuses_what_it_does_not_take():
    t = prefill.PrefillTiles(bq=16, bk=32)
    assert prefill.why_not(256, 8192, prefill.PrefillTiles()) is None
    assert "head dim 48" in prefill.why_not(48, 128, t)
    assert "not a multiple of bk=32" in prefill.why_not(32, 100, t)
    assert "bq=24" in prefill.why_not(32, 128, prefill.PrefillTiles(bq=24))
    assert "heads=3" in prefill.why_not(32, 128, prefill.PrefillTiles(bq=16, heads=3))
    assert "does not divide the 3 query heads" in prefill.why_not(32, 128, prefill.PrefillTiles(heads=2), 3)
    assert prefill.why_not(256, 8192, prefill.PrefillTiles(bq=16, heads=4), 12) is None
    rng = np.random.default_rng(0)
    qh, kc, vc, mask, positions = _inputs(rng, 1, 16, 2, 3, 32, 80, (0,), jnp.float32)
    with pytest.raises(ValueError, match=f"not a multiple of bk={prefill.PrefillTiles().bk}"):
        prefill.qsa_prefill_attention(qh, kc, vc, mask, positions, interpret=True)
    qh, kc, vc, mask, positions = _inputs(rng, 1, 16, 2, 3, 32, 96, (0,), jnp.float32)
    with pytest.raises(ValueError, match="do not agree"):
        prefill.qsa_prefill_attention(qh, kc, vc, mask[:, :, :64], positions, interpret=True,
                                      tiles=prefill.PrefillTiles(bq=16, bk=32))
    with pytest.raises(dispatch.NotApplicable, match="head dim 48"):
        api.prefill_backend("pallas_interpret", 48, 128)
    assert api.prefill_backend("reference", 48, 128) == "reference"
    assert "qsa_prefill_attention" in dispatch.KNOWN_OPS


def test_model_prefill_call_through_the_kernel(monkeypatch):
    """A 24-token call of the model's QSA layer (96-key cache) with op "qsa_prefill_attention" on the kernel against
    the reference layer: the kernel runs (one launch), not the key-chunked path, the output within fp32 error and
    the state the same bits."""
    from tests.pallas.test_qsa import _layer_setup
    cfg, p, st, make_meta, dt, kx = _layer_setup(np.random.randint(1 << 30))
    x = jax.random.normal(kx, (1, 24, 64), dt)
    pos0 = jnp.array([30], jnp.int32)
    meta = make_meta(cfg, pos0, 24, dt)
    monkeypatch.setattr(prefill, "choose_tiles", lambda *a: prefill.PrefillTiles(bq=16, bk=32, num_warps=4))
    monkeypatch.setattr(qsa, "KEY_CHUNK", 32)

    def run():
        return jax.jit(lambda x, st: qsa.qsa_layer(p, x, st, pos0, meta["cos"], meta["sin"], meta["rope_fn"], cfg,
                                                   meta["n_valid"]))
    y_ref, st_ref, _ = run()(x, st)
    monkeypatch.setenv("FNX_KERNELS", f"qsa_prefill_attention={KERNEL}")
    monkeypatch.setattr(qsa, "_masked_attention_chunked", lambda *a: pytest.fail("the chunked path ran"))
    f = run()
    assert "qsa_prefill_attention" in str(jax.make_jaxpr(f)(x, st))
    y, st_new, _ = f(x, st)
    y, y_ref = np.asarray(y), np.asarray(y_ref)
    assert np.abs(y - y_ref).max() <= 1e-5 * np.abs(y_ref).max()
    for k in st_ref:
        np.testing.assert_array_equal(np.asarray(st_new[k]), np.asarray(st_ref[k]))


def test_prefill_attention_lowers_for_cuda_released_shapes():
    """A 2,048-token chunk at an 8K cache: 2 KV heads x 12 query heads, hd 256, the default tiles."""
    sds = [jax.ShapeDtypeStruct((1, 2048, 2, 12, 256), jnp.bfloat16),
           jax.ShapeDtypeStruct((1, 2, 8192, 256), jnp.bfloat16), jax.ShapeDtypeStruct((1, 2, 8192, 256), jnp.bfloat16),
           jax.ShapeDtypeStruct((1, 2048, 8192), jnp.bool_), jax.ShapeDtypeStruct((1, 2048), jnp.int32)]
    f = jax.jit(lambda *a: prefill.qsa_prefill_attention(*a))
    text = f.trace(*sds).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text.lower() and "qsa_prefill_attention" in text
