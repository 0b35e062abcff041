import numpy as np
import pytest
import torch

from tests.conftest import load_script

import fnx


@pytest.fixture(scope="session")
def tiny():
    return load_script("make_tiny_checkpoint")


class Case:
    """One tiny config written to disk, with the transformers oracle loaded from the same files."""

    def __init__(self, tiny, name, root):
        self.name = name
        self.dir = tiny.write_checkpoint(root / name, name, seed=0)
        from transformers import Qwen4ExpForCausalLM
        self.ref = Qwen4ExpForCausalLM.from_pretrained(self.dir, attn_implementation="eager",
                                                       dtype=torch.float32).eval()
        self.model = fnx.load(self.dir, dtype=np.float32)
        self.cfg = self.model.cfg

    def tokens(self, batch, length, seed):
        """Random ids with the PLE's EOS inside each row (never at the same place twice)."""
        rng = np.random.default_rng(seed)
        eos = self.cfg.ple_eos_token_id if self.cfg.eos_token_id is not None else 0
        ids = rng.integers(0, self.cfg.vocab_size, size=(batch, length))
        for b in range(batch):
            for p in rng.choice(length, size=max(1, length // 12), replace=False):
                ids[b, p] = eos
        return ids

    def reference(self, ids):
        with torch.no_grad():
            return self.ref(torch.as_tensor(ids)).logits.float().numpy()


@pytest.fixture(scope="session")
def cases(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    store = {}

    def get(name):
        if name not in store:
            store[name] = Case(tiny, name, root)
        return store[name]
    return get


def prefill_then_decode(model, ids, prefill: int, capacity: int):
    """Logits [B, L, V] of ids [B, L]: the first `prefill` tokens in one `fnx.extend` call, then one token per call."""
    st = fnx.new_state(model, ids.shape[0], capacity)
    lg, st = fnx.extend(model, st, ids[:, :prefill])
    seq = [np.asarray(lg)]
    for t in range(prefill, ids.shape[1]):
        lg, st = fnx.extend(model, st, ids[:, t:t + 1])
        seq.append(np.asarray(lg))
    return np.concatenate(seq, axis=1)


def rel_err(a, b):
    """max |a - b| / max |b|: the worst logit error relative to the logit scale."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())
