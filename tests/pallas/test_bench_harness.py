"""The kernel benchmark's timing harness (fnx.pallas.bench): slope timing over distinct applications."""

import os

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


def test_time_case_reports_a_positive_slope(monkeypatch):
    """The slope between the two compiled programs, each run for real, from a clock that charges 10 us an
    application over a 100 us call (the CPU's own clock under a loaded CI machine can invert two programs' times:
    timing is the GPU scripts' business, this test checks the arithmetic and the programs)."""
    ran = []

    def fake_min_time(f, sets, iters, warmup):
        ran.append(np.asarray(jax.tree.leaves(f(sets))[0]).size)
        return 1e-4 + 1e-5 * len(sets)

    monkeypatch.setattr(bench, "_min_time", fake_min_time)
    r = bench.time_case(_case(), iters=3, warmup=1, min_apps=12)
    assert len(ran) == 2 and all(ran)
    assert r["us"] == 10.0 and r["apps"] == 3 * (1 + 4) and r["sets"] == 3 and r["call_us"] == 130.0
    assert np.isclose(r["tbps"], 256 * 256 * 4 / (r["us"] * 1e-6) / 1e12, rtol=2e-2, atol=2e-3)  # rounded


def test_noise_that_hides_the_slope_is_an_error(monkeypatch):
    monkeypatch.setattr(bench, "_min_time", lambda f, sets, iters, warmup: 1e-3)  # B no slower than A
    with pytest.raises(RuntimeError, match="timing noise"):
        bench.time_case(_case(), iters=1, warmup=0)


def test_check_case_flags_a_variant_that_computes_something_else():
    """A case with a `check` records its error against it: within tolerance "ok", past it (or NaN) "mismatch"."""
    import jax.numpy as jnp

    from fnx.pallas.bench import BenchCase, check_case
    x = jnp.linspace(-1.0, 1.0, 64)
    case = lambda fn, check: BenchCase(kernel="k", shape="s", impl="i", fn=fn, arg_sets=[(x,), (x,)], bytes=1,
                                       check=check)
    assert check_case(case(lambda a: a * 2, None)) == {}
    ok = check_case(case(lambda a: a * 2, lambda a: a * 2 + 0.01))
    assert ok["check"] == "ok" and abs(ok["max_rel_err"] - 0.005) < 1e-4
    assert check_case(case(lambda a: a * 2, lambda a: a * 3))["check"] == "mismatch"
    assert check_case(case(lambda a: a * jnp.nan, lambda a: a))["check"] == "mismatch"
    # several outputs: each against its own, the largest error of each relative to its own scale
    two = check_case(case(lambda a: (a * 2, a * 1000), lambda a: (a * 2, a * 1000 + 1)))
    assert two["check"] == "ok" and abs(two["max_rel_err"] - 1 / 1001) < 1e-5, two     # |1| over max 1001
    assert check_case(case(lambda a: (a * 2, a * 3), lambda a: (a * 2, a * 2)))["check"] == "mismatch"
    assert check_case(case(lambda a: (a, a), lambda a: (a,)))["check"] == "mismatch"


def test_check_case_computes_a_shared_check_once():
    """Tile variants of one shape share their check object and arguments: the check runs once for them."""
    import jax.numpy as jnp

    from fnx.pallas.bench import BenchCase, check_case
    calls = []

    def ref(a):
        calls.append(1)          # traced once per compilation
        return a * 2

    x = jnp.arange(8.0)
    for k in (1.0, 1.001):
        r = check_case(BenchCase("k", "s", "i", lambda a, k=k: a * 2 * k, [(x,), (x,)], bytes=1, check=ref))
        assert r["check"] == "ok"
    assert len(calls) == 1


def test_a_case_variant_is_traced_under_its_settings_and_leaves_none_behind(monkeypatch):
    """BenchCase.env (bench_kernels.py --variants): the case's programs are traced with those FNX_ settings, even
    where the case calls a jitted function already traced under other settings (JAX keeps traces per function),
    and the environment and the next case's traces are as before it."""
    monkeypatch.delenv("FNX_BENCH_PROBE", raising=False)

    @jax.jit
    def inner(x):   # reads a knob when traced, as fnx's kernels do
        return x + (1.0 if os.environ.get("FNX_BENCH_PROBE") == "1" else 0.0)

    sets = [(jnp.zeros((4,)),), (jnp.ones((4,)),)]
    base = bench.BenchCase("toy", "4", "reference", inner, sets, bytes=16)
    var = bench.BenchCase("toy", "4", "reference+p", inner, sets, bytes=16, env={"FNX_BENCH_PROBE": "1"})
    outs = []
    for case in (base, var, base):
        p = bench.prepare_case(case, min_apps=2)
        outs.append([float(y[0]) for y in p.once(p.once_args)])
    assert outs == [[0.0, 1.0], [1.0, 2.0], [0.0, 1.0]]
    assert "FNX_BENCH_PROBE" not in os.environ
    check = bench.BenchCase("toy", "4", "reference+p", inner, sets, bytes=16, env={"FNX_BENCH_PROBE": "1"},
                            check=lambda x: x + 1.0, check_tol=0.0)
    assert bench.check_case(check)["check"] == "ok"       # the check's own call traced under the settings too


def test_variant_specs():
    assert bench.parse_variants("da: FNX_DOT_ACC=1;h: FNX_DOT_ACC=1 FNX_MOE_BLOCK_TILES=mma16=1,split_act=1") == [
        ("da", {"FNX_DOT_ACC": "1"}), ("h", {"FNX_DOT_ACC": "1", "FNX_MOE_BLOCK_TILES": "mma16=1,split_act=1"})]
    with pytest.raises(SystemExit, match="--variants: 'PATH=x' in variant 'a' is not FNX_NAME=VALUE"):
        bench.parse_variants("a: PATH=x")
