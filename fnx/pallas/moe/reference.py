"""Plain-jnp ground truth for the MoE decode kernels (the same arithmetic as fnx.model.moe `route` and
`_expert_gather`), plus the expert dedupe the Pallas path runs in jnp before its kernels.

Quantized expert weights are recognised by their fields (`scale_inv`: FP8 E4M3 128x128 blocks;
`scale_2`: NVFP4), the layouts of fnx.model.quant, so this package imports nothing above fnx/pallas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fnx.pallas.gemv import reference as gemv_reference

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST


def weight_format(w) -> str:
    """'fp8_block' (fnx.model.quant.Fp8Block), 'nvfp4' (fnx.model.quant.Nvfp4) or 'dense' (a plain array)."""
    if hasattr(w, "scale_inv"):
        return "fp8_block"
    if hasattr(w, "scale_2"):
        return "nvfp4"
    return "dense"


def kernel_operands(w):
    """(format, the arrays a kernel reads in argument order, static meta) of an expert weight: dense (w,), None;
    FP8 (q, fp32 block scales), the block; NVFP4 (packed codes, E4M3 scales, fp32 row globals), the group."""
    from fnx.pallas.stacked import astype      # the fields may be layers of stacks: kept views where no cast
    fmt = weight_format(w)
    if fmt == "fp8_block":
        return fmt, (w.w, astype(w.scale_inv, F32)), tuple(w.block)
    if fmt == "nvfp4":
        return fmt, (w.w, w.scale, astype(w.scale_2, F32)), w.group
    return fmt, (w,), None


def route(logits: jax.Array, top_k: int, norm_topk_prob: bool, dtype=None):
    """Router logits [T, E] -> weights [T, K] (`dtype`, default logits.dtype), expert ids [T, K] int32.
    fp32 softmax, top-k with ties to the lower id, optional renormalisation, one rounding."""
    probs = jax.nn.softmax(logits.astype(F32), axis=-1)
    w, idx = lax.top_k(probs, top_k)
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w.astype(dtype or logits.dtype), idx


def _dequantize(w, dtype):
    """fp32 dequantization rounded once to `dtype` (fnx.model.quant.dequantize), by fnx.pallas.gemv's reference."""
    fmt = weight_format(w)
    if fmt == "fp8_block":
        return gemv_reference.dequantize("fp8", w.w, w.scale_inv, block=w.block).astype(dtype)
    if fmt == "nvfp4":
        return gemv_reference.dequantize("nvfp4", w.w, w.scale, w.scale_2, group=w.group).astype(dtype)
    return jnp.asarray(w).astype(dtype)


e2m1_bits_to_f32 = gemv_reference.e2m1_to_f32   # E2M1 codes -> fp32 from the bit fields, integer ops only


def _take(w, idx):
    from fnx.pallas.stacked import tree_map         # fields may be layer views of stacks
    return tree_map(lambda a: a[idx], w) if weight_format(w) != "dense" else w[idx]


