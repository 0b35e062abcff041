"""Online NVFP4 quantization: nearest-value rounding, representable values kept, typical error."""

import jax
import jax.numpy as jnp
import numpy as np

from fnx.model.quant import E2M1_VALUES, dequantize, quantize_nvfp4


def test_representable_values_round_trip_exactly():
    rng = np.random.default_rng(0)
    vals = rng.choice(E2M1_VALUES, size=(4, 64)).astype(np.float32)
    vals[:, ::16] = 6.0  # every group amax is 6: group scale 448, global 1/448 (exact up to fp32's 1/448)
    q = quantize_nvfp4(jnp.asarray(vals))
    np.testing.assert_allclose(np.asarray(dequantize(q)), vals, rtol=3e-7, atol=0)


def test_error_is_nearest_value_rounding():
    w = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 96))
    q = quantize_nvfp4(w)
    d = np.asarray(dequantize(q))
    rel = np.linalg.norm(d - np.asarray(w)) / np.linalg.norm(np.asarray(w))
    assert 0.05 < rel < 0.12
    # no element is further from its value than half the largest E2M1 gap (2) times its group's scale
    eff = (np.asarray(q.scale.astype(jnp.float32)) * np.asarray(q.scale_2)[..., None])
    eff = np.repeat(eff, 16, axis=-1)
    assert np.all(np.abs(d - np.asarray(w)) <= 1.0 * eff + 1e-6)
