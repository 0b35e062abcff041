"""Quality of a checkpoint: held-out perplexity (trained and untrained), quantized runs against BF16 (KL divergence,
top-1 agreement, perplexity), and MTP acceptance length with speculative decoding. JSON lines go to
benchmarks/results/eval_quality.jsonl; a markdown table is printed last.

    python scripts/eval_quality.py                                  # checkpoints/fnx-mini, every protocol
    python scripts/eval_quality.py --quick                          # fewer passages (a smoke run)
    python scripts/eval_quality.py --skip untrained,quant,mtp --variants "tf32: FNX_GDN_SCAN_TILES=precision=tf32"
                                    # a knob's cost in accuracy: KL / top-1 of each variant against the default run

Protocols (as the seed note's "40 x 512-token and 300 x 60-token passages"): passages are contiguous windows of
the held-out documents (`checkpoints/fnx-mini/heldout.npz`, documents never trained on), each run from a fresh
state; perplexity is exp(mean next-token NLL over every predicted token). Windows are taken round-robin over the
documents, window k of a document starting at token k * length, so the two protocols are fixed by the data.
When fewer windows exist than asked for, the protocol runs on what exists and says so (`passages` in the output).

Quantized runs: FP8 dense (fnx's online FP8 128x128-block weights, `quant="fp8"` at load time) and NVFP4 routed
experts (the ModelOpt layout written by tests/checkpoint/writers.py and read by fnx's loader). GGUF types: this script has
no GGUF writer for the model yet (fnx reads GGUF), so they are reported as missing. KL is KL(P_bf16 || P_quant) per predicted token, in nats.

MTP acceptance: `fnx.Engine(..., speculative=k)` with greedy sampling on natural prompts (the first tokens of
held-out passages, and chat questions about the documentation), `Engine.acceptance_length` = mean tokens emitted
per speculative round (accepted drafts + 1)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fnx  # noqa: E402
from fnx.model.api import Model  # noqa: E402
from fnx.model.transformer import init_state, step  # noqa: E402
from fnx.ple import initial_context, ngram_ids  # noqa: E402
from fnx.pallas.bench import settings  # noqa: E402

DEFAULT_CKPT = ROOT / "checkpoints" / "fnx-mini"
RESULTS = ROOT / "benchmarks" / "results" / "eval_quality.jsonl"
CHAT_PROMPTS = [
    "What does json.dumps() do?",
    "What is the os.path module for?",
    "Tell me about package management.",
    "What is a list comprehension in Python?",
    "What does str.split() do?",
    "Explain virtual environments briefly.",
    "What is the subprocess module for?",
    "When is KeyError raised?",
]


def load_heldout(ckpt: Path) -> list[np.ndarray]:
    z = np.load(ckpt / "heldout.npz")
    toks, lens = z["tokens"].astype(np.int32), z["lengths"]
    return np.split(toks, np.cumsum(lens)[:-1])


def passages(docs: list[np.ndarray], n: int, length: int) -> np.ndarray:
    """Up to n windows [n, length], round-robin over the documents."""
    out, k = [], 0
    while len(out) < n:
        added = False
        for d in docs:
            if (k + 1) * length <= d.size:
                out.append(d[k * length:(k + 1) * length])
                added = True
                if len(out) == n:
                    break
        if not added:
            break
        k += 1
    return np.stack(out) if out else np.zeros((0, length), np.int32)


def _ple_ids(model: Model, tokens: np.ndarray):
    if model.ngram is None:
        return None
    ids, _ = ngram_ids(initial_context(tokens.shape[0], model.ngram), tokens.astype(np.int64), model.ngram)
    return jnp.asarray(ids.astype(np.int32))


_fwd = jax.jit(lambda params, state, tok, ids, cfg: step(params, state, tok, ids, cfg=cfg)[0],
               static_argnames=("cfg",))


def logprobs(model: Model, tokens: np.ndarray, batch: int = 8) -> np.ndarray:
    """log-softmax of the logits [N, L-1, V] (float32) for predicting tokens[:, 1:] from fresh states."""
    outs = []
    for s in range(0, tokens.shape[0], batch):
        tok = tokens[s:s + batch]
        state = init_state(model.cfg, tok.shape[0], tok.shape[1], model.dtype)
        lg = _fwd(model.params, state, jnp.asarray(tok[:, :-1]), _ple_ids(model, tok[:, :-1]), model.cfg)
        outs.append(np.asarray(jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1)))
    return np.concatenate(outs)


def nll(lp: np.ndarray, tokens: np.ndarray) -> float:
    return float(-np.take_along_axis(lp, tokens[:, 1:, None].astype(np.int64), axis=-1).mean())


def compare(lp_ref: np.ndarray, lp: np.ndarray) -> dict:
    p = np.exp(lp_ref)
    kl = (p * (lp_ref - lp)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
            "top1_agree": float((lp_ref.argmax(-1) == lp.argmax(-1)).mean())}


def untrained_model(ckpt: Path, dtype) -> Model:
    """The same architecture with the training script's initial weights (seed from train_log.json)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_mini
    cfg = fnx.ModelConfig.from_json(ckpt)
    seed = json.loads((ckpt / "train_log.json").read_text())["seed"] if (ckpt / "train_log.json").exists() \
        else train_mini.SEED
    params, mtp = train_mini.build_trees(cfg, train_mini.init_tensors(cfg, seed))
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    return Model(cfg, params, {}, "untrained (init of scripts/train_mini.py)")


