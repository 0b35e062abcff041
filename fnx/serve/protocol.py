"""OpenAI request fields -> checked values. Every refusal is an `APIError` that says which field, what value and
what is allowed, answered as OpenAI-style JSON (`{"error": {"message", "type", "param", "code"}}`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from fnx.engine.sampling import MAX_LOGIT_BIAS


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                              429: "rate_limit_error", 503: "server_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                            f"send JSON encoded as UTF-8", code="invalid_utf8") from None

    def no_constant(name):
        raise APIError(400, f"the request body contains {name}, which is not JSON; send finite numbers",
                       code="invalid_json")
    try:
        body = json.loads(text, parse_constant=no_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _type_name(kinds) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
             dict: "an object"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def get(body: dict, name: str, kinds: tuple, default=None):
    """body[name] if present and not null, checked to be of one of `kinds` (JSON true is not a number)."""
    v = body.get(name)
    if v is None:
        return default
    if float in kinds and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise APIError(400, f"`{name}` must be {_type_name(kinds)}, got {json.dumps(v)[:80]}", param=name)
    if isinstance(v, float) and not math.isfinite(v):
        raise APIError(400, f"`{name}` must be finite, got {v}", param=name)
    return v


def number(body, name, default, lo=None, hi=None, lo_open=False, why=None):
    v = get(body, name, (float,), default)
    if v is None:
        return None
    bad = (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi)
    if bad:
        rng = why or f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise APIError(400, f"`{name}` must be {rng}, got {v}", param=name)
    return v


def integer(body, name, default, lo=None, hi=None):
    v = get(body, name, (int,), default)
    if v is None:
        return None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise APIError(400, f"`{name}` must be an integer {rng}, got {v}", param=name)
    return v


@dataclass
class Sampling:
    """The OpenAI sampling fields common to both endpoints, checked."""
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int | None
    max_tokens: int | None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    logit_bias: tuple[tuple[int, float], ...] = ()


# choices one request may ask for (`n` times the prompts of a completion): each is a request of its own in the
# engine's queue
MAX_CHOICES = 64


def sampling_fields(body: dict, defaults: dict, vocab: int) -> Sampling:
    n = integer(body, "n", 1, lo=1, hi=MAX_CHOICES)
    if get(body, "best_of", (int,), 1) != 1:
        raise APIError(400, "`best_of` other than 1 is not supported", param="best_of")
    bias = []
    for key, value in get(body, "logit_bias", (dict,), {}).items():
        try:
            tid = int(key)
        except ValueError:
            tid = -1
        if not 0 <= tid < vocab or str(tid) != key:     # exactly the id's digits: " 5" or "05" would repeat "5"
            raise APIError(400, f"`logit_bias` keys must be token ids in [0, {vocab}), got {key!r}", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise APIError(400, f"`logit_bias` values must be numbers in [-100, 100], got {json.dumps(value)[:40]} "
                                f"for {key}", param="logit_bias")
        bias.append((tid, float(value)))
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"`logit_bias` takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}",
                       param="logit_bias")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise APIError(400, f"`stop` must be a string or an array of strings, got {json.dumps(stop)[:80]}",
                       param="stop")
    if len(stop) > 16:
        raise APIError(400, f"`stop` takes at most 16 strings, got {len(stop)}", param="stop")
    stop_ids = get(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop_ids):
        raise APIError(400, f"`stop_token_ids` must be token ids in [0, {vocab})", param="stop_token_ids")
    max_tokens = integer(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", None, lo=1)
    seed = integer(body, "seed", None)
    top_k = integer(body, "top_k", defaults.get("top_k", 0), lo=-1, hi=2**31 - 1)
    stream_options = get(body, "stream_options", (dict,), {})
    stream = get(body, "stream", (bool,), False)
    if stream_options and not stream:
        raise APIError(400, "`stream_options` is only allowed together with `stream: true`", param="stream_options")
    return Sampling(
        temperature=number(body, "temperature", defaults.get("temperature", 1.0), lo=0, why=">= 0"),
        top_p=number(body, "top_p", defaults.get("top_p", 1.0), lo=0, hi=1, lo_open=True),
        top_k=0 if top_k >= vocab or top_k < 0 else top_k,
        min_p=number(body, "min_p", defaults.get("min_p", 0.0), lo=0, hi=1),
        presence_penalty=number(body, "presence_penalty", 0.0, lo=-2, hi=2),
        frequency_penalty=number(body, "frequency_penalty", 0.0, lo=-2, hi=2),
        repetition_penalty=number(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0), lo=0,
                                  lo_open=True, why="> 0"),
        # The engine's PRNG takes 32-bit seeds: any integer is accepted and used modulo 2**32.
        seed=None if seed is None else seed % 2**32,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=get(body, "ignore_eos", (bool,), False),
        stream=stream,
        include_usage=bool(get(stream_options, "include_usage", (bool,), False)),
        n=n,
        logit_bias=tuple(bias),
    )
