"""One process of a 2-process CPU run through jax.distributed (each process with 2 forced host devices):
    python tests/parallel/multiprocess_check.py CKPT PORT PROCESS_ID MESH
Both processes run the same sharded forward over the 4 global devices; process 0 prints the max relative error
against its own single-device forward as one JSON line."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import faulthandler  # noqa: E402
import jax  # noqa: E402

faulthandler.dump_traceback_later(int(os.environ.get("FNX_MP_DUMP", "100000")), exit=True)

jax.config.update("jax_cpu_collectives_implementation", "gloo")
ckpt, port, pid, mesh_text = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           local_device_ids=[0, 1])

import json  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import fnx  # noqa: E402
from fnx import parallel  # noqa: E402
from fnx.model.transformer import init_state, step  # noqa: E402
from fnx.ple import ngram_ids  # noqa: E402

model = fnx.load(ckpt, dtype=np.float32)
cfg = model.cfg
rng = np.random.default_rng(0)
ids = rng.integers(0, cfg.vocab_size, size=(2, 2 * cfg.indexer_budget + 3)).astype(np.int32)
state = init_state(cfg, 2, ids.shape[1], jnp.float32)
ple, _ = ngram_ids(np.asarray(state["ngram_ctx"]).astype(np.int64), ids.astype(np.int64), model.ngram)
ple = ple.astype(np.int32)

local = jax.local_devices()[0]
ref_params = jax.device_put(model.params, local)
ref = step(ref_params, jax.device_put(state, local), jax.device_put(ids, local), jax.device_put(ple, local),
           cfg=cfg)[0]
ref = np.asarray(ref)

mesh, mcfg = parallel.as_mesh(mesh_text)
assert mesh.devices.size == 4 and len(jax.devices()) == 4, jax.devices()
params = parallel.place(jax.tree.map(np.asarray, model.params), parallel.param_shardings(cfg, model.params, mesh))
st = parallel.place(jax.tree.map(np.asarray, state), parallel.state_shardings(cfg, state, mesh))
rep = lambda x: parallel.place(x, parallel.replicated(mesh, x))  # noqa: E731
fwd = jax.jit(lambda p, s, t, i: step(p, s, t, i, cfg=cfg, moe_impl=parallel.ExpertParallel(mesh))[0])
logits = fwd(params, st, rep(ids), rep(ple))
full = np.asarray(multihost_utils.process_allgather(logits, tiled=True))
err = float(np.abs(full - ref).max() / np.abs(ref).max())
if pid == 0:
    print(json.dumps({"mesh": mesh_text, "processes": jax.process_count(), "devices": len(jax.devices()),
                      "rel_err": err, "argmax_equal": bool((full.argmax(-1) == ref.argmax(-1)).all())}), flush=True)
jax.distributed.shutdown()
