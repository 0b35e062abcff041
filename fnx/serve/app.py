"""HTTP handlers: the OpenAI-compatible API, health, metrics and the chat page, as a Starlette app. Handlers
parse and check requests, tokenize, hand token ids to the scheduler and turn its outputs into text, SSE chunks
and OpenAI response objects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field, replace

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from fnx.engine import SamplingParams
from fnx.serve.metrics import Metrics
from fnx.serve.page import CHAT_PAGE
from fnx.serve.protocol import MAX_CHOICES, APIError, Sampling, get, integer, parse_body, sampling_fields
from fnx.serve.scheduler import QueueFull, RequestStream, Scheduler, Unavailable
from fnx.serve.text import ChatParser, StopStrings, starts_in_reasoning
from fnx.tokenizer import TemplateError, Tokenizer, TokenizerError
from fnx.serve.worker import LOGPROBS_BUCKET


@dataclass
class ServerState:
    tokenizer: Tokenizer
    scheduler: Scheduler
    metrics: Metrics
    model_name: str
    capacity: int
    reserve: int                          # positions a request needs beyond prompt + max_tokens (Engine.reserve)
    vocab: int
    reasoning: bool                       # split <think>...</think> into reasoning_content
    defaults: dict = field(default_factory=dict)   # sampling defaults from generation_config.json
    created: int = field(default_factory=lambda: int(time.time()))
    info: dict = field(default_factory=dict)


@dataclass
class Piece:
    """What one engine output turned into: released text, its tokens' logprobs, and maybe the end."""
    text: str
    token_ids: list[int]
    logprobs: list[dict]
    finish_reason: str | None = None
    prompt_logprobs: list | None = None   # with a request's first piece, when it asked for them


def _err(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


# ---- shared request plumbing -----------------------------------------------------------------------------------

def _check_model(st: ServerState, body: dict):
    name = get(body, "model", (str,), st.model_name)
    if name != st.model_name:
        raise APIError(404, f"the model `{name}` does not exist on this server; it serves `{st.model_name}` "
                            f"(see GET /v1/models)", param="model", code="model_not_found")


async def _body(st: ServerState, request: Request) -> dict:
    """The request's JSON body, checked, for this server's model."""
    body = parse_body(await request.body())
    _check_model(st, body)
    return body


def _engine_params(st: ServerState, s: Sampling, prompt_len: int, top_n: int | None) -> SamplingParams:
    max_tokens = s.max_tokens
    room = st.capacity - prompt_len - st.reserve
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this server's context holds {st.capacity} "
                            f"positions ({prompt_len + st.reserve + 1} needed to generate one token). Shorten the "
                            f"prompt or start the server with a larger --capacity", param="messages",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = room
    try:
        return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                              repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
                              frequency_penalty=s.frequency_penalty, seed=s.seed, max_tokens=max_tokens,
                              stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos, logit_bias=s.logit_bias,
                              logprobs=0 if top_n is None or top_n == 0 else LOGPROBS_BUCKET)
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split(" ")[0]) from None


async def _submit(st: ServerState, prompt: list[int], params: SamplingParams) -> RequestStream:
    try:
        return await st.scheduler.submit(prompt, params)
    except QueueFull as e:
        raise APIError(429, str(e), code="queue_full") from None
    except Unavailable as e:
        raise APIError(503, str(e), code="unavailable") from None
    except ValueError as e:
        msg = str(e)
        code = "context_length_exceeded" if "context" in msg else None
        raise APIError(400, msg, code=code) from None


async def _submit_all(st: ServerState, jobs: list[tuple[list[int], SamplingParams]]) -> list[RequestStream]:
    """One engine request per choice; if one is refused (a full queue), those already queued are cancelled and the
    whole request fails with that error."""
    streams: list[RequestStream] = []
    try:
        for prompt, params in jobs:
            streams.append(await _submit(st, prompt, params))
    except APIError:
        for stream in streams:
            st.scheduler.abort(stream.id)
        raise
    return streams


def _choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The engine parameters of a prompt's n choices: with a seed, choice j samples with seed + j (reproducible,
    and not n copies of one sample); without one, each draws its own."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + j) % 2**32) for j in range(n)]


async def _merged(gens: list):
    """(i, item) from several async generators as their items come; an exception in one ends the merge with it."""
    if len(gens) == 1:
        async for x in gens[0]:
            yield 0, x
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, gen):
        try:
            async for x in gen:
                await queue.put((i, x))
            await queue.put((i, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))
    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    left = len(gens)
    try:
        while left:
            i, x = await queue.get()
            if x is done:
                left -= 1
            elif isinstance(x, Exception):
                raise x
            else:
                yield i, x
    finally:
        for t in tasks:
            t.cancel()


