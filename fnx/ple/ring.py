"""`ring` mode: the table stays where a host mode keeps it (pageable mmap by default: evictable, swappable), and
each step's rows reach the GPU through a small ring in page-locked memory, without the engine's host loop in
the way.

Inside the jitted step, at its start, a kernel writes the step's row ids into a page-locked control block
(`fnx.pallas.ple_ring.post`); a host thread of this store, polling that block, reads them, gathers the rows from
the backing store (with its deadline, page guards and counters) and copies them into the ring; at the PLE
layer a second kernel waits on the GPU for the host's DONE word and reads the rows (`wait`). The fetch runs while
the GPU runs the embedding and the layers before the PLE layer, and the step needs nothing from the host loop,
so the overlapped and speculative engines run as with the table on the device.

    store = open_store(checkpoint_dir, "ring")              # backing="pageable" | "swap" | "direct"
    params = ... store.table ...                           # a RingTable where the table would be
    store.check()                                          # failures of the device path surface here

Failure behaviour:
- the backing store's deadline and page guards apply to every request: rows it cannot read are zero rows, the
  error is pending for the next `check()` / `consume_pending()` (the engine calls it after each step);
- the GPU waits at most `gpu_timeout_s` (default 2 s) for the host; past that it uses zero rows, marks the
  request ABANDONED, and `check()` reports it; a later request gets a new seq, so a late host cannot confuse it;
- a request whose id pairs do not all carry its seq within the deadline (a torn write) is served as zero rows
  and reported the same way.

The host thread waits for requests in a small C loop (compiled at first use with the system's C compiler,
called through ctypes with the GIL released): it spins `spin_us` (20 ms on a GPU) after each request, then
polls every 20 us, and every 500 us once idle for 100 ms more. With a pageable backing, one C call per request copies the rows the page cache holds straight into the
ring (`preadv2` with RWF_NOWAIT per row: a row that would wait for the disk comes back EAGAIN, and a read cannot
fault); only the others take the backing store's guarded path (WILLNEED, MADV_POPULATE_READ, its deadline).
Without a C compiler it polls and copies from Python and says so once in the log."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from fnx.pallas.ple_ring import layout
from fnx.ple import _linux as lx
from fnx.ple.store import MODES as _HOST_MODES, PleFetchError, RowStore, address_halves, rows_from_words
from fnx.ple.table import TableError

log = logging.getLogger("fnx.ple")

BACKINGS = ("pageable", "swap", "direct")
assert all(b in _HOST_MODES for b in BACKINGS)

_POLL_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <time.h>
#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif
static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}
/* Wait until the 32-bit word at `word` differs from `last`; spin for spin_ns, then sleep 20 us between reads
   until fast_ns, then 500 us (an idle store costs little; 1 us timer slack for this thread); give up after
   timeout_ns. Returns the word's value (== last on timeout). */
uint32_t fnx_ring_poll(const volatile uint32_t *word, uint32_t last, int64_t spin_ns, int64_t fast_ns,
                       int64_t timeout_ns) {
  struct timespec t0, t;
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    uint32_t v = *word;
    if (v != last) return v;
    clock_gettime(CLOCK_MONOTONIC, &t);
    int64_t el = (int64_t)(t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec);
    if (el >= timeout_ns) return last;
    if (el < spin_ns) { relax(); continue; }
    struct timespec s = {0, el < fast_ns ? 20000 : 500000};
    nanosleep(&s, 0);
  }
}
/* One request, as far as the page cache allows: its n (seq, id) pairs checked (-1 when one does not carry seq
   yet: torn, or still in flight), ids into ids_out (-2 when one is past `rows`), then each row copied from its
   extent's file (the last extent whose first row is <= id: ext_start ascending) into dst + i * row_bytes with
   preadv2 RWF_NOWAIT. status[i] as fnx_ring_copy_cached. Returns how many rows were not copied. */
int64_t fnx_ring_serve(const volatile uint64_t *pairs, int64_t n, uint32_t seq, int64_t rows, int64_t n_ext,
                       const int64_t *ext_start, const int32_t *ext_fd, const int64_t *ext_off, uint8_t *dst,
                       int64_t row_bytes, int64_t *ids_out, int32_t *status) {
  for (int64_t i = 0; i < n; i++) {
    uint64_t p = pairs[i];
    if ((uint32_t)p != seq) return -1;
    ids_out[i] = (int64_t)(p >> 32);
    if (ids_out[i] >= rows) return -2;
  }
  int64_t missing = 0;
  for (int64_t i = 0; i < n; i++) {
    int64_t id = ids_out[i], lo = 0, hi = n_ext - 1;
    while (lo < hi) {                       /* the last e with ext_start[e] <= id */
      int64_t mid = (lo + hi + 1) / 2;
      if (ext_start[mid] <= id) lo = mid; else hi = mid - 1;
    }
    struct iovec v = {dst + i * row_bytes, (size_t)row_bytes};
    ssize_t got = preadv2(ext_fd[lo], &v, 1, ext_off[lo] + (id - ext_start[lo]) * row_bytes, RWF_NOWAIT);
    if (got == row_bytes) { status[i] = 0; continue; }
    status[i] = got < 0 ? errno : EAGAIN;
    missing++;
  }
  return missing;
}
"""

