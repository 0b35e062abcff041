"""Text-level post-processing of generated output: stop strings, and the Qwen chat format (`<think>` reasoning,
`<tool_call>{json}</tool_call>` tool calls), both incremental so that streaming and non-streaming responses come
from the same code."""

from __future__ import annotations

import json
import uuid


def _partial_suffix(text: str, tags) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (text to hold back)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class StopStrings:
    """Cuts the output at the first occurrence of any stop string. Text that could still grow into a stop string
    is held back until it cannot (or until the end of the stream)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text to release, whether a stop string was hit; if so, nothing after it is released)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
        keep = _partial_suffix(buf, self.stops)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def starts_in_reasoning(prompt_text: str) -> bool:
    """Templates that open `<think>` in the generation prompt leave the model mid-reasoning."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def parse_tool_call(body: str) -> dict | None:
    """`{"name": ..., "arguments": {...}}` -> an OpenAI tool call, or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


class ChatParser:
    """Generated text in, events out: ("reasoning", text), ("content", text), ("tool_call", call).

    reasoning: split `<think>...</think>` off (starting inside it when the prompt opened it).
    tools: parse `<tool_call>{json}</tool_call>`; a block that is not valid JSON is passed through as content."""

    def __init__(self, reasoning: bool = True, in_reasoning: bool = False, tools: bool = True):
        self.reasoning, self.tools = reasoning, tools
        self.mode = "reasoning" if (reasoning and in_reasoning) else "content"
        self.buf = ""
        self.at_start = True                 # nothing emitted in the current section yet (strip leading newlines)
        self.seen_content = False

    def _emit(self, kind: str, text: str, events: list):
        if self.at_start:
            text = text.lstrip("\n")
        if text:
            self.at_start = False
            if kind == "content":
                self.seen_content = True
            if events and events[-1][0] == kind:
                events[-1] = (kind, events[-1][1] + text)
            else:
                events.append((kind, text))

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        events: list[tuple] = []
        while self.buf:
            if self.mode == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    self._emit("reasoning", self.buf[:i], events)
                    self.buf = self.buf[i + len(THINK_CLOSE):]
                    self.mode, self.at_start = "content", True
                    continue
                keep = _partial_suffix(self.buf, [THINK_CLOSE])
                self._emit("reasoning", self.buf[:len(self.buf) - keep], events)
                self.buf = self.buf[len(self.buf) - keep:]
                break
            if self.mode == "tool":
                i = self.buf.find(TOOL_CLOSE)
                if i < 0:
                    break
                body, self.buf = self.buf[:i], self.buf[i + len(TOOL_CLOSE):]
                call = parse_tool_call(body.strip())
                if call is None:
                    self._emit("content", TOOL_OPEN + body + TOOL_CLOSE, events)
                else:
                    events.append(("tool_call", call))
                self.mode = "content"
                continue
            # content
            if self.reasoning and not self.seen_content and self.buf.lstrip("\n").startswith(THINK_OPEN):
                self.buf = self.buf.lstrip("\n")[len(THINK_OPEN):]
                self.mode, self.at_start = "reasoning", True
                continue
            tags = ([TOOL_OPEN] if self.tools else []) + \
                   ([THINK_OPEN] if self.reasoning and not self.seen_content else [])
            i = self.buf.find(TOOL_OPEN) if self.tools else -1
            if i >= 0:
                self._emit("content", self.buf[:i], events)
                self.buf = self.buf[i + len(TOOL_OPEN):]
                self.mode = "tool"
                continue
            keep = _partial_suffix(self.buf, tags) if tags else 0
            if self.reasoning and not self.seen_content and THINK_OPEN.startswith(self.buf.lstrip("\n")):
                keep = len(self.buf)
            self._emit("content", self.buf[:len(self.buf) - keep], events)
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return events

    def finish(self) -> list[tuple]:
        """End of output: a reasoning block cut short stays reasoning; an unterminated tool call is content."""
        events: list[tuple] = []
        rest, self.buf = self.buf, ""
        if self.mode == "tool":
            self._emit("content", TOOL_OPEN + rest, events)
        elif rest:
            self._emit(self.mode, rest, events)
        self.mode = "content"
        return events
