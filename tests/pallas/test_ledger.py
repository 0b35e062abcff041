"""fnx.pallas.ledger: kernel counting and family attribution from a profiler trace (a real Perfetto JSON file,
written here in the layout the profiler gives a GPU), and the model's named scopes that the attribution reads."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from fnx.pallas import ledger
from tests.conftest import load_script


def _trace():
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 7, "tid": 10, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "pid": 7, "tid": 11, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    k = lambda name, ts, dur, **args: {"ph": "X", "pid": 7, "tid": 10, "ts": ts, "dur": dur, "name": name,  # noqa
                                       "args": args}
    kernels = []
    for c in range(2):                                     # two calls, 1000 us apart
        t = 1000.0 * c
        kernels += [
            k("fnx_gemv_fp8", t + 0, 10),
            k("loop_multiply_fusion", t + 12, 4, tf_op="jit(step)/moe/mul"),
            k("nvjet_hsh_64x8_64x16", t + 20, 6, tf_op="jit(step)/head/dot_general"),
            k("moe_gate_up", t + 30, 20),
            k("input_reduce_fusion", t + 45, 10),             # overlaps the previous kernel by 5 us
            k("gdn_recurrent", t + 60, 5, tf_op="jit(step)/gdn/pallas_call"),
        ]
    derived = [{"ph": "X", "pid": 7, "tid": 11, "ts": 0, "dur": 70, "name": "fusion.1"},   # a derived lane
               {"ph": "X", "pid": 1, "tid": 3, "ts": 0, "dur": 500, "name": "PjitFunction(step)"}]  # host
    return {"displayTimeUnit": "ns", "traceEvents": meta + kernels + derived}


def test_counts_and_families_from_a_trace_file(tmp_path):
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    with gzip.open(path, "rt") as f:
        kernels = ledger.device_kernels(json.load(f))
    assert len(kernels) == 12                                   # device stream lane only
    led = ledger.summarize(kernels, calls=2, wall_ms=2.0)
    assert led["launches_per_call"] == 6
    fam = led["families"]
    assert fam["gemv"]["kernels_per_call"] == 1 and fam["gemv"]["ms_per_call"] == pytest.approx(0.010)
    assert fam["moe"]["kernels_per_call"] == 2 and fam["moe"]["ms_per_call"] == pytest.approx(0.024)
    assert fam["head"]["ms_per_call"] == pytest.approx(0.006)   # a library GEMM under the head scope is the head
    assert fam["gdn"]["kernels_per_call"] == 1 and fam[ledger.OTHER]["kernels_per_call"] == 1
    assert led["busy_ms_per_call"] == pytest.approx(0.050)      # 10 + 4 + 6 + (20 + 10 - 5 overlap) + 5 us
    assert led["idle_ms_per_call"] == pytest.approx(1.0 - 0.050)
    top = led["top_kernels"]                                    # by time per call, with their family
    assert [t["name"] for t in top[:2]] == ["moe_gate_up", "fnx_gemv_fp8"]
    assert top[0] == {"name": "moe_gate_up", "family": "moe", "kernels_per_call": 1, "us_per_call": 20}
    assert len(ledger.summarize(kernels, calls=2, top=3)["top_kernels"]) == 3


def test_profile_on_a_host_without_gpu_says_so():
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the trace has device lanes")
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((32, 32))
    led = ledger.profile(lambda: f(x).block_until_ready(), calls=2)
    assert led["device_kernels"] == 0 and "no device kernels" in led["note"] and led["wall_ms_per_call"] > 0


def test_model_ops_carry_their_family_scope():
    """The compiled step's op names hold the scopes the ledger attributes by (and numerics are untouched: the
    parity tests run the same code)."""
    from fnx.model.transformer import init_state, param_shapes, step
    cfg = load_script("bench_decode").bench_config(4, tiny=True)
    shapes = param_shapes(cfg, jnp.float32)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    state = init_state(cfg, 1, 16, jnp.float32)
    ids = jnp.zeros((1, 1, cfg.ngram_heads), jnp.int32)
    text = jax.jit(lambda p, s, t, i: step(p, s, t, i, cfg=cfg)).lower(params, state, jnp.ones((1, 1), jnp.int32),
                                                                          ids).compile().as_text()
    for scope in ("/moe/", "/gdn/", "/qsa/", "/hc/", "/ple/", "/head/"):
        assert scope in text, scope
