"""The scheduler and the engine thread with a stand-in engine (no device, no compiles): outputs reach the right
stream, aborts reach the engine, a full queue refuses, and an engine that raises fails its requests, not the server."""

import asyncio
import time
from collections import deque
from types import SimpleNamespace

import pytest

from fnx.engine import Output, SamplingParams
from fnx.serve.metrics import Metrics
from fnx.serve.scheduler import QueueFull, Scheduler, Unavailable
from fnx.serve.worker import EngineThread


class FakeEngine:
    """Emits token 7 per step for each request until max_tokens; `explode` makes step() raise."""

    def __init__(self, slots=2):
        self.slots = [None] * slots
        self.waiting = deque()
        self.capacity, self.prefill_chunk, self.prefill_chunk_idle = 64, 16, 16
        self.cfg = SimpleNamespace(vocab_size=32)
        self.stats = {"drafted": 0, "accepted": 0}
        self.acceptance_length = 0.0
        self.aborted = []
        self.explode = False

    @property
    def num_running(self):
        return sum(s is not None for s in self.slots)

    def has_work(self):
        return bool(self.waiting) or self.num_running > 0

    def submit(self, prompt, params, request_id):
        if len(prompt) > 10:
            raise ValueError("prompt too long for the fake")
        self.waiting.append(SimpleNamespace(id=request_id, history=list(prompt), left=params.max_tokens))
        return request_id

    def abort(self, rid):
        self.aborted.append(rid)
        self.waiting = deque(r for r in self.waiting if r.id != rid)
        self.slots = [None if (s is not None and s.id == rid) else s for s in self.slots]

    def close(self):          # the worker closes its engine when it stops
        self.closed = True

    def step(self):
        time.sleep(0.001)
        if self.explode:
            raise RuntimeError("boom")
        for i, s in enumerate(self.slots):
            if s is None and self.waiting:
                self.slots[i] = self.waiting.popleft()
        outs = []
        for i, r in enumerate(self.slots):
            if r is None:
                continue
            r.left -= 1
            r.history.append(7)
            done = r.left == 0
            outs.append(Output(r.id, [7], [], done, "length" if done else None))
            if done:
                self.slots[i] = None
        return outs


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def make(slots=2, queue=1):
    eng = FakeEngine(slots)
    worker = EngineThread(eng, deliver=None, warmup=False)
    sched = Scheduler(worker, slots, queue, Metrics("fake"))
    return eng, worker, sched


async def collect(stream):
    return [o async for o in stream]


def test_streams_queue_full_and_abort():
    eng, worker, sched = make(slots=2, queue=1)

    async def main():
        sched.start(asyncio.get_running_loop())
        worker.start()
        long = SamplingParams(max_tokens=100_000)
        s2, s3, s4 = [await sched.submit([1], long) for _ in range(3)]     # 2 running, 1 queued
        with pytest.raises(QueueFull):
            await sched.submit([1], SamplingParams(max_tokens=1))
        for s in (s2, s3, s4):
            sched.abort(s.id)
        out2 = [await collect(s) for s in (s2, s3, s4)]
        s1 = await sched.submit([1, 2], SamplingParams(max_tokens=3))
        out1 = await collect(s1)
        with pytest.raises(ValueError, match="too long"):
            await sched.submit(list(range(20)), SamplingParams())   # refused by the engine: no stream left over
        await asyncio.sleep(0.1)
        worker.stop()
        return out1, out2

    out1, out2 = run(main())
    worker.join(5)
    assert [t for o in out1 for t in o.token_ids] == [7, 7, 7] and out1[-1].finish_reason == "length"
    assert all(o[-1].finish_reason == "abort" for o in out2)
    assert set(eng.aborted) >= {o[-1].request_id for o in out2}
    assert sched.in_flight == 0 and sched.metrics.requests == {"abort": 3, "length": 1}


def test_engine_failure_fails_requests_not_the_server():
    eng, worker, sched = make()

    async def main():
        sched.start(asyncio.get_running_loop())
        worker.start()
        eng.explode = True
        s = await sched.submit([1], SamplingParams(max_tokens=5))
        out = await collect(s)
        with pytest.raises(Unavailable, match="boom"):
            await sched.submit([1], SamplingParams(max_tokens=5))
        worker.stop()
        return out

    out = run(main())
    worker.join(5)
    assert out[-1].finished and out[-1].finish_reason == "error"
    assert isinstance(worker.failed, RuntimeError)


def _plan(capacity, reserve, chunk, idle=None):
    from fnx.engine import Engine
    from fnx.serve.worker import warmup_plan
    eng = SimpleNamespace(capacity=capacity, reserve=reserve, prefill_chunk=chunk, prefill_chunk_idle=idle or chunk)
    eng.prefill_bucket = lambda n: Engine.prefill_bucket(eng, n)
    eng.prefill_buckets = lambda: Engine.prefill_buckets(eng)
    plan = warmup_plan(eng)
    assert [p for p in plan if p[1] == 0] == [(n, 0, mt) for n, lp, mt in plan if lp] and len(plan) % 2 == 0
    return [(n, mt) for n, lp, mt in plan if lp == 0]


def test_warmup_plan_reaches_every_bucket_a_prompt_can():
    """One warm-up prompt per prefill bucket a request can reach within the capacity (prompt + generated + the
    engine's reserve): the full ladder when the chunk fits; the longest prompt that fits in the last reachable
    bucket (one token generated when two do not fit); a capacity with no room for a prompt is refused by name."""
    assert _plan(4096, 5, 512) == [(16, 2), (32, 2), (64, 2), (128, 2), (256, 2), (512, 2)]
    assert _plan(512, 5, 512) == [(16, 2), (32, 2), (64, 2), (128, 2), (256, 2), (506, 1)]   # 506 + 1 + 5 = 512
    assert _plan(200, 5, 512) == [(16, 2), (32, 2), (64, 2), (128, 2), (194, 1)]
    assert _plan(136, 5, 512) == [(16, 2), (32, 2), (64, 2), (128, 2), (130, 1)]            # 129-130: bucket 256
    assert _plan(133, 5, 512) == [(16, 2), (32, 2), (64, 2), (127, 1)]                       # 128 + 1 + 5 > 133
    assert _plan(20, 11, 100) == [(8, 1)]
    assert _plan(300, 3, 100) == [(16, 2), (32, 2), (64, 2), (100, 2)]                       # a chunk of 100
    with pytest.raises(ValueError, match="capacity of 8 leaves no room for a prompt.*reserves 11"):
        _plan(8, 11, 512)
    # an idle budget above the chunk: its buckets too (the warm-up's requests run alone, in idle steps), a chunk
    # budget that is no power of two a bucket of its own below them
    ladder = [(16, 2), (32, 2), (64, 2), (128, 2), (256, 2), (512, 2)]
    assert _plan(4096, 5, 512, 2048) == ladder + [(1024, 2), (2048, 2)]
    assert _plan(4096, 5, 600, 2048) == ladder + [(600, 2), (1024, 2), (2048, 2)]
    assert _plan(1500, 5, 512, 2048) == ladder + [(1024, 2), (1494, 1)]                 # 1494 + 1 + 5 = 1500
    assert _plan(4096, 5, 8, 8) == [(8, 2)]
