"""The OpenAI API of the real server, through the real `openai` client: both endpoints streaming and not, greedy
output equal to `fnx.generate`, stop strings, logprobs, seeds, reasoning split, models, health, metrics."""

import httpx
import numpy as np
import openai
import pytest

import fnx
from fnx.engine import SamplingParams
from fnx.tokenizer import Tokenizer
from tests.serve.conftest import CAPACITY, SLOTS, metric

MODEL = "tiny-serve"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(serve_checkpoint):
    return Tokenizer(serve_checkpoint)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(f"{server.base}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert "layers scanned" in server.output()             # --layers auto on the CPU: the config's layout
    page = httpx.get(f"{server.base}/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"] and 'id="stop"' in page.text


def test_completions_stream_equals_non_stream(client):
    kw = dict(model=MODEL, prompt="Hello, world! How are", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 12 and full.usage.prompt_tokens > 0
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage.model_dump() == full.usage.model_dump() and chunks[-1].choices == []


def test_chat_stream_equals_non_stream(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant"
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (msg.content or "")
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_greedy_equals_fnx_generate(client, serve_checkpoint, tok):
    """The server's greedy tokens are exactly fnx.generate's for the same prompt ids."""
    model = fnx.load(serve_checkpoint, dtype=np.float32)
    for prompt in ["The quick brown fox", "Café 中文 🙂"]:
        ids = tok.encode(prompt)
        want = fnx.generate(model, ids, max_new_tokens=20, sampling=SamplingParams(ignore_eos=True))
        got = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0, logprobs=0,
                                        extra_body={"ignore_eos": True})
        c = got.choices[0]
        assert c.logprobs.tokens == [tok.token_text(t) for t in want]
        assert c.text == b"".join(tok.token_bytes(t) for t in want if t not in tok.special_ids).decode(
            "utf-8", errors="replace")


def test_stop_strings(client):
    kw = dict(model=MODEL, prompt="Numbers: 0 1 2 3", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    stop = next(text[i:i + 2] for i in range(4, len(text) - 2) if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i)
    cut = client.completions.create(**kw, stop=[stop, "never-seen"])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:text.find(stop)]


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0])          # greedy picks the most likely token
        assert entry.token == entry.top_logprobs[0].token and entry.bytes is not None


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="Streaming sends", max_tokens=16, temperature=1.0, top_p=0.9,
              presence_penalty=0.5, frequency_penalty=0.3,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    a = client.completions.create(**kw, seed=1234).choices[0].text
    b = client.completions.create(**kw, seed=1234).choices[0].text
    others = {client.completions.create(**kw, seed=s).choices[0].text for s in (1, 2, 3)}
    assert a == b and len(others | {a}) > 1


def test_reasoning_content(client, tok):
    """A template that opens <think> in the generation prompt: the output is reasoning until </think>."""
    kw = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    raw = tok.apply_chat_template(CHAT, enable_thinking=True)
    plain = client.completions.create(model=MODEL, prompt=tok.encode(raw), max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    if "</think>" in plain:
        pytest.skip("the tiny model closed the think block itself")
    assert msg.model_extra["reasoning_content"] == plain.lstrip("\n") and not msg.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == \
        msg.model_extra["reasoning_content"]


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=4, temperature=0)
    text = httpx.get(f"{server.base}/metrics").text
    for name in ["fnx_requests_waiting", "fnx_requests_running", "fnx_generation_tokens_per_second",
                 "fnx_time_to_first_token_seconds_count", "fnx_time_per_output_token_seconds_count",
                 "fnx_spec_decode_acceptance_length", "fnx_cache_usage_ratio", "fnx_generation_tokens_total",
                 "fnx_compiles_after_warmup_total"]:
        assert f"\n{name}" in text, name
    assert metric(server.base, "fnx_time_to_first_token_seconds_count") >= 1
    assert metric(server.base, "fnx_generation_tokens_total") >= 4
    assert 0 <= metric(server.base, "fnx_cache_usage_ratio") <= 1
    assert metric(server.base, "fnx_requests_running") <= SLOTS
    assert CAPACITY == client.models.list().data[0].model_extra["max_model_len"]


def _compiles_after_warmup(base: str) -> float:
    return sum(float(line.split()[-1]) for line in httpx.get(f"{base}/metrics").text.splitlines()
               if line.startswith("fnx_compiles_after_warmup_total"))


def test_warmup_covers_greedy_and_sampled_requests(server, client):
    """Greedy and sampled requests, with and without top logprobs, echo's prompt logprobs and a logit_bias run only
    programs the start-up warm-up compiled (an all-greedy batch runs its own argmax-only decode program)."""
    before = _compiles_after_warmup(server.base)
    for temperature in (0, 0.8):
        for logprobs in (None, 3):
            client.completions.create(model=MODEL, prompt="warm programs", max_tokens=4, temperature=temperature,
                                      seed=1, logprobs=logprobs)
    for n_words in (2, 30, 50):     # echo's prompt logprobs, three prefill buckets (50: the idle budget's, 64)
        r = client.completions.create(model=MODEL, prompt="warm " * n_words, max_tokens=1, logprobs=1, echo=True)
        assert r.usage.prompt_tokens >= n_words
    for temperature in (0, 0.8):                                   # a logit_bias: the biased programs
        for logprobs in (None, 2):
            r = client.completions.create(model=MODEL, prompt="warm biased programs", max_tokens=3, seed=1,
                                          temperature=temperature, logprobs=logprobs, logit_bias={"11": 3.0})
            assert r.usage.completion_tokens >= 1
    assert _compiles_after_warmup(server.base) == before


