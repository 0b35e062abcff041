"""Can the GPU read the PLE table straight from a pageable file mapping (no page-locking)?

`uva` mode page-locks the whole table (51.2 GB of RAM that cannot swap). Linux HMM (kernel 6.1.24+, the open
NVIDIA kernel modules, driver 535+) lets a CUDA kernel load from any address of the process, a plain `mmap` of
the table file included: the GPU takes a page fault the first time it touches a page and the driver maps it.
If this host has it, the uva gather kernel could read the `pageable` store's own mapping, and the table would stay
in the page cache (evictable, swappable) while the GPU reads it.

This probe says whether it does, without risking the caller:
1. the driver's answers (`cuDeviceGetAttribute` through libcuda: pageable memory access, whether it uses the host
   page tables, host-pointer use for registered memory), the kernel release, and whether the NVIDIA module is the
   open one;
2. only where pageable access is reported: in a child process (a bad address kills only it), the uva gather
   kernel reads random rows of an mmap'd table file at their mapped addresses; the rows are compared with the
   file's bytes and timed: the first touch (GPU page faults) and again (pages mapped), per gather in one program.

    python scripts/probe_hmm.py [--table PATH] [--gb 1] [--rows 64] [--out results.jsonl]

On a host without CUDA it prints why and exits 0 (nothing to probe)."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time

# CUdevice_attribute values (cuda.h)
ATTRS = {"pageable_memory_access": 88, "concurrent_managed_access": 89,
         "can_use_host_pointer_for_registered_mem": 91, "pageable_memory_access_uses_host_page_tables": 100,
         "host_native_atomic_supported": 86}


def driver_facts() -> dict:
    """The CUDA driver's answers for device 0, or {"error": why} where there is no usable driver."""
    out: dict = {"kernel": platform.release()}
    try:
        with open("/proc/driver/nvidia/version") as f:
            ver = f.read()
        out["nvidia_module"] = ver.splitlines()[0].strip()
        out["open_kernel_module"] = "Open Kernel Module" in ver
    except OSError:
        out["nvidia_module"] = None
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return {**out, "error": f"no CUDA driver library here ({e})"}
    rc = cu.cuInit(0)
    if rc:
        return {**out, "error": f"cuInit failed with CUresult {rc}"}
    dev = ctypes.c_int()
    rc = cu.cuDeviceGet(ctypes.byref(dev), 0)
    if rc:
        return {**out, "error": f"cuDeviceGet(0) failed with CUresult {rc}"}
    ver = ctypes.c_int()
    cu.cuDriverGetVersion(ctypes.byref(ver))
    out["driver_api"] = ver.value
    for name, attr in ATTRS.items():
        v = ctypes.c_int()
        rc = cu.cuDeviceGetAttribute(ctypes.byref(v), attr, dev)
        out[name] = v.value if rc == 0 else f"CUresult {rc}"
    return out


def _child(table: str, rows: int, row_bytes: int, chain: int) -> dict:
    """In the child: gather random rows of the mmap'd file through the uva kernel at their mapped addresses."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fnx.pallas.uva_gather import pallas as uva_pallas
    from fnx.ple.store import UvaTable, _register_uva, address_halves
    mm = np.memmap(table, dtype=np.uint8, mode="r")
    n = mm.shape[0] // row_bytes
    view = mm[: n * row_bytes].reshape(n, row_bytes)
    addr = mm.ctypes.data                                  # the mapping's address in this process
    # one "chunk" per 2^32 / row_bytes rows (the kernel's offsets are 32-bit within a chunk)
    per = (2**32 - 1) // row_bytes
    starts = np.arange(0, n, per, dtype=np.int64)
    lo, hi = (jnp.asarray(h) for h in address_halves(np.uint64(addr) + starts.astype(np.uint64) * np.uint64(row_bytes)))
    st = jnp.asarray(starts.astype(np.int32))
    rng = np.random.default_rng(0)
    gather = jax.jit(lambda i: uva_pallas.gather_words(i, st, lo, hi, row_bytes))
    res: dict = {"table": table, "table_rows": int(n), "rows": rows, "row_bytes": row_bytes}
    ids = rng.integers(0, n, rows).astype(np.int32)
    t = time.perf_counter()
    got = np.asarray(gather(jnp.asarray(ids)))               # includes the compile: a separate first call below
    res["first_call_with_compile_ms"] = (time.perf_counter() - t) * 1e3
    res["equal"] = bool(np.array_equal(got.view(np.uint8).reshape(rows, row_bytes), view[ids]))
    fresh = rng.integers(0, n, rows).astype(np.int32)
    t = time.perf_counter()
    jax.block_until_ready(gather(jnp.asarray(fresh)))
    res["fresh_rows_first_touch_us"] = (time.perf_counter() - t) * 1e6
    t = time.perf_counter()
    jax.block_until_ready(gather(jnp.asarray(fresh)))
    res["same_rows_again_us"] = (time.perf_counter() - t) * 1e6
    # the same chained timing as bench_ple's, over a table handle of the mapping (raw bytes, no dequantization)
    _register_uva()
    handle = UvaTable(st, lo, hi, None, None, row_bytes=row_bytes, width=row_bytes, dtype="uint8", out_dtype="uint8")
    import bench_ple        # scripts/ is this script's folder on sys.path
    warm_ids = jnp.asarray(rng.integers(0, n, (rows, 1)).astype(np.int32))
    times = bench_ple.chained_gather_us(handle, int(n), warm_ids, iters=15, chain=chain)   # first run touches them
    res[f"in_jit_mapped_us_per_gather_x{chain}"] = float(np.median(times)) * 1e6
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", help="a raw row file (default: a synthetic one of --gb GB, bench_ple's)")
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--row-bytes", type=int, default=160)
    ap.add_argument("--rows", type=int, default=64, help="rows per gather (64: one sequence, k=3)")
    ap.add_argument("--chain", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds for the child's read test")
    ap.add_argument("--out", help="append the result as one JSON line")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.table, args.rows, args.row_bytes, args.chain)), flush=True)
        return 0
    res = {"probe": "hmm", "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("FNX_COMMIT", ""),
           **driver_facts()}
    if "error" in res:
        print(f"# no CUDA driver to probe: {res['error']}")
    elif res.get("pageable_memory_access") != 1:
        res["read_test"] = "skipped: the driver reports no pageable memory access (no HMM on this host)"
    else:
        table = args.table
        if table is None:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            import bench_ple
            table = bench_ple.synthetic_table(f"/tmp/fnx_ple_bench/ple_synthetic_{args.gb:g}g.raw", args.gb)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--table", table, "--rows", str(args.rows),
               "--row-bytes", str(args.row_bytes), "--chain", str(args.chain)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            if p.returncode == 0 and lines:
                res["read_test"] = json.loads(lines[-1])
            else:
                res["read_test"] = f"child failed (rc {p.returncode}): {p.stderr.strip()[-600:]}"
        except subprocess.TimeoutExpired:
            res["read_test"] = f"child timed out after {args.timeout:g} s"
    line = json.dumps(res)
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
