import numpy as np
import pytest
import torch

import fnx
from tests.conftest import load_script


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    tiny = load_script("make_tiny_checkpoint")
    root = tmp_path_factory.mktemp("engine")
    store = {}

    def get(name):
        if name not in store:
            d = tiny.write_checkpoint(root / name, name, seed=0)
            from transformers import Qwen4ExpForCausalLM
            ref = Qwen4ExpForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
            store[name] = (fnx.load(d, dtype=np.float32), ref)
        return store[name]
    return get


def prompts_for(model, seed=0):
    """A short prompt with an EOS inside and a prompt that crosses the indexer budget."""
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    eos = cfg.ple_eos_token_id
    short = list(rng.integers(0, eos, size=9))
    short[4] = eos
    long = list(rng.integers(0, eos, size=cfg.indexer_budget * 2 + 3))
    long[len(long) // 3] = eos
    return [[int(t) for t in short], [int(t) for t in long]]
