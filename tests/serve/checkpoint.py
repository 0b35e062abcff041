"""A tiny servable checkpoint: a random tiny-a-shaped model whose vocabulary is a byte-level BPE tokenizer trained
here on a few KB of text, plus a tokenizer_config.json with a small Qwen-style chat template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.conftest import load_script

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]     # ids 0, 1, 2 (special: skipped in output text)
MARKUP = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # plain added tokens: they stay in the text
BPE_VOCAB = 300
MODEL_VOCAB = 320

CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A serving engine batches requests that arrive at different times.",
    "Streaming sends each token to the client as soon as it is decoded.",
    "Prefill reads the whole prompt; decode produces one token per step.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 65536.",
    "Café, naïve, résumé, façade, jalapeño, smörgåsbord.",
    "Grüße aus München; ¿Qué tal? Ça va très bien.",
    "中文文本的测试句子。你好，世界！",
    "日本語のテキストです。こんにちは。",
    "Emoji: 🙂 🚀 🎉 ✨ and symbols € £ ¥ → ∑ ∞.",
    "def add(a, b):\n    return a + b\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>",
]

# Our own minimal template in the Qwen chat format: system/tools block, turns, tool calls, generation prompt.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "Functions you may call, one <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> each:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}{% if m.role != 'system' %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined %}{% if enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}{% endif %}"
)


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS_LINES * 20, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP])
    assert tok.get_vocab_size() <= MODEL_VOCAB
    return tok


def write_serve_checkpoint(out: Path) -> Path:
    tiny = load_script("make_tiny_checkpoint")
    tok = train_tokenizer()
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    kwargs = dict(tiny.TINY_CONFIGS["tiny-a"], vocab_size=MODEL_VOCAB, eos_token_id=im_end, bos_token_id=eot)
    tiny.write_checkpoint(out, kwargs, seed=0)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, eot], "bos_token_id": eot}))
    return out
