"""A step's PLE rows through a ring in page-locked host memory, served by a host thread (op "ple_ring").

`post(ids, lo, hi)` hands the row ids of a request to the host (their pairs written to the control block) and
returns its ticket; `wait(ticket, lo, hi, timeout_us, dep, n, row_bytes, max_ids)` waits, on the GPU, for the
host to put the rows in the ring and reads them. With real addresses both run the Pallas kernels on a CUDA GPU
(no other backend can reach host memory from inside a jitted program: anywhere else this raises). With `mem`,
a stand-in memory whose byte offsets play the addresses, they run "reference" (jnp) or "pallas_interpret" (the
kernel bodies, interpreted): what the CPU tests compare. The host side is `fnx.ple.ring`."""

from __future__ import annotations

from fnx.pallas import dispatch
from fnx.pallas.ple_ring import pallas as ring_pallas
from fnx.pallas.ple_ring import reference

BACKENDS = dispatch.HOST_MEMORY_BACKENDS


def post(ids, lo, hi, *, mem=None, impl: str | None = None):
    """ids [N] int32 -> the ticket (with `mem`: (ticket, the pairs the kernel would store))."""
    impl = dispatch.host_memory_impl("ple_ring", impl, mem)
    if impl == "pallas":
        return ring_pallas.post(ids, lo, hi)
    if impl == "reference":
        return reference.post(ids, lo, mem)
    return ring_pallas.post(ids, lo, hi, mem=mem, interpret=True)


def wait(ticket, lo, hi, timeout_us, dep, n: int, row_bytes: int, max_ids: int, *, mem=None,
         impl: str | None = None):
    """-> (words [N, row_bytes // 4] uint32, ok [>= N] int32)."""
    impl = dispatch.host_memory_impl("ple_ring", impl, mem)
    if row_bytes % 4:
        raise ValueError(f"ple_ring reads 4-byte words: row_bytes={row_bytes} is not a multiple of 4")
    if n > max_ids:
        raise ValueError(f"ple_ring: a request of {n} row ids exceeds the ring's {max_ids}")
    if impl == "pallas":
        return ring_pallas.wait(ticket, lo, hi, timeout_us, dep, n, row_bytes, max_ids)
    if impl == "reference":
        return reference.wait(ticket, lo, mem, n, row_bytes, max_ids)
    return ring_pallas.wait(ticket, lo, hi, timeout_us, dep, n, row_bytes, max_ids, mem=mem, interpret=True)
