"""The scheduler: admission (a bounded queue), one asyncio stream per request, cancellation, timing. No device
code: it talks to the engine thread only through that thread's inbox and the outputs it delivers back."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fnx.engine import Output, SamplingParams
from fnx.serve.metrics import Metrics
from fnx.serve.worker import EngineThread


class QueueFull(Exception):
    pass


class Unavailable(Exception):
    pass


class RequestStream:
    """The engine outputs of one request, as an async iterator, with its timing."""

    def __init__(self, rid: str, prompt_tokens: int):
        self.id = rid
        self.prompt_tokens = prompt_tokens
        self.queue: asyncio.Queue[Output] = asyncio.Queue()
        self.t_submit = time.monotonic()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.generated = 0
        self.finished = False

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        while True:
            out = await self.queue.get()
            yield out
            if out.finished:
                return


class Scheduler:
    def __init__(self, worker: EngineThread, max_slots: int, max_queue: int, metrics: Metrics):
        self.worker, self.metrics = worker, metrics
        self.max_slots, self.max_queue = max_slots, max_queue
        self.streams: dict[str, RequestStream] = {}
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        worker.deliver = self._deliver_threadsafe
        worker.step_seconds = metrics.step.observe
        worker.on_snapshot = self._snapshot

    def start(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def _snapshot(self, snap: dict):
        self.metrics.engine = snap

    @property
    def in_flight(self) -> int:
        return len(self.streams)

    @property
    def running(self) -> int:
        return min(len(self.streams), self.max_slots)

    @property
    def queue_depth(self) -> int:
        return max(0, len(self.streams) - self.max_slots)

    # ---- requests -------------------------------------------------------------------------------------------
    async def submit(self, prompt: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; raises QueueFull, Unavailable, or ValueError (the engine refused the request)."""
        if self.draining:
            raise Unavailable("the server is shutting down and accepts no new requests")
        if self.worker.failed is not None:
            raise Unavailable(f"the engine failed and serves no more requests: {self.worker.failed}")
        if len(self.streams) >= self.max_slots + self.max_queue:
            self.metrics.reject("queue_full")
            raise QueueFull(f"the server is at capacity: {self.max_slots} running and {self.max_queue} queued "
                            f"requests; retry later")
        rid = f"cmpl-{uuid.uuid4().hex}"
        stream = RequestStream(rid, len(prompt))
        self.streams[rid] = stream
        accepted = self.loop.create_future()

        def done(err):
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(lambda: accepted.done() or accepted.set_result(err))

        self.worker.submit(rid, prompt, params, done)
        try:
            err = await accepted
        except BaseException:
            self.abort(rid)
            raise
        if err is not None:
            self.streams.pop(rid, None)
            if isinstance(err, ValueError):
                raise err
            raise Unavailable(str(err))
        return stream

    def abort(self, rid: str, reason: str = "abort"):
        """Cancel a request (client gone, stop string hit, shutdown). Safe to call on finished requests. A reader
        still waiting on the stream gets a final output with finish_reason "abort"."""
        stream = self.streams.pop(rid, None)
        if stream is None:
            return
        self.worker.abort(rid)
        self._account(stream, reason)
        stream.queue.put_nowait(Output(rid, [], [], True, "abort"))

    def _account(self, s: RequestStream, reason: str):
        s.finished = True
        self.metrics.finished(reason, s.prompt_tokens, s.generated, s.t_submit, s.t_first, s.t_last)

    def _deliver_threadsafe(self, outs: list[Output]):
        with contextlib.suppress(RuntimeError):   # the loop is closed: shutting down, nobody is listening
            self.loop.call_soon_threadsafe(self._deliver, outs)

    def _deliver(self, outs: list[Output]):
        now = time.monotonic()
        n = 0
        for o in outs:
            s = self.streams.get(o.request_id)
            if s is None:  # aborted while this step ran
                continue
            if o.token_ids:
                if s.t_first is None:
                    s.t_first = now
                    self.metrics.first_token(now - s.t_submit)
                s.t_last = now
                s.generated += len(o.token_ids)
                n += len(o.token_ids)
            s.queue.put_nowait(o)
            if o.finished:
                self.streams.pop(o.request_id, None)
                self._account(s, o.finish_reason or "stop")
        if n:
            self.metrics.tokens(n)

    async def drain(self, timeout: float):
        """Graceful shutdown: refuse new requests, let running ones finish for up to `timeout` s, abort the rest."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.streams):
            self.abort(rid)