def load_quant(ckpt: Path, kind: str, dtype, tmp: Path):
    """(model, note) for a quantized variant, or (None, why) when fnx cannot run it yet."""
    import inspect
    if kind == "fp8-dense":
        if "quant" in inspect.signature(fnx.load).parameters:
            return fnx.load(ckpt, dtype=dtype, quant="fp8"), "fnx.load(quant='fp8')"
        from fnx.checkpoint.hf import load_hf
        cfg, params, mtp = load_hf(ckpt, dtype=dtype, quant="fp8")
        return Model(cfg, params, mtp, str(ckpt)), "fnx.checkpoint.hf.load_hf(quant='fp8'): online 128x128 FP8"
    if kind == "nvfp4-experts":
        try:
            sys.path.insert(0, str(ROOT))
            from tests.checkpoint.writers import write_nvfp4
        except ImportError as exc:
            return None, f"no NVFP4 writer available ({exc})"
        q, _ = write_nvfp4(ckpt, tmp)
        return fnx.load(q, dtype=dtype), "ModelOpt NVFP4 layout (routed experts, group 16; MTP FP8) via fnx.load"
    if kind.startswith("gguf"):
        return None, "no GGUF writer for this model in eval_quality.py yet (fnx reads GGUF); not measured"
    raise ValueError(kind)


