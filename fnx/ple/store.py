"""The PLE row store: one interface over the n-gram table wherever it lives.

    store = open_store(checkpoint_dir, "pageable")          # or a raw row file from convert_to_raw
    rows = store.rows(ids)            # ids [N, heads] int -> [N, heads * width] bf16, in head order
    store.prefetch(ids)               # advisory: start the reads, return at once
    fetch = store.fetch(ids)          # rows + which tokens were zero-filled + the error, if any
    store.close()

Modes (same rows for the same ids, bit for bit):

| mode | where the table is | per fetch |
|---|---|---|
| `device` | one jax array on the default device (FP8/BF16 bytes as stored) | gather + dequantize in a jitted function |
| `pinned` | jax arrays with memory_kind `pinned_host` (page-locked host memory the GPU can DMA from; on the CPU backend plain host memory), gathered on the host through zero-copy views | NumPy gather |
| `pageable` | read-only shared mmap of the checkpoint's safetensors files or of a raw row file, `MADV_RANDOM` | `process_madvise(MADV_WILLNEED)` then `MADV_POPULATE_READ` on the pages, then a NumPy gather |
| `swap` | a private anonymous copy (`MAP_NORESERVE`, `MADV_NOHUGEPAGE`) the kernel may swap out | same as `pageable` |
| `direct` | the files, read with O_DIRECT `preadv` of 4 KiB-aligned blocks by a thread pool (no page cache) | aligned reads |
| `ring` | where its backing host mode keeps it (`pageable` by default: evictable, swappable) | in the step: a kernel posts the ids to a page-locked control block, a host thread of the store copies the rows into a small pinned ring while the first layers run, a kernel at the PLE layer waits for them (`fnx.ple.ring`) |
| `uva` | as `pinned`, plus a `UvaTable` handle for the params: a CUDA kernel reads the rows from the pinned memory at their host addresses inside the jitted step (the fastest host mode on the H200: +0.08 ms per MTP round against `device`) | on the GPU, in the step; `rows` as `pinned` |

FP8 rows are dequantized as the reference does, `bf16(row).to(scale.dtype) * scale`, then cast to `out_dtype`.

Failures: a fetch that passes its deadline (`deadline_s`) or hits unreadable pages / short reads zero-fills
the rows it could not read and reports them in `Fetch.missing`; the `missing_rows`/`deadline_misses`/`io_errors`
counters move; the error is raised by the *next* call under `policy="fail"`, or logged once and kept in
`last_error` under `policy="degrade"`. Pages are touched only after `MADV_POPULATE_READ` succeeded on them (or,
on kernels without it, after a size check of the file), so a truncated or failing file gives zero rows and an
error, not SIGBUS. Start-up validation (`fnx.ple.table.validate`) checks shapes, dtype, scale, stored hash
constants and a content fingerprint before any mode reads a row."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from fnx.ple import _linux as lx
from fnx.ple.ngram import NgramConstants
from fnx.ple.table import TableError, TableSource, open_source, validate

log = logging.getLogger("fnx.ple")

MODES = ("device", "pinned", "pageable", "swap", "direct", "uva", "ring")
POLICIES = ("fail", "degrade")


class PleFetchError(RuntimeError):
    """An earlier fetch zero-filled rows (deadline passed or pages unreadable)."""


@dataclass
class Fetch:
    rows: np.ndarray  # [N, heads * width] out_dtype; zero where missing
    missing: np.ndarray  # [N] bool: at least one of this token's rows was zero-filled
    error: BaseException | None = None


@dataclass
class StoreStats:
    fetches: int = 0
    rows_requested: int = 0
    rows_unique: int = 0
    missing_rows: int = 0  # unique table rows zero-filled
    flagged_tokens: int = 0  # ids rows (tokens) with at least one zero-filled table row
    deadline_misses: int = 0
    io_errors: int = 0
    prefetch_calls: int = 0
    prefetch_ranges: int = 0
    advise_syscalls: int = 0
    # where a mapped store's fetch time goes: MADV_WILLNEED, MADV_POPULATE_READ (page faults, and the reads of
    # pages not in the page cache), and the copy out of the mapping
    willneed_seconds: float = 0.0
    populate_seconds: float = 0.0
    copy_seconds: float = 0.0
    fetch_seconds: float = 0.0
    max_fetch_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


class RowStore:
    """Base class: id checks, dedup, dequantization, deadlines, counters. Modes implement `_gather`."""

    mode = "abstract"

    def __init__(self, src: TableSource, consts: NgramConstants | None = None, *, out_dtype=ml_dtypes.bfloat16,
                 policy: str = "fail", deadline_s: float | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"deadline_s must be positive or None, got {deadline_s}")
        if not src.fingerprint:
            validate(src, consts)
        self.src, self.consts = src, consts
        self.heads = consts.num_heads if consts is not None else None
        self.width = src.width
        self.out_dtype = np.dtype(out_dtype)
        self.policy, self.deadline_s = policy, deadline_s
        self.fingerprint = src.fingerprint
        self.last_error: BaseException | None = None
        self._pending: BaseException | None = None
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._closed = False
        if src.dtype == "F8_E4M3":
            # The product depends only on the byte: a 256-entry table is the whole dequantization.
            codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
            lut = codes.astype(ml_dtypes.bfloat16).astype(src.scale.dtype) * src.scale
            self._lut = lut.astype(self.out_dtype)
            # Two bytes at a time: a 65,536-entry table of output pairs (256 KiB for 16-bit outputs) halves the
            # lookups; np.take on it is ~3x faster than indexing the 256-entry table (a decode fetch's rows: 26 ->
            # 7 us on the CPU VM).
            self._lut2 = None
            if self.out_dtype.itemsize == 2 and src.row_bytes % 2 == 0 and sys.byteorder == "little":
                l16 = self._lut.view(np.uint16).astype(np.uint32)
                i = np.arange(65536, dtype=np.uint32)
                self._lut2 = l16[i & 255] | (l16[i >> 8] << 16)
        else:
            self._lut = self._lut2 = None

    # -- public API ------------------------------------------------------------------------------------------

    def rows(self, ids) -> np.ndarray:
        """ids [N, heads] int32/int64 -> [N, heads * width] out_dtype (zero-filled rows under the policy)."""
        return self.fetch(ids).rows

    def fetch(self, ids, deadline_s: float | None = ..., *, surface: bool = True) -> Fetch:
        """surface=False leaves an earlier failure pending (for host callbacks, which must not raise); the
        caller then calls `check()` outside the jitted step."""
        self._check_open()
        if surface:
            self._surface_pending()
        flat, n_tok, heads = self._check_ids(ids)
        deadline_s = self.deadline_s if deadline_s is ... else deadline_s
        start = time.perf_counter()
        uniq, inv, raw, ok, error = self._fetch_raw(flat, deadline_s)
        out = self._dequantize(raw)[inv].reshape(n_tok, heads * self.width)
        missing = np.zeros(n_tok, dtype=bool)
        if not ok.all():
            bad = ~ok[inv].reshape(n_tok, heads)
            missing = bad.any(axis=1)
            out.reshape(n_tok, heads, self.width)[bad] = 0
            self._record_failure(error, int((~ok).sum()), int(missing.sum()))
        dt = time.perf_counter() - start
        with self._lock:
            s = self._stats
            s.fetches += 1
            s.rows_requested += flat.size
            s.rows_unique += len(uniq)
            s.fetch_seconds += dt
            s.max_fetch_seconds = max(s.max_fetch_seconds, dt)
        return Fetch(out, missing, error)

    def _fetch_raw(self, flat: np.ndarray, deadline_s: float | None):
        """flat [n] int64 ids -> (uniq, inv, raw [len(uniq), row_bytes] uint8, ok [len(uniq)] bool, error): the
        stored bytes of the unique rows, read under the deadline (the rows it leaves unread are zero, ok False)."""
        uniq, inv = _unique_inverse(flat)
        error = None
        if deadline_s is None:
            raw, ok, error = self._gather_guarded(uniq)
        else:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"fnx-ple-{self.mode}")
            fut = self._pool.submit(self._gather_guarded, uniq)
            try:
                raw, ok, error = fut.result(timeout=deadline_s)
            except cf.TimeoutError:
                raw = np.zeros((len(uniq), self.src.row_bytes), np.uint8)
                ok = np.zeros(len(uniq), dtype=bool)
                error = PleFetchError(f"PLE {self.mode} fetch of {len(uniq)} rows passed its {deadline_s * 1e3:.1f} "
                                      "ms deadline; the rows were zero-filled")
                with self._lock:
                    self._stats.deadline_misses += 1
        return uniq, inv, raw, ok, error

    def prefetch(self, ids) -> None:
        """Advisory: start bringing these rows closer (never raises for I/O; errors show up in the fetch)."""
        self._check_open()
        flat, _, _ = self._check_ids(ids)
        uniq = _unique_inverse(flat)[0]           # Python ints for a decode step's few ids, np.unique beyond
        with self._lock:
            self._stats.prefetch_calls += 1
        self._prefetch(uniq)

    def check(self) -> None:
        """Raise (policy fail) or log once (policy degrade) a failure left by an earlier fetch."""
        self._surface_pending()

    def consume_pending(self) -> BaseException | None:
        """Return and clear a failure an earlier fetch left pending, without raising: for a caller that handles
        the failure itself (the engine ends the affected requests). Under policy degrade it is logged once, as
        `check()` does."""
        with self._lock:
            err, self._pending = self._pending, None
        if err is not None and self.policy != "fail":
            lx.log_once(f"degrade-{self.mode}", logging.WARNING,
                        "fnx.ple: %s store is degraded (policy=degrade): %s; continuing with zero rows where reads "
                        "fail (see store.stats and store.last_error)", self.mode, err)
        return err

    @property
    def device_path(self) -> bool:
        """Whether a jitted program on this machine takes this store's rows itself (no host fetch in the step):
        `uva` when its gather kernel runs here, `ring` when its page-locked control block exists (a CUDA device).
        False for every host mode and under emulation."""
        return False

    @property
    def stats(self) -> dict:
        with self._lock:
            d = dict(self._stats.__dict__)
        d.update(d.pop("extra"))
        d["mode"], d["policy"] = self.mode, self.policy
        return d

    def evict(self, ids=None) -> None:
        """Drop this store's cached pages so the next fetch is cold (benchmarks). Modes without a cache no-op.
        ids [N, heads]: only the pages of these rows where the mode can (pageable); others drop everything."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<fnx.ple {self.mode} store: {self.src.describe()}, fingerprint {self.fingerprint}>"

    # -- shared helpers ----------------------------------------------------------------------------------------

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"the PLE {self.mode} store is closed")

    def _check_ids(self, ids):
        arr = np.asarray(ids)
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"ids must be integers, got dtype {arr.dtype}")
        if arr.ndim != 2 or (self.heads is not None and arr.shape[1] != self.heads):
            want = self.heads if self.heads is not None else "heads"
            raise ValueError(f"ids must be shaped [N, {want}], got {arr.shape}")
        flat = arr.reshape(-1).astype(np.int64, copy=False)
        if flat.size and (flat.min() < 0 or flat.max() >= self.src.rows):
            raise ValueError(f"ids must lie in [0, {self.src.rows}), got [{flat.min()}, {flat.max()}]")
        return flat, arr.shape[0], arr.shape[1]

    def _surface_pending(self):
        err, self._pending = self._pending, None
        if err is None:
            return
        if self.policy == "fail":
            raise PleFetchError(f"an earlier PLE fetch failed: {err}") from err
        lx.log_once(f"degrade-{self.mode}", logging.WARNING,
                    "fnx.ple: %s store is degraded (policy=degrade): %s; continuing with zero rows where reads fail "
                    "(see store.stats and store.last_error)", self.mode, err)

    def _record_failure(self, error, n_rows, n_tokens):
        if error is None:
            error = PleFetchError(f"{n_rows} PLE rows could not be read")
        with self._lock:
            self._stats.missing_rows += n_rows
            self._stats.flagged_tokens += n_tokens
            self.last_error = error
            self._pending = error

    def _gather_guarded(self, uniq):
        try:
            raw, ok = self._gather(uniq)
            err = None if ok.all() else PleFetchError(
                f"{int((~ok).sum())} of {len(uniq)} PLE rows were unreadable in {self.mode} mode "
                f"(first row {int(uniq[~ok][0])}); they were zero-filled")
            if err is not None:
                with self._lock:
                    self._stats.io_errors += 1
            return raw, ok, err
        except OSError as exc:
            with self._lock:
                self._stats.io_errors += 1
            return (np.zeros((len(uniq), self.src.row_bytes), np.uint8), np.zeros(len(uniq), bool),
                    PleFetchError(f"PLE {self.mode} read failed: {exc}"))

    def _dequantize(self, raw: np.ndarray) -> np.ndarray:
        """raw [n, row_bytes] uint8 -> [n, width] out_dtype."""
        if self._lut2 is not None:
            return np.take(self._lut2, np.ascontiguousarray(raw).view(np.uint16)).view(self.out_dtype)
        if self._lut is not None:
            return np.take(self._lut, raw)
        return raw.view(self.src.np_dtype).astype(self.out_dtype)

    # -- per mode ----------------------------------------------------------------------------------------------

    def _gather(self, uniq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """uniq [n] sorted unique rows -> (raw [n, row_bytes] uint8, ok [n] bool)."""
        raise NotImplementedError

    def _prefetch(self, uniq: np.ndarray) -> None:
        """Modes whose rows are already in memory have nothing to start."""

    def _close(self) -> None:
        pass


# Up to this many ids, a fetch's unique rows are found with Python ints: NumPy's unique costs ~13 us of call
# overhead for a decode step's 16-80 ids (CPU VM), the set and sort ~3 us.
SMALL_UNIQUE = 128


def _unique_inverse(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(flat, return_inverse=True) for an int64 vector: (sorted unique values, index of each input)."""
    if flat.size > SMALL_UNIQUE:
        uniq, inv = np.unique(flat, return_inverse=True)
        return uniq, inv.reshape(-1)
    vals = flat.tolist()
    order = sorted(set(vals))
    slot = {v: i for i, v in enumerate(order)}
    return np.array(order, dtype=np.int64), np.array([slot[v] for v in vals], dtype=np.intp)


def _extent_starts(src: TableSource) -> np.ndarray:
    return np.cumsum([0] + [e.rows for e in src.extents[:-1]], dtype=np.int64)


class _MappedStore(RowStore):
    """Rows in one or more address ranges (one per extent), gathered with NumPy."""

    guard = False  # populate-read pages before touching them (file- or swap-backed memory)

    def _setup_views(self, addrs: list[int], extents=None):
        rb = self.src.row_bytes
        extents = extents or self.src.extents
        self._addrs = np.asarray(addrs, dtype=np.int64)
        self._views = [lx.view(a, e.rows * rb).reshape(e.rows, rb) for a, e in zip(addrs, extents)]
        self._starts = np.cumsum([0] + [e.rows for e in extents[:-1]], dtype=np.int64)
        self._advisor = lx.Advisor() if self.guard else None
        self._populate = True
        if self.guard:
            try:
                lx.madvise(addrs[0] // lx.PAGE * lx.PAGE, lx.PAGE, lx.MADV_POPULATE_READ)
            except OSError as exc:
                self._populate = False
                lx.log_once("populate_read", logging.WARNING,
                            "fnx.ple: MADV_POPULATE_READ is unavailable (%s; needs Linux 5.14); %s mode guards reads "
                            "with a file-size check only, so an I/O error on the device can still raise SIGBUS",
                            exc, self.mode)

    def _locate(self, uniq):
        idx = np.searchsorted(self._starts, uniq, side="right") - 1
        return idx, uniq - self._starts[idx]

    def _addresses(self, idx, local):
        return self._addrs[idx] + local * self.src.row_bytes

    def _size_ok(self, idx, local) -> np.ndarray:
        return np.ones(len(idx), dtype=bool)

    def _gather(self, uniq):
        idx, local = self._locate(uniq)
        ok = np.ones(len(uniq), dtype=bool)
        t0 = t1 = t2 = time.perf_counter()
        if self.guard:
            iov, which = lx.page_ranges(0, self._addresses(idx, local), self.src.row_bytes)
            # the range lengths' sum, for both calls (one batch: a decode step's few ranges, in Python ints)
            total = sum(iov[:, 1].tolist()) if len(iov) <= self._advisor.batch else None
            self._advisor.advise(iov, lx.MADV_WILLNEED, total)  # start every read; failures show up below
            t1 = time.perf_counter()
            if self._populate:
                ok = ~self._advisor.advise(iov, lx.MADV_POPULATE_READ, total)[which]
            else:
                ok = self._size_ok(idx, local)
            t2 = time.perf_counter()
        if len(self._views) == 1 and ok.all():      # the common case: one copy, no zero fill
            raw = self._views[0][local]
        elif len(self._views) == 1:
            raw = np.zeros((len(uniq), self.src.row_bytes), dtype=np.uint8)
            sel = np.flatnonzero(ok)
            raw[sel] = self._views[0][local[sel]]
        else:
            raw = np.zeros((len(uniq), self.src.row_bytes), dtype=np.uint8)
            for e in np.unique(idx[ok]).tolist():
                sel = np.flatnonzero((idx == e) & ok)
                raw[sel] = self._views[e][local[sel]]
        t3 = time.perf_counter()
        with self._lock:
            st = self._stats
            st.willneed_seconds += t1 - t0
            st.populate_seconds += t2 - t1
            st.copy_seconds += t3 - t2
            if self.guard:
                st.advise_syscalls = self._advisor.syscalls
        return raw, ok

    def resident_fraction(self, sample: int = 4096, seed: int = 0) -> float:
        """The fraction of `sample` random rows whose first page is in memory (mincore): how warm the page cache
        is for this table, without touching it."""
        rng = np.random.default_rng(seed)
        rows = rng.integers(0, self.src.rows, size=min(sample, self.src.rows))
        idx, local = self._locate(np.sort(rows))
        addr = self._addresses(idx, local) // lx.PAGE * lx.PAGE
        return float(np.mean([lx.resident(int(a), lx.PAGE)[0] for a in addr]))

    def _prefetch(self, uniq):
        if not self.guard:
            return
        idx, local = self._locate(uniq)
        iov, _ = lx.page_ranges(0, self._addresses(idx, local), self.src.row_bytes)
        self._advisor.advise(iov, lx.MADV_WILLNEED)
        with self._lock:
            self._stats.prefetch_ranges += len(iov)
            self._stats.advise_syscalls = self._advisor.syscalls

    def _close(self):
        self._views = []
        if self._advisor is not None:
            self._advisor.close()


class PageableStore(_MappedStore):
    """Read-only shared mmap of the table's files (page cache; nothing loaded up front)."""

    mode = "pageable"
    guard = True

    def __init__(self, src, consts=None, **kw):
        super().__init__(src, consts, **kw)
        self._maps = {}  # path -> (fd, addr, size)
        try:
            for path in src.paths:
                fd = os.open(path, os.O_RDONLY)
                size = os.fstat(fd).st_size
                self._maps[path] = (fd, lx.map_file(fd, size), size)
                lx.madvise(self._maps[path][1], size, lx.MADV_RANDOM)
                try:
                    lx.fadvise(fd, 0, 0, lx.POSIX_FADV_RANDOM)
                except OSError:
                    pass
            for e in src.extents:  # the validation checked this too; the mapping must cover every row
                if e.offset + e.rows * src.row_bytes > self._maps[e.path][2]:
                    raise TableError(f"{e.path}: shorter than its table rows; the file is truncated")
            self._setup_views([self._maps[e.path][1] + e.offset for e in src.extents])
        except BaseException:
            self._unmap()
            raise

    def _size_ok(self, idx, local):
        # Without MADV_POPULATE_READ: refuse rows past the file's current end (truncation after open).
        ok = np.ones(len(idx), dtype=bool)
        for path, (fd, _, _) in self._maps.items():
            size = os.fstat(fd).st_size
            for e_i, e in enumerate(self.src.extents):
                if e.path == path:
                    sel = idx == e_i
                    ok[sel] &= e.offset + (local[sel] + 1) * self.src.row_bytes <= size
        return ok

    def evict(self, ids=None):
        if ids is None:
            for fd, addr, size in self._maps.values():
                lx.madvise(addr, size, lx.MADV_DONTNEED)  # drop our page-table entries
                lx.fadvise(fd, 0, 0, lx.POSIX_FADV_DONTNEED)  # then the (clean) page-cache pages
            return
        # only these rows' pages: a whole 51 GB table takes seconds to walk, a decode step's rows microseconds
        flat, _, _ = self._check_ids(ids)
        idx, local = self._locate(np.unique(flat))
        rb = self.src.row_bytes
        ranges = []
        for e_i in np.unique(idx).tolist():
            e = self.src.extents[e_i]
            fd, base, _ = self._maps[e.path]
            iov, _ = lx.page_ranges(base, e.offset + local[idx == e_i] * rb, rb)
            ranges += [(fd, base, addr, length) for addr, length in iov.tolist()]
        for _, _, addr, length in ranges:       # every mapping dropped first: the page cache frees only
            lx.madvise(addr, length, lx.MADV_DONTNEED)   # pages no page table holds any more
        for fd, base, addr, length in ranges:
            lx.fadvise(fd, addr - base, length, lx.POSIX_FADV_DONTNEED)

    def _unmap(self):
        for fd, addr, size in self._maps.values():
            lx.unmap(addr, size)
            os.close(fd)
        self._maps = {}

    def _close(self):
        super()._close()
        self._unmap()


class SwapStore(_MappedStore):
    """The table copied into private anonymous memory (`MAP_NORESERVE`): the kernel may swap it out, and
    `MADV_WILLNEED` then starts the swap-ins of a fetch in parallel."""

    mode = "swap"
    guard = True

    def __init__(self, src, consts=None, *, check_memory: bool = True, **kw):
        super().__init__(src, consts, **kw)
        info = lx.meminfo()
        room = info.get("MemAvailable", 0) + info.get("SwapFree", 0)
        if check_memory and info and room < src.nbytes:
            raise TableError(f"swap mode needs {src.nbytes / 2**30:.1f} GiB of RAM + free swap for the table; this "
                             f"host has {room / 2**30:.1f} GiB (MemAvailable + SwapFree). Use pageable mode, or add "
                             "swap")
        if not info.get("SwapTotal"):
            lx.log_once("no-swap", logging.WARNING, "fnx.ple: swap mode on a host without swap: the table stays "
                        "resident in RAM (nothing can be paged out)")
        self._size = -(-src.nbytes // lx.PAGE) * lx.PAGE
        self._addr = lx.map_anonymous(self._size)
        try:
            lx.madvise(self._addr, self._size, lx.MADV_NOHUGEPAGE)
            mem = lx.view(self._addr, self._size, writable=True)
            pos = 0
            for e in src.extents:
                fd = os.open(e.path, os.O_RDONLY)
                try:
                    todo, off = e.rows * src.row_bytes, e.offset
                    while todo:
                        n = os.preadv(fd, [memoryview(mem[pos:pos + min(todo, 64 << 20)])], off)
                        if n <= 0:
                            raise TableError(f"{e.path}: unexpected end of file at byte {off}")
                        pos, off, todo = pos + n, off + n, todo - n
                finally:
                    os.close(fd)
            del mem
            lx.madvise(self._addr, self._size, lx.MADV_RANDOM)
            rb = src.row_bytes
            starts = _extent_starts(src)
            self._setup_views([self._addr + int(s) * rb for s in starts])
        except BaseException:
            lx.unmap(self._addr, self._size)
            raise

    def evict(self, ids=None):
        try:
            lx.madvise(self._addr, self._size, lx.MADV_PAGEOUT)  # only has an effect with swap
        except OSError as exc:
            lx.log_once("pageout", logging.WARNING, "fnx.ple: MADV_PAGEOUT failed (%s); swap store stays resident",
                        exc)

    def _close(self):
        super()._close()
        lx.unmap(self._addr, self._size)


class PinnedStore(_MappedStore):
    """The table in jax `pinned_host` memory, gathered on the host through zero-copy views of those buffers.

    On a GPU this memory is page-locked: it cannot swap, counts fully against RAM, and the device can DMA from it
    (the basis of a future UVA gather kernel). On the CPU backend `pinned_host` is ordinary host memory."""

    mode = "pinned"
    chunk_bytes = 1 << 30

    def __init__(self, src, consts=None, *, device=None, check_memory: bool = True, **kw):
        super().__init__(src, consts, **kw)
        import jax
        from jax.sharding import SingleDeviceSharding
        device = device or jax.devices()[0]
        kinds = [m.kind for m in device.addressable_memories()] if hasattr(device, "addressable_memories") else []
        if "pinned_host" not in kinds:
            raise TableError(f"pinned mode needs a jax device with a 'pinned_host' memory; {device} has {kinds}. "
                             "Use pageable or device mode")
        info = lx.meminfo()
        if check_memory and info and info.get("MemAvailable", 0) < src.nbytes:
            raise TableError(f"pinned mode needs {src.nbytes / 2**30:.1f} GiB of free RAM for the table; "
                             f"MemAvailable is {info['MemAvailable'] / 2**30:.1f} GiB. Use pageable mode")
        sharding = SingleDeviceSharding(device, memory_kind="pinned_host")
        rb = src.row_bytes
        step = max(1, self.chunk_bytes // rb)
        self._arrays, addrs, extents = [], [], []
        from fnx.ple.table import Extent
        for e in src.extents:
            for lo in range(0, e.rows, step):
                n = min(step, e.rows - lo)
                host = _pread_rows(e.path, e.offset + lo * rb, n, rb)
                arr = jax.device_put(host, sharding)
                arr.block_until_ready()
                try:
                    addr = arr.unsafe_buffer_pointer()
                except Exception as exc:  # noqa: BLE001 - backend-specific
                    raise TableError(f"pinned mode: this backend gives no host pointer for pinned_host buffers "
                                     f"({exc}); use pageable mode") from exc
                if not np.array_equal(lx.view(addr, n * rb)[: min(n * rb, 4096)], host.reshape(-1)[:4096]):
                    raise TableError("pinned mode: the pinned_host buffer is not host-addressable at its pointer on "
                                     "this backend; use pageable mode")
                self._arrays.append(arr)
                addrs.append(addr)
                extents.append(Extent(e.path, e.offset + lo * rb, n))
        self._setup_views(addrs, extents)  # gather over the pinned chunks, not over the files

    def _close(self):
        super()._close()
        for a in self._arrays:
            a.delete()
        self._arrays = []


class UvaStore(PinnedStore):
    """`pinned`, plus the rows gathered on the device straight from the pinned chunks (`fnx.pallas.uva_gather`: a
    CUDA kernel reading host memory through the chunks' host addresses under unified virtual addressing), so a
    jitted step takes its PLE rows from its own n-gram ids with no host thread, copy or round trip.

    `self.table` (a `UvaTable` pytree: the chunk starts, the base addresses as two uint32 halves and the scale) is
    what a params tree holds in place of the table; its `gather(ids)` runs inside any jit, dequantized as
    `DeviceStore.gather`. The host
    interface (`rows`, `fetch`) is `pinned`'s NumPy gather. `emulate=True` (tests on a CPU) puts a device copy of
    the chunks' bytes behind offsets that stand for the addresses and gathers from it with the kernel's addressing
    (`impl` "reference" or "pallas_interpret"); without it a non-CUDA device raises when the gather is traced."""

    mode = "uva"

    def __init__(self, src, consts=None, *, emulate: bool = False, impl: str | None = None, **kw):
        super().__init__(src, consts, **kw)
        import jax.numpy as jnp
        _register_uva()
        rb = src.row_bytes
        if rb % 4:
            raise TableError(f"uva mode reads rows as 4-byte words; this table's rows are {rb} bytes")
        starts = np.asarray(self._starts, np.int64)
        if src.rows >= 2**31:
            raise TableError(f"uva mode indexes rows with int32: the table has {src.rows:,} rows")
        mem = None
        self._emulated = emulate
        if emulate:
            offs = np.cumsum([0] + [v.nbytes for v in self._views[:-1]], dtype=np.int64)
            addrs = offs.astype(np.uint64)
            mem = jnp.asarray(np.concatenate([v.reshape(-1) for v in self._views]).view(np.uint32))
        else:
            addrs = np.asarray(self._addrs, np.int64).astype(np.uint64)
        lo, hi = address_halves(addrs)
        self.table = UvaTable(jnp.asarray(starts.astype(np.int32)), jnp.asarray(lo), jnp.asarray(hi),
                              None if src.scale is None else jnp.asarray(src.scale), mem,
                              row_bytes=rb, width=self.width, dtype=np.dtype(src.np_dtype).name,
                              out_dtype=self.out_dtype.name, impl=impl)
        import jax
        self._jit = jax.jit(UvaTable.gather)
        if emulate or self._kernel_runs():
            self._self_check()

    @property
    def device_path(self) -> bool:
        return not self._emulated and self._kernel_runs()

    @staticmethod
    def _kernel_runs() -> bool:
        from fnx.pallas.dispatch import why_unavailable
        return why_unavailable("pallas") is None

    def _self_check(self):
        """Start-up validation of the device path: the first and last row of every chunk read by the gather kernel
        equal the host's bytes, else TableError (the memory is not readable at its host address from the device
        on this system)."""
        import jax.numpy as jnp

        from fnx.pallas.uva_gather import api
        t = self.table
        ends = np.asarray(list(self._starts[1:]) + [self.src.rows], np.int64)
        ids = np.unique(np.concatenate([np.asarray(self._starts, np.int64), ends - 1])).astype(np.int32)
        impl = t.impl or (None if t.mem is None else "reference")
        got = np.asarray(api.gather_words(jnp.asarray(ids), t.starts, t.lo, t.hi, t.row_bytes, mem=t.mem, impl=impl))
        idx, local = self._locate(ids.astype(np.int64))
        want = np.stack([self._views[i][r] for i, r in zip(idx, local)])
        if not np.array_equal(got.view(np.uint8).reshape(want.shape), want):
            raise TableError("uva mode: rows read by the GPU from the pinned table differ from its bytes (host "
                             "memory not readable at its host address from the device here); use pinned or pageable")

    def rows_device(self, ids):
        """ids [..., heads] -> [..., heads * width] out_dtype, gathered on the device (see the class)."""
        import jax.numpy as jnp
        return self._jit(self.table, jnp.asarray(ids, jnp.int32))


def address_halves(addrs) -> tuple[np.ndarray, np.ndarray]:
    """64-bit addresses -> (lo, hi) uint32 halves, as the device kernels take them (JAX runs without 64-bit ints)."""
    a = np.asarray(addrs).astype(np.uint64)
    return (a & np.uint64(0xFFFFFFFF)).astype(np.uint32), (a >> np.uint64(32)).astype(np.uint32)


class UvaTable:
    """The device-side handle of a `UvaStore` table (a jax pytree: the arrays are its leaves, the layout static):
    starts [C] int32, lo / hi [C] uint32 (each chunk's base address), scale (FP8 tables) or None, mem (emulation
    only) or None. `gather(ids)` runs inside any jit."""

    def __init__(self, starts, lo, hi, scale, mem, *, row_bytes: int, width: int, dtype: str, out_dtype: str,
                 impl: str | None = None):
        self.starts, self.lo, self.hi, self.scale, self.mem = starts, lo, hi, scale, mem
        self.row_bytes, self.width, self.dtype, self.out_dtype, self.impl = row_bytes, width, dtype, out_dtype, impl

    def _aux(self):
        return (self.row_bytes, self.width, self.dtype, self.out_dtype, self.impl)

    @property
    def shape(self) -> tuple[int, int]:
        """[rows, width] of the table (what a params tree's table leaf reports)."""
        return (-1, self.width)

    def gather(self, ids):
        """ids [..., heads] -> [..., heads * width] out_dtype: the rows' bytes through `fnx.pallas.uva_gather`,
        dequantized as `DeviceStore.gather` (FP8: bf16(row) in the scale's dtype times the scale)."""
        import jax.numpy as jnp

        from fnx.pallas.uva_gather import api
        impl = self.impl or (None if self.mem is None else "reference")
        words = api.gather_words(ids.reshape(-1).astype(jnp.int32), self.starts, self.lo, self.hi, self.row_bytes,
                                 mem=self.mem, impl=impl)
        return rows_from_words(words, ids.shape, self.row_bytes, self.width, self.dtype, self.scale, self.out_dtype)


def rows_from_words(words, ids_shape, row_bytes: int, width: int, dtype: str, scale, out_dtype: str):
    """words [N, row_bytes // 4] uint32 (rows' stored bytes, N = prod(ids_shape)) -> [..., heads * width] out_dtype,
    dequantized as `DeviceStore.gather` (FP8: bf16(row) in the scale's dtype times the scale). Traceable."""
    import jax.numpy as jnp
    from jax import lax
    raw = lax.bitcast_convert_type(words, jnp.uint8).reshape(words.shape[0], row_bytes)
    dt = jnp.dtype(dtype)
    if dt.itemsize == 1:
        vals = lax.bitcast_convert_type(raw, dt)
    else:
        vals = lax.bitcast_convert_type(raw.reshape(raw.shape[0], width, dt.itemsize), dt)
    if scale is not None:
        vals = vals.astype(jnp.bfloat16).astype(scale.dtype) * scale
    return vals.astype(jnp.dtype(out_dtype)).reshape(*ids_shape[:-1], ids_shape[-1] * width)


def _uva_flatten(t: UvaTable):
    return (t.starts, t.lo, t.hi, t.scale, t.mem), t._aux()


def _uva_unflatten(aux, children):
    row_bytes, width, dtype, out_dtype, impl = aux
    return UvaTable(*children, row_bytes=row_bytes, width=width, dtype=dtype, out_dtype=out_dtype, impl=impl)


_UVA_REGISTERED = []


def _register_uva():
    """UvaTable as a jax pytree (once; this module imports jax only when a device mode is opened)."""
    if not _UVA_REGISTERED:
        import jax
        jax.tree_util.register_pytree_node(UvaTable, _uva_flatten, _uva_unflatten)
        _UVA_REGISTERED.append(True)


def _pread_rows(path: str, offset: int, n: int, row_bytes: int) -> np.ndarray:
    out = np.empty((n, row_bytes), dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = os.preadv(fd, [memoryview(out.reshape(-1))], offset)
    finally:
        os.close(fd)
    if got != out.size:
        raise TableError(f"{path}: short read at byte {offset} ({got} of {out.size}); the file is truncated")
    return out


class DirectStore(RowStore):
    """O_DIRECT reads of the 4 KiB blocks holding each row, spread over a thread pool; no page cache.

    `prefetch` starts the reads and keeps the rows in a bounded cache (`cache_rows`) the next fetch consumes."""

    mode = "direct"
    align = 4096

    def __init__(self, src, consts=None, *, io_threads: int = 8, cache_rows: int = 1 << 16, **kw):
        super().__init__(src, consts, **kw)
        if src.row_bytes > self.align:
            raise TableError(f"direct mode reads rows of at most {self.align} bytes, got {src.row_bytes}")
        self._fds = {}
        try:
            for path in src.paths:
                try:
                    self._fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
                except OSError as exc:
                    raise TableError(f"{path}: cannot open with O_DIRECT ({exc}); this filesystem (e.g. tmpfs) does "
                                     "not support direct I/O. Use pageable mode") from exc
        except BaseException:
            self._close()
            raise
        self._starts = _extent_starts(src)
        self._ext_fd = [self._fds[e.path] for e in src.extents]
        self._ext_off = np.array([e.offset for e in src.extents], dtype=np.int64)
        self._io = cf.ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="fnx-ple-direct")
        self.io_threads = io_threads
        self._cache: OrderedDict = OrderedDict()
        self._cache_rows = cache_rows
        self._cache_lock = threading.Lock()
        self._tls = threading.local()

    def _buffer(self, nbytes):
        buf = getattr(self._tls, "buf", None)
        if buf is None or buf[1] < nbytes:
            if buf is not None:
                with self._cache_lock:
                    self._tls_bufs.remove(buf)
                lx.unmap(buf[0], buf[1])
            size = max(nbytes, 1 << 20)
            addr = lx.map_anonymous(size)
            self._tls.buf = buf = (addr, size)
            with self._cache_lock:
                self._tls_bufs = getattr(self, "_tls_bufs", []) + [buf]
        return lx.view(buf[0], buf[1], writable=True)

    def _read_blocks(self, fd_idx, starts):
        """Read 2 aligned blocks at each start (a row spans at most 2); returns (bytes [n, 2*align], nread [n])."""
        span = 2 * self.align
        mem = self._buffer(len(starts) * span)
        got = np.zeros(len(starts), dtype=np.int64)
        for i, (f, s) in enumerate(zip(fd_idx.tolist(), starts.tolist())):
            try:
                got[i] = os.preadv(self._ext_fd[f], [memoryview(mem[i * span:(i + 1) * span])], s)
            except OSError:
                got[i] = -1
        return mem[: len(starts) * span].reshape(len(starts), span).copy(), got

    def _read(self, uniq):
        rb = self.src.row_bytes
        idx = np.searchsorted(self._starts, uniq, side="right") - 1
        off = self._ext_off[idx] + (uniq - self._starts[idx]) * rb
        start = off // self.align * self.align
        key = np.unique(np.stack([idx, start], axis=1), axis=0)
        parts = np.array_split(np.arange(len(key)), min(self.io_threads, max(1, len(key) // 8)))
        futs = [self._io.submit(self._read_blocks, key[p, 0], key[p, 1]) for p in parts if len(p)]
        blocks, got = [], []
        for f in futs:
            b, g = f.result()
            blocks.append(b)
            got.append(g)
        blocks = np.concatenate(blocks) if blocks else np.zeros((0, 2 * self.align), np.uint8)
        got = np.concatenate(got) if got else np.zeros(0, np.int64)
        # Map each row to its block: key rows are sorted by (extent, start).
        k = np.searchsorted(key[:, 0] * (1 << 50) + key[:, 1], idx * (1 << 50) + start)
        inner = off - start
        ok = got[k] >= inner + rb
        cols = inner[:, None] + np.arange(rb)[None, :]
        raw = np.take_along_axis(blocks[k], cols, axis=1)
        raw[~ok] = 0
        return raw, ok

    def _gather(self, uniq):
        raw = np.zeros((len(uniq), self.src.row_bytes), dtype=np.uint8)
        ok = np.zeros(len(uniq), dtype=bool)
        with self._cache_lock:
            hit = np.array([int(r) in self._cache for r in uniq.tolist()], dtype=bool) if self._cache else \
                np.zeros(len(uniq), bool)
            for i in np.flatnonzero(hit).tolist():
                raw[i] = self._cache.pop(int(uniq[i]))
                ok[i] = True
        miss = np.flatnonzero(~hit)
        if len(miss):
            r, o = self._read(uniq[miss])
            raw[miss], ok[miss] = r, o
        with self._lock:
            self._stats.extra["cache_hits"] = self._stats.extra.get("cache_hits", 0) + int(hit.sum())
        return raw, ok

    def _prefetch(self, uniq):
        def work():
            raw, ok = self._read(uniq)
            with self._cache_lock:
                for r, row, good in zip(uniq.tolist(), raw, ok.tolist()):
                    if good:
                        self._cache[r] = row
                while len(self._cache) > self._cache_rows:
                    self._cache.popitem(last=False)
        self._io.submit(work)

    def _close(self):
        if getattr(self, "_io", None) is not None:
            self._io.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        for addr, size in getattr(self, "_tls_bufs", []):
            lx.unmap(addr, size)
        self._tls_bufs = []


class DeviceStore(RowStore):
    """The whole table as one jax array on a device (stored bytes, [rows, row_bytes] uint8), gathered and
    dequantized by a jitted function. `rows_device(ids)` keeps the result on the device; `gather(table, ids)`
    is the same computation for use inside a caller's jit (pass `store.table`)."""

    mode = "device"
    chunk_bytes = 256 << 20

    def __init__(self, src, consts=None, *, device=None, **kw):
        super().__init__(src, consts, **kw)
        import jax
        import jax.numpy as jnp
        from jax import lax
        self._jax, self._jnp = jax, jnp
        device = device or jax.devices()[0]
        rb = src.row_bytes
        place = jax.jit(lambda t, c, i: lax.dynamic_update_slice(t, c, (i, 0)), donate_argnums=0)
        table = jax.device_put(jnp.zeros((src.rows, rb), jnp.uint8), device)
        step = max(1, self.chunk_bytes // rb)
        pos = 0
        for e in src.extents:
            for lo in range(0, e.rows, step):
                n = min(step, e.rows - lo)
                chunk = jax.device_put(_pread_rows(e.path, e.offset + lo * rb, n, rb), device)
                table = place(table, chunk, np.int32(pos) if src.rows < 2**31 else np.int64(pos))
                pos += n
        self.table = table.block_until_ready()
        self.scale = None if src.scale is None else jax.device_put(src.scale, device)
        self._dtype = src.np_dtype
        self._jit = jax.jit(self.gather)

    def gather(self, table, ids):
        """jnp: ids [..., heads] -> [..., heads * width] out_dtype (usable inside any jit)."""
        jnp, lax = self._jnp, self._jax.lax
        raw = jnp.take(table, ids.reshape(-1), axis=0)  # [n, row_bytes] uint8
        isz = self._dtype.itemsize
        if isz == 1:
            vals = lax.bitcast_convert_type(raw, self._dtype)
        else:
            vals = lax.bitcast_convert_type(raw.reshape(raw.shape[0], self.width, isz), self._dtype)
        if self.scale is not None:
            vals = vals.astype(jnp.bfloat16).astype(self.scale.dtype) * self.scale
        return vals.astype(self.out_dtype).reshape(*ids.shape[:-1], ids.shape[-1] * self.width)

    def rows_device(self, ids):
        return self._jit(self.table, self._jnp.asarray(ids, self._jnp.int32))

    def fetch(self, ids, deadline_s=..., *, surface=True):
        self._check_open()
        flat, n, heads = self._check_ids(ids)
        start = time.perf_counter()
        out = np.asarray(self.rows_device(np.asarray(ids)))
        dt = time.perf_counter() - start
        with self._lock:
            s = self._stats
            s.fetches += 1
            s.rows_requested += flat.size
            s.fetch_seconds += dt
            s.max_fetch_seconds = max(s.max_fetch_seconds, dt)
        return Fetch(out, np.zeros(n, dtype=bool))

    def _close(self):
        self.table.delete()


_CLASSES = {"device": DeviceStore, "pinned": PinnedStore, "pageable": PageableStore, "swap": SwapStore,
            "direct": DirectStore, "uva": UvaStore}


def open_store(source, mode: str = "pageable", *, cfg=None, consts: NgramConstants | None = None,
               layer: int | None = None, expected_fingerprint: str | None = None, **options) -> RowStore:
    """Open the n-gram table of a checkpoint (directory with config.json + safetensors, a standalone safetensors
    file, or a raw row file from `convert_to_raw`) in one of MODES.

    cfg: an fnx ModelConfig (read from `source/config.json` when source is a checkpoint directory); it gives the
    hash constants, the row count and width to validate against. layer: 0-based decoder layer of the PLE (default:
    the first PLE layer). options: out_dtype, policy ('fail'|'degrade'), deadline_s, and per-mode ones
    (direct: io_threads, cache_rows; swap/pinned: check_memory; device/pinned: device)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if isinstance(source, TableSource):
        src = source
    else:
        path = os.fspath(source)
        if cfg is None and os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
            from fnx.config import ModelConfig
            cfg = ModelConfig.from_json(path)
        if cfg is not None and layer is None and cfg.ple_layers:
            layer = cfg.ple_layers[0]
        src = open_source(path, layer if (cfg is not None or layer is not None) else None)
    embed_dim = None
    if cfg is not None:
        if not cfg.ple_layer_ids:
            raise TableError("this config has no PLE layer")
        idx = cfg.ple_layers.index(layer) if layer in cfg.ple_layers else 0
        consts = consts or NgramConstants.from_config(cfg, idx)
        embed_dim = cfg.ple_embed_dim
    validate(src, consts, embed_dim, expected_fingerprint)
    if mode == "ring":
        from fnx.ple.ring import RingStore
        return RingStore(src, consts, **options)
    return _CLASSES[mode](src, consts, **options)
