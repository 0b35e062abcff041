"""The MTP verify window and its rollback with every op built to cut the window's launches on, against the same
window with them off: a small model whose projections fuse into FP8 blocks (so the several-token pairs apply), FP8
dense and NVFP4 experts, bf16, every other kernel on the test backend. On a GPU the compiled kernels together; on
the CPU (interpreted, ~2 minutes) an extended case (FNX_EXTENDED_TESTS=1)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnx.config import ModelConfig
from fnx.pallas import dispatch
from tests.pallas.kernel_mode import KERNEL
from tests.pallas.verify_round import pallas_calls

# the ops built for the verify window's launches (BENCHMARKS.md, thirty-third and thirty-fourth sessions)
NEW_OPS = ("gemv_pair_many", "gdn_window_parts", "gdn_replay_conv", "moe_route_acts", "qsa_prep")
# and the tile fields that issue a kernel's loads first (thirty-fifth session), read when a program is traced:
# (without, with) each (the GEMV's is on by default since the thirty-sixth session)
NEW_TILES = {"FNX_GDN_WINDOW_TILES": ("", "early=1"), "FNX_GEMV_XFIRST": ("0", "1")}


def _config() -> ModelConfig:
    """4 layers (3 GDN, 1 QSA), widths whose projections are whole 128-row FP8 blocks: GDN qkv 384 + z 128, QSA
    q 512 + k 128 + v 128, the shared expert's gate / up 2 x 128; bf16 b / a (8 rows), router (17), indexer (80)."""
    return ModelConfig(scan_layers=False, vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25, mrope_section=(4, 2, 2),
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                       linear_value_head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                       shared_expert_intermediate_size=128, hc_lowrank=16, indexer_n_heads=4, indexer_head_dim=16,
                       indexer_budget=64, ple_embed_dim=64, ngram_vocab_size_base=1000, eos_token_id=511,
                       mtp_num_hidden_layers=1)


@pytest.mark.extended
def test_verify_window_and_rollback_with_the_new_ops_match_without(monkeypatch):
    from fnx.model.fuse import fuse_projections
    from fnx.model.transformer import init_state, param_shapes, rollback, step
    from fnx.pallas.moe import decode_pallas
    from tests.conftest import load_script
    bd = load_script("bench_decode")
    cfg = _config()
    p = bd.random_tree(param_shapes(cfg, jnp.bfloat16), jax.random.PRNGKey(0), jnp.bfloat16)
    p = fuse_projections(cfg, bd.quantize_tree(p, "fp8+nvfp4"))
    assert "fused:in_proj_qkv+in_proj_z" in p["segments"][0][0]["linear_attn"]
    ids = lambda n: jnp.zeros((1, n, cfg.ngram_heads), jnp.int32) if cfg.ple_layer_ids else None  # noqa: E731
    # a prompt through the reference (fast on the CPU), then the window from position 9
    monkeypatch.setenv("FNX_KERNELS", "reference")
    st = init_state(cfg, 1, 256, jnp.bfloat16)
    _, st, _, _ = step(p, st, jnp.arange(1, 10, dtype=jnp.int32)[None], ids(9), cfg=cfg)
    # e2m1 "mma" at these widths (8 rows of 128 columns: what the router's activations are for)
    monkeypatch.setenv(decode_pallas.TOKENS_TILES_ENV, "group=1,acc=1,wround=0,flat=1,e2m1=mma,bn=8,cw=128")
    window = jnp.asarray([[7, 8, 9, 10, 11]], jnp.int32)
    nv, keep = jnp.asarray([5], jnp.int32), jnp.asarray([3], jnp.int32)

    def verify_and_rollback(p, st):
        logits, full, _, aux = step(p, st, window, ids(5), cfg=cfg, snapshots=True, n_valid=nv)
        return logits, rollback(cfg, full, aux, keep)

    res, launched, text = {}, {}, {}
    for on in (False, True):
        monkeypatch.setenv("FNX_KERNELS", ",".join(
            f"{op}={'reference' if op in NEW_OPS and not on else KERNEL}" for op in dispatch.KNOWN_OPS))
        for env, values in NEW_TILES.items():    # the tile fields that only move loads: the same bits
            monkeypatch.setenv(env, values[on])
        jax.clear_caches()
        jx = jax.make_jaxpr(verify_and_rollback)(p, st)
        launched[on], text[on] = collections.Counter(pallas_calls(jx.jaxpr.eqns)), str(jx)
        res[on] = verify_and_rollback(p, st)
    # each op in the program: the pairs (GDN in-projections and the MoE's, 4 layers), the QSA prep, the router's
    # activations (no u32 concatenate of mma_activations' own), the replay's conv copy (no gather of conv rows)
    assert launched[True]["fnx_gemv_pair_many_fp8_loop"] == 8 and launched[True]["qsa_prep"] == 1, launched[True]
    assert not launched[False]["fnx_gemv_pair_many_fp8_loop"] and not launched[False]["qsa_prep"]
    assert launched[True]["moe_decode_gate_up"] == launched[False]["moe_decode_gate_up"] == 4
    acts = f"u32[5,{cfg.hidden_size // 2 + 1}] = concatenate"
    assert acts in text[False] and acts not in text[True]
    conv_rows = f"bf16[1,3,{2 * 2 * 64 + 4 * 32}] = gather"
    assert conv_rows in text[False] and conv_rows not in text[True]
    (lg0, st0), (lg1, st1) = res[False], res[True]
    scale = float(jnp.abs(lg0.astype(jnp.float32)).max())
    err = float(jnp.abs(lg1.astype(jnp.float32) - lg0.astype(jnp.float32)).max()) / scale
    print(f"logits: {err:.2e} of their scale; launches {sum(launched[False].values())} -> "
          f"{sum(launched[True].values())} Pallas calls")
    assert err <= 2e-2, err         # the same values but for fp32 sums in other orders (pairs' narrow rows, prep)
    for a, b in zip(jax.tree.leaves(st0), jax.tree.leaves(st1), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        top = np.abs(a).max() if a.size else 0.0
        assert np.abs(a - b).max() <= 2e-2 * max(top, 1e-6), (a.shape, np.abs(a - b).max(), top)
