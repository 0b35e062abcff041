"""The device mesh of an engine: `MeshConfig(tp=2, ep=1)` -> a `jax.sharding.Mesh` with axes ("ep", "tp").

tp: attention heads, GDN heads, dense projections, lm_head (vocabulary); ep: routed experts by expert id (the
experts are split over ep x tp, every device holding E / (ep * tp) of them). "tp" is the minor axis, so the
devices of one tensor-parallel group are adjacent in `jax.devices()`. The mesh may span processes
(`jax.distributed`): it is built from the global device list."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("ep", "tp")


@dataclass(frozen=True)
class MeshConfig:
    tp: int = 1
    ep: int = 1
    hc: str = "replicated"    # hyper-connection weights: "replicated" (no collective) or "sharded" (see README)
    ngram: str = "rows"       # device n-gram table: "rows" (split by rows, exact all-reduce) or "replicated"

    def __post_init__(self):
        for name in ("tp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"mesh {name} must be a positive integer, got {v!r}")
        if self.hc not in ("replicated", "sharded"):
            raise ValueError(f"mesh hc must be 'replicated' or 'sharded', got {self.hc!r}")
        if self.ngram not in ("rows", "replicated"):
            raise ValueError(f"mesh ngram must be 'rows' or 'replicated', got {self.ngram!r}")

    @property
    def size(self) -> int:
        return self.tp * self.ep

    @classmethod
    def parse(cls, text: str) -> "MeshConfig":
        """'tp=2,ep=1' (also 'tp=2', 'ep=4,hc=sharded'); missing sizes are 1."""
        kw = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, val = part.partition("=")
            if not sep or key not in ("tp", "ep", "hc", "ngram"):
                raise ValueError(f"bad mesh item {part!r} in {text!r}; expected tp=N, ep=N, hc=..., ngram=...")
            kw[key] = int(val) if key in ("tp", "ep") else val
        return cls(**kw)

    def __str__(self) -> str:
        return f"tp={self.tp},ep={self.ep}" + (f",hc={self.hc}" if self.hc != "replicated" else "")

    def build(self, devices=None) -> Mesh:
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < self.size:
            raise ValueError(f"mesh {self} needs {self.size} devices, {len(devices)} are visible "
                             f"({devices[0].platform}); on the CPU set XLA_FLAGS="
                             f"--xla_force_host_platform_device_count={self.size} before importing jax")
        grid = np.array(devices[:self.size], dtype=object).reshape(self.ep, self.tp)
        mesh = Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))
        _CONFIGS[id(mesh)] = (mesh, self)
        return mesh


_CONFIGS: dict[int, tuple[Mesh, MeshConfig]] = {}


def as_mesh(mesh) -> tuple[Mesh, MeshConfig]:
    """A Mesh, a MeshConfig or a 'tp=2,ep=1' string -> (Mesh, MeshConfig)."""
    if isinstance(mesh, str):
        mesh = MeshConfig.parse(mesh)
    if isinstance(mesh, MeshConfig):
        return mesh.build(), mesh
    if isinstance(mesh, Mesh):
        known = _CONFIGS.get(id(mesh))
        if known is not None and known[0] is mesh:
            return known
        if set(mesh.axis_names) != set(AXES):
            raise ValueError(f"an fnx mesh has axes {AXES}, got {mesh.axis_names}")
        return mesh, MeshConfig(tp=mesh.shape["tp"], ep=mesh.shape["ep"])
    raise TypeError(f"mesh must be a jax.sharding.Mesh, a MeshConfig or a 'tp=N,ep=N' string, got {type(mesh)}")
