"""Expert parallelism: the routed experts split by expert id over ep x tp, each device running its own experts
inside `shard_map` and one `psum` combining the per-(token, k) outputs.

Why not plain SPMD: `w[idx]` on an expert-sharded w is partitioned by XLA as a masked local gather followed by
an all-reduce of the gathered *weights* [T, K, 2I, D] (measured on the CPU mesh: README "Experts"), which at the
released shapes moves ~100 MB per layer per decode step. Here only the outputs [T, K, D] cross devices, and
the arithmetic per (token, k) is exactly the single-device one (the sum adds exact zeros).

Pass an `ExpertParallel` as `moe_impl` (the Engine does this when given a mesh)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from fnx.model import moe
from fnx.parallel.mesh import AXES


@dataclass(frozen=True)
class ExpertParallel:
    mesh: Mesh
    local: str = "auto"         # per-shard implementation: "gather" | "grouped" | "auto" (as moe.moe_block)
    axes: tuple = AXES

    @property
    def shards(self) -> int:
        n = 1
        for a in self.axes:
            n *= self.mesh.shape[a]
        return n

    def _local_fn(self, tokens: int, top_k: int):
        impl = self.local
        if impl == "auto":
            impl = "gather" if tokens <= moe.GATHER_MAX_TOKENS or tokens * top_k <= 64 else "grouped"
        return {"gather": moe._expert_gather, "grouped": moe._expert_grouped, "ragged": moe._expert_ragged}[impl]

    def __call__(self, gate_up, down, x: jax.Array, idx: jax.Array) -> jax.Array:
        """Same contract as moe._expert_gather: x [T, D], idx [T, K] -> outputs [T, K, D]."""
        n_exp = down.shape[0]
        fn = self._local_fn(*idx.shape)
        if self.shards == 1 or n_exp % self.shards:
            return fn(gate_up, down, x, idx)
        n_local = n_exp // self.shards

        def per_shard(gu, dn, x, idx):
            lo = lax.axis_index(self.axes) * n_local
            mine = (idx >= lo) & (idx < lo + n_local)
            outs = fn(gu, dn, x, jnp.where(mine, idx - lo, 0))   # pairs of other shards run expert 0, dropped
            return lax.psum(jnp.where(mine[..., None], outs, jnp.zeros((), outs.dtype)), self.axes)

        return jax.shard_map(per_shard, mesh=self.mesh, in_specs=(P(self.axes), P(self.axes), P(), P()),
                             out_specs=P(), check_vma=False)(gate_up, down, x, idx)