async def _pieces(st: ServerState, stream: RequestStream, stops: StopStrings, want_lp: bool):
    """Engine outputs -> Pieces: detokenised (never half a character), cut at stop strings."""
    detok = st.tokenizer.detokenizer()
    async for out in stream:
        if out.finished and out.finish_reason in ("abort", "error") and not out.token_ids:
            if out.finish_reason == "error":
                raise APIError(500, "the engine failed while running this request (see the server log)",
                               code="engine_error")
            raise APIError(503, "the request was cancelled (the client went away or the server is shutting down)",
                           code="aborted")
        text = detok.add(out.token_ids)
        if out.finished:
            text += detok.flush()
        released, hit = stops.feed(text)
        lps = out.logprobs if want_lp else []
        plp = out.prompt_logprobs
        if hit:
            st.scheduler.abort(stream.id, reason="stop")
            yield Piece(released, out.token_ids, lps, "stop", plp)
            return
        if out.finished:
            yield Piece(released + stops.flush(), out.token_ids, lps,
                        "length" if out.finish_reason == "length" else "stop", plp)
            return
        yield Piece(released, out.token_ids, lps, None, plp)


def _usage(streams: list[RequestStream], n: int) -> dict:
    """Token counts of a response: each prompt once (its n choices share it), every choice's generated tokens."""
    prompt = sum(s.prompt_tokens for s in streams[::n])
    generated = sum(s.generated for s in streams)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}


async def _run_to_end(request: Request, st: ServerState, streams: list[RequestStream], gens: list) -> list[list]:
    """Drain every choice's generator for a non-streaming response (together), cancelling the requests if the
    client goes away first or one of them fails."""
    def abort_all():
        for stream in streams:
            st.scheduler.abort(stream.id)

    async def watch():
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                abort_all()
                return

    async def drain(gen):
        return [p async for p in gen]
    watcher = asyncio.create_task(watch())
    tasks = [asyncio.create_task(drain(g)) for g in gens]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
        if failed is not None:
            abort_all()                                    # the other choices end too (their errors are not news)
            await asyncio.gather(*tasks, return_exceptions=True)
            raise failed.exception()
        return [t.result() for t in tasks]
    finally:
        watcher.cancel()
        for t in tasks:
            t.cancel()
        abort_all()


def _sse(st: ServerState, streams: list[RequestStream], chunks):
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            for stream in streams:              # a no-op when finished; cancels when the client went away
                st.scheduler.abort(stream.id)
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _top_n(body: dict, chat: bool) -> int | None:
    """None: no logprobs; n >= 0: the chosen token's logprob and the n most likely."""
    if chat:
        if not get(body, "logprobs", (bool,), False):
            if body.get("top_logprobs") is not None:
                raise APIError(400, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
            return None
        return integer(body, "top_logprobs", 0, lo=0, hi=LOGPROBS_BUCKET)
    return integer(body, "logprobs", None, lo=0, hi=LOGPROBS_BUCKET)


# ---- /v1/completions -------------------------------------------------------------------------------------------

def _one_prompt(st: ServerState, p, where: str) -> list[int] | None:
    """A prompt as token ids (a string, or an array of token ids), or None when `p` is neither."""
    if isinstance(p, str):
        if not p:
            raise APIError(400, f"{where} is empty", param="prompt")
        return st.tokenizer.encode(p, add_special_tokens=True)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < st.vocab]
        if bad:
            raise APIError(400, f"{where}'s token ids must lie in [0, {st.vocab}), got {bad[0]}", param="prompt")
        return list(p)
    return None


def _completion_prompts(st: ServerState, body: dict) -> list[tuple[list[int], str | None]]:
    """`prompt`: a string, an array of token ids, or an array of either (several prompts, a choice each), as
    (token ids, the string or None)."""
    p = body.get("prompt")
    one = _one_prompt(st, p, "`prompt`")
    if one is not None:
        return [(one, p if isinstance(p, str) else None)]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        out = []
        for i, x in enumerate(p):
            ids = _one_prompt(st, x, f"`prompt[{i}]`")
            if ids is None:
                raise APIError(400, f"`prompt[{i}]` must be a non-empty string or a non-empty array of token ids",
                               param="prompt")
            out.append((ids, x if isinstance(x, str) else None))
        return out
    raise APIError(400, "`prompt` must be a non-empty string, a non-empty array of token ids, or an array of those",
                   param="prompt")


