"""Multi-device inference: a device mesh (`MeshConfig`), sharding rules as data (`param_shardings`,
`state_shardings`), placement (`place`, `shard_model`) and expert parallelism (`ExpertParallel`).
XLA's SPMD partitioner inserts the collectives; README.md in this folder has the layout and the collective count."""

from fnx.parallel.experts import ExpertParallel
from fnx.parallel.mesh import AXES, MeshConfig, as_mesh
from fnx.parallel.rules import (mtp_param_shardings, notes, param_shardings, place, replicated,
                                state_shardings)

__all__ = ["AXES", "ExpertParallel", "MeshConfig", "as_mesh", "mtp_param_shardings", "notes", "param_shardings",
           "place", "replicated", "shard_model", "shard_state", "state_shardings"]


def shard_model(model, mesh):
    """An `fnx.Model` whose params live on the mesh (a new object; the input model is left as it is)."""
    from fnx.model.api import Model
    mesh, mcfg = as_mesh(mesh)
    params = place(model.params, param_shardings(model.cfg, model.params, mesh, mcfg))
    return Model(model.cfg, params, model.mtp, model.path)


def shard_state(cfg, state, mesh):
    mesh, mcfg = as_mesh(mesh)
    return place(state, state_shardings(cfg, state, mesh, mcfg))
