"""Backend choice: explicit, per op, never silent."""

import logging

import pytest

from fnx.pallas import dispatch


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend the compiled backend can run (dispatch only; nothing is compiled here)."""
    monkeypatch.setattr(dispatch, "why_unavailable",
                        lambda b: None if b in dispatch.BACKENDS else f"unknown backend {b!r}")
    monkeypatch.delenv("FNX_KERNELS", raising=False)
    dispatch._logged.clear()


def test_auto_picks_only_gpu_verified_kernels(fake_gpu, monkeypatch, caplog):
    assert dispatch.resolve("gemv_nvfp4") == "pallas"
    monkeypatch.delitem(dispatch.VERIFIED_ON_GPU, "moe_experts")
    with caplog.at_level(logging.WARNING, logger="fnx.pallas"):
        assert dispatch.resolve("moe_experts") == "reference"
    assert "not passed its GPU tests" in caplog.text and "FNX_KERNELS=moe_experts=pallas" in caplog.text
    monkeypatch.setenv("FNX_KERNELS", "moe_experts=pallas")
    assert dispatch.resolve("moe_experts") == "pallas"          # opting in by name
    assert dispatch.resolve("gemv_nvfp4") == "pallas"           # ops not named keep "auto"
    assert dispatch.resolve("moe_experts", "reference") == "reference"   # an explicit impl wins over the env


def test_env_and_force(monkeypatch):
    monkeypatch.setenv("FNX_KERNELS", "reference")
    assert dispatch.resolve("gemv_bf16") == "reference"
    monkeypatch.setenv("FNX_KERNELS", "gemv_bf16")
    with pytest.raises(ValueError, match="not op=backend|supports"):
        dispatch.resolve("gemv_bf16")
    monkeypatch.setenv("FNX_KERNELS", "gemv_bf16=pallas_interpret,bad")
    with pytest.raises(ValueError, match="not op=backend"):
        dispatch.resolve("gemv_bf16")
    monkeypatch.delenv("FNX_KERNELS")
    with dispatch.force("pallas_interpret"):
        assert dispatch.resolve("anything") == "pallas_interpret"
    assert dispatch.resolve("anything") == "reference"
    with pytest.raises(ValueError, match="unknown backend"):
        with dispatch.force("cuda"):
            pass


def test_named_backend_that_cannot_run_raises(monkeypatch):
    monkeypatch.setattr(dispatch, "why_unavailable", lambda b: "no GPU here" if b == "pallas" else None)
    with pytest.raises(ValueError, match="cannot run here: no GPU here"):
        dispatch.resolve("gemv_fp8", "pallas")
    with pytest.raises(ValueError, match="unknown implementation"):
        dispatch.resolve("gemv_fp8", "triton")


def test_a_call_the_kernel_does_not_serve(fake_gpu, monkeypatch):
    """Auto and FNX_KERNELS take the reference for such a call; naming the kernel raises, saying why."""
    why = "64 tokens > 32"
    assert dispatch.resolve("gemv_nvfp4", None, not_applicable=why) == "reference"
    monkeypatch.setenv("FNX_KERNELS", "gemv_fp8=pallas")
    assert dispatch.resolve("gemv_fp8", None, not_applicable=why) == "reference"
    assert dispatch.resolve("gemv_fp8", None) == "pallas"
    with pytest.raises(dispatch.NotApplicable, match="does not apply to this call: 64 tokens"):
        dispatch.resolve("gemv_fp8", "pallas", not_applicable=why)
    assert dispatch.resolve("gemv_fp8", "reference", not_applicable=why) == "reference"


def test_auto_keeps_the_reference_where_the_verified_kernel_measured_slower(fake_gpu, monkeypatch, caplog):
    assert "moe_experts" in dispatch.VERIFIED_ON_GPU and "moe_experts" in dispatch.AUTO_KEEPS_REFERENCE
    with caplog.at_level(logging.INFO, logger="fnx.pallas"):
        assert dispatch.resolve("moe_experts") == "reference"
    assert "measured slower" in caplog.text
    assert dispatch.resolve("gemv_nvfp4") == "pallas"                # verified, nothing against it
    assert dispatch.resolve("moe_experts", "pallas") == "pallas"      # named: runs the kernel
    monkeypatch.setenv("FNX_KERNELS", "moe_experts=pallas")
    assert dispatch.resolve("moe_experts") == "pallas"
    monkeypatch.delitem(dispatch.AUTO_KEEPS_REFERENCE, "moe_experts")
    monkeypatch.delenv("FNX_KERNELS")
    assert dispatch.resolve("moe_experts") == "pallas"


def test_a_call_auto_keeps_on_the_reference(fake_gpu, monkeypatch, caplog):
    """prefer_reference (a measurement at this call's shape or format): auto takes the reference and says why once;
    a backend named by FNX_KERNELS or impl runs as named."""
    why = "5 tokens: measured slower here"
    with caplog.at_level(logging.INFO, logger="fnx.pallas"):
        assert dispatch.resolve("moe_decode", prefer_reference=why) == "reference"
        assert dispatch.resolve("moe_decode", prefer_reference=why) == "reference"
    assert caplog.text.count(why) == 1
    assert dispatch.resolve("moe_decode") == "pallas"
    assert dispatch.resolve("moe_decode", "pallas", prefer_reference=why) == "pallas"
    monkeypatch.setenv("FNX_KERNELS", "moe_decode=pallas")
    assert dispatch.resolve("moe_decode", prefer_reference=why) == "pallas"
    monkeypatch.setenv("FNX_KERNELS", "moe_decode=reference")
    assert dispatch.resolve("moe_decode") == "reference"


def test_auto_runs_the_gdn_recurrence_kernel_for_verify_windows_only(fake_gpu, monkeypatch):
    """gdn_decode under "auto": one token keeps the reference (measured no gain in the whole step), a verify window
    of several tokens takes the kernel (5.4x the reference in isolation); a named backend runs as named."""
    import jax.numpy as jnp

    from fnx.pallas.gdn import api as gdn_api
    from fnx.pallas.gdn import pallas as gdn_kernel
    ran = []
    monkeypatch.setattr(gdn_kernel, "gdn_recurrent", lambda *a, **kw: ran.append("pallas") or ("o", "s"))
    monkeypatch.setattr(gdn_api.reference, "gdn_recurrent", lambda *a, **kw: ran.append("reference") or ("o", "s"))

    def call(t, impl=None):
        b, hk, hv, dk, dv = 1, 2, 4, 16, 16
        gdn_api.gdn_recurrent(jnp.zeros((b, t, hk, dk)), jnp.zeros((b, t, hk, dk)), jnp.zeros((b, t, hv, dv)),
                              jnp.zeros((b, t, hv)), jnp.zeros((b, t, hv)), jnp.zeros((b, hv, dk, dv)), impl=impl)
    call(1)
    call(5)
    call(1, impl="pallas")
    assert ran == ["reference", "pallas", "pallas"]
    assert "gdn_decode" in dispatch.VERIFIED_ON_GPU and "gdn_decode" not in dispatch.AUTO_KEEPS_REFERENCE


def test_qsa_attention_kernel_under_auto_only_for_long_caches(fake_gpu):
    """auto keeps the masked dense QSA path below qsa_api.KERNEL_MIN_CAPACITY (measured faster at 1K context) and
    takes the kernel from there up (measured faster at 8K in the step); a named backend runs as named at any capacity, and
    the block-score kernel stays on the reference under auto."""
    from fnx.pallas.qsa import api as qsa_api
    short, long_ = qsa_api.auto_reason(4096), qsa_api.auto_reason(qsa_api.KERNEL_MIN_CAPACITY)
    assert short is not None and "4096" in short and long_ is None
    assert qsa_api.backend(prefer_reference=short) == "reference"
    assert qsa_api.backend(prefer_reference=long_) == "pallas"
    assert qsa_api.backend("pallas", prefer_reference=short) == "pallas"
    assert dispatch.resolve(qsa_api.SCORES_OP) == "reference"


def test_env_names_only_known_ops(monkeypatch):
    """A misspelt op in FNX_KERNELS is an error naming the nearest op, not a silent "auto" for every op."""
    monkeypatch.setenv("FNX_KERNELS", "qsa_decode=pallas")
    with pytest.raises(ValueError, match="no op is named 'qsa_decode' \\(did you mean 'qsa_decode_attention'"):
        dispatch.resolve("gemv_fp8")
    monkeypatch.setenv("FNX_KERNELS", "gemv_fp8=reference,qsa_decode_attention=reference")
    assert dispatch.resolve("qsa_decode_attention") == "reference"


def test_known_ops_cover_every_kernel_module():
    """KNOWN_OPS holds each op name the kernel modules resolve, and the tables keyed by op name use only those."""
    from fnx.pallas.gdn import api as gdn_api
    from fnx.pallas.gemv import api as gemv_api
    from fnx.pallas.hc import api as hc_api
    from fnx.pallas.qsa import api as qsa_api
    names = {gdn_api.OP, gdn_api.STEP_OP, gdn_api.WINDOW_OP, gdn_api.WINDOW_PARTS_OP, gdn_api.OP_PREFILL, gdn_api.OP_CHUNK_PREP,
             gdn_api.REPLAY_CONV_OP, hc_api.OP,
             hc_api.OP_M1, hc_api.OP_FEW, hc_api.OP_ONE, hc_api.OP_FEW_ONE, hc_api.OP_PREFILL, qsa_api.OP, qsa_api.SCORES_OP, qsa_api.TOPK_OP, qsa_api.TOPK_LONG_OP,
             qsa_api.COMBINE_OP, qsa_api.PREP_OP, qsa_api.PREFILL_OP, qsa_api.SELECT_OP,
             qsa_api.SELECT_LONG_OP, gemv_api.PAIR_OP, gemv_api.PAIR_MANY_OP, "moe_route",
             "moe_route_acts", "moe_experts", "moe_decode", "moe_grouped"}
    names |= {f"gemv_{f}{s}" for f in gemv_api.FORMATS for s in ("", "_argmax")}
    from fnx.pallas.gemv import dequant
    from fnx.pallas.gdn import out_norm
    from fnx.pallas.moe import api as moe_api
    from fnx.pallas.hc import prefill as hc_prefill
    names |= {dequant.OP, out_norm.OP, moe_api.PREFILL_ROUTE_OP, hc_prefill.MIX_OP,
              hc_prefill.NORM_OP}
    assert names == set(dispatch.KNOWN_OPS)
    for table in (dispatch.VERIFIED_ON_GPU, dispatch.AUTO_KEEPS_REFERENCE, dict.fromkeys(dispatch.MESH_READY)):
        assert set(table) <= set(dispatch.KNOWN_OPS), set(table) - set(dispatch.KNOWN_OPS)