def _completion_logprobs(st: ServerState, ids: list[int], lps: list[dict | None], top_n: int, offset: int):
    """The legacy `logprobs` object of tokens `ids`; an entry None (an echoed prompt's first token) has none."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for t, lp in zip(ids, lps):
        s = st.tokenizer.token_text(t)
        tokens.append(s)
        token_lps.append(None if lp is None else lp.get("logprob"))
        tops.append({st.tokenizer.token_text(i): v for i, v in lp.get("top", [])[:top_n]}
                    if top_n and lp is not None else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


async def completions(request: Request):
    st: ServerState = request.app.state.fnx
    try:
        body = await _body(st, request)
        echo = get(body, "echo", (bool,), False)
        if get(body, "suffix", (str,), None):
            raise APIError(400, "`suffix` is not supported by this server", param="suffix")
        s = sampling_fields(body, st.defaults, st.vocab)
        top_n = _top_n(body, chat=False)
        prompts = _completion_prompts(st, body)
        if len(prompts) * s.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={s.n} choices is more than the {MAX_CHOICES} one request "
                                f"may ask for", param="n")
        jobs = []
        for prompt, _ in prompts:
            params = _engine_params(st, s, len(prompt), top_n)
            if echo and top_n is not None:       # the echoed prompt's tokens with their logprobs
                params = replace(params, prompt_logprobs=top_n)
            jobs += [(prompt, p) for p in _choice_params(params, s.n)]
        streams = await _submit_all(st, jobs)
    except APIError as e:
        return _err(e)
    rid, created = streams[0].id, int(time.time())
    # echo: each choice's text (and logprobs) start with its prompt's
    echoed = [(ids, text if text is not None else st.tokenizer.decode(ids, skip_special_tokens=False))
              for ids, text in prompts for _ in range(s.n)] if echo else None
    gens = [_pieces(st, stream, StopStrings(s.stop), top_n is not None) for stream in streams]

    def choice(i, text, lp, finish):
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

    def chunk(choices):
        return {"id": rid, "object": "text_completion", "created": created, "model": st.model_name,
                "choices": choices}

    if s.stream:
        async def chunks():
            offsets = [0] * len(streams)
            started = [False] * len(streams)
            async for i, p in _merged(gens):
                lp, text = None, p.text
                ids, lps = p.token_ids, p.logprobs
                if echoed is not None and not started[i]:
                    text = echoed[i][1] + text
                    ids, lps = echoed[i][0] + ids, (p.prompt_logprobs or []) + lps
                started[i] = True
                if top_n is not None:
                    lp, offsets[i] = _completion_logprobs(st, ids, lps, top_n, offsets[i])
                if text or lp:
                    yield chunk([choice(i, text, lp, None)])
                if p.finish_reason:
                    yield chunk([choice(i, "", None, p.finish_reason)])
            if s.include_usage:
                yield dict(chunk([]), usage=_usage(streams, s.n))
        return _sse(st, streams, chunks())
    try:
        results = await _run_to_end(request, st, streams, gens)
    except APIError as e:
        return _err(e)
    choices = []
    for i, parts in enumerate(results):
        text, ids, lps = "".join(p.text for p in parts), [t for p in parts for t in p.token_ids], \
            [x for p in parts for x in p.logprobs]
        if echoed is not None:
            text, ids = echoed[i][1] + text, echoed[i][0] + ids
            lps = ((parts[0].prompt_logprobs if parts else None) or []) + lps
        lp = None
        if top_n is not None:
            lp, _ = _completion_logprobs(st, ids, lps, top_n, 0)
        choices.append(choice(i, text, lp, parts[-1].finish_reason if parts else "stop"))
    return JSONResponse(dict(chunk(choices), usage=_usage(streams, s.n)))


# ---- /v1/chat/completions --------------------------------------------------------------------------------------

def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "`messages` must be a non-empty array of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"`messages[{i}]` must be an object with a string `role`", param="messages")
        m = dict(m)
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            texts = []
            for part in c:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise APIError(400, f"`messages[{i}].content` has a part of type {kind!r}; this server takes "
                                        f"text parts only", param="messages")
                texts.append(part["text"])
            m["content"] = "".join(texts)
        elif c is not None and not isinstance(c, str):
            raise APIError(400, f"`messages[{i}].content` must be a string or an array of text parts",
                           param="messages")
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function") if isinstance(tc, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                # Qwen templates print dict arguments with tojson; decode the OpenAI string form for them.
                with contextlib.suppress(ValueError):
                    fn["arguments"] = json.loads(fn["arguments"])
        out.append(m)
    return out


def _chat_logprobs(st: ServerState, ids: list[int], lps: list[dict], top_n: int) -> list[dict]:
    tok = st.tokenizer
    out = []
    for t, lp in zip(ids, lps):
        out.append({"token": tok.token_text(t), "logprob": lp.get("logprob"), "bytes": list(tok.token_bytes(t)),
                    "top_logprobs": [{"token": tok.token_text(i), "logprob": v, "bytes": list(tok.token_bytes(i))}
                                     for i, v in lp.get("top", [])[:top_n]]})
    return out


def _render_chat(st: ServerState, body: dict, messages: list[dict], tools, add_generation_prompt: bool) -> str:
    """The conversation through the chat template (`chat_template_kwargs`, `reasoning_effort`); a template that
    refuses or fails is the request's error."""
    kwargs = dict(get(body, "chat_template_kwargs", (dict,), {}))
    effort = get(body, "reasoning_effort", (str,), None)
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    for reserved in ("messages", "tools", "add_generation_prompt"):
        kwargs.pop(reserved, None)
    try:
        return st.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                **kwargs)
    except TemplateError as e:
        raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
    except TokenizerError as e:
        raise APIError(400, str(e), param="messages") from None
    except Exception as e:  # a template that fails on unexpected input: still the request's fault
        raise APIError(400, f"the chat template could not render these messages: {type(e).__name__}: {e}",
                       param="messages") from None


