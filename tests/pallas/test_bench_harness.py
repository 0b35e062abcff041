"""The kernel benchmark's timing harness (fnx.pallas.bench): slope timing over distinct applications."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.pallas import bench


def _case(n_sets=3):
    key = jax.random.PRNGKey(0)
    sets = [(jax.random.normal(jax.random.fold_in(key, i), (8, 256)),
             jax.random.normal(jax.random.fold_in(key, 100 + i), (256, 256))) for i in range(n_sets)]
    return bench.BenchCase("toy", "8x256", "reference", lambda x, w: jnp.tanh(x @ w), sets,
                           bytes=256 * 256 * 4, flops=2 * 8 * 256 * 256)


def test_repetitions_differ_in_the_activation_only():
    case = _case()
    out = bench._varied(case.arg_sets, 3)
    assert len(out) == 9
    for r in range(3):
        for i, a in enumerate(case.arg_sets):
            b = out[r * 3 + i]
            assert b[1] is a[1]                       # the weights are the same arrays, never copied
            diff = float(jnp.max(jnp.abs(b[0] - a[0])))
            assert (diff == 0) == (r == 0)            # every later repetition has its own activation


def test_time_case_reports_a_positive_slope():
    r = bench.time_case(_case(), iters=3, warmup=1, min_apps=12)
    assert r["us"] > 0 and r["apps"] == 3 * (1 + 4)
    assert np.isclose(r["tbps"], 256 * 256 * 4 / (r["us"] * 1e-6) / 1e12, rtol=2e-2, atol=2e-3)  # rounded


def test_noise_that_hides_the_slope_is_an_error(monkeypatch):
    monkeypatch.setattr(bench, "_min_time", lambda f, sets, iters, warmup: 1e-3)  # B no slower than A
    with pytest.raises(RuntimeError, match="timing noise"):
        bench.time_case(_case(), iters=1, warmup=0)
