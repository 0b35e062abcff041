"""The text layer without a server: incremental detokenisation, stop strings, the Qwen reasoning/tool-call parser,
the chat template, request field checks."""

import json

import pytest

from fnx.serve.protocol import APIError, parse_body, sampling_fields
from fnx.serve.text import ChatParser, StopStrings
from fnx.tokenizer import Tokenizer
from tests.serve.checkpoint import CHAT_TEMPLATE, train_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))
    return Tokenizer(d)


TEXTS = ["Café naïve 中文文本 🙂🚀 ∑∞ plain ascii", "日本語のテキストです。", "🎉" * 5, "a\u0301 e\u0301"]


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_never_splits_a_character(tok, text):
    ids = tok.encode(text)
    assert len(ids) > len(text.encode()) // 4   # byte-level pieces: many characters span several tokens
    d = tok.detokenizer()
    pieces = [d.add([i]) for i in ids] + [d.flush()]
    assert "".join(pieces) == text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_invalid_bytes_become_replacement(tok):
    lone = [i for i in range(tok.vocab_size) if tok.token_bytes(i) == bytes([0xE4])][0]  # a 3-byte lead alone
    d = tok.detokenizer()
    assert d.add([lone]) == ""                   # held: it may still be completed
    assert d.add(tok.encode("x")) == "\ufffdx"   # it was not
    assert d.add([lone]) + d.flush() == "\ufffd"


def test_detokenizer_skips_special_tokens_only(tok):
    ids = tok.encode("<|im_end|><think>a</think><tool_call>")
    d = tok.detokenizer()
    assert "".join(d.add([i]) for i in ids) == "<think>a</think><tool_call>"


def feed_all(make, text, step):
    p = make()
    events = []
    for i in range(0, len(text), step):
        events += p.feed(text[i:i + step])
    events += p.finish()
    merged = []
    for kind, val in events:
        if merged and kind == merged[-1][0] and kind != "tool_call":
            merged[-1] = (kind, merged[-1][1] + val)
        else:
            merged.append((kind, val))
    return merged


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_chat_parser_any_chunking(step):
    text = ('<think>\nI should call the tool.\n</think>\n\nLet me check. <tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call> done <tool_call>not json</tool_call>')
    ev = feed_all(lambda: ChatParser(tools=True), text, step)
    kinds = [k for k, _ in ev]
    assert kinds == ["reasoning", "content", "tool_call", "content"]
    assert ev[0][1] == "I should call the tool.\n"
    assert ev[1][1] == "Let me check. "
    call = ev[2][1]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert ev[3][1] == " done <tool_call>not json</tool_call>"


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_chat_parser_prompt_opened_think_and_truncation(step):
    ev = feed_all(lambda: ChatParser(in_reasoning=True), "step one</think>answer <tool_call>{}", step)
    assert ev == [("reasoning", "step one"), ("content", "answer <tool_call>{}")]   # tools off: plain text
    ev = feed_all(lambda: ChatParser(tools=True), "x <tool_call>{\"name\": \"f\"", step)
    assert ev == [("content", "x <tool_call>{\"name\": \"f\"")]                    # cut short: stays text
    ev = feed_all(lambda: ChatParser(reasoning=False), "<think>a</think>b", step)
    assert ev == [("content", "<think>a</think>b")]


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_stop_strings(step):
    text = "Hello world. STOP here. END"
    s = StopStrings(["END", "STOP"])
    out, hit = "", False
    for i in range(0, len(text), step):
        r, hit = s.feed(text[i:i + step])
        out += r
        if hit:
            break
    assert hit and out == "Hello world. "
    s = StopStrings(["xyz"])
    out = "".join(s.feed(c)[0] for c in "abc xy") + s.flush()
    assert out == "abc xy"


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] == tok.token_id("<|im_start|>") and tok.token_id("<|im_end|>") in ids


def test_request_checks():
    with pytest.raises(APIError) as e:
        parse_body(b'{"a": NaN}')
    assert e.value.status == 400
    with pytest.raises(APIError) as e:
        parse_body(b"\xff\xfe{}")
    assert "UTF-8" in e.value.message
    for body, param in [({"temperature": -0.5}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                        ({"max_tokens": -3}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"),
                        ({"temperature": "hot"}, "temperature"), ({"seed": 1.5}, "seed"), ({"stop": [1]}, "stop"),
                        ({"temperature": True}, "temperature")]:
        with pytest.raises(APIError) as e:
            sampling_fields(body, {}, 320)
        assert e.value.status == 400 and e.value.param == param, body
        assert param in e.value.message
    s = sampling_fields({"seed": -1, "top_k": 10_000, "stop": "x"}, {}, 320)
    assert s.seed == 2**32 - 1 and s.top_k == 0 and s.stop == ["x"]