async def chat_completions(request: Request):
    st: ServerState = request.app.state.fnx
    try:
        body = await _body(st, request)
        s = sampling_fields(body, st.defaults, st.vocab)
        top_n = _top_n(body, chat=True)
        messages = _messages(body)
        tools = get(body, "tools", (list,), None)
        tool_choice = body.get("tool_choice", "auto")
        if tool_choice not in ("auto", "none", None):
            raise APIError(400, f"`tool_choice` {json.dumps(tool_choice)} is not supported: this server does not "
                                f"constrain decoding; use \"auto\" or \"none\"", param="tool_choice")
        if tool_choice == "none":
            tools = None
        rf = get(body, "response_format", (dict,), None)
        if rf and rf.get("type") not in (None, "text"):
            raise APIError(400, f"`response_format` {rf.get('type')!r} is not supported (no constrained decoding)",
                           param="response_format")
        text = _render_chat(st, body, messages, tools, add_generation_prompt=True)
        prompt = st.tokenizer.encode(text, add_special_tokens=False)
        if not prompt:
            raise APIError(400, "the rendered chat prompt is empty", param="messages")
        params = _engine_params(st, s, len(prompt), top_n)
        streams = await _submit_all(st, [(prompt, p) for p in _choice_params(params, s.n)])
    except APIError as e:
        return _err(e)
    rid, created = "chatcmpl-" + streams[0].id.split("-", 1)[1], int(time.time())
    in_reasoning = st.reasoning and starts_in_reasoning(text)
    parsers = [ChatParser(reasoning=st.reasoning, in_reasoning=in_reasoning, tools=bool(tools)) for _ in streams]
    gens = [_pieces(st, stream, StopStrings(s.stop), top_n is not None) for stream in streams]

    def chunk(i, delta, lp, finish):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

    if s.stream:
        async def chunks():
            for i in range(len(streams)):
                yield chunk(i, {"role": "assistant", "content": ""}, None, None)
            n_calls = [0] * len(streams)
            pending_lp: list[list[dict]] = [[] for _ in streams]
            async for i, p in _merged(gens):
                if top_n is not None:
                    pending_lp[i] += _chat_logprobs(st, p.token_ids, p.logprobs, top_n)
                events = parsers[i].feed(p.text) + (parsers[i].finish() if p.finish_reason else [])
                for kind, val in events:
                    if kind == "tool_call":
                        delta = {"tool_calls": [{"index": n_calls[i], **val}]}
                        n_calls[i] += 1
                    else:
                        delta = {"reasoning_content" if kind == "reasoning" else "content": val}
                    yield chunk(i, delta, {"content": pending_lp[i]} if pending_lp[i] else None, None)
                    pending_lp[i] = []
                if p.finish_reason:
                    finish = "tool_calls" if n_calls[i] and p.finish_reason == "stop" else p.finish_reason
                    yield chunk(i, {}, {"content": pending_lp[i]} if pending_lp[i] else None, finish)
            if s.include_usage:
                yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.model_name,
                       "choices": [], "usage": _usage(streams, s.n)}
        return _sse(st, streams, chunks())
    try:
        results = await _run_to_end(request, st, streams, gens)
    except APIError as e:
        return _err(e)
    choices = []
    for i, (parts, parser) in enumerate(zip(results, parsers)):
        events = parser.feed("".join(p.text for p in parts)) + parser.finish()
        content = "".join(v for k, v in events if k == "content")
        reasoning = "".join(v for k, v in events if k == "reasoning")
        calls = [v for k, v in events if k == "tool_call"]
        message = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        finish = parts[-1].finish_reason if parts else "stop"
        if calls and finish == "stop":
            finish = "tool_calls"
        lp = None
        if top_n is not None:
            lp = {"content": _chat_logprobs(st, [t for p in parts for t in p.token_ids],
                                            [x for p in parts for x in p.logprobs], top_n)}
        choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": st.model_name,
                         "choices": choices, "usage": _usage(streams, s.n)})


