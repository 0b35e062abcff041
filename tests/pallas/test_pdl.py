"""FNX_PDL_TRIGGER: every Pallas kernel of fnx says `griddepcontrol.launch_dependents` at its start when compiled
for a GPU (checked in the Triton IR of programs lowered for CUDA on this machine), never in interpret mode, and not
at all by default."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.pallas import pdl, triton_ir
from fnx.pallas.gemv import pallas as gp
from fnx.pallas.hc import pallas as hcp

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


@pytest.fixture(autouse=True)
def _fresh_traces():
    """The kernels' jitted wrappers keep the traces made with the knob on: none outlives a test here."""
    yield
    jax.clear_caches()


def _gemv_launches(fmt="bf16"):
    """A bf16 GEMV (through stacked.call) lowered for CUDA: its launches."""
    fn = functools.partial(gp.gemv, fmt=fmt, tiles=gp.Tiles(64, 128, 1))
    lowered = jax.jit(lambda x, w: fn(x, w, None, None)).trace(S((1, 256), BF16), S((128, 256), BF16)).lower(
        lowering_platforms=("cuda",))
    return triton_ir.launches(lowered)


def _hc_launches():
    """A one-token hyper-connection boundary (two direct pallas_calls and no stacked.call) lowered for CUDA."""
    s, d, r = 4, 64, 16
    fn = functools.partial(hcp.hc_boundary_m1, streams=s, eps=1e-6)
    lowered = jax.jit(fn).trace(S((1, s * d), BF16), S((1, d), BF16), S((1, s), BF16), S((s * d,), BF16),
                                S((r, s * d), BF16), S((s * d, r), BF16), S((s, s * d), BF16)).lower(
        lowering_platforms=("cuda",))
    return triton_ir.launches(lowered)


def _triggers(text: str) -> int:
    return text.count("griddepcontrol.launch_dependents")


@pytest.mark.parametrize("launches", [_gemv_launches, _hc_launches])
def test_trigger_in_every_kernel_only_where_named(monkeypatch, launches):
    monkeypatch.delenv(pdl.ENV, raising=False)
    jax.clear_caches()
    off = launches()
    assert off and all(_triggers(text) == 0 for *_, text in off)
    monkeypatch.setenv(pdl.ENV, "1")
    jax.clear_caches()      # the kernels' jitted wrappers read the knob when traced
    on = launches()
    assert [name for name, *_ in on] == [name for name, *_ in off]
    for name, _, _, text in on:
        assert _triggers(text) == 1, name
        # not pure: a side-effecting asm (kept where it is, at the kernel's start, before any load)
        asm = next(ln for ln in text.splitlines() if "griddepcontrol" in ln)
        assert "pure = false" in asm, asm
        first_load = min((i for i, ln in enumerate(text.splitlines()) if "tt.load" in ln), default=None)
        at = next(i for i, ln in enumerate(text.splitlines()) if "griddepcontrol" in ln)
        assert first_load is None or at < first_load, name


def test_interpret_mode_never_binds_it(monkeypatch):
    """In interpret mode the knob changes nothing: the kernel runs and gives the same bits."""
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 256), jnp.float32).astype(BF16)
    w = jax.random.normal(jax.random.PRNGKey(1), (128, 256), jnp.float32).astype(BF16)
    run = lambda: gp.gemv(x, w, None, None, fmt="bf16", tiles=gp.Tiles(64, 128, 1), interpret=True)  # noqa: E731
    monkeypatch.delenv(pdl.ENV, raising=False)
    want = np.asarray(run(), np.float32)
    monkeypatch.setenv(pdl.ENV, "1")
    jax.clear_caches()
    np.testing.assert_array_equal(np.asarray(run(), np.float32), want)


def test_bad_value_raises(monkeypatch):
    monkeypatch.setenv(pdl.ENV, "yes")
    with pytest.raises(ValueError, match="FNX_PDL_TRIGGER"):
        pdl.trigger()