def test_tools_in_the_conversation(client, tok):
    """Tools and earlier tool calls reach the template; the reply is parsed with tool-call parsing on."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]   # short: 256 positions
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    want = tok.apply_chat_template(messages[:1] + [dict(messages[1], tool_calls=[
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}])] + messages[2:],
        tools=tools)
    assert r.usage.prompt_tokens == len(tok.encode(want))


def test_n_choices_and_several_prompts(client):
    """`n` choices and several prompts in one completion request: one engine request each, choice i * n + j for
    prompt i's choice j; each equals the same request sent alone (a seed gives choice j the seed + j); streamed
    chunks carry their choice's index and add up to the same texts; the prompt counts once in the usage."""
    kw = dict(model=MODEL, max_tokens=8, temperature=0.9, seed=7, extra_body={"ignore_eos": True})
    prompts = ["Several prompts", "in one request"]
    r = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        for j in range(2):
            alone = client.completions.create(prompt=p, **dict(kw, seed=7 + j)).choices[0]
            assert r.choices[2 * i + j].text == alone.text and r.choices[2 * i + j].finish_reason == "length"
    alone_usage = [client.completions.create(prompt=p, **kw).usage for p in prompts]
    assert r.usage.prompt_tokens == sum(u.prompt_tokens for u in alone_usage)
    assert r.usage.completion_tokens == 4 * 8
    texts = ["", "", "", ""]
    for chunk in client.completions.create(prompt=prompts, n=2, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]
    greedy = client.completions.create(prompt=[[5, 6, 7], "tokens and text"], max_tokens=5, temperature=0,
                                       model=MODEL)
    assert [c.index for c in greedy.choices] == [0, 1] and all(c.text for c in greedy.choices)


def test_chat_n_choices(client):
    """`n` chat choices, streamed and not: seeded, choice j equals the request alone with seed + j."""
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18
    for j in range(3):
        alone = client.chat.completions.create(**dict(kw, seed=11 + j)).choices[0].message
        assert r.choices[j].message.model_dump() == alone.model_dump()     # content, reasoning, tool calls
    got = {}
    roles = set()
    for chunk in client.chat.completions.create(n=3, stream=True, **kw):
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
    assert roles == {0, 1, 2} and [got[j] for j in range(3)] == [c.message.content for c in r.choices]


def test_echo_with_logprobs_scores_the_prompt(client, serve_checkpoint, tok):
    """`echo` with `logprobs` (what lm-eval's loglikelihood requests send: echo, logprobs 1, max_tokens 1): the
    text starts with the prompt, `token_logprobs` holds None for the first prompt token and then each prompt
    token's log-probability given the ones before it (equal to the forward pass's log-softmax), then the generated
    tokens'; streamed the same; several prompts each echo their own."""
    import jax
    model = fnx.load(serve_checkpoint, dtype=np.float32)
    prompt = "The capital of France is Paris, and"
    ids = tok.encode(prompt, add_special_tokens=True)
    lp = np.asarray(jax.nn.log_softmax(np.asarray(fnx.forward(model, np.asarray([ids])))[0], axis=-1))
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    c = r.choices[0]
    assert c.text.startswith(prompt) and len(c.text) > len(prompt)
    got = c.logprobs.token_logprobs
    assert len(got) == len(ids) + 1 and got[0] is None and c.logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(got[1:len(ids)], [lp[j, ids[j + 1]] for j in range(len(ids) - 1)], rtol=0, atol=2e-5)
    assert c.logprobs.tokens[:len(ids)] == [tok.token_text(t) for t in ids]
    for j in range(1, len(ids)):                                  # top-1: the most likely token at each position
        (best, v), = c.logprobs.top_logprobs[j].items()
        assert v == pytest.approx(float(lp[j - 1].max()), abs=2e-5)
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                              echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == c.text
    assert [x for ch in streamed if ch.choices and ch.choices[0].logprobs
            for x in ch.choices[0].logprobs.token_logprobs] == got
    plain = client.completions.create(model=MODEL, prompt=[prompt, ids[1:]], max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    assert plain.choices[1].text.startswith(tok.decode(ids[1:], skip_special_tokens=False))


def test_tokenize_and_detokenize(server, client, tok):
    """POST /tokenize gives the ids a completion (`prompt`) or a chat request (`messages`) runs: the same counts as
    their usage; /detokenize turns ids back into text; bad input gets a 400 naming the field."""
    base = server.base
    prompt = "Tokenize this, please: Café 中文"
    r = httpx.post(f"{base}/tokenize", json={"model": MODEL, "prompt": prompt}).json()
    assert r["tokens"] == tok.encode(prompt, add_special_tokens=True) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == CAPACITY
    used = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert used == r["count"]
    chat = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": CHAT}).json()
    assert chat["count"] == client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage.prompt_tokens
    back = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()["prompt"]
    assert back.endswith(prompt)
    for path, body, param in [("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [1, -2]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens"),
                              ("/tokenize", {"model": "other", "prompt": "x"}, "model")]:
        bad = httpx.post(f"{base}{path}", json=body)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, (path, body)


def test_logit_bias(client, tok):
    """`logit_bias` (token id strings -> [-100, 100]): +100 on one token makes a greedy completion that token
    throughout, in both endpoints, streamed too."""
    tid = tok.encode(" the")[0]
    kw = dict(model=MODEL, max_tokens=5, temperature=0, logit_bias={str(tid): 100}, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt="Bias this", logprobs=0, **kw)
    assert r.choices[0].logprobs.tokens == [tok.token_text(tid)] * 5
    chat = client.chat.completions.create(messages=CHAT, logprobs=True, **kw)
    assert [c.token for c in chat.choices[0].logprobs.content] == [tok.token_text(tid)] * 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="Bias this", stream=True, **kw))
    assert streamed == r.choices[0].text
