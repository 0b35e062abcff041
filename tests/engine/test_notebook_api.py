"""The notebook-facing API: text in and out, chat, streaming text, readable repr."""

import numpy as np
import pytest

import fnx
from tests.conftest import load_script


@pytest.fixture(scope="module")
def model_with_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tiny = load_script("make_tiny_checkpoint")
    d = tiny.write_checkpoint(tmp_path_factory.mktemp("nb") / "tiny-a", "tiny-a", seed=0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "packages are installed with apt", "héllo wörld"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=250, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        '{"eos_token": "<|endoftext|>", "chat_template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\\n'
        '{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"}')
    return fnx.load(d, dtype=np.float32)


def test_text_in_text_out(model_with_tokenizer):
    m = model_with_tokenizer
    text = fnx.generate(m, "the quick", 6, sampling=fnx.SamplingParams(ignore_eos=True))
    ids = fnx.generate(m, m.tokenizer.encode("the quick"), 6, sampling=fnx.SamplingParams(ignore_eos=True))
    assert isinstance(text, str) and text == m.tokenizer.decode(ids)
    assert isinstance(fnx.generate(m, ["a", "b c"], 3), list)


def test_chat_and_stream(model_with_tokenizer, capsys):
    m = model_with_tokenizer
    reply = fnx.chat(m, [{"role": "user", "content": "what is apt"}], max_new_tokens=5)
    streamed = fnx.chat(m, [{"role": "user", "content": "what is apt"}], max_new_tokens=5, stream=True)
    assert reply == streamed and capsys.readouterr().out.strip() == streamed.strip()


def test_repr_and_formats(model_with_tokenizer):
    r = repr(model_with_tokenizer)
    assert "params:" in r and "float32" in r and "tokenizer: yes" in r and "memory:" in r
    assert sum(model_with_tokenizer.formats().values()) == model_with_tokenizer.num_parameters()


def test_text_without_tokenizer_is_a_clear_error(tmp_path):
    tiny = load_script("make_tiny_checkpoint")
    m = fnx.load(tiny.write_checkpoint(tmp_path / "t", "tiny-d", seed=0), dtype=np.float32)
    with pytest.raises(ValueError, match="no tokenizer"):
        fnx.generate(m, "hello", 3)
