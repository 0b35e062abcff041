"""`dot_acc(acc, a, b)`: acc + a @ b (or a @ b.T) in fp32 inside a Pallas kernel, with the accumulator handed to
the tensor-core product itself on the Triton lowering.

Why: Pallas lowers `acc + jnp.dot(a, b)` to `tt.dot(a, b, zeros)` followed by an `arith.addf`, the zeros a
`tt.splat` of a scalar constant. Triton's combine pass folds `addf(acc, dot(a, b, 0))` into `dot(a, b, acc)` only
when it recognizes the zero, and it does not look through a splat (the stock Triton 3.5 build for sm_90 keeps the
add: the prefill MoE blocks' K loop carries one FADD per accumulator element per step, and each Hopper
`warp_group_dot` is followed by a wait for zero pending products, so no product overlaps the next step's loads and
decoding; `scripts/sass_count.py --moe-blocks`). This primitive emits `tt.dot(a, b, acc)` directly.

Arithmetic: the same fp32 products and sums, accumulated into `acc` by the tensor core in its own order instead of
summed apart and added once (an ulp of fp32 apart, as any change of tile does). Off the Triton lowering (the
interpreter, XLA on any backend) it is exactly `acc + dot_general(a, b)` in fp32.

The Triton rule reuses Pallas' own `dot_general` rule (operand types, transposes and precision checks stay
Pallas') and hands the accumulator to the `tt.dot` it built in place of its zeros. Should a JAX version's rule return
anything else (its result cast, a chain of products as the TF32 x3 algorithms build), the rule adds the accumulator
after the product as Pallas would (the same arithmetic, without the fusion) and logs it once.

Off until measured on a GPU: `FNX_DOT_ACC=1` (read when a kernel is traced) binds the primitive; unset or 0,
`dot_acc` is `acc + lax.dot_general(...)` itself, the kernels' code before this module (the primitive and its rule
are not involved)."""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import batching, mlir

try:        # the public home of Primitive in newer JAX; jax.core's is deprecated there
    from jax.extend.core import Primitive
except ImportError:     # pragma: no cover - older JAX
    from jax.core import Primitive
try:        # jax.core's exports shrink release by release; the class itself lives in jax._src.core
    from jax._src.core import ShapedArray
except ImportError:     # pragma: no cover
    from jax.core import ShapedArray

from fnx.pallas import triton_rules

F32 = jnp.float32
log = logging.getLogger(__name__)

dot_acc_p = Primitive("fnx_dot_acc")
ENV = "FNX_DOT_ACC"


def fused() -> bool:
    """Whether `dot_acc` hands the accumulator to the product (`FNX_DOT_ACC`, read when a kernel is traced)."""
    v = os.environ.get(ENV, "0").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{ENV}={v!r}: use 1 (the accumulator into the tensor-core product) or 0 (a separate add)")
    return v == "1"


def _dims(trans_b: bool):
    return (((1,), (1 if trans_b else 0,)), ((), ()))


def _impl(acc, a, b, *, trans_b: bool, precision=None):
    return acc + lax.dot_general(a, b, _dims(trans_b), precision=precision, preferred_element_type=F32)


def dot_acc(acc, a, b, *, trans_b: bool = False, precision=lax.Precision.HIGHEST, fuse: bool | None = None):
    """acc [m, n] fp32 + a [m, k] @ b [k, n] (b [n, k] with trans_b), products in fp32 at `precision` (as
    `lax.dot_general`'s; None: the default). With FNX_DOT_ACC=1 (or `fuse` True, a kernel's own measured choice;
    None: the variable decides), in a Pallas kernel on the Triton lowering the accumulator goes into the
    tensor-core product; otherwise, and off that lowering, acc + dot_general."""
    if a.ndim != 2 or b.ndim != 2 or acc.ndim != 2:
        raise ValueError(f"dot_acc: 2-D operands only, got acc {acc.shape}, a {a.shape}, b {b.shape}")
    m, k = a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if kb != k or acc.shape != (m, n):
        raise ValueError(f"dot_acc: acc {acc.shape} + a {a.shape} @ b {b.shape}{'.T' if trans_b else ''} do not fit")
    if acc.dtype != F32:
        raise ValueError(f"dot_acc: the accumulator is fp32, got {acc.dtype}")
    if not (fused() if fuse is None else fuse):
        return _impl(acc, a, b, trans_b=trans_b, precision=precision)
    return dot_acc_p.bind(acc, a, b, trans_b=bool(trans_b), precision=precision)


