"""Thin ctypes wrappers for the Linux memory calls the row store needs (mmap, madvise, process_madvise,
posix_fadvise). Errors come back as OSError with errno; nothing here raises SIGBUS."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading

import numpy as np

log = logging.getLogger("fnx.ple")

PAGE = mmap.PAGESIZE

PROT_READ, PROT_WRITE = 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x01, 0x02, 0x20, 0x4000
MADV_RANDOM, MADV_WILLNEED, MADV_DONTNEED = 1, 3, 4
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_PAGEOUT, MADV_POPULATE_READ = 14, 15, 21, 22
POSIX_FADV_RANDOM, POSIX_FADV_WILLNEED, POSIX_FADV_DONTNEED = 1, 3, 4
SYS_PROCESS_MADVISE = 440  # x86-64 and arm64 share the asm-generic number for syscalls added after 5.x

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.posix_fadvise.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_int]
_libc.syscall.restype = ctypes.c_long
MAP_FAILED = ctypes.c_void_p(-1).value

_once: set = set()
_once_lock = threading.Lock()


def log_once(key: str, level: int, msg: str, *args) -> None:
    """Log a message the first time `key` is seen in this process (every fallback is logged once)."""
    with _once_lock:
        if key in _once:
            return
        _once.add(key)
    log.log(level, msg, *args)


def _oserror(what: str) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


def map_file(fd: int, size: int) -> int:
    """Read-only shared mapping of a whole file; returns the address."""
    addr = _libc.mmap(None, size, PROT_READ, MAP_SHARED, fd, 0)
    if addr in (None, MAP_FAILED):
        raise _oserror(f"mmap of {size} bytes")
    return addr


def map_anonymous(size: int) -> int:
    """Private anonymous memory the kernel may swap out (MAP_NORESERVE: no commit charge up front)."""
    addr = _libc.mmap(None, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    if addr in (None, MAP_FAILED):
        raise _oserror(f"anonymous mmap of {size} bytes")
    return addr


def unmap(addr: int, size: int) -> None:
    if _libc.munmap(ctypes.c_void_p(addr), size) != 0:
        raise _oserror("munmap")


def view(addr: int, size: int, writable: bool = False) -> np.ndarray:
    """uint8 NumPy view of [addr, addr + size). The caller keeps the mapping alive while the view is used."""
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))
    if not writable:
        arr.setflags(write=False)
    return arr


def resident(addr: int, size: int) -> np.ndarray:
    """mincore(2): bool [pages] of [addr, addr + size) (addr page-aligned) whose pages are in memory."""
    pages = -(-size // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
        raise _oserror("mincore")
    return (np.frombuffer(vec, np.uint8) & 1).astype(bool)


def madvise(addr: int, size: int, advice: int) -> None:
    if _libc.madvise(ctypes.c_void_p(addr), size, advice) != 0:
        raise _oserror(f"madvise(advice={advice})")


def fadvise(fd: int, offset: int, size: int, advice: int) -> None:
    rc = _libc.posix_fadvise(fd, offset, size, advice)  # returns the error number, not -1
    if rc != 0:
        raise OSError(rc, f"posix_fadvise(advice={advice}): {os.strerror(rc)}")


def iov_max() -> int:
    try:
        return int(os.sysconf("SC_IOV_MAX"))
    except (ValueError, OSError):
        return 1024


class Advisor:
    """madvise over many disjoint ranges: one process_madvise per batch of up to 1024 ranges, or (when the
    syscall is missing or refused) one madvise per range, logged once."""

    def __init__(self):
        self.batch = min(1024, iov_max())
        self.pidfd = None
        self.reason = None
        try:
            self.pidfd = os.pidfd_open(os.getpid())
        except (AttributeError, OSError) as exc:
            self.reason = f"pidfd_open unavailable ({exc})"
        self.syscalls = 0
        self._c_nr, self._c_flags = ctypes.c_long(SYS_PROCESS_MADVISE), ctypes.c_uint(0)
        self._c_fd = ctypes.c_int(self.pidfd if self.pidfd is not None else -1)

    @property
    def batched(self) -> bool:
        return self.pidfd is not None

    def _fallback(self, why: str) -> None:
        self.reason = why
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        log_once("process_madvise", logging.WARNING,
                 "fnx.ple: process_madvise is unavailable (%s); prefetch falls back to one madvise call per range, "
                 "which costs about 1.5 us per range (fine for decode, slow for prefill hints)", why)

    def advise(self, iov: np.ndarray, advice: int, total: int | None = None) -> np.ndarray:
        """iov [n, 2] uint64 (address, length). Returns a bool [n] mask of ranges that failed. total: the sum of
        the lengths when the caller knows it (a fetch advises one iov twice; for a decode step's few ranges the
        NumPy sum is a noticeable part of the call).

        A batch whose process_madvise stops early is redone range by range, so the failing ranges are exact."""
        iov = np.ascontiguousarray(iov, dtype=np.uint64)
        failed = np.zeros(len(iov), dtype=bool)
        for lo in range(0, len(iov), self.batch):
            part = iov[lo:lo + self.batch]
            if self.pidfd is not None:
                want = total if total is not None and len(part) == len(iov) else int(part[:, 1].sum())
                self.syscalls += 1
                got = _libc.syscall(self._c_nr, self._c_fd, ctypes.c_void_p(part.ctypes.data),
                                    ctypes.c_size_t(len(part)), ctypes.c_int(advice), self._c_flags)
                if got == want:
                    continue
                if got < 0:
                    e = ctypes.get_errno()
                    if e in (errno.ENOSYS, errno.EPERM, errno.EBADF) or (e == errno.EINVAL and advice == MADV_WILLNEED):
                        self._fallback(f"errno {errno.errorcode.get(e, e)}: {os.strerror(e)}")
                # Partial or failed batch: find the failing ranges one by one.
            for j, (addr, length) in enumerate(part):
                self.syscalls += 1
                if _libc.madvise(ctypes.c_void_p(int(addr)), ctypes.c_size_t(int(length)), advice) != 0:
                    failed[lo + j] = True
        return failed

    def close(self):
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


# Up to this many offsets, page_ranges works in Python ints: a decode step's 16-80 rows cost NumPy's per-call
# overhead (about ten calls) more than the arithmetic.
SMALL_RANGES = 128


def page_ranges(base: int, offsets: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Page-aligned ranges covering [base + offsets[i], + length) for every i.

    Returns (iov [m, 2] uint64 of unique ranges, ascending, which [n] int index into iov for each input)."""
    if len(offsets) <= SMALL_RANGES:
        return _page_ranges_small(base, np.asarray(offsets).tolist(), length)
    start = (base + offsets) // PAGE * PAGE
    end = -(-(base + offsets + length) // PAGE) * PAGE
    if len(start) > 1 and (start[1:] >= start[:-1]).all():
        # sorted (a fetch's unique rows in one extent): groups of equal starts without a sort
        new = np.empty(len(start), dtype=bool)
        new[0] = True
        np.not_equal(start[1:], start[:-1], out=new[1:])
        firsts = np.flatnonzero(new)
        span = np.maximum.reduceat(end, firsts) - start[firsts]
        return (np.stack([start[firsts].astype(np.uint64), span.astype(np.uint64)], axis=1),
                (np.cumsum(new) - 1).reshape(-1))
    uniq, which = np.unique(start, return_inverse=True)
    span = np.zeros(len(uniq), dtype=np.int64)
    np.maximum.at(span, which, end - start)
    return np.stack([uniq.astype(np.uint64), span.astype(np.uint64)], axis=1), which.reshape(-1)


def _page_ranges_small(base: int, offsets: list[int], length: int) -> tuple[np.ndarray, np.ndarray]:
    """page_ranges with Python ints: the same ranges (each start's longest end) in the same ascending order."""
    end_of: dict[int, int] = {}
    starts = []
    for o in offsets:
        s = (base + o) // PAGE * PAGE
        e = -(-(base + o + length) // PAGE) * PAGE
        starts.append(s)
        if end_of.get(s, 0) < e:
            end_of[s] = e
    order = sorted(end_of)
    slot = {s: i for i, s in enumerate(order)}
    iov = np.array([(s, end_of[s] - s) for s in order], dtype=np.uint64).reshape(-1, 2)
    return iov, np.array([slot[s] for s in starts], dtype=np.intp)


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":", 1)
                parts = v.split()
                out[k] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    except OSError:
        pass
    return out
