"""The checkpoint's tokenizer (`tokenizer.json` through the `tokenizers` library), incremental detokenisation
that never emits half of a multi-byte character, and the chat template (jinja2, from tokenizer_config.json or
chat_template.jinja)."""

from __future__ import annotations

import codecs
import json
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(RuntimeError):
    pass


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The GPT-2 byte-level alphabet: printable unicode stand-in -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Tokenizer:
    """Text <-> ids, the special tokens, and the chat template of one checkpoint directory."""

    def __init__(self, directory: str | Path):
        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {d}: the server needs the checkpoint's tokenizer "
                                 f"(an HF `tokenizers` file) beside config.json")
        self.tok = HFTokenizer.from_file(str(path))
        spec = json.loads(path.read_text(encoding="utf-8"))
        cfg_path = d / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        self.added = {t["id"]: t for t in spec.get("added_tokens", [])}
        self.special_ids = {i for i, t in self.added.items() if t.get("special")}
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        decoder = spec.get("decoder") or {}
        kinds = {decoder.get("type")} | {x.get("type") for x in decoder.get("decoders", []) or []}
        self.byte_level = "ByteLevel" in kinds
        self._bytes: list[bytes | None] | None = None
        if self.byte_level:
            bd = _byte_decoder()
            table: list[bytes | None] = [None] * self.vocab_size
            for piece, i in self.tok.get_vocab(with_added_tokens=False).items():
                if i < len(table):
                    table[i] = bytes(bd[c] for c in piece) if all(c in bd for c in piece) else piece.encode()
            for i, t in self.added.items():
                if i < len(table):
                    table[i] = t["content"].encode()
            self._bytes = table
        self.template_source = self._find_template(d)
        self._template = None
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))

    # ---- ids ------------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    def token_bytes(self, i: int) -> bytes:
        """The exact bytes one token stands for (byte-level tokenizers), else its decoded text."""
        if self._bytes is not None:
            return (self._bytes[i] if 0 <= i < len(self._bytes) else None) or b""
        return self.tok.decode([i], skip_special_tokens=False).encode()

    def token_text(self, i: int) -> str:
        """One token as text for logprobs: bytes that do not form whole characters become U+FFFD."""
        return self.token_bytes(i).decode("utf-8", errors="replace")

    def detokenizer(self, skip_special_tokens: bool = True) -> "Detokenizer":
        return Detokenizer(self, skip_special_tokens)

    # ---- chat -----------------------------------------------------------------------------------------------
    def _find_template(self, d: Path) -> str | None:
        jinja_file = d / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8")
        t = self.config.get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {x.get("name"): x.get("template") for x in t}
            t = named.get("default") or next(iter(named.values()), None)
        return t

    def apply_chat_template(self, messages: list[dict], tools: list | None = None,
                            add_generation_prompt: bool = True, **kwargs) -> str:
        if self.template_source is None:
            raise TokenizerError("this checkpoint has no chat template (tokenizer_config.json `chat_template` or "
                                 "chat_template.jinja); use /v1/completions with a raw prompt")
        if self._template is None:
            self._template = _jinja_env().from_string(self.template_source)
        return self._template.render(messages=messages, tools=tools or None,
                                     add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                                     eos_token=self.eos_token or "", **kwargs)


def _token_text(t) -> str | None:
    if isinstance(t, dict):
        return t.get("content")
    return t


class TemplateError(ValueError):
    """The chat template refused the conversation (its raise_exception), a user error."""


def _raise(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _jinja_env():
    # The settings HF transformers renders chat templates with.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                                        undefined=jinja2.Undefined)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env


class Detokenizer:
    """Ids in, text out, one step at a time. Text is released only up to the last complete UTF-8 character, so
    a character split over several byte-level tokens comes out whole, in the step that completes it."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        if tok.byte_level:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            self._prefix = self._read = 0     # offsets into ids of the text already released

    def add(self, ids) -> str:
        if self.tok.byte_level:
            out = []
            for i in ids:
                self.ids.append(i)
                if self.skip and i in self.tok.special_ids:
                    continue
                out.append(self._utf8.decode(self.tok.token_bytes(i)))
            return "".join(out)
        self.ids.extend(ids)
        # Generic tokenizers: decode a window and release only text not ending in a replacement character.
        prev = self.tok.decode(self.ids[self._prefix:self._read], self.skip)
        full = self.tok.decode(self.ids[self._prefix:], self.skip)
        if len(full) > len(prev) and not full.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return full[len(prev):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of the stream (an unfinished character becomes U+FFFD)."""
        if self.tok.byte_level:
            return self._utf8.decode(b"", final=True)
        prev = self.tok.decode(self.ids[self._prefix:self._read], self.skip)
        full = self.tok.decode(self.ids[self._prefix:], self.skip)
        self._prefix = self._read = len(self.ids)
        return full[len(prev):]