dot_acc_p.def_impl(_impl)
dot_acc_p.def_abstract_eval(lambda acc, a, b, **_: ShapedArray(acc.shape, F32))
mlir.register_lowering(dot_acc_p, mlir.lower_fun(_impl, multiple_results=False))


def _batch(args, dims, *, trans_b, precision):
    return jax.vmap(functools.partial(_impl, trans_b=trans_b, precision=precision), in_axes=dims)(*args), 0


batching.primitive_batchers[dot_acc_p] = _batch


@functools.cache
def _dot_params(a_aval, b_aval, trans_b: bool, precision) -> dict:
    """The parameters `lax.dot_general` binds for this product in the running JAX (they differ between versions)."""
    jaxpr = jax.make_jaxpr(lambda x, y: lax.dot_general(x, y, _dims(trans_b), precision=precision,
                                                        preferred_element_type=F32))(
        jax.ShapeDtypeStruct(a_aval.shape, a_aval.dtype), jax.ShapeDtypeStruct(b_aval.shape, b_aval.dtype))
    (eqn,) = jaxpr.jaxpr.eqns
    return dict(eqn.params)


_logged = set()


def _triton_rule(ctx, acc, a, b, *, trans_b, precision):
    """The primitive (bound only with FNX_DOT_ACC=1) on the Pallas Triton lowering: Pallas' own product, its zero
    accumulator replaced by acc."""
    from jax._src.lib.mlir.dialects import arith as arith_dialect
    from jax._src.pallas.triton import lowering as tl
    try:
        acc_aval, a_aval, b_aval = ctx.avals_in
        params = _dot_params(a_aval, b_aval, trans_b, precision)
        sub = ctx.replace(avals_in=[a_aval, b_aval], avals_out=[ShapedArray(acc_aval.shape, F32)])
        out = tl.triton_lowering_rules[lax.dot_general_p](sub, a, b, **params)
    except Exception as err:        # noqa: BLE001 - this JAX's lowering internals differ from the ones known here
        raise NotImplementedError(f"dot_acc ({ENV}=1): Pallas' Triton dot rule could not be reused in this JAX "
                                  f"({type(err).__name__}: {err}); unset {ENV}") from err
    op = out.owner
    if _takes_acc(op, acc):
        op.operands[2] = acc            # the zeros it was given become dead and are dropped
        return out
    if "fallback" not in _logged:
        _logged.add("fallback")
        log.warning("dot_acc: this JAX's Pallas dot rule returned %s, not a tt.dot with a zero accumulator; the "
                    "accumulator is added after the product (the same arithmetic, without the fused accumulation)",
                    getattr(op, "name", type(op).__name__))
    return arith_dialect.addf(acc, out)


def _takes_acc(op, acc) -> bool:
    """Whether `op` is a `tt.dot` whose accumulator operand is a zero constant (a splat of 0 or a dense 0) of acc's
    type: then acc may take its place."""
    try:
        if getattr(op, "name", None) != "tt.dot" or len(op.operands) != 3 or op.operands[2].type != acc.type:
            return False
        z = op.operands[2].owner
        if getattr(z, "name", None) == "tt.splat":
            z = z.operands[0].owner
        if getattr(z, "name", None) != "arith.constant":
            return False
        from jax._src.lib.mlir import ir
        attr = z.attributes["value"]
        try:
            return ir.FloatAttr(attr).value == 0.0          # a scalar constant (splat above)
        except (TypeError, ValueError):
            dense = ir.DenseFPElementsAttr(attr)            # a dense tensor constant
            return dense.is_splat and ir.FloatAttr(dense.get_splat_value()).value == 0.0
    except Exception:       # noqa: BLE001 - an IR shape this rule does not know: no fusion
        return False


TRITON_REGISTERED = triton_rules.register(dot_acc_p, _triton_rule)
