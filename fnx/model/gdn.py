"""Gated DeltaNet layer (`linear_attn`, MODEL_SPEC.md section 5): short causal conv, gated delta rule with an fp32
recurrent state, sigmoid- (or silu-) gated RMSNorm. Chunked form for multi-token calls, recurrent form for decode.

State per layer: conv [B, K-1, C] (pre-conv inputs, activation dtype), rec [B, Hv, dk, dv] fp32."""

from __future__ import annotations

import os

import jax
from jax import lax

from fnx.model.fuse import linear_windows
from fnx.model.ops import F32, HIGHEST, linear, rms_norm_gated
from fnx.pallas import dispatch
from fnx.pallas.gdn import out_norm
from fnx.pallas.gdn.api import gdn_chunk_prep, gdn_chunk_prep_conv, gdn_chunk_scan, gdn_recurrent, gdn_step
from fnx.pallas.gdn.api import gdn_window
from fnx.pallas.gdn.api import window_takes_partials
from fnx.pallas.gdn.reference import causal_conv, conv_and_gates, window_after, window_of  # noqa: F401  (PLE)
from fnx.pallas.gdn.reference import delta_rule_recurrent, l2norm  # noqa: F401  (the token-by-token reference)
from fnx.pallas.gdn.reference import unit_lower_inverse  # noqa: F401  (the chunked form's inverse)

CHUNK = 64
INTRA_ENV = "FNX_GDN_INTRA"         # the chunked form's XLA products: "highest" (fp32) or "tf32x3" (a GPU knob)
SPLIT_ENV = "FNX_GDN_SPLIT_DOTS"    # "0": let XLA merge the chunked form's product pairs


def split_dots() -> bool:
    """Whether the chunked form keeps each pair of intra-chunk products that share an operand (`k_beta k^T` and
    `q k^T`; `inv v_beta` and `inv (k_beta decay)`) as two library products (`FNX_GDN_SPLIT_DOTS`, read when a
    program is traced; "1", the default, or "0"): the second reads its shared operand through an optimization
    barrier, so XLA's dot merger does not concatenate the other operands and slice the merged result apart. On
    an H100 (4 layers, a 512-token prefill chunk, 2026-12-06) the merged form's fp32 products, concatenations and
    slices took ~470 us where the split one's products take ~200: the chunk 6,131 against 6,260 us; at 2,048
    tokens XLA did not merge them (the same kernels). The same values: only which kernels compute them changes."""
    v = os.environ.get(SPLIT_ENV, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{SPLIT_ENV}={v!r}: use 1 (the products apart) or 0 (as XLA merges them)")
    return v == "1"


def intra_precision():
    """The precision of the chunked form's batched intra-chunk products (`FNX_GDN_INTRA`, read when a program is
    traced): "highest" (fp32, the default) or "tf32x3" (three TF32 tensor-core products, about fp32's accuracy, as
    the chunk scan kernel's default; XLA takes it on a GPU only). Off until measured: an H100 prefill table had these
    products at ~350 us a GDN layer and 2,048-token chunk, fp32 on the CUDA cores."""
    v = os.environ.get(INTRA_ENV, "highest").strip()
    table = {"highest": HIGHEST, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3}
    if v not in table:
        raise ValueError(f"{INTRA_ENV}={v!r}: use one of {sorted(table)}")
    return table[v]


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = CHUNK, impl: str | None = None, rep: int = 1,
                       out_dtype=None):
    """Chunked (WY / UT-transform) form of the same recurrence; same arguments and results (q and k may hold the
    key heads only, each read by `rep` value heads in turn). The per-chunk part (op "gdn_chunk_prep": the in-chunk
    decays, the intra-chunk products and the unit-lower inverse; XLA's batched products by default,
    `reference.chunk_prep`; FNX_KERNELS picks) then the sequential pass over the chunks (`gdn_chunk_scan`, `impl`).
    out_dtype: o's dtype (fp32 by default; the scan kernel may store it so, `ScanTiles.tokens_out`)."""
    length = v.shape[1]
    apart = lax.optimization_barrier if split_dots() else (lambda a: a)     # noqa: E731
    parts = gdn_chunk_prep(q, k, v, g, beta, chunk, precision=intra_precision(), apart=apart, rep=rep)
    # the chunks one after another: one Pallas launch (op "gdn_prefill") or XLA's scan (the reference)
    return gdn_chunk_scan(*parts, state, impl=impl, tokens=(length, F32 if out_dtype is None else out_dtype))