_poll_lib = []


def _native():
    """The compiled helpers (poll, serve), cached per source hash under the temp dir; (None, None) without a
    C compiler (logged once)."""
    if _poll_lib:
        return _poll_lib[0]
    tag = hashlib.sha256(_POLL_C.encode()).hexdigest()[:12]
    d = os.path.join(tempfile.gettempdir(), f"fnx-ring-{os.getuid()}")
    so = os.path.join(d, f"ring_{tag}.so")
    fns = (None, None)
    try:
        if not os.path.exists(so):
            os.makedirs(d, exist_ok=True)
            src = os.path.join(d, f"ring_{tag}.c")
            with open(src, "w") as f:
                f.write(_POLL_C)
            cc = os.environ.get("CC", "cc")
            tmp = f"{so}.{os.getpid()}"
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, src], check=True, capture_output=True,
                           timeout=60)
            os.replace(tmp, so)
        lib = ctypes.CDLL(so)
        poll, serve = lib.fnx_ring_poll, lib.fnx_ring_serve
        serve.restype = ctypes.c_int64
        serve.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int64, ctypes.c_int64,
                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                          ctypes.c_void_p, ctypes.c_void_p]
        poll.restype = ctypes.c_uint32
        poll.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        fns = (poll, serve)
    except (OSError, subprocess.SubprocessError) as exc:
        lx.log_once("ring-poll", logging.WARNING, "fnx.ple: ring mode could not build its C helpers (%s); its host "
                    "thread polls and copies from Python (higher latency under a busy GIL)", exc)
    _poll_lib.append(fns)
    return fns


def _native_poll():
    return _native()[0]


