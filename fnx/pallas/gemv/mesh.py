"""The GEMV kernels per shard on a device mesh.

Inside `fnx.pallas.dispatch.on_mesh(mesh)`, `api.linear` calls `partitioned(fmt, interpret)(x, w, *aux)`: a
`custom_partitioning` function whose partition rule reads how the weight is laid out and runs the kernel on each
device's shard:

  W split over output rows (N: q/k/v, gate/up, in_proj, lm_head)   y_local = kernel(x, W_local), y split over N
  W split over input columns (K: o_proj, out_proj, down)           y = psum(kernel(x_local, W_local) in fp32),
                                                                   rounded once after the sum
  W whole                                                          every device runs the whole kernel

x is resharded to match (sliced over K, or replicated). Scales follow their weight (FP8 block scales
[N/128, K/128] and NVFP4 group scales [N, K/16] split like W; the NVFP4 per-row global [N] like W's rows). A shard
whose local shape no tile divides runs the reference arithmetic on that shard (the same rule as `auto` for a
whole weight), logged once.
"""

from __future__ import annotations

import functools
import logging

import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from fnx.pallas.gemv import pallas as gp
from fnx.pallas.gemv import reference

log = logging.getLogger("fnx.pallas")
F32 = jnp.float32

# Shardy factor rules: x [m, k], W [n, k] (NVFP4 packs k into j = k/2 bytes), scales with their own factors
RULES = {"bf16": "m k, n k -> m n", "fp8": "m k, n k, a b -> m n", "nvfp4": "m k, n j, n l, n -> m n"}
_logged: set = set()
partition_calls = {"count": 0}          # how many per-shard lowerings were built (tests check the kernels ran)


def _local(x, w, aux, fmt: str, interpret: bool, fp32: bool):
    """One shard's y = x @ W.T through the kernel (fp32 out when `fp32`: a partial sum awaiting its psum)."""
    from fnx.pallas.gemv import api
    m, k = x.shape
    n = w.shape[0]
    t = api.tiles_for(fmt, n, k, m)
    scale, scale_2 = (aux + (None, None))[:2]
    if t is None:
        if (fmt, n, k) not in _logged:
            _logged.add((fmt, n, k))
            log.warning("fnx gemv_%s on a mesh: no tile divides the shard N=%d K=%d; that shard runs the reference",
                        fmt, n, k)
        wq = reference.dequantize(fmt, w, scale, scale_2, (128, 128), 16).astype(x.dtype)
        y = lax.dot_general(x, wq, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                            preferred_element_type=F32)
        return y if fp32 else y.astype(x.dtype)
    # the kernel rounds its output to x's dtype: an fp32 x gives the fp32 sums (it converts x to bf16 itself)
    return gp.gemv(x.astype(F32) if fp32 else x, w, scale, scale_2, fmt=fmt, tiles=t, interpret=interpret)


def _entry(spec, i):
    return spec[i] if spec is not None and len(spec) > i else None


@functools.lru_cache(maxsize=None)
def partitioned(fmt: str, interpret: bool):
    """f(x [M, K], w, *aux) -> y [M, N] in x.dtype, partitioned by W's sharding (module docstring)."""
    if fmt not in RULES:
        raise ValueError(f"unknown GEMV format {fmt!r}")

    def whole(x, w, *aux):
        return _local(x, w, aux, fmt, interpret, fp32=False)

    f = custom_partitioning(whole)

    def layout(mesh, arg_shapes):
        ws = arg_shapes[1].sharding.spec
        n_ax, k_ax = _entry(ws, 0), _entry(ws, 1)
        shs = [NamedSharding(mesh, P(None, k_ax)), NamedSharding(mesh, P(n_ax, k_ax))]
        if fmt == "fp8":
            shs.append(NamedSharding(mesh, P(n_ax, k_ax)))
        elif fmt == "nvfp4":
            shs += [NamedSharding(mesh, P(n_ax, k_ax)), NamedSharding(mesh, P(n_ax))]
        return n_ax, k_ax, tuple(shs)

    def infer(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, P(None, layout(mesh, arg_shapes)[0]))

    def partition(mesh, arg_shapes, result_shape):
        n_ax, k_ax, shs = layout(mesh, arg_shapes)
        partition_calls["count"] += 1
        if k_ax is None:
            lower = whole
        else:
            def lower(x, w, *aux):
                return lax.psum(_local(x, w, aux, fmt, interpret, fp32=True), k_ax).astype(x.dtype)
        return mesh, lower, NamedSharding(mesh, P(None, n_ax)), shs

    f.def_partition(infer_sharding_from_operands=infer, partition=partition, sharding_rule=RULES[fmt])
    return f