def delta_rule_chunked_conv(conv, g, beta, state, *, key_heads: int, key_dim: int, chunk: int = CHUNK,
                            impl: str | None = None, out_dtype=None, raw: bool = False):
    """`delta_rule_chunked` from the GDN conv output conv [B, L, 2 HK dk + HV dv] (g, beta [B, L, HV]): q and k
    l2-normed, q scaled by dk^-1/2 (the layer's prefill) by `gdn_chunk_prep_conv`, where the prep kernel may read
    them in place (`PrepTiles.in_place`); o [B, L, HV, dv] in out_dtype (fp32 by default), the final state. With
    `raw`, o as the chunk scan leaves it: [B, HV, N, C, dv] fp32 (for `fnx.pallas.gdn.out_norm`)."""
    apart = lax.optimization_barrier if split_dots() else (lambda a: a)     # noqa: E731
    parts = gdn_chunk_prep_conv(conv, g, beta, chunk, key_heads=key_heads, key_dim=key_dim, scale=key_dim ** -0.5,
                                precision=intra_precision(), apart=apart)
    return gdn_chunk_scan(*parts, state, impl=impl,
                          tokens=None if raw else (conv.shape[1], F32 if out_dtype is None else out_dtype))


def rec_after(aux: dict, n_keep: jax.Array, conv_width: int | None = None):
    """The recurrent state after the first n_keep [B] tokens of a `snapshots` call: the window re-run from its
    input state with the tokens past n_keep made no-ops (g = 0: no decay, beta = 0: no write). The kept tokens
    repeat the verify call's arithmetic exactly and a no-op token leaves the state bit for bit, so this equals
    the state a token-by-token run would hold after n_keep tokens. With `conv_width` W (aux holds "conv_x"):
    (rec, conv state after n_keep [B, W, C]), the conv rows copied by the replay's own programs where op
    "gdn_replay_conv" is on (else `window_after`)."""
    k = aux["k"]
    # the mask in the kernel (n_keep), the state alone (want_o=False: no q . S reduction or o store per token),
    # written over rec0's buffer (inplace: rec0 is dead after the replay; the verify program donates the state, so
    # the result lands in the state's own buffer instead of a new one copied back)
    conv = None if conv_width is None else (aux["conv_x"], conv_width)
    res = gdn_recurrent(k, k, aux["v"], aux["g"], aux["beta"], aux["rec0"], scale=k.shape[-1] ** -0.5,
                        qk_l2norm=True, out_dtype=aux["v"].dtype, n_keep=n_keep, want_o=False, inplace=True,
                        conv=conv)
    return res[1] if conv is None else (res[1], res[-1])


