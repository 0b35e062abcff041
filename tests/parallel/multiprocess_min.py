"""Two CPU processes through jax.distributed (gloo), 2 forced host devices each: an fnx mesh over the 4 global
devices, `fnx.parallel.place` from host values, a sharded reduction and a cross-process gather.
    python tests/parallel/multiprocess_min.py PORT PROCESS_ID"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid = sys.argv[1], int(sys.argv[2])
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid, local_device_ids=[0, 1])
import numpy as np, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from fnx import parallel
mesh, _ = parallel.as_mesh("tp=2,ep=2")
assert jax.process_count() == 2 and len(jax.devices()) == 4
x = parallel.place(np.arange(32.).reshape(8, 4), NamedSharding(mesh, P(("ep", "tp"))))
y = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(mesh, P()))(x)
assert np.asarray(y).tolist() == [112., 120., 128., 136.], np.asarray(y)
from jax.experimental import multihost_utils
assert (np.asarray(multihost_utils.process_allgather(x, tiled=True)) == np.arange(32.).reshape(8, 4)).all()
print("ok", pid, flush=True)
jax.distributed.shutdown()
