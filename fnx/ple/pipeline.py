"""Getting PLE rows to the jitted step.

Two routes:

* In-graph host callbacks (`fetch_rows_in_graph`): the step itself calls back into Python at the PLE layer
  (`jax.pure_callback`, `io_callback`, or `jax.experimental.buffer_callback`). Simple, but on a GPU each call
  drains the stream, copies through pageable memory and splits XLA's command buffer (GPU_NOTES.md: ~0.35 ms per
  callback on the H200), and nothing overlaps the fetch.
* The fast path (`PrefetchPipeline`): the ids depend only on tokens, so as soon as a step's tokens are known the
  engine hands them to a host thread, which computes the ids, fetches the rows from the store and copies them to
  the device, while the device still runs the previous program (or the embedding and layer 0 of this one). The
  step receives the rows as `ple_rows` (`fnx.model.transformer.step(..., ple_rows=...)`). At most `slots` steps
  are in flight (double buffering by default); `hint_prompt` prefetches a whole prompt's rows on admission,
  window by window, behind any step fetch.

The engine runs either route (`Engine(ple_fetch="pipeline" | "callback-*")`), but its default is "sync" (fetch,
then one program): on the H200 a second program's launch cost more host time than the overlap won
(BENCHMARKS.md, "The engine on a host PLE store").
"""

from __future__ import annotations

import ctypes
import glob
import itertools
import logging
import os
import queue
import sys
import threading
from dataclasses import dataclass

import numpy as np

from fnx.ple import _linux as lx
from fnx.ple.ngram import ngram_ids
from fnx.ple.store import DeviceStore, PleFetchError, RowStore

log = logging.getLogger("fnx.ple")

CALLBACKS = ("pure", "io", "buffer")