class RingStore(RowStore):
    """The `ring` mode (see the module docstring). options: backing (a host mode, default "pageable") and its
    options, max_ids (row ids per request the ring holds: a step's B x L x heads; default 65,536, a 2,048-token
    prefill chunk of 2 sequences at 16 heads), gpu_timeout_s, spin_us, switch_interval_s (the interpreter's GIL
    switch interval this store lowers the process to, default 200 us; None: unchanged), emulate (CPU tests: the
    device side runs as host callbacks over the same control block), device."""

    mode = "ring"

    def __init__(self, src, consts=None, *, backing: str = "pageable", max_ids: int = 65536,
                 gpu_timeout_s: float = 2.0, spin_us: float | None = None, switch_interval_s: float | None = 2e-4,
                 emulate: bool = False, device=None, impl: str | None = None, **kw):
        if backing not in BACKINGS:
            raise ValueError(f"ring mode's backing must be one of {BACKINGS}, got {backing!r}")
        if not max_ids > 0:
            raise ValueError(f"max_ids must be positive, got {max_ids}")
        if not 0 < gpu_timeout_s < 2000:
            raise ValueError(f"gpu_timeout_s must lie in (0, 2000) seconds (the kernel counts microseconds in "
                             f"int32), got {gpu_timeout_s}")
        if src.row_bytes % 4:
            raise TableError(f"ring mode moves rows as 4-byte words; this table's rows are {src.row_bytes} bytes")
        if src.rows >= 2**31:
            raise TableError(f"ring mode passes row ids as int32: the table has {src.rows:,} rows")
        own = {k: kw.pop(k) for k in ("out_dtype", "policy", "deadline_s") if k in kw}
        super().__init__(src, consts, **own)
        from fnx.ple.store import _CLASSES
        self.host = _CLASSES[backing](src, consts, **own, **kw)
        self.backing, self.max_ids = backing, int(max_ids)
        self._stats.extra.update(ring_requests=0, ring_rows=0, ring_serve_seconds=0.0, ring_max_serve_seconds=0.0,
                                 ring_abandoned=0, ring_torn=0)
        try:
            self._setup_block(device, emulate)
        except BaseException:
            self.host.close()
            raise
        _register()
        import jax.numpy as jnp
        scale = None if src.scale is None else jnp.asarray(src.scale)
        self.table = RingTable(jnp.asarray(self._lo), jnp.asarray(self._hi),
                               jnp.asarray([int(gpu_timeout_s * 1e6)], jnp.int32), scale,
                               row_bytes=src.row_bytes, width=self.width, dtype=np.dtype(src.np_dtype).name,
                               out_dtype=self.out_dtype.name, max_ids=self.max_ids,
                               impl=impl or ("callback" if emulate else None), store=self if emulate else None)
        self.gpu_timeout_s = gpu_timeout_s
        self._last_abandoned = 0
        self._jit = None
        self._stop = threading.Event()
        # spin after each request: 20 ms with a GPU (requests come every few ms while decoding), 0.5 ms in
        # emulation (CPU tests: a spinning core would slow the test itself)
        self.spin_ns = int((spin_us if spin_us is not None else 20000.0 if self._block is not None else 500.0) * 1e3)
        self._poll, serve = _native()
        self._setup_fast_copy(serve)
        if switch_interval_s is not None and sys.getswitchinterval() > switch_interval_s:
            # the host thread needs the GIL for each request while the engine thread runs Python: at the default
            # 5 ms interval a request could wait that long for it (on the H200, 8 slots, MTP k=4: 14.3 ms per round
            # against 8.3 with the table in the params). Process-wide; switch_interval_s=None leaves it alone.
            lx.log_once("ring-switch", logging.INFO, "fnx.ple: ring mode sets the interpreter's switch interval to "
                        "%.0f us (was %.0f us) so its host thread gets the GIL promptly", switch_interval_s * 1e6,
                        sys.getswitchinterval() * 1e6)
            sys.setswitchinterval(switch_interval_s)
        self._thread = threading.Thread(target=self._serve, name="fnx-ple-ring", daemon=True)
        self._thread.start()

    @property
    def device_path(self) -> bool:
        return self._block is not None

    # -- the control block ---------------------------------------------------------------------------------------

    def _setup_block(self, device, emulate):
        """The control block: page-locked (a jax pinned_host buffer) on a CUDA device, else (emulation, or a host
        that cannot run the kernels: then only `rows` / `fetch` work, and tracing the handle raises) anonymous
        memory."""
        nbytes = layout.total_bytes(self.max_ids, self.src.row_bytes)
        self._block = None
        device = None if emulate else _cuda_device(device)
        if device is None:
            self._addr = lx.map_anonymous(nbytes)
        else:
            import jax
            from jax.sharding import SingleDeviceSharding
            self._block = jax.device_put(np.zeros(nbytes // 4, np.uint32),
                                         SingleDeviceSharding(device, memory_kind="pinned_host"))
            self._block.block_until_ready()
            self._addr = self._block.unsafe_buffer_pointer()
        self._nbytes = nbytes
        self._mem = lx.view(self._addr, nbytes, writable=True)
        self._mem[:] = 0
        w = self._mem.view(np.uint32)
        self._done = w[layout.DONE // 4:layout.DONE // 4 + 1]
        self._abandoned = w[layout.ABANDONED // 4:layout.ABANDONED // 4 + 1]
        self._header = self._mem[layout.HEADER:layout.HEADER + 8].view(np.uint64)
        self._pairs = self._mem[layout.PAIRS:layout.PAIRS + 8 * self.max_ids].view(np.uint64)
        ro = layout.rows_offset(self.max_ids)
        self._ring = self._mem[ro:ro + self.max_ids * self.src.row_bytes].reshape(self.max_ids, self.src.row_bytes)
        self._lo, self._hi = address_halves([self._addr])

    def _setup_fast_copy(self, serve):
        """With a pageable backing: each request checked and its rows copied straight from the page cache into the
        ring by one C call (`fnx_ring_serve`: preadv2 RWF_NOWAIT per row, no fault possible); rows not cached go
        the backing store's guarded way (WILLNEED, POPULATE_READ, its deadline)."""
        self._serve_c = None
        maps = getattr(self.host, "_maps", None)
        if serve is None or not maps:
            return
        self._serve_c = serve
        self._ext_fd = np.asarray([maps[e.path][0] for e in self.src.extents], np.int32)
        self._ext_off = np.asarray([e.offset for e in self.src.extents], np.int64)
        self._ext_start = np.asarray(self.host._starts, np.int64)
        self._ids_buf = np.zeros(self.max_ids, np.int64)
        self._status_buf = np.zeros(self.max_ids, np.int32)
        self._stats.extra.update(ring_cached_rows=0, ring_uncached_rows=0)

    def _serve_cached(self, seq: int, n: int):
        """One C call: -1 (a pair without this seq yet), -2 (an id past the table) or (ids [n], positions of the
        rows the page cache lacked)."""
        got = self._serve_c(self._addr + layout.PAIRS, n, seq, self.src.rows, len(self._ext_start),
                            self._ext_start.ctypes.data, self._ext_fd.ctypes.data, self._ext_off.ctypes.data,
                            self._addr + layout.rows_offset(self.max_ids), self.src.row_bytes,
                            self._ids_buf.ctypes.data, self._status_buf.ctypes.data)
        if got < 0:
            return got
        status = self._status_buf[:n]
        at = np.flatnonzero(status) if got else np.zeros(0, np.intp)
        if got:
            odd = set(np.unique(status[at]).tolist()) - {errno.EAGAIN}
            if odd & {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}:
                self._serve_c = None
                lx.log_once("ring-nowait", logging.WARNING, "fnx.ple: this kernel refuses page-cache-only reads "
                            "(preadv2 RWF_NOWAIT: errno %s); ring mode reads every row the backing store's way",
                            sorted(odd))
        return self._ids_buf[:n].copy(), at

    # -- the host thread ----------------------------------------------------------------------------------------

    def _wait_header(self, last: int, busy: bool = True) -> int:
        """The header's seq once it differs from `last` (or `last` after ~100 ms, to check for close). busy: the
        last request was within ~100 ms (spin, then poll every 20 us), else idle (poll every 500 us). Without the
        compiled poller the Python loop yields between reads when busy and sleeps 500 us between them when idle."""
        if self._poll is not None:
            spin, fast = (self.spin_ns, 100_000_000) if busy else (0, 0)
            return int(self._poll(self._addr + layout.HEADER, last, spin, fast, 100_000_000))
        pause = 0.0 if busy else 0.0005
        end = time.perf_counter() + 0.1
        while time.perf_counter() < end:
            v = int(self._header[0]) & 0xFFFFFFFF
            if v != last:
                return v
            time.sleep(pause)
        return last

    def _serve(self):
        last, busy = 0, True
        while not self._stop.is_set():
            seq = self._wait_header(last, busy)
            busy = seq != last
            if not busy:
                continue
            start = time.perf_counter()
            try:
                n = self._serve_one(seq, start)
            except Exception as exc:  # noqa: BLE001 - the thread must answer every request, whatever failed
                log.exception("fnx.ple: ring request %d failed", seq)
                self._ring[:] = 0
                self._record_failure(PleFetchError(f"PLE ring request {seq} failed on the host: {exc}"), 0, 0)
                n = 0
            self._done[0] = seq                      # after the rows: x86 stores are seen in order
            last = seq
            dt = time.perf_counter() - start
            with self._lock:
                x = self._stats.extra
                x["ring_requests"] += 1
                x["ring_rows"] += n
                x["ring_serve_seconds"] += dt
                x["ring_max_serve_seconds"] = max(x["ring_max_serve_seconds"], dt)

    def _serve_one(self, seq: int, start: float) -> int:
        n = int(self._header[0]) >> 32
        if not 0 < n <= self.max_ids:
            raise PleFetchError(f"request {seq} names {n} row ids (the ring holds {self.max_ids})")
        deadline = self.deadline_s if self.deadline_s is not None else self.gpu_timeout_s
        fast = self._serve_c is not None
        while True:                                  # every pair carries this request's seq once written
            if fast:
                got = self._serve_cached(seq, n)
                if got == -2:
                    raise PleFetchError(f"request {seq} names a row past the {self.src.rows}-row table")
                if got != -1:
                    flat, at = got
                    break
            else:
                pairs = self._pairs[:n].copy()
                if ((pairs & np.uint64(0xFFFFFFFF)) == np.uint64(seq)).all():
                    flat, at = (pairs >> np.uint64(32)).astype(np.int64), None
                    if flat.max() >= self.src.rows:
                        raise PleFetchError(f"request {seq} names row {int(flat.max())} of a "
                                            f"{self.src.rows}-row table")
                    break
            if time.perf_counter() - start > deadline:
                with self._lock:
                    self._stats.extra["ring_torn"] += 1
                self._ring[:n] = 0
                self._record_failure(PleFetchError(f"PLE ring request {seq}: its row ids were not all written "
                                                   f"within {deadline * 1e3:.0f} ms; zero rows were used"), n, 0)
                return n
            time.sleep(0)
        cached = 0 if at is None else n - len(at)
        unique = 0
        if at is None or len(at):
            slow = flat if at is None else flat[at]
            uniq, inv, raw, ok, error = self._fetch_raw(slow, self.deadline_s)
            unique = len(uniq)
            if at is None:
                self._ring[:n] = raw[inv]
            else:
                self._ring[at] = raw[inv]
            if not ok.all():
                self._record_failure(error, int((~ok).sum()), 0)
        with self._lock:
            s = self._stats
            s.fetches += 1
            s.rows_requested += n
            s.rows_unique += unique                   # the rows read the guarded way (after dedup)
            if at is not None:
                s.extra["ring_cached_rows"] += cached
                s.extra["ring_uncached_rows"] += n - cached
        return n

    def rows_device(self, ids):
        """ids [..., heads] -> [..., heads * width] out_dtype, through the ring in one jitted program (post, then
        wait): the device path's latency with the host's dispatch."""
        import jax
        import jax.numpy as jnp
        if self._jit is None:
            self._jit = jax.jit(RingTable.gather)
        return self._jit(self.table, jnp.asarray(ids, jnp.int32))

    # -- RowStore ------------------------------------------------------------------------------------------------

    def _gather(self, uniq):
        return self.host._gather(uniq)

    def _prefetch(self, uniq):
        self.host._prefetch(uniq)

    def evict(self, ids=None) -> None:
        self.host.evict(ids)

    def _surface_pending(self):
        self._note_abandoned()
        super()._surface_pending()

    def consume_pending(self):
        self._note_abandoned()
        return super().consume_pending()

    def _note_abandoned(self):
        """A request the GPU stopped waiting for becomes this store's pending error."""
        a = int(self._abandoned[0])
        if a != self._last_abandoned:
            self._last_abandoned = a
            with self._lock:
                self._stats.extra["ring_abandoned"] += 1
            self._record_failure(PleFetchError(f"the GPU waited {self.gpu_timeout_s:.3g} s for the PLE rows of ring "
                                               f"request {a} and used zero rows"), 0, 0)

    def _close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.host.close()
        if self._block is not None:
            self._block.delete()
        else:
            lx.unmap(self._addr, self._nbytes)

    # -- the device side in emulation (CPU tests): what the kernels do, as host callbacks ----------------------

    def _emu_post(self, ids):
        w = self._mem.view(np.uint32)
        done, aband = int(w[layout.DONE // 4]), int(w[layout.ABANDONED // 4])
        diff = (aband - done) & 0xFFFFFFFF          # the later of the two, wrap-safe (as the kernel's int32 a - b)
        seq = ((aband if 0 < diff < 2**31 else done) + 1) & 0xFFFFFFFF
        ids = np.asarray(ids).reshape(-1).astype(np.uint64)
        self._emu_pairs(seq, ids)
        self._header[0] = np.uint64(seq) | (np.uint64(len(ids)) << np.uint64(32))   # published after the pairs
        return np.full((1,), np.uint32(seq).view(np.int32), np.int32)

    def _emu_pairs(self, seq: int, ids):
        """The post kernel's pair stores (seq | id << 32), before it publishes the header."""
        self._pairs[:len(ids)] = np.uint64(seq) | (ids << np.uint64(32))

    def _emu_wait(self, ticket, n: int):
        seq = int(np.asarray(ticket).reshape(-1)[0]) & 0xFFFFFFFF
        end = time.perf_counter() + self.gpu_timeout_s
        while int(self._done[0]) != seq:
            if time.perf_counter() > end:
                self._abandoned[0] = seq
                return (np.zeros((n, self.src.row_bytes // 4), np.uint32), np.zeros((n,), np.int32))
            time.sleep(20e-6)
        return self._ring[:n].copy().view(np.uint32), np.ones((n,), np.int32)


def _cuda_device(device):
    """`device` (default: the first) when it is a CUDA GPU with pinned_host memory and the kernels can run, else
    None."""
    import jax
    from fnx.pallas.dispatch import why_unavailable
    device = device or jax.devices()[0]
    kinds = [m.kind for m in device.addressable_memories()] if hasattr(device, "addressable_memories") else []
    if device.platform != "gpu" or "pinned_host" not in kinds or why_unavailable("pallas"):
        return None
    return device


class RingTable:
    """The device-side handle of a `RingStore` (a jax pytree: lo / hi [1] uint32, the control block's address;
    timeout_us [1] int32; scale or None). `post(ids)` at the start of a step, `wait(ticket, dep)` where the rows
    are needed (after `dep`), or `gather(ids)` for both at once; all run inside any jit."""

    def __init__(self, lo, hi, timeout_us, scale, *, row_bytes: int, width: int, dtype: str, out_dtype: str,
                 max_ids: int, impl: str | None = None, store=None):
        self.lo, self.hi, self.timeout_us, self.scale = lo, hi, timeout_us, scale
        self.row_bytes, self.width, self.dtype, self.out_dtype = row_bytes, width, dtype, out_dtype
        self.max_ids, self.impl, self.store = max_ids, impl, store

    def _aux(self):
        return (self.row_bytes, self.width, self.dtype, self.out_dtype, self.max_ids, self.impl, self.store)

    @property
    def shape(self) -> tuple[int, int]:
        return (-1, self.width)

    def post(self, ids) -> "RingTicket":
        """ids [..., heads] -> a ticket for `wait` (the ids handed to the host thread)."""
        import jax
        import jax.numpy as jnp
        from jax.experimental import io_callback
        flat = ids.reshape(-1).astype(jnp.int32)
        if flat.shape[0] > self.max_ids:
            raise ValueError(f"ple ring: a step of {flat.shape[0]} row ids ({tuple(ids.shape)}) exceeds the ring's "
                             f"max_ids={self.max_ids}; open the store with a larger max_ids or prefill in smaller "
                             "chunks")
        if self.impl == "callback":
            t = io_callback(self.store._emu_post, jax.ShapeDtypeStruct((1,), jnp.int32), flat,
                                             ordered=True)
        else:
            from fnx.pallas.ple_ring import api
            t = api.post(flat, self.lo, self.hi, impl=self.impl)
        return RingTicket(t, tuple(ids.shape))

    def wait(self, ticket: "RingTicket", dep=None):
        """-> rows [..., heads * width] out_dtype (zero where the GPU's deadline passed), after `dep`."""
        import jax
        import jax.numpy as jnp
        from jax.experimental import io_callback
        n = int(np.prod(ticket.shape))
        if self.impl == "callback":
            words, _ = io_callback(
                lambda t: self.store._emu_wait(t, n),
                (jax.ShapeDtypeStruct((n, self.row_bytes // 4), jnp.uint32), jax.ShapeDtypeStruct((n,), jnp.int32)),
                ticket.seq, ordered=True)
        else:
            from fnx.pallas.ple_ring import api
            dep = ticket.seq if dep is None else dep
            words, _ = api.wait(ticket.seq, self.lo, self.hi, self.timeout_us, dep, n, self.row_bytes, self.max_ids,
                                impl=self.impl)
        return rows_from_words(words, ticket.shape, self.row_bytes, self.width, self.dtype, self.scale,
                               self.out_dtype)

    def gather(self, ids):
        return self.wait(self.post(ids))


class RingTicket:
    """A posted request inside one trace: seq (the kernel's ticket array) and the ids' shape."""

    def __init__(self, seq, shape):
        self.seq, self.shape = seq, shape


def _flatten(t: RingTable):
    return (t.lo, t.hi, t.timeout_us, t.scale), t._aux()


def _unflatten(aux, children):
    row_bytes, width, dtype, out_dtype, max_ids, impl, store = aux
    return RingTable(*children, row_bytes=row_bytes, width=width, dtype=dtype, out_dtype=out_dtype, max_ids=max_ids,
                     impl=impl, store=store)


_REGISTERED = []


def _register():
    if not _REGISTERED:
        import jax
        jax.tree_util.register_pytree_node(RingTable, _flatten, _unflatten)
        _REGISTERED.append(True)


if sys.byteorder != "little":   # the pairs are read as little-endian uint64
    raise ImportError("fnx.ple.ring assumes a little-endian host")
