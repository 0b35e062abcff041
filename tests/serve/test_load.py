"""A bounded load test: 64 concurrent greedy streams (8 batch slots, the rest queued) all complete, and each one
equals the same request run alone."""

import asyncio

import numpy as np
import openai

from tests.serve.conftest import metric

MODEL = "tiny-serve"
N, PROMPT_LEN, MAX_TOKENS = 64, 12, 16


def prompts():
    # One prompt length, so the engine's per-length programs compile once (see the report on _reset_row).
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(3, 300, PROMPT_LEN)] for _ in range(N)]


async def stream_one(client, prompt):
    text, finish = [], None
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True, logprobs=0)
    tokens = []
    async for chunk in stream:
        c = chunk.choices[0]
        text.append(c.text)
        if c.logprobs:
            tokens += c.logprobs.tokens
        finish = c.finish_reason or finish
    return "".join(text), tokens, finish


def test_64_concurrent_streams_equal_alone(server):
    ps = prompts()

    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)
        alone = [await stream_one(client, p) for p in ps]
        together = await asyncio.gather(*(stream_one(client, p) for p in ps))
        await client.close()
        return alone, together

    steps = metric(server.base, "fnx_engine_steps_total")
    alone, together = asyncio.run(main())
    assert all(f in ("stop", "length") for _, _, f in together)
    assert together == alone
    assert any(len(tokens) == MAX_TOKENS for _, tokens, _ in alone)
    # Batching happened: far fewer engine steps than 2 x 64 sequential requests would need.
    sequential_steps = sum(len(tokens) for _, tokens, _ in alone)
    assert metric(server.base, "fnx_engine_steps_total") - steps < 2 * sequential_steps - sequential_steps // 2
