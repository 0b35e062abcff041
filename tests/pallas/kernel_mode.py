"""Which Pallas backend the kernel tests exercise: the compiled kernel on a CUDA GPU (so `pytest tests/pallas` on
the GPU host checks the real thing against the references), the interpreter everywhere else."""

from fnx.pallas import dispatch

KERNEL = "pallas" if dispatch.why_unavailable("pallas") is None else "pallas_interpret"
INTERPRET = KERNEL == "pallas_interpret"


def ops_outside_kernels(fn, *args) -> list[str]:
    """The primitives fn's jaxpr runs outside its pallas_calls (nested jaxprs of jit and the like included, the
    kernels' bodies not): what XLA compiles around the kernels, e.g. a split-K sum after a kernel."""
    import jax

    def walk(jaxpr):
        out = []
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                continue
            out.append(e.primitive.name)
            for p in e.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None:
                    out += walk(getattr(inner, "jaxpr", inner))
        return out
    return walk(jax.make_jaxpr(fn)(*args).jaxpr)