# ---- /tokenize, /detokenize (the server's own tokenizer, as vLLM's endpoints of these names) ----------------------

async def tokenize(request: Request):
    """{"prompt": text[, "add_special_tokens": true]} or {"messages": [...][, "add_generation_prompt": true,
    "tools", "chat_template_kwargs"]} -> {"count", "max_model_len", "tokens"}: the ids a completion or a chat
    request with these fields would run."""
    st: ServerState = request.app.state.fnx
    try:
        body = await _body(st, request)
        if "messages" in body:
            text = _render_chat(st, body, _messages(body), get(body, "tools", (list,), None),
                                get(body, "add_generation_prompt", (bool,), True))
            ids = st.tokenizer.encode(text, add_special_tokens=False)
        else:
            p = get(body, "prompt", (str,), None)
            if p is None:
                raise APIError(400, "give `prompt` (a string) or `messages`", param="prompt")
            ids = st.tokenizer.encode(p, add_special_tokens=get(body, "add_special_tokens", (bool,), True))
    except APIError as e:
        return _err(e)
    return JSONResponse({"count": len(ids), "max_model_len": st.capacity, "tokens": ids})


async def detokenize(request: Request):
    """{"tokens": [ids]} -> {"prompt": text} (special tokens kept)."""
    st: ServerState = request.app.state.fnx
    try:
        body = await _body(st, request)
        ids = get(body, "tokens", (list,), None)
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "`tokens` must be an array of token ids", param="tokens")
        bad = [t for t in ids if not 0 <= t < st.vocab]
        if bad:
            raise APIError(400, f"`tokens` must lie in [0, {st.vocab}), got {bad[0]}", param="tokens")
    except APIError as e:
        return _err(e)
    return JSONResponse({"prompt": st.tokenizer.decode(ids, skip_special_tokens=False)})


# ---- the rest --------------------------------------------------------------------------------------------------

async def models(request: Request):
    st: ServerState = request.app.state.fnx
    return JSONResponse({"object": "list", "data": [{"id": st.model_name, "object": "model", "created": st.created,
                                                     "owned_by": "fnx", "max_model_len": st.capacity}]})


async def health(request: Request):
    st: ServerState = request.app.state.fnx
    sch = st.scheduler
    if sch.worker.failed is not None:
        return JSONResponse({"status": "failed", "error": str(sch.worker.failed)}, status_code=503)
    if sch.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok", "model": st.model_name, "running": st.metrics.engine.get("running", 0),
                         "in_flight": sch.in_flight})


async def metrics(request: Request):
    st: ServerState = request.app.state.fnx
    running = st.metrics.engine.get("running", 0)
    return PlainTextResponse(st.metrics.render(max(0, st.scheduler.in_flight - running), running),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


async def page(request: Request):
    return HTMLResponse(CHAT_PAGE)


async def _not_found(request: Request, exc):
    status = getattr(exc, "status_code", 404)
    msg = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return _err(APIError(status, msg.get(status, str(getattr(exc, "detail", exc))), code="not_found"))


async def _internal(request: Request, exc):
    return _err(APIError(500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error"))


def build_app(state: ServerState) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.scheduler.start(asyncio.get_running_loop())
        yield
        await state.scheduler.drain(0)

    app = Starlette(routes=[
        Route("/", page, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ], exception_handlers={404: _not_found, 405: _not_found, 500: _internal}, lifespan=lifespan)
    app.state.fnx = state
    return app
