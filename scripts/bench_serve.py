"""Throughput and latency of a running `python -m fnx.serve` at several concurrencies.

Each level keeps C streaming /v1/completions requests in flight (a new one starts when one ends) until N have
finished. Prompts are random token ids of a fixed length; `ignore_eos` makes every request generate exactly
--max-tokens, so levels are comparable. Per request: TTFT (send -> first token), TPOT ((last - first token) /
(tokens - 1)), end-to-end latency; per level: output tokens/s over the level's wall time, p50/p99 of each.
One JSON line per level is printed and appended to benchmarks/results/bench_serve.jsonl.

    python -m fnx.serve --model DIR --max-slots 16 &
    python scripts/bench_serve.py --base-url http://127.0.0.1:8000 --concurrency 1 4 16 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]


async def one(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": r.status_code, "body": (await r.aread()).decode()[:200]}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if ev.get("choices") and (ev["choices"][0].get("text") or ev["choices"][0].get("finish_reason")):
                now = time.perf_counter()
                first = first or now
                last = now
    if first is None:
        return {"error": "no tokens"}
    return {"ttft": first - t0, "e2e": last - t0, "tokens": tokens,
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else None}


def pct(xs, q):
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


async def level(base: str, model: str, concurrency: int, n: int, prompt_len: int, max_tokens: int, vocab: int,
                seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, vocab, prompt_len)] for _ in range(n)]
    results: list[dict] = []
    queue = list(prompts)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        async def worker():
            while queue:
                p = queue.pop()
                results.append(await one(client, model, p, max_tokens))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r for r in results if "error" in r]
    ms = lambda xs: [x * 1000 if x is not None else None for x in xs]  # noqa: E731
    ttft, tpot, e2e = ms([r["ttft"] for r in ok]), ms([r["tpot"] for r in ok]), ms([r["e2e"] for r in ok])
    out_tokens = sum(r["tokens"] for r in ok)
    return {"concurrency": concurrency, "requests": len(ok), "errors": len(errors),
            "error_sample": errors[0] if errors else None, "prompt_tokens": prompt_len, "max_tokens": max_tokens,
            "wall_s": round(wall, 3), "output_tok_s": round(out_tokens / wall, 2),
            "requests_s": round(len(ok) / wall, 3),
            **{f"{name}_{tag}_ms": (round(v, 2) if v is not None else None)
               for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e))
               for tag, v in (("p50", pct(xs, 50)), ("p99", pct(xs, 99)), ("mean", pct(xs, 50) and float(np.mean(
                   [x for x in xs if x is not None]))))}}


def server_info(base: str) -> dict:
    m = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    accept = next((float(x.split()[-1]) for x in metrics.splitlines()
                   if x.startswith("fnx_spec_decode_acceptance_length ")), None)
    return {"model": m["id"], "max_model_len": m.get("max_model_len"), "acceptance_length": accept}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: max(8, 2 x concurrency))")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=0, help="sample prompt ids below this (default: 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_serve.jsonl")
    p.add_argument("--note", default="", help="free text stored with each line (e.g. the server's flags)")
    args = p.parse_args(argv)

    info = server_info(args.base_url)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = None
    vocab = args.vocab or 256
    # one short warm request: the engine compiles per-prompt-length helpers on first sight (see the serve README)
    asyncio.run(level(args.base_url, info["model"], 1, 1, args.prompt_tokens, 2, vocab, args.seed + 999))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for c in args.concurrency:
        n = args.requests or max(8, 2 * c)
        r = asyncio.run(level(args.base_url, info["model"], c, n, args.prompt_tokens, args.max_tokens, vocab,
                              args.seed))
        row = {"bench": "serve", **r, **info, "machine": platform.node(), "cpu": platform.processor() or None,
               "commit": commit, "note": args.note, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        line = json.dumps(row)
        print(line, flush=True)
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