def gdn_layer(p: dict, x: jax.Array, conv_state: jax.Array, rec_state: jax.Array, cfg, n_valid: jax.Array,
              snapshots: bool = False):
    """x [B, L, D]; n_valid [B]: tokens past n_valid are padding and leave the state untouched.
    Returns (y [B, L, D], conv_state, rec_state, aux). With `snapshots` the recurrence runs token by token and
    aux holds what `rollback` needs to stop after any prefix: conv_x [B, K-1+L, C], and for `rec_after` the
    state before the call rec0 [B, Hv, dk, dv] with the window's k [B, L, Hk, dk], v, g, beta. (Rollback replays
    the kept prefix from rec0 instead of storing a state per token: 3 passes over the state instead of L + 3,
    the bulk of a verify round's GDN traffic.)"""
    bsz, length, _ = x.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    # fused or not; a verify window's gdn_window may take the projections as split-K partials (op
    # "gdn_window_parts": it sums them where it reads them, so no sum kernel runs between the two launches)
    wins = linear_windows(x, p, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                          partials=snapshots and length > 1 and window_takes_partials())
    if length == 1 and not snapshots:
        # decode: conv update, gates, recurrence and output norm as one op ("gdn_step": one kernel on a GPU; its
        # reference is the same ops as below, with the recurrence dispatched as "gdn_decode"). The kernel reads
        # qkv, z, b and a in place in the (fused) products: no slice kernels between the products and the launch.
        qkv, z, b, a = ((w.buf, w.start) for w in wins)
        o, conv_state, rec_state = gdn_step(qkv, z, b, a, conv_state, p["conv1d"], p["A_log"], p["dt_bias"],
                                            p["norm"], rec_state, n_valid, key_heads=hk, eps=cfg.rms_norm_eps,
                                            act=cfg.output_gate_type, inplace=True)
        return linear(o.reshape(bsz, length, hv * dv), p["out_proj"]), conv_state, rec_state, {}
    if snapshots:
        # verify: the conv, gates, recurrence and norm as one op ("gdn_window": one kernel on a GPU, reading the
        # fused products in place; its reference is the ops below). The state before the call stays for rollback,
        # which replays the kept prefix from it (`rec_after`, `window_after` on the parts it returns).
        rec0 = rec_state
        o, conv_state, rec_state, parts = gdn_window(*((w.buf, w.start) for w in wins), conv_state, p["conv1d"],
                                                     p["A_log"], p["dt_bias"], p["norm"], rec_state, n_valid,
                                                     key_heads=hk, eps=cfg.rms_norm_eps, act=cfg.output_gate_type)
        return (linear(o.reshape(bsz, length, hv * dv), p["out_proj"]), conv_state, rec_state,
                dict(parts, rec0=rec0))
    zwin = wins[1]
    qkv, b, a = (w.get() for w in (wins[0], wins[2], wins[3]))
    conv, g, beta, conv_state, _ = conv_and_gates(qkv, b, a, conv_state, p["conv1d"], p["A_log"], p["dt_bias"],
                                                  n_valid, key_heads=hk, key_head_dim=dk, value_heads=hv, split=False)
    # q, k and v out of conv (q, k l2-normed per key head: value head h reads key head h // (hv // hk), q scaled by
    # dk^-1/2). impl None, as gdn_step and gdn_window above: op "gdn_prefill" takes fnx.pallas.dispatch's choice
    # (FNX_KERNELS, dispatch.force; the reference under a mesh) when the layer is traced
    raw_shape = (bsz, hv, -(-length // CHUNK), CHUNK, dv)       # the chunk scan's own layout of o
    norm_backend = dispatch.resolve(out_norm.OP, None,
                                    not_applicable=out_norm.why_not(raw_shape, dv, cfg.output_gate_type))
    if norm_backend != "reference":     # the norm reads o in the scan's layout and z in place (op "gdn_out_norm")
        o, rec_state = delta_rule_chunked_conv(conv, g, beta, rec_state, key_heads=hk, key_dim=dk, raw=True)
        o = out_norm.out_norm(o, (zwin.buf, zwin.start), p["norm"], cfg.rms_norm_eps, cfg.output_gate_type, length,
                              x.dtype, impl=norm_backend)
    else:
        o, rec_state = delta_rule_chunked_conv(conv, g, beta, rec_state, key_heads=hk, key_dim=dk, out_dtype=x.dtype)
        o = rms_norm_gated(o, zwin.get().reshape(bsz, length, hv, dv), p["norm"], cfg.rms_norm_eps,
                           cfg.output_gate_type)
    return linear(o.reshape(bsz, length, hv * dv), p["out_proj"]), conv_state, rec_state, {}
