"""Writes the example notebooks from the cell sources below (so they stay reviewable as code). The notebooks are
committed; tests/examples executes them top to bottom.

    python examples/make_notebooks.py
"""

from pathlib import Path

import nbformat as nbf

HERE = Path(__file__).parent
SETUP = """import os, sys, time
import numpy as np
import jax, jax.numpy as jnp
import matplotlib.pyplot as plt
import fnx
# the shipped mini model; FNX_MODEL points elsewhere (any HF checkpoint directory with a tokenizer)
MODEL_DIR = os.environ.get("FNX_MODEL", os.path.join(os.path.dirname(os.path.abspath("")), "checkpoints", "fnx-mini"))
if not os.path.isdir(MODEL_DIR):
    MODEL_DIR = os.path.join(os.path.abspath(""), "checkpoints", "fnx-mini")
"""

NOTEBOOKS = {
    "01_quickstart.ipynb": [
        ("md", "# fnx quickstart\nLoad the shipped mini Flash-Next, generate text, chat, and stream."),
        ("code", SETUP),
        ("code", "model = fnx.load(MODEL_DIR, dtype=jnp.float32)\nmodel"),
        ("md", "`fnx.generate` takes text (with the model's tokenizer) or token ids and returns the same kind."),
        ("code", 'print(fnx.generate(model, "The package manager", max_new_tokens=40))'),
        ("code", 'ids = model.tokenizer.encode("Debian")\nprint(fnx.generate(model, ids, max_new_tokens=10))'),
        ("md", "Sampling, with a seed per request:"),
        ("code", 'sp = fnx.SamplingParams(temperature=0.8, top_p=0.95, seed=0)\n'
                 'print(fnx.generate(model, ["The kernel", "A file system"], 30, sampling=sp))'),
        ("md", "Chat applies the checkpoint's chat template; `stream=True` prints as it goes."),
        ("code", 'reply = fnx.chat(model, [{"role": "user", "content": "How do I install a package?"}],\n'
                 '                 max_new_tokens=60, stream=True)'),
        ("code", 'for piece in fnx.stream_text(model, "To configure the network,", 40, echo=False):\n'
                 '    print(piece, end="|")'),
    ],
    "02_speculative_decoding.ipynb": [
        ("md", "# MTP speculative decoding\nThe MTP layer drafts k tokens, and the target verifies them in one step."
               " Greedy output is identical for every k; what changes is how many tokens each round yields."),
        ("code", SETUP),
        ("code", "model = fnx.load(MODEL_DIR, dtype=jnp.float32)\n"
                 'prompts = ["The Debian project", "To install a package, run", "The file system hierarchy",\n'
                 '           "A kernel module is"]\n'
                 "ids = [model.tokenizer.encode(p) for p in prompts]\n"
                 "plain = fnx.generate(model, ids, 48)"),
        ("code", "ks, accept, same = [1, 2, 3, 4], [], []\n"
                 "for k in ks:\n"
                 "    eng = fnx.Engine(model, max_slots=4, capacity=256, speculative=k)\n"
                 "    out = fnx.generate(model, ids, 48, engine=eng)\n"
                 "    accept.append(eng.acceptance_length)\n"
                 "    same.append(out == plain)\n"
                 "print(dict(zip(ks, accept)), 'identical to plain greedy:', same)\n"
                 "assert all(same)"),
        ("code", "plt.figure(figsize=(4, 3))\nplt.plot(ks, accept, 'o-')\n"
                 "plt.xlabel('draft tokens k'); plt.ylabel('tokens per round'); plt.title('MTP acceptance')\n"
                 "plt.grid(True); plt.show()"),
    ],
    "03_routing_and_ple.ipynb": [
        ("md", "# Inside the model: hyper-connection streams, expert routing, the PLE table\n"
               "`fnx.forward(..., return_layers=True)` returns every layer's 4-stream hidden state and the experts "
               "each token was routed to."),
        ("code", SETUP),
        ("code", "model = fnx.load(MODEL_DIR, dtype=jnp.float32)\ncfg = model.cfg\n"
                 'ids = np.array([model.tokenizer.encode("The apt tool downloads packages from the archive and '
                 'installs them with dpkg.")])\n'
                 "logits, layers = fnx.forward(model, ids, return_layers=True)\n"
                 "print(layers['hidden'].shape, layers['experts'].shape)"),
        ("md", "Expert load per layer (how many of the routed slots each expert took):"),
        ("code", "E = cfg.num_experts\n"
                 "counts = np.stack([np.bincount(np.asarray(layers['experts'][l]).ravel(), minlength=E)\n"
                 "                   for l in range(cfg.num_hidden_layers)])\n"
                 "plt.figure(figsize=(8, 3)); plt.imshow(counts, aspect='auto', cmap='viridis')\n"
                 "plt.xlabel('expert'); plt.ylabel('layer'); plt.colorbar(label='routed tokens'); plt.show()"),
        ("md", "The norm of each hyper-connection stream through the layers:"),
        ("code", "h = np.asarray(layers['hidden'])[:, 0]                      # [layers, T, S*D]\n"
                 "S, D = cfg.hc_count, cfg.hidden_size\n"
                 "norms = np.linalg.norm(h.reshape(h.shape[0], h.shape[1], S, D), axis=-1).mean(1)\n"
                 "plt.figure(figsize=(4, 3)); plt.plot(norms); plt.xlabel('layer'); plt.ylabel('mean stream norm')\n"
                 "plt.legend([f'stream {j}' for j in range(S)]); plt.show()"),
        ("md", "The PLE n-gram ids of the prompt: each token reads one row per n-gram head from the hashed table."),
        ("code", "from fnx.ple import initial_context, ngram_ids\n"
                 "ctx = initial_context(1, model.ngram)\n"
                 "rows, _ = ngram_ids(ctx, ids, model.ngram)\n"
                 "print('rows per token:', rows.shape[-1], ' table rows:', model.ngram.num_rows)\n"
                 "print('distinct rows touched by this prompt:', len(np.unique(rows)))\n"
                 "plt.figure(figsize=(6, 2.5)); plt.imshow(rows[0].T, aspect='auto', cmap='magma')\n"
                 "plt.xlabel('token'); plt.ylabel('n-gram head'); plt.title('table row ids'); plt.show()"),
    ],
    "04_quantization_quality.ipynb": [
        ("md", "# Quantization quality\nKL divergence and top-1 agreement of FP8 (128x128 blocks, dense "
               "projections) and NVFP4 (routed experts) against the float model, on the same text."),
        ("code", SETUP),
        ("code", "from fnx.model import quant\n"
                 "ref = fnx.load(MODEL_DIR, dtype=jnp.float32)\n"
                 "fp8 = fnx.load(MODEL_DIR, dtype=jnp.float32, quant='fp8')\n"
                 "def nvfp4_experts(params):\n"
                 "    def q(path, x):\n"
                 "        names = [getattr(p, 'key', '') for p in path]\n"
                 "        if 'experts' in names and not quant.is_quantized(x):\n"
                 "            return quant.quantize_nvfp4(x)\n"
                 "        return x\n"
                 "    return jax.tree_util.tree_map_with_path(q, params)\n"
                 "nv = fnx.Model(ref.cfg, nvfp4_experts(ref.params), ref.mtp, ref.path, ref.tokenizer)\n"
                 "print(fp8.formats()); print(nv.formats())"),
        ("code", 'text = "Packages are installed with apt. The dpkg database records every file a package owns. " * 3\n'
                 "ids = np.array([ref.tokenizer.encode(text)[:96]])\n"
                 "def stats(m):\n"
                 "    p = jax.nn.log_softmax(fnx.forward(ref, ids)[0].astype(jnp.float32), -1)\n"
                 "    q = jax.nn.log_softmax(fnx.forward(m, ids)[0].astype(jnp.float32), -1)\n"
                 "    kl = float(jnp.mean(jnp.sum(jnp.exp(p) * (p - q), -1)))\n"
                 "    top1 = float(jnp.mean(jnp.argmax(p, -1) == jnp.argmax(q, -1)))\n"
                 "    return kl, top1\n"
                 "res = {name: stats(m) for name, m in [('fp8 dense', fp8), ('nvfp4 experts', nv)]}\n"
                 "res"),
        ("code", "names = list(res)\nfig, ax = plt.subplots(1, 2, figsize=(7, 3))\n"
                 "ax[0].bar(names, [res[n][0] for n in names]); ax[0].set_title('KL vs float (nats/token)')\n"
                 "ax[1].bar(names, [res[n][1] for n in names]); ax[1].set_title('top-1 agreement')\n"
                 "ax[1].set_ylim(0, 1); plt.tight_layout(); plt.show()"),
    ],
}


def main():
    for name, cells in NOTEBOOKS.items():
        nb = nbf.v4.new_notebook()
        nb.cells = [nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src)
                    for kind, src in cells]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbf.write(nb, HERE / name)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