def _host_rows(store: RowStore, ids: np.ndarray) -> np.ndarray:
    """Callback body: never raises (an exception inside a jax callback is undefined behaviour); failures are
    zero-filled by the store and surface through `store.check()` after the step."""
    ids = np.asarray(ids)
    heads = ids.shape[-1]
    try:
        rows = store.fetch(ids.reshape(-1, heads), surface=False).rows
    except Exception as exc:  # noqa: BLE001 - reported through the store, never raised inside XLA
        store._record_failure(PleFetchError(f"in-graph PLE fetch failed: {exc!r}"), ids.size, ids.size // heads)
        lx.log_once("callback-error", logging.ERROR, "fnx.ple: in-graph PLE fetch failed (%r); zero rows", exc)
        rows = np.zeros((ids.size // heads, heads * store.width), store.out_dtype)
    return rows.reshape(*ids.shape[:-1], heads * store.width)


def fetch_rows_in_graph(store: RowStore, ids, method: str = "pure"):
    """ids [..., heads] int32 (a traced jax array) -> rows [..., heads * width] store.out_dtype, fetched from the
    store by a host callback. Usable inside jit. Call `store.check()` after the step to raise a failure.

    method: 'pure' (jax.pure_callback; may be deduplicated or dropped when unused), 'io' (io_callback,
    unordered), 'buffer' (jax.experimental.buffer_callback: writes the result buffer in place; on a GPU it copies
    the ids and rows itself on XLA's stream through libcudart)."""
    import jax
    import jax.numpy as jnp

    if method not in CALLBACKS:
        raise ValueError(f"method must be one of {CALLBACKS}, got {method!r}")
    if isinstance(store, DeviceStore):
        raise ValueError("a device store needs no callback: call store.gather(store.table, ids) inside the jit, "
                         "passing store.table as an argument")
    ids = jnp.asarray(ids, jnp.int32)
    shape = ids.shape[:-1] + (ids.shape[-1] * store.width,)
    out = jax.ShapeDtypeStruct(shape, store.out_dtype)
    fn = lambda i: _host_rows(store, i)  # noqa: E731
    if method == "pure":
        return jax.pure_callback(fn, out, ids, vmap_method="sequential")
    if method == "io":
        from jax.experimental import io_callback
        return io_callback(fn, out, ids, ordered=False)
    return _buffer_callback_rows(store, ids, shape)


def _buffer_callback_rows(store, ids, shape):
    import jax
    import jax.numpy as jnp
    from jax import lax
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError as exc:
        raise RuntimeError(f"jax {jax.__version__} has no jax.experimental.buffer_callback; use method='io'") from exc
    isz = np.dtype(store.out_dtype).itemsize
    carrier = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[isz]  # bit-carrier dtype every buffer protocol knows
    on_gpu = jax.default_backend() == "gpu"

    def cb(ctx, out, ids_buf):
        if on_gpu:
            _cuda_callback(ctx, out, ids_buf, store, isz)
        else:
            rows = _host_rows(store, np.asarray(ids_buf))
            np.asarray(out)[...] = rows.view(np.dtype(carrier))

    raw = buffer_callback(cb, jax.ShapeDtypeStruct(shape, carrier), has_side_effect=True)(ids)
    return lax.bitcast_convert_type(raw, store.out_dtype)


_cudart = None


def _load_cudart():
    global _cudart
    if _cudart is not None:
        return _cudart
    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for base in sys.path:
        names += sorted(glob.glob(os.path.join(base, "nvidia", "**", "libcudart.so*"), recursive=True))
    for n in names:
        try:
            lib = ctypes.CDLL(n)
        except OSError:
            continue
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        _cudart = lib
        return lib
    raise RuntimeError("buffer callback on GPU needs libcudart (looked for libcudart.so* on the loader path and in "
                       "the nvidia-* wheels); use method='io'")


def _cuda_callback(ctx, out, ids_buf, store, isz):
    lib = _load_cudart()
    stream = ctypes.c_void_p(ctx.stream)
    ids_ptr = ids_buf.__cuda_array_interface__["data"][0]
    out_ptr = out.__cuda_array_interface__["data"][0]
    host_ids = np.empty(ids_buf.shape, np.int32)
    for rc in (lib.cudaMemcpyAsync(host_ids.ctypes.data, ids_ptr, host_ids.nbytes, 2, stream),  # D2H
               lib.cudaStreamSynchronize(stream)):
        if rc:
            raise RuntimeError(f"CUDA error {rc} copying PLE ids to the host")
    rows = np.ascontiguousarray(_host_rows(store, host_ids))
    for rc in (lib.cudaMemcpyAsync(out_ptr, rows.ctypes.data, rows.nbytes, 1, stream),  # H2D
               lib.cudaStreamSynchronize(stream)):  # rows must outlive the copy
        if rc:
            raise RuntimeError(f"CUDA error {rc} copying PLE rows to the device")


@dataclass
class PipelineRows:
    rows: object  # jax.Array [B, L, heads * width] on the target device (or np.ndarray with to_device=False)
    missing: np.ndarray  # [B, L] bool: token rows zero-filled
    flagged: np.ndarray  # [B] bool: requests with at least one zero-filled token
    error: BaseException | None
    new_context: np.ndarray | None  # [B, n-1] when the ticket was submitted as tokens
    host_seconds: float  # ids + fetch + copy time on the pipeline thread


class Ticket:
    __slots__ = ("seq", "event", "result", "exc", "submitted")

    def __init__(self, seq):
        self.seq, self.event, self.result, self.exc = seq, threading.Event(), None, None
        self.submitted = 0.0


class PrefetchPipeline:
    """A host thread that turns a step's tokens into device-resident PLE rows ahead of the step.

        pipe = PrefetchPipeline(store)                       # store.consts gives the hash constants
        t = pipe.submit_tokens(context, tokens)              # context [B, n-1], tokens [B, L]; returns at once
        ...dispatch whatever does not need the rows...
        r = pipe.take(t)                                     # waits; r.rows [B, L, heads*width] on the device
        logits, state, h = step(params, state, tokens, None, cfg=cfg, ple_rows=r.rows)
        pipe.hint_prompt(context, prompt)                    # on admission: prefetch a whole prompt's rows

    At most `slots` tickets are in flight (submit blocks when all are taken: double buffering by default). Step
    fetches always run before queued prompt hints. `device`/`sharding`: where the rows go (default device)."""

    def __init__(self, store: RowStore, *, slots: int = 2, device=None, to_device: bool = True,
                 hint_window: int = 4096):
        if store.consts is None:
            raise ValueError("the pipeline computes n-gram ids: open the store with a config or consts")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.store, self.consts = store, store.consts
        self.hint_window = hint_window
        self.to_device = to_device
        self._device = device
        self._slots = threading.Semaphore(slots)
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._closed = False
        self.hints_done = 0
        # where a step's time goes: submit -> the thread starts it (queue), the thread's ids + fetch + copy (host),
        # and how long take() blocked the caller (wait: what the overlap did not hide)
        self.stats = {"steps": 0, "queue_seconds": 0.0, "host_seconds": 0.0, "wait_seconds": 0.0}
        self._thread = threading.Thread(target=self._run, name="fnx-ple-pipeline", daemon=True)
        self._thread.start()

    # -- engine side -------------------------------------------------------------------------------------------

    def submit_ids(self, ids) -> Ticket:
        """ids [B, L, heads] already computed."""
        return self._submit(("ids", np.asarray(ids), None))

    def submit_tokens(self, context, tokens) -> Ticket:
        """context [B, n-1] (before these tokens), tokens [B, L]: ids are computed on the pipeline thread.
        The result's new_context is the context after all L tokens (roll back with fnx.ple.context_after)."""
        return self._submit(("tokens", np.asarray(context), np.asarray(tokens)))

    def take(self, ticket: Ticket, timeout: float | None = None) -> PipelineRows:
        """Wait for a ticket's rows. Raises what the thread raised (bad ids, closed store) and, under the store's
        fail policy, a PleFetchError on the step after the one whose rows were zero-filled."""
        import time
        start = time.perf_counter()
        ready = ticket.event.wait(timeout)
        self.stats["wait_seconds"] += time.perf_counter() - start
        if not ready:
            raise TimeoutError(f"PLE rows of ticket {ticket.seq} not ready after {timeout} s")
        if ticket.exc is not None:
            raise ticket.exc
        return ticket.result

    def hint_prompt(self, context, prompt) -> None:
        """Prefetch the rows of a whole prompt (context [1 or B, n-1], prompt [same, T]) in windows, behind steps."""
        if self._closed:
            raise RuntimeError("the PLE pipeline is closed")
        ctx, prompt = np.asarray(context), np.asarray(prompt)
        for lo in range(0, prompt.shape[1], self.hint_window):
            window = prompt[:, lo:lo + self.hint_window]
            self._queue.put((1, next(self._seq), ("hint", ctx, window, None)))
            ctx = np.concatenate([ctx, window], axis=1)[:, -ctx.shape[1]:]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put((-1, next(self._seq), None))
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- thread side -------------------------------------------------------------------------------------------

    def _submit(self, job) -> Ticket:
        if self._closed:
            raise RuntimeError("the PLE pipeline is closed")
        import time
        self._slots.acquire()
        t = Ticket(next(self._seq))
        t.submitted = time.perf_counter()
        self._queue.put((0, t.seq, job + (t,)))
        return t

    def _run(self):
        import time

        import jax
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            kind = job[0]
            if kind == "hint":
                try:
                    ids, _ = ngram_ids(job[1], job[2], self.consts)
                    self.store.prefetch(ids.reshape(-1, ids.shape[-1]))
                    self.hints_done += 1
                except Exception as exc:  # noqa: BLE001 - a hint is advisory
                    lx.log_once("hint-error", logging.WARNING, "fnx.ple: prompt prefetch hint failed: %r", exc)
                continue
            ticket = job[-1]
            start = time.perf_counter()
            self.stats["queue_seconds"] += start - ticket.submitted
            try:
                new_ctx = None
                if kind == "tokens":
                    ids, new_ctx = ngram_ids(job[1], job[2], self.consts)
                else:
                    ids = job[1]
                b, length, heads = ids.shape
                fetch = self.store.fetch(ids.reshape(-1, heads), surface=False)
                rows = fetch.rows.reshape(b, length, heads * self.store.width)
                if self.to_device:
                    rows = jax.device_put(rows, self._device)
                    rows.block_until_ready()  # the copy is done here, off the engine's critical path
                missing = fetch.missing.reshape(b, length)
                ticket.result = PipelineRows(rows, missing, missing.any(axis=1), fetch.error, new_ctx,
                                             time.perf_counter() - start)
                self.stats["steps"] += 1
                self.stats["host_seconds"] += ticket.result.host_seconds
                if fetch.error is None:
                    try:
                        self.store.check()  # under fail, an earlier failure is raised to this step's take()
                    except PleFetchError as exc:
                        ticket.exc = exc
            except BaseException as exc:  # noqa: BLE001 - handed to take()
                ticket.exc = exc
            finally:
                self._slots.release()
                ticket.event.set()
