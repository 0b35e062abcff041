"""Host cost of launching a jitted program on the GPU, by kind of argument: how much of an engine step's host
time is the launch itself, and whether a NumPy argument (copied in by the launch) costs more than a device array,
with the device idle and with it busy (does the copy wait behind queued work?).

    python scripts/probe_dispatch.py            # prints one line per case, us per launch (host time, no sync)
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def per_call(fn, n=200):
    fn()
    jax.effects_barrier()
    t = time.perf_counter()
    for _ in range(n):
        out = fn()
    dt = (time.perf_counter() - t) / n
    jax.block_until_ready(out)
    return dt * 1e6


def main():
    leaves = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    params = [jnp.full((256, 256), i, jnp.bfloat16) for i in range(leaves)]
    small_np = np.arange(80, dtype=np.uint32).reshape(5, 16)
    rows_np = np.ones((16, 1, 2560), jnp.bfloat16)
    small_dev, rows_dev = jax.device_put(small_np), jax.device_put(rows_np)
    f = jax.jit(lambda p, a: a.sum() + p[0][0, 0].astype(jnp.float32))
    g = jax.jit(lambda p, a, r: a.sum() + r.sum().astype(jnp.float32) + p[0][0, 0].astype(jnp.float32))
    n = 8192 if jax.default_backend() == "gpu" else 256
    big = jnp.ones((n, n), jnp.bfloat16)
    busy = jax.jit(lambda x: (x @ x).astype(jnp.bfloat16))
    res = {"leaves": leaves, "device": jax.devices()[0].device_kind}
    res["launch_device_args_us"] = per_call(lambda: f(params, small_dev))
    res["launch_numpy_arg_us"] = per_call(lambda: f(params, small_np))
    res["launch_two_numpy_args_us"] = per_call(lambda: g(params, small_np, rows_np))
    res["launch_two_device_args_us"] = per_call(lambda: g(params, small_dev, rows_dev))
    res["launch_few_leaves_us"] = per_call(lambda: f(params[:4], small_dev))
    res["device_put_small_us"] = per_call(lambda: jax.device_put(small_np))
    res["device_put_rows_us"] = per_call(lambda: jax.device_put(rows_np))
    res["jnp_asarray_small_us"] = per_call(lambda: jnp.asarray(small_np))
    # the device busy for ~20 ms: does a launch with a NumPy argument wait behind it?
    donate = jax.jit(lambda p, a: (a + 1, p[0][0, 0]), donate_argnums=(1,))
    box = {"a": jax.device_put(small_np)}

    def donated():
        box["a"], out = donate(params, box["a"])
        return out
    for name, fn in (("numpy", lambda: g(params, small_np, rows_np)), ("device", lambda: g(params, small_dev, rows_dev)),
                     ("device_few_leaves", lambda: f(params[:4], small_dev)),
                     ("device_30_leaves", lambda: f(params[:30], small_dev)),
                     ("donated", donated),
                     ("device_put", lambda: jax.device_put(rows_np))):
        times = []
        for _ in range(20):
            x = big
            for _ in range(20):
                x = busy(x)
            t = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t)
            jax.block_until_ready((x, out))
        res[f"busy_launch_{name}_us"] = float(np.median(times)) * 1e6
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}))


if __name__ == "__main__":
    main()
