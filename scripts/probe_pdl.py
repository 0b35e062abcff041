"""Which kernels of a compiled program wait for their predecessor (`griddepcontrol.wait`) and which release their
dependents early (`griddepcontrol.launch_dependents`), read from the PTX XLA writes: a program of two Pallas GEMVs
with an XLA op between them, compiled under FNX_PDL_TRIGGER (see fnx/pallas/pdl.py). One JSON line to stdout.

    FNX_PDL_TRIGGER=1 python scripts/probe_pdl.py --dump /tmp/pdl_dump

XLA_FLAGS is set here (its dump folder) before JAX starts; a GPU is needed."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re


def census(dump: str) -> dict:
    """{kernel entry name: {"wait": n, "launch_dependents": n}} over the .ptx files under `dump`."""
    out = {}
    for path in glob.glob(os.path.join(dump, "**", "*.ptx"), recursive=True):
        text = open(path).read()
        for m in re.finditer(r"\.entry\s+(\w+)\s*\(", text):
            start = m.end()
            nxt = re.search(r"\.entry\s+\w+\s*\(", text[start:])
            body = text[start:start + nxt.start()] if nxt else text[start:]
            out[m.group(1)] = {"wait": body.count("griddepcontrol.wait"),
                               "launch_dependents": body.count("griddepcontrol.launch_dependents")}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", required=True, help="a new folder for XLA's dump")
    args = ap.parse_args()
    os.makedirs(args.dump, exist_ok=True)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.dump}").strip()
    import jax
    import jax.numpy as jnp
    from fnx.pallas.gemv import pallas as gp

    t = gp.Tiles(64, 128, 1)

    def prog(x, w1, w2):
        y = gp.gemv(x, w1, None, None, fmt="bf16", tiles=t)
        y = jnp.tanh(y.astype(jnp.float32)).astype(jnp.bfloat16) * 3      # an XLA fusion between the kernels
        return gp.gemv(y, w2, None, None, fmt="bf16", tiles=t)
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (1, 1024), jnp.bfloat16)
    w1 = jax.random.normal(key, (1024, 1024), jnp.bfloat16) * 0.03
    w2 = jax.random.normal(key, (1024, 1024), jnp.bfloat16) * 0.03
    got = jax.jit(prog)(x, w1, w2)
    want = jnp.tanh((x.astype(jnp.float32) @ w1.astype(jnp.float32).T).astype(jnp.bfloat16).astype(jnp.float32)
                    ).astype(jnp.bfloat16) * 3
    want = want.astype(jnp.float32) @ w2.astype(jnp.float32).T
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
    print(json.dumps({"part": "pdl census", "trigger": os.environ.get("FNX_PDL_TRIGGER", "0"),
                      "device": jax.devices()[0].device_kind, "max_rel_err": round(err, 5),
                      "kernels": census(args.dump)}), flush=True)


if __name__ == "__main__":
    main()