def experts(gate_up, down, x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [T, D], idx [T, K] -> per-(token, k) expert outputs [T, K, D] (x.dtype): h = x @ gate_up[e].T rounded,
    a = silu(gate) * up, out = a @ down[e].T rounded. gate_up [E, 2I, D] holds gate rows then up rows."""
    inter = down.shape[-1]
    gu = _dequantize(_take(gate_up, idx), x.dtype)          # [T, K, 2I, D]
    h = jnp.einsum("td,tkid->tki", x, gu, precision=HIGHEST, preferred_element_type=F32).astype(x.dtype)
    a = jax.nn.silu(h[..., :inter]) * h[..., inter:]
    dn = _dequantize(_take(down, idx), x.dtype)             # [T, K, D, I]
    return jnp.einsum("tki,tkdi->tkd", a, dn, precision=HIGHEST, preferred_element_type=F32).astype(x.dtype)


def experts_blocks(gate_up, down, xb: jax.Array, block_expert: jax.Array) -> jax.Array:
    """xb [n_blocks, B, D], block_expert [n_blocks] -> [n_blocks, B, D]: every row of block n through expert
    block_expert[n], the arithmetic of `experts`."""
    n, b, d = xb.shape
    idx = jnp.broadcast_to(block_expert[:, None], (n, b)).reshape(-1, 1)
    return experts(gate_up, down, xb.reshape(n * b, d), idx).reshape(n, b, d)


def round_to(x: jax.Array, dtype) -> jax.Array:
    """x (fp32) rounded to `dtype`'s precision, kept in fp32: where the kernels round an intermediate (`rnd`).
    For bf16 through lax.reduce_precision, which XLA keeps: a dtype op, or a convert to bf16 and back, XLA:CPU may
    compute in fp32 and leave unrounded (excess precision: in a bf16 combine of 5 tokens a third of the outputs
    came out an ulp off the rounded terms' sum).
    reduce_precision flushes fp16's subnormals where a convert keeps them, so other narrow dtypes convert."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize >= 4:
        return x.astype(F32)
    if dtype == jnp.bfloat16:
        return lax.reduce_precision(x.astype(F32), exponent_bits=8, mantissa_bits=7)
    return x.astype(dtype).astype(F32)


def _weighted_sum(outs: jax.Array, w: jax.Array) -> jax.Array:
    """sum_k round(outs[t, k] * w[t, k]) in fp32 (w rounded to outs.dtype first), unrounded: [T, D]."""
    dt = outs.dtype
    terms = round_to(outs.astype(F32) * w.astype(dt).astype(F32)[..., None], dt)
    return jnp.sum(terms, axis=1)


def combine(outs: jax.Array, w: jax.Array) -> jax.Array:
    """outs [T, K, D], w [T, K] -> [T, D]: each output times its weight, rounded to outs.dtype (explicitly, as the
    kernels do: `round_to`), summed over k in fp32, one rounding (the transformers grouped_mm combine)."""
    return _weighted_sum(outs, w).astype(outs.dtype)


def dedupe(idx: jax.Array, n_experts: int, n_slots: int | None = None):
    """idx [T, K] -> (experts [S] int32, slot [T, K] int32): the distinct expert ids in ascending order, padded
    with `n_experts` (an empty slot) to a static S = min(T*K, E) unless given, and for each (token, k) the slot of
    its expert, so experts[slot] == idx."""
    t, k = idx.shape
    s = n_slots or min(t * k, n_experts)
    flat = jnp.sort(idx.reshape(-1).astype(jnp.int32))
    first = jnp.concatenate([jnp.ones((1,), bool), flat[1:] != flat[:-1]])
    rank = jnp.cumsum(first.astype(jnp.int32)) - 1
    uniq = jnp.full((s,), n_experts, jnp.int32).at[jnp.where(first, rank, s)].set(flat, mode="drop")
    slot = jnp.searchsorted(uniq, idx.astype(jnp.int32), side="left",
                            method="compare_all").astype(jnp.int32)    # one fusion, not the scan method's loop
    return uniq, slot


def decode(x, w, ids, gate_up, down, s_gate, s_up, s_sig, shared_down):
    """The MoE block after its router (fnx.model.moe.moe_block's arithmetic): x [M, D], routing weights w [M, K]
    and ids [M, K], the shared expert's gate / up projections [M, I_s] and gate logit [M, 1], shared_down
    [D, I_s] -> [M, D] = combine(routed experts) + sigmoid(logit) * shared_down(silu(gate) * up), each step
    rounded to x.dtype. The roundings after the experts are explicit (`round_to`) where the decode kernels round:
    each weighted term, the routed sum, the shared expert's silu(gate) * up (its sigmoid, the product
    with gate, the product with up), its down product, the sigmoid gate and the gated shared term."""
    dt = x.dtype
    routed = round_to(_weighted_sum(experts(gate_up, down, x, ids), w), dt)
    g, u = (v.astype(dt).astype(F32) for v in (s_gate, s_up))
    a = round_to(round_to(g * round_to(jax.nn.sigmoid(g), dt), dt) * u, dt).astype(dt)
    s = round_to(lax.dot_general(a, _dequantize(shared_down, dt), (((1,), (1,)), ((), ())), precision=HIGHEST,
                                 preferred_element_type=F32), dt)
    gate = round_to(jax.nn.sigmoid(s_sig.reshape(-1, 1).astype(dt).astype(F32)), dt)
    return (routed + round_to(gate * s, dt)).astype(dt)
