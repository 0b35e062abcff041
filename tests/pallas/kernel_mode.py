"""Which Pallas backend the kernel tests exercise: the compiled kernel on a CUDA GPU (so `pytest tests/pallas` on
the GPU host checks the real thing against the references), the interpreter everywhere else."""

from fnx.pallas import dispatch

KERNEL = "pallas" if dispatch.why_unavailable("pallas") is None else "pallas_interpret"
INTERPRET = KERNEL == "pallas_interpret"
