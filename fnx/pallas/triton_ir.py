"""The Triton IR inside a program lowered for CUDA, as text, on any machine (no GPU needed): each Pallas Triton
launch is a custom call carrying its kernel as MLIR bytecode. `scripts/sass_count.py` compiles these texts with a
stock Triton; tests read them to check what a kernel's lowering emits."""

from __future__ import annotations

import re


def launches(lowered) -> list[tuple[str, int, int, str]]:
    """(name, num_warps, num_stages, Triton IR text) of each Pallas Triton launch in `lowered` (the result of
    `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`), in program order."""
    from jax._src.lib import triton as jax_triton     # its dialect prints the IR in Triton's own syntax
    from jax._src.lib.mlir import ir
    out = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    if o.operation.name == "stablehlo.custom_call" and \
                            "triton" in str(o.attributes["call_target_name"]):
                        cfg = o.attributes["mhlo.backend_config"]
                        ctx = ir.Context()
                        ctx.allow_unregistered_dialects = True     # gpu.barrier (debug_barrier): printed generic
                        jax_triton.dialect.register_dialect(ctx)
                        module = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes, context=ctx)
                        stages = ir.IntegerAttr(cfg["num_stages"]).value if "num_stages" in cfg else 1
                        text = module.operation.get_asm(enable_debug_info=False)
                        # an op of a dialect this context lacks prints in generic form, which Triton's parser
                        # refuses: gpu.barrier (`debug_barrier`) has no operands or results
                        text = re.sub(r'^(\s*)"gpu\.barrier"\(\).*$', r"\1gpu.barrier", text, flags=re.M)
                        out.append((ir.StringAttr(cfg["name"]).value, ir.IntegerAttr(cfg["num_warps"]).value,
                                    stages, text))
                    walk(o.operation)
    walk(lowered.compiler_ir().operation)
    return out
