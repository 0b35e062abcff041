"""The server with MTP speculation (`--speculative 2`), through the real `openai` client: its rounds overlapped
(each launched before the previous round's tokens reach the host), the same greedy text as the plain server, every
program compiled by the warm-up, and requests that run to the edge of the context."""

import httpx
import openai
import pytest

from tests.serve.conftest import Server, metric

MODEL = "tiny-serve"
CAP, K = 128, 2


@pytest.fixture(scope="module")
def spec(serve_checkpoint, jax_cache, tmp_path_factory):
    s = Server(serve_checkpoint, tmp_path_factory.mktemp("logs") / "spec.log", jax_cache,
               "--max-slots", "2", "--capacity", str(CAP), "--prefill-chunk", "16", "--speculative", str(K))
    yield s
    s.stop()


def _client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _compiles_after_warmup(base: str) -> float:
    return sum(float(line.split()[-1]) for line in httpx.get(f"{base}/metrics").text.splitlines()
               if line.startswith("fnx_compiles_after_warmup_total"))


def test_speculative_server_equals_the_plain_one_and_compiles_nothing_new(spec, server):
    """Greedy text equal to the plain server's over many rounds (streamed and not), with penalties too; sampled,
    logprob, penalized and logit-biased requests and two at once run only programs the warm-up compiled; the acceptance metric
    moves."""
    before = _compiles_after_warmup(spec.base)
    kw = dict(model=MODEL, prompt="Speculate over several rounds, please", max_tokens=16, temperature=0,
              extra_body={"ignore_eos": True})
    plain = _client(server.base).completions.create(**kw)
    fast = _client(spec.base).completions.create(**kw)
    assert fast.choices[0].text == plain.choices[0].text and fast.usage.completion_tokens == 16
    streamed = "".join(c.choices[0].text for c in _client(spec.base).completions.create(stream=True, **kw))
    assert streamed == plain.choices[0].text
    c = _client(spec.base)
    for temperature, logprobs, pen, bias in ((0.8, None, 0, None), (0.8, 3, 0, None), (0, 2, 0, None),
                                             (0, None, 0.5, None), (0.8, 2, 0.5, None), (0, None, 0, {"11": 2.0}),
                                             (0.8, 2, 0.5, {"11": 2.0})):
        r = c.completions.create(model=MODEL, prompt="sampled rounds", max_tokens=10, temperature=temperature,
                                 seed=4, logprobs=logprobs, frequency_penalty=pen, logit_bias=bias,
                                 extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 10
        if logprobs:
            assert len(r.choices[0].logprobs.top_logprobs) == 10
    pen = dict(kw, frequency_penalty=1.5, extra_body={"ignore_eos": True, "repetition_penalty": 1.2})
    assert (_client(spec.base).completions.create(**pen).choices[0].text
            == _client(server.base).completions.create(**pen).choices[0].text)   # penalties: lossless too
    with httpx.Client(timeout=120) as a, httpx.Client(timeout=120) as b:     # two requests in two slots at once
        body = dict(model=MODEL, prompt="together", max_tokens=9, temperature=0, ignore_eos=True, stream=True)
        with a.stream("POST", f"{spec.base}/v1/completions", json=body) as r1, \
                b.stream("POST", f"{spec.base}/v1/completions", json=dict(body, prompt="at once")) as r2:
            assert r1.status_code == 200 and r2.status_code == 200
            assert sum(1 for _ in r1.iter_lines()) and sum(1 for _ in r2.iter_lines())
    assert _compiles_after_warmup(spec.base) == before
    assert metric(spec.base, "fnx_spec_decode_acceptance_length") >= 1


def test_a_request_runs_to_the_edge_of_the_context(spec):
    """Without max_tokens a request gets the rest of the context less what an overlapped round reserves (k + 1
    positions, and k - 1 for the round that may run after its last tokens), and runs there without error; one token
    more is refused with the reason."""
    c = _client(spec.base)
    r = c.completions.create(model=MODEL, prompt="to the edge", temperature=0, extra_body={"ignore_eos": True})
    room = CAP - r.usage.prompt_tokens - (K + 1 + K - 1)
    assert r.usage.completion_tokens == room and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="context"):
        c.completions.create(model=MODEL, prompt="to the edge", max_tokens=room + 1, temperature=0)
    again = c.completions.create(model=MODEL, prompt="after the edge", max_tokens=5, temperature=0)
    assert again.usage.completion_tokens <= 5
