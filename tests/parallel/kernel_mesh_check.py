"""Run in a subprocess with forced host devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=4 FNX_KERNELS=gemv_bf16=pallas_interpret \
        python tests/parallel/kernel_mesh_check.py [CKPT [MESH ...]]
The GEMV kernels (interpret mode) per shard inside `dispatch.on_mesh`: every weight layout (rows split, columns
split, rows over both axes, whole) and format (bf16, FP8 blocks, NVFP4) against the same kernel on one device;
then, with CKPT, a prefill + decode step of the model on each MESH (default tp=2,ep=1 and tp=2,ep=2) against one
device. One JSON line per check."""

from __future__ import annotations

import contextlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fnx import parallel
from fnx.model import quant
from fnx.pallas import dispatch
from fnx.pallas.gemv import api
from fnx.pallas.gemv import mesh as gm


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def op_checks():
    mesh, _ = parallel.as_mesh("tp=2,ep=2")
    rng = np.random.default_rng(0)
    n, k = 512, 1024
    x = jnp.asarray(rng.normal(size=(3, k)), jnp.bfloat16)
    wd = jnp.asarray(rng.normal(size=(n, k)) * k ** -0.5, jnp.float32)
    weights = {"bf16": (wd.astype(jnp.bfloat16), ()), }
    f8 = quant.quantize_fp8_block(wd)
    weights["fp8"] = (f8.w, (f8.scale_inv,))
    f4 = quant.quantize_nvfp4(wd)
    weights["nvfp4"] = (f4.w, (f4.scale, f4.scale_2))
    layouts = {"rows": ("tp", None), "cols": (None, "tp"), "rows_all": (("ep", "tp"), None), "whole": (None, None)}
    for fmt, (w, aux) in weights.items():
        call = lambda x, w, *aux, _f=fmt: api.linear(x, w, fmt=_f, impl="pallas_interpret",  # noqa: E731
                                                      **dict(zip(("scale", "scale_2"), aux)))
        want = jax.jit(call)(x, w, *aux)
        for name, spec in layouts.items():
            def put(a, spec=spec):
                s = tuple(spec[:a.ndim])
                return jax.device_put(a, NamedSharding(mesh, P(*s)))
            before = gm.partition_calls["count"]
            with dispatch.on_mesh(mesh):
                got = jax.jit(call)(jax.device_put(x, NamedSharding(mesh, P())), put(w), *[put(a) for a in aux])
            print(json.dumps({"check": "op", "fmt": fmt, "layout": name, "rel_err": rel(got, want),
                              "partitioned": gm.partition_calls["count"] > before,
                              "out_spec": str(got.sharding.spec)}), flush=True)


def model_check(ckpt, meshes):
    """Prefill + one decode step of the bf16 tiny model with the GEMV kernels per shard (decode shapes take the
    kernel) against the same kernels on one device."""
    import fnx
    from fnx.model.api import extend, new_state
    model = fnx.load(ckpt, dtype=jnp.bfloat16)
    ids = np.array([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])

    def run(mesh_text):
        m, state = model, new_state(model, 2, 16)
        if mesh_text is not None:
            mesh, _ = parallel.as_mesh(mesh_text)
            m, state = parallel.shard_model(model, mesh), parallel.shard_state(model.cfg, state, mesh)
        # FNX_KERNELS=gemv_bf16=pallas_interpret: the GEMVs take the kernel, every other op its reference
        ctx = dispatch.on_mesh(mesh) if mesh_text is not None else contextlib.nullcontext()
        with ctx:
            a, state = extend(m, state, ids)
            b, state = extend(m, state, np.argmax(np.asarray(a)[:, -1], -1)[:, None])
        return np.asarray(a, np.float32), np.asarray(b, np.float32)
    want = run(None)
    for text in meshes:
        before = gm.partition_calls["count"]
        got = run(text)
        print(json.dumps({"check": "model", "mesh": text, "rel_err": [rel(g, w) for g, w in zip(got, want)],
                          "argmax_equal": bool((got[1].argmax(-1) == want[1].argmax(-1)).all()),
                          "partitioned": gm.partition_calls["count"] - before}), flush=True)


if __name__ == "__main__":
    op_checks()
    if len(sys.argv) > 1:
        model_check(sys.argv[1], sys.argv[2:] or ["tp=2,ep=1", "tp=2,ep=2"])
