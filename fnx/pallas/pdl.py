"""Programmatic dependent launch (PDL) from the Pallas Triton kernels: `griddepcontrol.launch_dependents` at the
start of every program, so the kernel after this one can be scheduled onto the GPU while this one still runs.

Why: a decode step is ~760 kernels on the H200, most of them a few microseconds long, and each pays its launch and
the spread of its programs over the SMs after its predecessor ends. JAX 0.11.2's XLA launches its kernels with PDL
(`--xla_gpu_enable_pdl`, on by default: the forty-seventh session measured it on) and puts `griddepcontrol.wait` at
the start of each kernel it compiles, Pallas' Triton kernels included, but only its own GEMM fusions say
`launch_dependents`; a kernel that never says it releases its dependents only when it exits, so after a Pallas
kernel the next one starts cold. With the trigger, the next kernel's programs are resident and wait in hardware
(their `griddepcontrol.wait`, which returns once this whole grid has finished and its writes are visible), so the
data order is the same as without it: only the launch moves earlier.

The trigger is `tt.elementwise_inline_asm` with side effects (not pure: never removed or hoisted past the kernel's
memory operations), bound through a primitive with a kernel-local effect so JAX keeps it in the kernel's jaxpr.
Hopper and later (sm_90+: the PTX instruction exists there only); interpret mode and other devices never bind it.

`FNX_PDL_TRIGGER` (read when a kernel is traced): 0 (the default; measured level on an H100, BENCHMARKS.md
"Forty-eighth session") or 1 (every Pallas kernel of fnx triggers at its start). `pallas_call` here is
`pl.pallas_call` with that wrapper; fnx's kernels call it.

The wait at the very start is not what a kernel pays for either: a Mosaic GPU kernel (`plgpu.kernel`) places its own
wait and gets a PDL launch when its module carries `mosaic_gpu.uses_pdl`; in a chain of weight-streaming kernels
whose weights are copied before the wait, with the next kernel released during this one's work, the per-kernel time
was the same as a Triton kernel's and as without the overlap (`scripts/probe_mosaic_pdl.py`, BENCHMARKS.md
"Fifty-eighth session"). What is left is the kernel count."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fnx.pallas import triton_rules

try:        # the public home of Primitive in newer JAX; jax.core's is deprecated there
    from jax.extend.core import Primitive
except ImportError:     # pragma: no cover - older JAX
    from jax.core import Primitive

ENV = "FNX_PDL_TRIGGER"
ASM = "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;"
LANES = 32              # the trigger's operand: one int32 per lane of a warp (each thread runs the asm; repeated
                        # triggers in a program are harmless)

launch_dependents_p = Primitive("fnx_gdc_launch_dependents")
launch_dependents_p.multiple_results = True


def trigger() -> bool:
    """Whether fnx's Pallas kernels trigger their dependents at their start (`FNX_PDL_TRIGGER`, read when a kernel is
    traced). A value other than 0 or 1 raises."""
    v = os.environ.get(ENV, "0").strip()
    if v not in ("0", "1"):
        raise ValueError(f"{ENV}={v!r}: use 1 (every Pallas kernel says launch_dependents at its start) or 0 (not)")
    return v == "1"


@launch_dependents_p.def_effectful_abstract_eval
def _abstract(lanes):
    del lanes
    return (), {triton_rules.kernel_effect(f"{ENV}=1 (unset it)")}


def _triton_rule(ctx, lanes):
    triton_rules.side_effect_asm(lanes, ASM)
    return []


TRITON_REGISTERED = triton_rules.register(launch_dependents_p, _triton_rule)


def launch_dependents():
    """`griddepcontrol.launch_dependents` here, inside a Pallas kernel on the Triton lowering."""
    if not TRITON_REGISTERED:       # pragma: no cover
        raise NotImplementedError(f"{ENV}=1: this JAX has no Pallas Triton lowering to register the trigger with")
    launch_dependents_p.bind(jnp.zeros((LANES,), jnp.int32))


def _device_ok() -> bool:
    """Whether the default device can run the trigger (a GPU of compute capability 9.0 or later), or there is no GPU
    (a lowering for an abstract CUDA device, as the tests do: the IR then shows it)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:            # pragma: no cover
        return True
    if dev.platform != "gpu":
        return True
    cc = getattr(dev, "compute_capability", None)
    try:
        return cc is None or float(cc) >= 9.0
    except (TypeError, ValueError):     # pragma: no cover
        return True


def _triggered(kernel):
    @functools.wraps(kernel)
    def body(*refs, **kw):
        launch_dependents()
        return kernel(*refs, **kw)
    return body


def pallas_call(kernel, **kwargs):
    """`pl.pallas_call(kernel, **kwargs)`, the kernel saying `launch_dependents` at its start where `FNX_PDL_TRIGGER=1`
    and it is compiled (not interpreted) for a GPU of sm_90 or later."""
    if trigger() and not kwargs.get("interpret") and _device_ok():
        kernel = _triggered(kernel)
    return pl.pallas_call(kernel, **kwargs)