def acceptance(model: Model, prompts: list[list[int]], k: int, max_new: int, stop: tuple[int, ...],
               **sampling) -> dict:
    """Greedy by default; `sampling` adds SamplingParams fields (e.g. repetition_penalty=1.3)."""
    from fnx.engine import Engine, SamplingParams
    from fnx.engine.engine import positions_reserved
    room = max_new + positions_reserved(k, overlap=True)          # what `Engine.submit` asks of the capacity
    eng = Engine(model, max_slots=min(8, len(prompts)), capacity=max(len(p) for p in prompts) + room,
                 prefill_chunk=64, speculative=k, extra_eos=stop)
    t = time.time()
    outs = fnx.generate(model, prompts, max_new_tokens=max_new,
                        sampling=SamplingParams(**{"temperature": 0.0, **sampling}), engine=eng)
    return {"k": k, **({"sampling": sampling} if sampling else {}),
            "acceptance_length": round(eng.acceptance_length, 4), "rounds": eng.stats["rounds"],
            "drafted": eng.stats["drafted"], "accepted": eng.stats["accepted"],
            "tokens": sum(len(o) for o in outs), "seconds": round(time.time() - t, 1), "prompts": len(prompts)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=str(DEFAULT_CKPT))
    ap.add_argument("--quick", action="store_true", help="8 x 512 and 40 x 60 passages, 4+4 prompts")
    ap.add_argument("--skip", default="", help="comma list of: untrained,quant,mtp,float32")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--variants", default="",
                    help="';'-separated 'LABEL: FNX_ENV=VALUE ...': the bf16 model's perplexity protocols again under "
                         "each variant's settings (e.g. a kernel's precision knob), with KL and top-1 against the "
                         "default run, e.g. 'tf32: FNX_GDN_SCAN_TILES=precision=tf32;ref: FNX_KERNELS=gdn_prefill="
                         "reference'")
    args = ap.parse_args(argv)
    from fnx.pallas.bench import parse_variants
    variants = parse_variants(args.variants) if args.variants else []
    ckpt = Path(args.ckpt)
    skip = set(filter(None, args.skip.split(",")))
    docs = load_heldout(ckpt)
    n_long, n_short = (8, 40) if args.quick else (40, 300)
    protos = {"long": passages(docs, n_long, 512), "short": passages(docs, n_short, 60)}
    meta = {"ckpt": str(ckpt.relative_to(ROOT) if ckpt.is_relative_to(ROOT) else ckpt),
            "machine": (f"{platform.machine()} CPU ({os.cpu_count()} cores)" if jax.default_backend() == "cpu"
                        else jax.devices()[0].device_kind), "jax": jax.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    rows = []

    def emit(row):
        row = {**row, **meta}
        rows.append(row)
        print(json.dumps(row), flush=True)

    bf16 = fnx.load(ckpt, dtype=jnp.bfloat16)
    ref_lp = {}
    for name, toks in protos.items():
        t = time.time()
        ref_lp[name] = logprobs(bf16, toks)
        v = nll(ref_lp[name], toks)
        emit({"metric": "perplexity", "model": "bf16", "protocol": name, "passages": int(toks.shape[0]),
              "tokens_per_passage": int(toks.shape[1]), "nll": round(v, 5), "ppl": round(math.exp(v), 3),
              "seconds": round(time.time() - t, 1)})
    for label, env in variants:
        for name, toks in protos.items():
            with settings(env):           # fnx reads its knobs when a program is traced: caches cleared in and out
                lp = logprobs(bf16, toks)
            v = nll(lp, toks)
            emit({"metric": "variant", "model": f"bf16+{label}", "settings": env, "protocol": name,
                  "passages": int(toks.shape[0]), "tokens_per_passage": int(toks.shape[1]), "nll": round(v, 5),
                  "ppl": round(math.exp(v), 3),
                  "ppl_vs_bf16_pct": round(100 * (math.exp(v - nll(ref_lp[name], toks)) - 1), 4),
                  **{f"vs_bf16_{k}": round(x, 8) for k, x in compare(ref_lp[name], lp).items()}})
    if "float32" not in skip:
        f32 = fnx.load(ckpt, dtype=jnp.float32)
        for name, toks in protos.items():
            lp = logprobs(f32, toks)
            v = nll(lp, toks)
            emit({"metric": "perplexity", "model": "float32", "protocol": name, "passages": int(toks.shape[0]),
                  "tokens_per_passage": int(toks.shape[1]), "nll": round(v, 5), "ppl": round(math.exp(v), 3),
                  **{f"vs_bf16_{k}": round(x, 6) for k, x in compare(ref_lp[name], lp).items()}})
        del f32
    if "untrained" not in skip:
        un = untrained_model(ckpt, jnp.bfloat16)
        for name, toks in protos.items():
            v = nll(logprobs(un, toks), toks)
            emit({"metric": "perplexity", "model": "untrained-bf16", "protocol": name,
                  "passages": int(toks.shape[0]), "tokens_per_passage": int(toks.shape[1]), "nll": round(v, 5),
                  "ppl": round(math.exp(v), 3)})
        del un
    if "quant" not in skip:
        with tempfile.TemporaryDirectory() as tmp:
            for kind in ("fp8-dense", "nvfp4-experts", "gguf-q8_0", "gguf-q4_k"):
                try:
                    model, note = load_quant(ckpt, kind, jnp.bfloat16, Path(tmp))
                except Exception as exc:  # noqa: BLE001 - report what failed, keep measuring the rest
                    model, note = None, f"failed: {type(exc).__name__}: {exc}"[:300]
                if model is None:
                    emit({"metric": "quant", "model": kind, "status": "missing", "note": note})
                    continue
                for name, toks in protos.items():
                    lp = logprobs(model, toks)
                    v = nll(lp, toks)
                    emit({"metric": "quant", "model": kind, "protocol": name, "passages": int(toks.shape[0]),
                          "nll": round(v, 5), "ppl": round(math.exp(v), 3),
                          "ppl_vs_bf16_pct": round(100 * (math.exp(v - nll(ref_lp[name], toks)) - 1), 3),
                          **{k: round(x, 6) for k, x in compare(ref_lp[name], lp).items()}, "note": note})
                del model
    if "mtp" not in skip:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
        n_prompts = 4 if args.quick else 16
        natural = [list(map(int, p[:32])) for p in passages(docs, n_prompts, 96)]
        chat = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").ids
                for q in CHAT_PROMPTS[: (4 if args.quick else 8)]]
        im_end = tok.token_to_id("<|im_end|>")
        for label, prompts in (("heldout-text", natural), ("chat", chat)):
            for k in (4,) if args.quick else (1, 2, 4):
                emit({"metric": "mtp_acceptance", "prompt_set": label, "dtype": "bf16", "max_new_tokens": 64,
                      **acceptance(bf16, prompts, k, 64, (im_end,))})
            # penalized requests: the drafter penalizes its drafts as the verify penalizes the window
            for extra in (dict(repetition_penalty=1.3), dict(temperature=0.8, repetition_penalty=1.3, seed=1)):
                emit({"metric": "mtp_acceptance", "prompt_set": label, "dtype": "bf16", "max_new_tokens": 64,
                      **acceptance(bf16, prompts, 4, 64, (im_end,), **extra)})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print("\n| metric | model | protocol / prompts | passages | value |\n|---|---|---|---|---|")
    for r in rows:
        if r["metric"] == "perplexity":
            print(f"| perplexity | {r['model']} | {r['protocol']} x{r['tokens_per_passage']} | {r['passages']} | "
                  f"{r['ppl']} |")
        elif r["metric"] == "variant":
            print(f"| variant | {r['model']} | {r['protocol']} | {r['passages']} | ppl {r['ppl']} "
                  f"({r['ppl_vs_bf16_pct']:+.3f}%), KL {r['vs_bf16_kl_mean']:.2e}, "
                  f"top-1 {r['vs_bf16_top1_agree']:.4f} |")
        elif r["metric"] == "quant" and r.get("status") != "missing":
            print(f"| quant | {r['model']} | {r['protocol']} | {r['passages']} | ppl {r['ppl']} "
                  f"({r['ppl_vs_bf16_pct']:+.2f}%), KL {r['kl_mean']:.2e}, top-1 {r['top1_agree']:.4f} |")
        elif r["metric"] == "quant":
            print(f"| quant | {r['model']} | - | - | missing: {r['note']} |")
        else:
            how = ", ".join(f"{k}={v}" for k, v in r.get("sampling", {}).items()) or "greedy"
            print(f"| MTP k={r['k']} ({how}) | bf16 | {r['prompt_set']} | {r['prompts']} | {r['acceptance_length']} "
                  f"tokens/round |")


if __name__ == "__main__":
    main()
