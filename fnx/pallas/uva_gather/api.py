"""Rows of a table in page-locked host memory, gathered on the device (op "uva_gather").

`gather_words(ids, starts, lo, hi, row_bytes)` with real host addresses runs the Pallas kernel on a CUDA GPU: no
other backend can read host memory from inside a jitted program, so on any other device it raises (there is no
fallback). With `mem` (a stand-in memory array whose byte offsets play the addresses) it runs "reference" (jnp)
or "pallas_interpret" (the kernel body, interpreted): what the CPU tests compare."""

from __future__ import annotations

from fnx.pallas import dispatch
from fnx.pallas.uva_gather import pallas as uva_pallas
from fnx.pallas.uva_gather import reference

BACKENDS = ("pallas", "pallas_interpret", "reference")


def gather_words(ids, starts, lo, hi, row_bytes: int, *, mem=None, impl: str | None = None):
    """ids [N] -> [N, row_bytes // 4] uint32 (see reference.py for the addressing). impl None: "pallas" for real
    addresses (mem None), "reference" for a stand-in memory."""
    impl = impl or ("pallas" if mem is None else "reference")
    if impl not in BACKENDS:
        raise ValueError(f"uva_gather backend must be one of {BACKENDS}, got {impl!r}")
    if mem is None:
        if impl != "pallas":
            raise ValueError(f"uva_gather: backend {impl!r} reads a stand-in memory; real host addresses need the "
                             "compiled kernel ('pallas')")
        why = dispatch.why_unavailable("pallas")
        if why:
            raise RuntimeError(f"uva_gather reads page-locked host memory from a CUDA kernel, which cannot run here: "
                               f"{why}. Keep the PLE table in 'device', 'pinned' or 'pageable' mode instead")
        return uva_pallas.gather_words(ids, starts, lo, hi, row_bytes)
    if impl == "pallas":
        raise ValueError("uva_gather: the compiled kernel reads real addresses; a stand-in memory runs "
                         "'reference' or 'pallas_interpret'")
    if impl == "reference":
        return reference.gather_words(ids, starts, lo, hi, mem, row_bytes)
    return uva_pallas.gather_words(ids, starts, lo, hi, row_bytes, mem=mem, interpret=True)
