"""Rows of a table in page-locked host memory, gathered on the device (op "uva_gather").

`gather_words(ids, starts, lo, hi, row_bytes)` with real host addresses runs the Pallas kernel on a CUDA GPU: no
other backend can read host memory from inside a jitted program, so on any other device it raises (there is no
fallback). With `mem` (a stand-in memory array whose byte offsets play the addresses) it runs "reference" (jnp)
or "pallas_interpret" (the kernel body, interpreted): what the CPU tests compare."""

from __future__ import annotations

from fnx.pallas import dispatch
from fnx.pallas.uva_gather import pallas as uva_pallas
from fnx.pallas.uva_gather import reference

BACKENDS = dispatch.HOST_MEMORY_BACKENDS


def gather_words(ids, starts, lo, hi, row_bytes: int, *, mem=None, impl: str | None = None):
    """ids [N] -> [N, row_bytes // 4] uint32 (see reference.py for the addressing). impl None: "pallas" for real
    addresses (mem None), "reference" for a stand-in memory."""
    impl = dispatch.host_memory_impl("uva_gather", impl, mem)
    if impl == "pallas":
        return uva_pallas.gather_words(ids, starts, lo, hi, row_bytes)
    if impl == "reference":
        return reference.gather_words(ids, starts, lo, hi, mem, row_bytes)
    return uva_pallas.gather_words(ids, starts, lo, hi, row_bytes, mem=mem, interpret=True)
