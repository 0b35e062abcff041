"""Bad input gets an OpenAI-style 4xx JSON error, and the server keeps serving; clients that go away mid-request
cancel their request in the engine."""

import socket
import time

import httpx
import openai
import pytest

from tests.serve.conftest import CAPACITY, metric

MODEL = "tiny-serve"
OK = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def post(server, path, body=None, raw=None):
    kw = {"content": raw, "headers": {"content-type": "application/json"}} if raw is not None else {"json": body}
    return httpx.post(f"{server.base}{path}", timeout=30, **kw)


def check_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and len(err["message"]) > 10 and err["type"]
    if param:
        assert err["param"] == param and param in err["message"]
    if code:
        assert err["code"] == code
    return err


CASES = [
    ("/v1/completions", None, b'{"model": "tiny-serve", "prompt": "x",', 400, None, "invalid_json"),
    ("/v1/completions", None, b'{"prompt": "caf\xe9"}', 400, None, "invalid_utf8"),
    ("/v1/chat/completions", None, b"\xc3\x28", 400, None, "invalid_utf8"),
    ("/v1/completions", None, b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", dict(OK, model="gpt-4"), None, 404, "model", "model_not_found"),
    ("/v1/chat/completions", dict(CHAT, model="nope"), None, 404, "model", "model_not_found"),
    ("/v1/completions", dict(OK, max_tokens=-5), None, 400, "max_tokens", None),
    ("/v1/chat/completions", dict(CHAT, max_tokens=-1), None, 400, "max_tokens", None),
    ("/v1/completions", dict(OK, temperature=-0.1), None, 400, "temperature", None),
    ("/v1/chat/completions", dict(CHAT, temperature=-1), None, 400, "temperature", None),
    ("/v1/completions", dict(OK, top_p=0), None, 400, "top_p", None),
    ("/v1/completions", dict(OK, top_p=1.01), None, 400, "top_p", None),
    ("/v1/chat/completions", dict(CHAT, top_p=-0.5), None, 400, "top_p", None),
    ("/v1/completions", dict(OK, n=0), None, 400, "n", None),
    ("/v1/chat/completions", dict(CHAT, n=65), None, 400, "n", None),
    ("/v1/completions", dict(OK, prompt=["a"] * 9, n=8), None, 400, "n", None),
    ("/v1/completions", dict(OK, prompt=list(range(1, CAPACITY + 10))), None, 400, None, "context_length_exceeded"),
    ("/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": "word " * 400}]), None, 400, None,
     "context_length_exceeded"),
    ("/v1/completions", dict(OK, max_tokens=CAPACITY), None, 400, None, "context_length_exceeded"),
    ("/v1/completions", dict(OK, prompt=[1, 99999]), None, 400, "prompt", None),
    ("/v1/completions", dict(OK, prompt=["a", ""]), None, 400, "prompt", None),
    ("/v1/completions", dict(OK, prompt=["a", [1, 99999]]), None, 400, "prompt", None),
    ("/v1/completions", dict(OK, prompt=["a", 3]), None, 400, "prompt", None),
    ("/v1/completions", dict(OK, prompt=""), None, 400, "prompt", None),
    ("/v1/chat/completions", dict(CHAT, messages=[]), None, 400, "messages", None),
    ("/v1/chat/completions", dict(CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]), None,
     400, "messages", None),
    ("/v1/chat/completions", dict(CHAT, tool_choice="required"), None, 400, "tool_choice", None),
    ("/v1/chat/completions", dict(CHAT, logprobs=True, top_logprobs=99), None, 400, "top_logprobs", None),
    ("/v1/completions", dict(OK, stop=[1, 2]), None, 400, "stop", None),
    ("/v1/completions", dict(OK, logit_bias={"abc": 1}), None, 400, "logit_bias", None),
    ("/v1/completions", dict(OK, logit_bias={"5": 1, " 5": 1}), None, 400, "logit_bias", None),   # one id twice
    ("/v1/completions", dict(OK, logit_bias={"5": 101}), None, 400, "logit_bias", None),
    ("/v1/chat/completions", dict(CHAT, logit_bias={"999999": 1}), None, 400, "logit_bias", None),
    ("/v1/completions", dict(OK, logit_bias={str(i): 1 for i in range(301)}), None, 400, "logit_bias", None),
    ("/v1/completions", dict(OK, seed="abc"), None, 400, "seed", None),
    ("/v1/completions", dict(OK, stream_options={"include_usage": True}), None, 400, "stream_options", None),
    ("/v1/nothing", {}, None, 404, None, None),
]


@pytest.mark.parametrize("path,body,raw,status,param,code", CASES)
def test_bad_request_gets_openai_error(server, path, body, raw, status, param, code):
    check_error(post(server, path, body, raw), status, param, code)


def test_still_serving_after_errors(server):
    for _ in range(2):
        for path, body, raw, *_ in CASES[:8]:
            post(server, path, body, raw)
    r = post(server, "/v1/completions", OK)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert httpx.get(f"{server.base}/health").json()["status"] == "ok"


def test_openai_client_raises_bad_request(server):
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT["messages"], temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def wait_for(cond, timeout=20):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_client_disconnect_mid_stream_cancels(server):
    aborted = metric(server.base, "fnx_requests_finished_total", 'reason="abort"')
    body = dict(OK, max_tokens=200, stream=True, ignore_eos=True)
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: ") for x in got)
    # the connection is closed here, long before 200 tokens
    wait_for(lambda: metric(server.base, "fnx_requests_finished_total", 'reason="abort"') == aborted + 1)
    wait_for(lambda: httpx.get(f"{server.base}/health").json()["in_flight"] == 0)
    assert post(server, "/v1/completions", OK).status_code == 200


def test_client_disconnect_non_streaming_cancels(server):
    aborted = metric(server.base, "fnx_requests_finished_total", 'reason="abort"')
    import json
    payload = json.dumps(dict(OK, max_tokens=200, ignore_eos=True)).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        wait_for(lambda: httpx.get(f"{server.base}/health").json()["in_flight"] == 1)
    wait_for(lambda: metric(server.base, "fnx_requests_finished_total", 'reason="abort"') == aborted + 1)
    wait_for(lambda: httpx.get(f"{server.base}/health").json()["in_flight"] == 0)
