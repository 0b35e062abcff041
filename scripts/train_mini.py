"""Train fnx-mini: a small Qwen3.8-Flash-Next (`qwen4_exp`) with every component, on freely licensed English
documentation from Debian packages, with fnx's own JAX model code. Writes the HF-layout checkpoint that ships in
`checkpoints/fnx-mini/`.

Three stages, so that the GPU only trains (each is re-runnable and deterministic for its inputs):

    python scripts/train_mini.py prepare              # CPU, needs apt: fetch + check the .debs, clean the text,
                                                      # split held-out documents, synthesise chat pairs, train
                                                      # the byte-level BPE tokenizer, write token arrays
    python scripts/train_mini.py train --out DIR      # GPU (or CPU for a smoke test): differentiate through
                                                      # fnx.model.transformer.step and mtp_step, AdamW
    python scripts/train_mini.py finalize DIR         # CPU: copy the trained tensors, add tokenizer files,
                                                      # generation_config and the model card to checkpoints/

Corpus (see SOURCES): the reStructuredText sources of the Python 3.11 documentation (PSF License, Debian package
python3.11-doc) and the plain-text Debian Reference (GPL-2+, package debian-reference-en). Each .deb is fetched by
exact version with `apt-get download` and checked against its sha256 before use.

Chat portion: question/answer pairs built mechanically from the training documents, never from the held-out
ones: glossary terms ("What is X?" -> the glossary definition), documented functions/classes ("What does
json.dumps() do?" -> the first paragraph of its documentation), module synopses, and section headings ("Tell me
about X." -> the section's first paragraph). The answers are verbatim documentation text; nothing is invented.

Training-only additions, documented here because they wrap fnx functions rather than change them:
- `fnx.model.qsa.qsa_layer` is wrapped to add an indexer distillation loss: KL from the main attention's dense
  causal per-block probability mass (stop-gradient) to the softmax of the indexer's block scores, with the
  indexer's input detached, so only the indexer weights learn from it. The QSA top-k selection itself has no
  gradient (as in the reference), so without this the indexer would keep its random initial weights.
- `fnx.model.moe.moe_block` is wrapped to add a Switch-style load-balancing loss on the router probabilities.
Both wrappers return exactly what the wrapped function returns; the forward pass is fnx's.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CACHE = ROOT / ".cache" / "fnx-mini"          # git-ignored: downloads, extracted text
PREPARED = CACHE / "prepared"                 # what the GPU run needs (carried): tokens, tokenizer
CHECKPOINT = ROOT / "checkpoints" / "fnx-mini"
SEED = 20261130

# (package, exact version, sha256 of the .deb, license)
SOURCES = [
    ("python3.11-doc", "3.11.2-6+deb12u9",
     "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be", "PSF-2.0"),
    ("debian-reference-en", "2.100",
     "9f31d3a17df505de09689ca255512ea58c1fc47c59bb1b0c7bf1c23362e9743f", "GPL-2.0-or-later"),
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                  "</tool_call>"]
EOS, IM_START, IM_END = 0, 1, 2          # ids of the first three special tokens
VOCAB = 8192
HELDOUT_PERCENT = 3                      # documents with crc32(name) % 100 < this are held out

# The model: every component of the release, scaled down (see README of the checkpoint).
CONFIG = dict(
    architectures=["Qwen4ExpForCausalLM"],
    model_type="qwen4_exp_text",
    vocab_size=VOCAB,
    hidden_size=256,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                         mrope_section=[3, 3, 2], mrope_interleaved=True),
    partial_rotary_factor=0.25,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    output_gate_type="sigmoid",
    linear_conv_kernel_dim=4,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=128,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
    hc_count=4,
    hc_lowrank=32,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=32,
    indexer_budget=128,
    indexer_compress_ratio=4,
    ple_layer_ids=[2],
    ple_embed_dim=256,
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=2,
    ngram_vocab_size_base=3000,
    make_ngram_vocab_size_divisible_by=64,
    split_ngram_parts=4,
    seed=1234,
    eos_token_id=EOS,
    bos_token_id=EOS,
    pad_token_id=None,
    tie_word_embeddings=False,
    mtp_num_hidden_layers=1,
    mtp_use_dedicated_embeddings=False,
    dtype="bfloat16",
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chat_text(question: str, answer: str | None = None) -> str:
    """The chat template rendered by hand (the tokenizer_config template produces the same string)."""
    s = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return s if answer is None else s + answer + "<|im_end|>\n"


# ==== prepare ==================================================================================================

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_debs(cache: Path) -> dict[str, Path]:
    """apt-get download each source at its exact version; check sha256; extract with dpkg-deb."""
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    out = {}
    for pkg, ver, sha, _ in SOURCES:
        found = [p for p in debs.glob(f"{pkg}_*.deb") if _sha256(p) == sha]
        if not found:
            subprocess.run(["apt-get", "download", f"{pkg}={ver}"], cwd=debs, check=True)
            found = [p for p in debs.glob(f"{pkg}_*.deb") if _sha256(p) == sha]
        if not found:
            raise SystemExit(f"{pkg}={ver}: no downloaded .deb has sha256 {sha}; the archive may have replaced "
                             f"it. Run 'apt-get update' and check 'apt-cache policy {pkg}'.")
        root = cache / "extract" / pkg
        if not root.exists():
            root.mkdir(parents=True)
            subprocess.run(["dpkg-deb", "-x", str(found[0]), str(root)], check=True)
        out[pkg] = root
    return out


_ROLE = re.compile(r":[a-zA-Z0-9_:+-]+:`~?!?([^`]*?)(?:\s*<[^`>]*>)?`")
_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]+>`__?")
_FOOTREF = re.compile(r"\s*\[#[^\]]*\]_")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+.:_])\1{2,}\s*$")
_SIG_DIRECTIVES = {"function", "method", "class", "attribute", "data", "exception", "decorator",
                   "classmethod", "staticmethod", "opcode", "cmdoption", "option", "envvar",
                   "describe", "coroutinefunction", "coroutinemethod", "abstractmethod", "property",
                   "decoratormethod", "c:function", "c:type", "c:member", "c:macro", "c:var", "pdbcommand"}
_KEEP_BODY = {"note": "Note:", "warning": "Warning:", "seealso": "See also:", "important": "Important:",
              "tip": "Tip:", "caution": "Caution:", "attention": "Attention:", "hint": "Hint:",
              "impl-detail": "CPython implementation detail:", "admonition": "", "code-block": None,
              "sourcecode": None, "doctest": None, "testcode": None, "testoutput": None, "code": None,
              "productionlist": None, "versionadded": "New in version {}.",
              "versionchanged": "Changed in version {}:", "deprecated": "Deprecated since version {}:",
              "deprecated-removed": "Deprecated since version {}:", "rubric": "", "centered": "",
              "topic": "", "table": "", "csv-table": "", "list-table": "", "glossary": "", "only": None,
              "availability": "Availability: {}", "audit-event": None}


def _inline(line: str) -> str:
    line = _LINK.sub(r"\1", line)
    line = _ROLE.sub(r"\1", line)
    line = _FOOTREF.sub("", line)
    line = line.replace("``", "")
    line = re.sub(r"(?<![\w*])\*\*([^*]+)\*\*", r"\1", line)
    line = re.sub(r"\|([A-Za-z]+)\|", r"\1", line)
    return line


def clean_rst(text: str) -> str:
    """reStructuredText -> readable plain text: roles and links become their text, section underlines go,
    signatures stay as plain lines, admonitions become 'Note:' etc., comments/index/toctree blocks are dropped."""
    lines = text.splitlines()
    out: list[str] = []
    skip_indent = None                       # drop an indented block below a dropped directive
    i = 0
    while i < len(lines):
        raw = lines[i]
        i += 1
        stripped = raw.strip()
        indent = len(raw) - len(raw.lstrip())
        if skip_indent is not None:
            if not stripped or indent > skip_indent:
                continue
            skip_indent = None
        if _UNDERLINE.match(raw) and (not out or not out[-1].strip() or len(stripped) >= len(out[-1].strip())):
            if out and out[-1].strip() and _UNDERLINE.match(out[-1]) is None:
                continue                     # underline below a title
            if not out or not out[-1].strip():
                continue                     # overline or transition
        m = re.match(r"^\s*\.\.\s+([a-zA-Z0-9:_-]+)::\s*(.*)$", raw)
        if m:
            name, arg = m.group(1), m.group(2).strip()
            base = name.split(":")[-1] if name.startswith("py:") else name
            if base in _SIG_DIRECTIVES:
                out.append(" " * indent + _inline(arg))
                # continuation signatures are indented under the directive
                while i < len(lines) and lines[i].strip() and (len(lines[i]) - len(lines[i].lstrip())) > indent \
                        and not lines[i].strip().startswith(":"):
                    out.append(" " * indent + _inline(lines[i].strip()))
                    i += 1
                while i < len(lines) and lines[i].strip().startswith(":"):   # options such as :noindex:
                    i += 1
                continue
            if base in _KEEP_BODY:
                fmt = _KEEP_BODY[base]
                if fmt:
                    out.append(" " * indent + _inline(fmt.format(arg) if "{}" in fmt else f"{fmt} {arg}".strip()))
                elif fmt == "" and arg:
                    out.append(" " * indent + _inline(arg))
                while i < len(lines) and lines[i].strip().startswith(":") and lines[i].strip().endswith(
                        tuple("abcdefghijklmnopqrstuvwxyz0123456789:")) and " " not in lines[i].strip()[:3]:
                    i += 1                   # directive options
                continue
            skip_indent = indent             # index, toctree, module, highlight, image, ...
            continue
        if re.match(r"^\s*\.\.(\s|$)", raw):  # comment or hyperlink target / substitution definition
            skip_indent = indent
            continue
        if stripped == "::":
            continue
        line = raw.rstrip()
        if line.endswith("::"):
            line = line[:-2].rstrip()
            line = line + ":" if line and not line.endswith(":") else line
        out.append(_inline(line))
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def python_docs(root: Path) -> list[tuple[str, str, str]]:
    """(name, raw rst, cleaned text) for each page of the Python documentation."""
    src = root / "usr/share/doc/python3.11/html/_sources"
    docs = []
    for path in sorted(src.rglob("*.rst.txt")):
        rel = str(path.relative_to(src))
        if rel.startswith(("whatsnew/changelog", "license", "copyright", "bugs", "about", "contents",
                           "genindex", "py-modindex")):
            continue
        raw = path.read_text(encoding="utf-8", errors="replace")
        docs.append(("python/" + rel[: -len(".rst.txt")], raw, clean_rst(raw)))
    return docs


def debian_reference(root: Path) -> list[tuple[str, str, str]]:
    """The Debian Reference, split into one document per numbered section (title + body, dedented; ASCII
    tables dropped)."""
    path = root / "usr/share/debian-reference/debian-reference.en.txt.gz"
    text = gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace").replace("\u00a0", " ")
    lines = text.splitlines()
    heading = re.compile(r"^(\d+(?:\.\d+){1,3})\. (\S.*)$")
    # the body starts at "Chapter 1." (before it: tables of contents)
    body = lines[next(i for i, l in enumerate(lines) if l.startswith("Chapter 1.")):]
    docs, cur_name, cur = [], None, []

    def flush():
        if cur_name and sum(len(x) for x in cur) > 200:
            t = "\n".join(cur)
            docs.append(("debian-reference/" + cur_name.split(" ")[0], t, re.sub(r"\n{3,}", "\n\n", t).strip() + "\n"))

    for line in body:
        m = heading.match(line)
        if m and len(m.group(1).split(".")) <= 3:
            flush()
            cur_name, cur = f"{m.group(1)} {m.group(2)}", [m.group(2), ""]
            continue
        s = line[4:] if line.startswith("    ") else line.lstrip()
        if s.startswith(("+-", "|")) or re.match(r"^Table \d+\.\d+\.", s):
            continue
        cur.append(s.rstrip())
    flush()
    return docs


def _first_paragraph(lines: list[str], start: int, min_indent: int) -> str:
    """The first prose paragraph at indent > min_indent after line `start` (joined into one line)."""
    para: list[str] = []
    j = start
    while j < len(lines) and not lines[j].strip():
        j += 1
    while j < len(lines) and lines[j].strip():
        ln = lines[j]
        if len(ln) - len(ln.lstrip()) <= min_indent:
            break
        para.append(ln.strip())
        j += 1
    text = " ".join(para)
    return text if 40 <= len(text) <= 700 and not text.startswith((">>>", "$", "#")) else ""


def chat_pairs(docs: list[tuple[str, str, str]]) -> list[tuple[str, str]]:
    """Question/answer pairs taken mechanically from the documents (answers are verbatim doc text)."""
    pairs = []
    for name, raw, clean in docs:
        if name.startswith("python/"):
            lines = raw.splitlines()
            module = None
            for k, line in enumerate(lines):
                m = re.match(r"^\.\. (?:py:)?module:: (\S+)", line)
                if m:
                    module = m.group(1)
                    syn = re.search(r":synopsis:\s*(.+)", "\n".join(lines[k + 1:k + 4]))
                    if syn:
                        pairs.append((f"What is the {module} module for?",
                                      f"The {module} module: {_inline(syn.group(1).strip())}"))
                m = re.match(r"^(\s*)\.\. (?:py:)?(function|method|class|exception|decorator)::\s*([\w.]+)", line)
                if m:
                    ind = len(m.group(1))
                    j = k + 1
                    while j < len(lines) and lines[j].strip() and not lines[j].strip().startswith(":"):
                        j += 1          # continuation signatures
                    while j < len(lines) and lines[j].strip().startswith(":"):
                        j += 1
                    ans = _first_paragraph(lines, j, ind)
                    if not ans or ans.startswith(".."):
                        continue
                    obj = m.group(3)
                    if module and "." not in obj and m.group(2) in ("function", "class", "exception", "decorator"):
                        obj = f"{module}.{obj}"
                    kind = m.group(2)
                    q = (f"What does {obj}() do?" if kind in ("function", "method", "decorator")
                         else f"What is the {obj} class?" if kind == "class" else f"When is {obj} raised?")
                    pairs.append((q, _inline(ans)))
            if name.endswith("glossary"):
                for k, line in enumerate(lines):
                    m = re.match(r"^   (\S[^\n]*)$", line)
                    if m and k + 1 < len(lines) and lines[k + 1].startswith("      "):
                        ans = _first_paragraph(lines, k + 1, 3)
                        if ans:
                            term = m.group(1).strip()
                            pairs.append((f"What is {'a ' if term[0].islower() else ''}{term} in Python?",
                                          _inline(ans)))
        # section headings (cleaned text): a title line followed by a paragraph
        clines = clean.splitlines()
        for k in range(len(clines) - 2):
            title = clines[k].strip()
            if (5 <= len(title) <= 60 and clines[k + 1].strip() == "" and not title.endswith((".", ":", ","))
                    and not clines[k].startswith(" ") and re.match(r"^[A-Z][\w ,'()/-]+$", title)
                    and (k == 0 or clines[k - 1].strip() == "")):
                ans = _first_paragraph(clines, k + 1, -1)
                if ans and ans[0].isupper():
                    h = zlib.crc32(title.encode()) % 3
                    q = [f"Tell me about {title.lower()}.", f"Explain {title.lower()} briefly.",
                         f"What should I know about {title.lower()}?"][h]
                    pairs.append((q, ans))
    # deterministic order, no duplicate questions
    seen, out = set(), []
    for q, a in pairs:
        if q not in seen:
            seen.add(q)
            out.append((q, a))
    return out


def train_tokenizer(texts: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    # Split like the Qwen family's byte-level BPE: contractions, letter runs with one leading non-letter,
    # single digits, punctuation runs, newlines, spaces; then map bytes to the byte-level alphabet.
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def prepare(args) -> None:
    cache = Path(args.cache)
    roots = fetch_debs(cache)
    docs = python_docs(roots["python3.11-doc"]) + debian_reference(roots["debian-reference-en"])
    held = [d for d in docs if zlib.crc32(d[0].encode()) % 100 < HELDOUT_PERCENT]
    train = [d for d in docs if zlib.crc32(d[0].encode()) % 100 >= HELDOUT_PERCENT]
    pairs = chat_pairs(train)
    rng = np.random.default_rng(SEED)
    order = rng.permutation(len(pairs))
    pairs = [pairs[i] for i in order]
    # a few pairs from the training documents also serve as fixed chat prompts for tests and evaluation
    chats = [chat_text(q, a) for q, a in pairs]
    texts = [d[2] for d in train] + chats
    tok = train_tokenizer(texts)

    out = cache / "prepared"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))

    # training stream: documents and chat samples shuffled together, each followed by <|endoftext|>
    units = [d[2] for d in train] + chats
    perm = rng.permutation(len(units))
    enc = tok.encode_batch([units[i] for i in perm])
    stream = np.concatenate([np.append(np.asarray(e.ids, np.uint16), np.uint16(EOS)) for e in enc])
    np.save(out / "train_tokens.npy", stream)
    held_enc = tok.encode_batch([d[2] for d in held])
    lens = np.asarray([len(e.ids) for e in held_enc], np.int64)
    np.save(out / "heldout_tokens.npy", np.concatenate([np.asarray(e.ids, np.uint16) for e in held_enc]))
    np.save(out / "heldout_lengths.npy", lens)
    (out / "heldout_docs.json").write_text(json.dumps([d[0] for d in held], indent=0) + "\n")
    (out / "heldout_text.json").write_text(json.dumps({d[0]: d[2] for d in held}) + "\n")
    chat_tokens = sum(len(e.ids) + 1 for k, e in enumerate(enc) if perm[k] >= len(train))
    manifest = {
        "seed": SEED,
        "sources": [{"package": p, "version": v, "sha256": s, "license": lic} for p, v, s, lic in SOURCES],
        "documents": {"train": len(train), "heldout": len(held), "heldout_rule": f"crc32(name) % 100 < "
                      f"{HELDOUT_PERCENT}"},
        "chat_pairs": len(pairs),
        "tokens": {"train": int(stream.size), "chat_part_of_train": int(chat_tokens),
                   "heldout": int(lens.sum())},
        "chars": {"train_docs": sum(len(d[2]) for d in train), "heldout_docs": sum(len(d[2]) for d in held)},
        "vocab_size": tok.get_vocab_size(),
        "special_tokens": SPECIAL_TOKENS,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "chat_samples.json").write_text(json.dumps(pairs[:200], indent=1) + "\n")
    print(json.dumps(manifest, indent=2))


# ==== the model: names, initial values, params trees ===========================================================

def model_config():
    from fnx.config import ModelConfig
    return ModelConfig.from_dict(CONFIG)


def _leaf_name(prefix: str, path: tuple[str, ...]) -> str:
    bare = path[-1] in ("dt_bias", "A_log") or (len(path) >= 2 and path[-2] == "experts")
    return prefix + ".".join(path) + ("" if bare else ".weight")


def _walk(tree, path=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _walk(v, path + (k,))
        else:
            yield path + (k,), v


def hf_layout(cfg) -> dict[str, tuple[tuple, tuple]]:
    """HF tensor name -> (where: ('top'|'layer', i, path) or ('mtp', path), shape) for every trained tensor.
    The n-gram table is one entry here (`...ngram_embedding.weight`); it is written as split_ngram_parts shards."""
    from fnx.checkpoint.hf import translate
    from fnx.model.mtp import mtp_param_shapes
    from fnx.model.transformer import _hc_shapes, layer_param_shapes
    out = {"model.embed_tokens.weight": (("top", None, ("embed_tokens",)), (cfg.vocab_size, cfg.hidden_size)),
           "lm_head.weight": (("top", None, ("lm_head",)), (cfg.vocab_size, cfg.hidden_size))}
    for path, shape in _walk(_hc_shapes(cfg, inject=False)):
        out[_leaf_name("model.hyper_connection_mixer.", path)] = (("top", None, ("hyper_connection_mixer",) + path),
                                                                  shape)
    for i in range(cfg.num_hidden_layers):
        for path, shape in _walk(layer_param_shapes(cfg, i)):
            out[_leaf_name(f"model.layers.{i}.", path)] = (("layer", i, path), shape)
    for path, shape in _walk(mtp_param_shapes(cfg)):
        if path[0] == "layer":
            name = _leaf_name("mtp.layers.0.", path[1:])
        else:
            name = _leaf_name("mtp.", path)
        out[name] = (("mtp", None, path), shape)
    # the names must be the ones fnx's single translation maps back to the same place
    for name, ((kind, layer, path), _) in out.items():
        if path[-1] == "ngram_embedding":
            continue
        inner = name[len("mtp."):] if kind == "mtp" else name
        t = translate(inner)
        want = path[1:] if kind == "mtp" and path[0] == "layer" else path
        assert t.kind == "param" and t.path == want, (name, t, path)
    return out


def init_tensors(cfg, seed: int) -> dict[str, np.ndarray]:
    """fp32 initial values by HF name (deterministic per name)."""
    n_layers = cfg.num_hidden_layers + 1
    out = {}
    for name, (_, shape) in hf_layout(cfg).items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            v = np.log(rng.uniform(1.0, 16.0, shape))
        elif leaf == "dt_bias":
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
            v = dt + np.log(-np.expm1(-dt))
        elif name.endswith("linear_attn.norm.weight"):
            v = np.ones(shape)
        elif len(shape) == 1:
            v = np.zeros(shape)                       # zero-centred norms: scale 1 + w
        elif leaf in ("embed_tokens", "ngram_embedding"):
            v = rng.standard_normal(shape)
        elif leaf == "conv1d":
            v = rng.uniform(-0.5, 0.5, shape)
        elif leaf == "block_inject_weight":
            v = 0.02 * rng.standard_normal(shape)
        else:
            std = 1.0 / math.sqrt(shape[-1])
            if leaf in ("o_proj", "out_proj", "down_proj", "value_proj"):
                std /= math.sqrt(2 * n_layers)
            elif leaf == "gate" and ".mlp." in name:
                std *= 0.5
            elif leaf == "input_mix_weight_up":
                std *= 0.5
            v = std * rng.standard_normal(shape)
        out[name] = v.astype(np.float32)
    return out


def build_trees(cfg, tensors: dict[str, np.ndarray]):
    """(params, mtp) pytrees of jnp arrays from HF-named tensors (layers arranged by fnx's layer plan)."""
    import jax.numpy as jnp
    from fnx.model.transformer import arrange_layers
    layout = hf_layout(cfg)
    top: dict = {}
    layers = [dict() for _ in range(cfg.num_hidden_layers)]
    mtp: dict = {}
    for name, ((kind, layer, path), _) in layout.items():
        dst = top if kind == "top" else layers[layer] if kind == "layer" else mtp
        for p in path[:-1]:
            dst = dst.setdefault(p, {})
        dst[path[-1]] = jnp.asarray(tensors[name])
    top["segments"] = arrange_layers(cfg, layers)
    return top, mtp


def flatten_trees(cfg, params, mtp) -> dict[str, np.ndarray]:
    """The inverse of build_trees: HF name -> host array."""
    import jax
    from fnx.model.transformer import layer_plan
    layers: list = [None] * cfg.num_hidden_layers
    for seg, seg_params in zip(layer_plan(cfg), params["segments"]):
        for j in range(seg.period):
            for g in range(seg.reps):
                i = seg.start + g * seg.period + j
                layers[i] = jax.tree.map(lambda a: a[g], seg_params[j]) if seg.scanned else seg_params[j]
    out = {}
    for name, ((kind, layer, path), _) in hf_layout(cfg).items():
        src = params if kind == "top" else layers[layer] if kind == "layer" else mtp
        for p in path:
            src = src[p]
        out[name] = np.asarray(jax.device_get(src), np.float32)
    return out


# ==== safetensors writing =======================================================================================

def _st_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    import struct
    header, blobs, offset = {}, [], 0
    names = {np.dtype(np.int64): "I64", np.dtype(np.float32): "F32"}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dt = "BF16" if a.dtype.name == "bfloat16" else names[a.dtype]
        b = a.tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def hf_tensors(cfg, flat: dict[str, np.ndarray], dtype="bfloat16") -> dict[str, np.ndarray]:
    """Final HF tensors: float weights in `dtype`, the n-gram table split into shards, PLE hash buffers (int64)."""
    import ml_dtypes
    from fnx.ple import NgramConstants
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    out = {}
    for name, a in flat.items():
        if name.endswith("ngram_embedding.weight"):
            base = name[: -len(".weight")]
            for k, part in enumerate(np.split(a, cfg.split_ngram_parts, axis=0)):
                out[f"{base}.shard_{k}.weight"] = part.astype(np_dtype)
            consts = NgramConstants.from_config(cfg, 0)
            pre = base[: -len("ngram_embedding")]
            out[pre + "layer_multipliers"] = consts.multipliers.astype(np.int64)
            out[pre + "ngram_heads_vocab_sizes"] = consts.head_vocab_sizes.astype(np.int64)
            out[pre + "ngram_heads_offsets"] = consts.head_offsets.astype(np.int64)
        elif name.endswith("conv1d.weight"):
            out[name] = a.reshape(a.shape[0], 1, a.shape[-1]).astype(np_dtype)   # torch Conv1d: [C, 1, K]
        else:
            out[name] = a.astype(np_dtype)
    return out


def write_safetensors(out_dir: Path, tensors: dict[str, np.ndarray], max_bytes: int = 15_000_000) -> None:
    """Sharded safetensors + model.safetensors.index.json (files under max_bytes each)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(out_dir.glob("*.safetensors")) + [out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(tensors, key=lambda n: (n.startswith("mtp."), n)):
        nb = tensors[name].nbytes
        if size + nb > max_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nb
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        (out_dir / fname).write_bytes(_st_bytes(shard))
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": int(total)}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# ==== training ==================================================================================================

_AUX: list | None = None           # aux-loss terms collected while a loss is traced (layers are unrolled)


def _install_aux_losses():
    """Wrap qsa_layer and moe_block (see the module docstring). Idempotent."""
    import jax
    import jax.numpy as jnp
    from fnx.model import moe, qsa
    from fnx.model.ops import F32, apply_rope, linear, rms_norm
    if getattr(qsa.qsa_layer, "_fnx_mini", False):
        return

    orig_qsa, orig_moe = qsa.qsa_layer, moe.moe_block

    def indexer_kl(p, x, st, pos0, cos, sin, rope_fn, cfg):
        """KL(dense attention block mass || softmax of indexer block scores), fresh state (pos0 = 0)."""
        bsz, length, _ = x.shape
        hi, di, cr = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
        h, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        nb = length // cr
        ix = p["indexer"]
        qk = linear(x, ix["index_qk_proj"])
        q_idx = apply_rope(rms_norm(qk[..., : hi * di].reshape(bsz, length, hi, di), ix["q_layernorm"], eps),
                           cos, sin)
        _, pooled, _ = qsa.indexer_blocks(ix, qk[..., hi * di:], st["idx_ring"], pos0, rope_fn, cfg)
        pooled = pooled[:, :nb]
        s = jnp.einsum("blhd,bnd->blhn", q_idx.astype(F32), pooled.astype(F32))
        s = jnp.sum(jax.nn.relu(s), axis=2) / math.sqrt(di)                          # [B, L, NB]
        pos = jnp.arange(length)
        valid = (jnp.arange(nb) * cr + cr - 1)[None, :] <= pos[:, None]                # [L, NB]

        def target():
            pa = jax.lax.stop_gradient(p)
            qg = linear(x, pa["q_proj"]).reshape(bsz, length, h, 2 * hd)
            q = apply_rope(rms_norm(qg[..., :hd], pa["q_norm"], eps), cos, sin)
            k = apply_rope(rms_norm(linear(x, pa["k_proj"]).reshape(bsz, length, hkv, hd), pa["k_norm"], eps),
                           cos, sin)
            qh = q.reshape(bsz, length, hkv, h // hkv, hd)
            a = jnp.einsum("blgrd,btgd->bgrlt", qh, k).astype(F32) / math.sqrt(hd)
            a = jnp.where(pos[:, None] >= pos[None, :], a, -jnp.inf)
            prob = jnp.mean(jax.nn.softmax(a, axis=-1), axis=(1, 2))                    # [B, L, T]
            mass = prob[..., : nb * cr].reshape(bsz, length, nb, cr).sum(-1)
            mass = jnp.where(valid, mass, 0.0)
            return jax.lax.stop_gradient(mass / jnp.maximum(mass.sum(-1, keepdims=True), 1e-9))

        tgt = target()
        logp = jax.nn.log_softmax(jnp.where(valid, s, -1e30), axis=-1)
        kl = jnp.sum(jnp.where(valid, tgt * (jnp.log(jnp.maximum(tgt, 1e-9)) - logp), 0.0), axis=-1)
        rows = valid.any(-1)                                                            # [L]
        return jnp.sum(kl * rows) / (bsz * jnp.maximum(rows.sum(), 1))

    def qsa_layer(p, x, st, pos0, cos, sin, rope_fn, cfg, n_valid):
        out = orig_qsa(p, x, st, pos0, cos, sin, rope_fn, cfg, n_valid)
        if _AUX is not None:
            _AUX.append(("indexer", indexer_kl(p, jax.lax.stop_gradient(x), st, pos0, cos, sin, rope_fn, cfg)))
        return out

    def moe_block(p, x, top_k, norm_topk_prob, impl="auto"):
        y, logits, idx = orig_moe(p, x, top_k, norm_topk_prob, impl)
        if _AUX is not None:
            e = logits.shape[-1]
            probs = jax.nn.softmax(logits.reshape(-1, e).astype(F32), axis=-1)
            frac = jnp.mean(jax.nn.one_hot(idx.reshape(-1, top_k), e, dtype=F32).sum(1), axis=0) / top_k
            _AUX.append(("balance", e * jnp.sum(jax.lax.stop_gradient(frac) * probs.mean(0))))
        return y, logits, idx

    qsa_layer._fnx_mini = True
    qsa.qsa_layer, moe.moe_block = qsa_layer, moe_block


def _xent(logits, labels):
    import jax
    import jax.numpy as jnp
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(lp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]


def make_loss(cfg, mtp_weight: float, idx_weight: float, bal_weight: float, mtp_stop_grad: bool,
              moe_impl: str = "ragged"):
    import jax
    import jax.numpy as jnp
    from fnx.model.mtp import init_mtp_state, mtp_step
    from fnx.model.transformer import init_state, step

    def loss_fn(trees, tokens, ple_ids):
        """tokens [B, L+1] int32, ple_ids [B, L+1, heads] int32 (ids of the whole stream, sliced)."""
        global _AUX
        params, mtp = trees
        bsz, lp1 = tokens.shape
        length = lp1 - 1
        inp, lab = tokens[:, :-1], tokens[:, 1:]
        _AUX = []
        try:
            state = init_state(cfg, bsz, length, jnp.float32)
            logits, _, hidden, _ = step(params, state, inp, ple_ids[:, :-1], cfg=cfg, moe_impl=moe_impl)
            ce = _xent(logits, lab).mean()
            h = jax.lax.stop_gradient(hidden) if mtp_stop_grad else hidden
            mstate = init_mtp_state(cfg, bsz, length - 1, jnp.float32)
            mlog, _, _ = mtp_step(params, mtp, mstate, h[:, :-1], inp[:, 1:], cfg=cfg, moe_impl=moe_impl)
            mce = _xent(mlog, lab[:, 1:]).mean()
            aux = list(_AUX)
        finally:
            _AUX = None
        idx = jnp.mean(jnp.stack([v for k, v in aux if k == "indexer"]))
        bal = jnp.mean(jnp.stack([v for k, v in aux if k == "balance"]))
        total = ce + mtp_weight * mce + idx_weight * idx + bal_weight * bal
        return total, {"loss": ce, "mtp_loss": mce, "indexer_kl": idx, "balance": bal}

    return loss_fn


def stream_ple_ids(cfg, tokens: np.ndarray) -> np.ndarray:
    """n-gram ids [N, heads] int32 of the whole token stream (PLE resets at every <|endoftext|>)."""
    from fnx.ple import NgramConstants, initial_context, ngram_ids
    consts = NgramConstants.from_config(cfg, 0)
    ids, _ = ngram_ids(initial_context(1, consts), tokens[None].astype(np.int64), consts)
    return ids[0].astype(np.int32)


def train(args) -> None:
    t_start = time.time()
    # XLA:CPU (jaxlib 0.10.2) deadlocks on the second run of this gradient program with its concurrency-optimized
    # scheduler (all threads parked in futex waits); the CPU smoke test turns that scheduler off. No effect on GPU.
    flags = os.environ.get("XLA_FLAGS", "")
    if "concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_enable_concurrency_optimized_scheduler=false").strip()
    import jax
    import jax.numpy as jnp
    import optax
    from fnx.model.transformer import layer_plan

    _install_aux_losses()
    cfg = model_config()
    assert not any(s.scanned for s in layer_plan(cfg)), "aux losses need unrolled layers"
    data = Path(args.data)
    tokens = np.load(data / "train_tokens.npy").astype(np.int32)
    ple = stream_ple_ids(cfg, tokens)
    held = np.load(data / "heldout_tokens.npy").astype(np.int32)
    held_ple = stream_ple_ids(cfg, held)       # held-out docs concatenated without separators: a long stream
    length, bsz = args.seq, args.batch
    print(f"devices {jax.devices()}; train tokens {tokens.size}; seq {length} batch {bsz}", flush=True)

    trees = build_trees(cfg, init_tensors(cfg, args.seed))
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(trees))
    decay = jax.tree.map(lambda a: a.ndim >= 2, trees)
    decay[0]["embed_tokens"] = False
    for seg in decay[0]["segments"]:
        for lay in seg:
            if "ple" in lay:
                lay["ple"]["ple_embedding"]["ngram_embedding"] = False
    tx = optax.chain(optax.clip_by_global_norm(args.clip), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8),
                     optax.add_decayed_weights(args.weight_decay, mask=decay))
    opt_state = tx.init(trees)
    loss_fn = make_loss(cfg, args.mtp_weight, args.indexer_weight, args.balance_weight, args.mtp_stop_grad)

    @jax.jit
    def train_step(trees, opt_state, tok, ids, lr):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trees, tok, ids)
        metrics["grad_norm"] = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, opt_state, trees)
        trees = jax.tree.map(lambda p, u: p - lr * u, trees, updates)
        return trees, opt_state, metrics

    eval_fn = jax.jit(lambda trees, tok, ids: loss_fn(trees, tok, ids)[1])

    rng = np.random.default_rng(args.seed)

    def batch(src, src_ple, starts):
        idx = starts[:, None] + np.arange(length + 1)[None]
        return jnp.asarray(src[idx]), jnp.asarray(src_ple[idx])

    n_eval = max(1, min(args.eval_batch, (held.size - 1) // (length + 1)))
    eval_starts = np.arange(n_eval) * (length + 1)
    eval_tok, eval_ids = batch(held, held_ple, eval_starts)

    warmup = args.warmup
    total = args.steps
    sched = None
    log = {"seed": args.seed, "args": vars(args), "params": n_params, "curve": [], "heldout_curve": []}
    step_times = []
    t_train = time.time()
    i = 0
    while True:
        if sched is None and (total is not None and i == 0 or i == args.measure_steps + 1):
            if total is None:    # fix the step count from the measured speed and the wall-clock budget
                per = float(np.median(step_times[1:])) if len(step_times) > 1 else step_times[0]
                left = args.budget_s - (time.time() - t_start) - args.reserve_s
                total = int(min(args.max_steps, i + max(0, left) // per))
                print(f"step time {per * 1e3:.1f} ms -> total steps {total}", flush=True)
            sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(total, warmup + 1),
                                                       end_value=args.lr * args.final_lr_frac)
        if total is not None and i >= total:
            break
        lr = sched(i) if sched is not None else args.lr * i / warmup
        starts = rng.integers(0, tokens.size - length - 1, size=bsz)
        tok, ids = batch(tokens, ple, starts)
        t0 = time.time()
        trees, opt_state, m = train_step(trees, opt_state, tok, ids, jnp.asarray(lr, jnp.float32))
        if i % args.log_every == 0 or i < args.measure_steps + 1:
            m = {k: float(v) for k, v in m.items()}
            step_times.append(time.time() - t0)
            log["curve"].append({"step": i, "lr": float(lr), **{k: round(v, 5) for k, v in m.items()}})
            print(f"step {i:5d} lr {float(lr):.2e} loss {m['loss']:.4f} mtp {m['mtp_loss']:.4f} "
                  f"idx {m['indexer_kl']:.4f} bal {m['balance']:.3f} gnorm {m['grad_norm']:.2f} "
                  f"({time.time() - t0:.3f}s)", flush=True)
        if i % args.eval_every == 0 and i > 0:
            em = {k: float(v) for k, v in eval_fn(trees, eval_tok, eval_ids).items()}
            log["heldout_curve"].append({"step": i, **{k: round(v, 5) for k, v in em.items()}})
            print(f"  held-out loss {em['loss']:.4f} mtp {em['mtp_loss']:.4f}", flush=True)
        i += 1
    jax.block_until_ready(trees)
    train_s = time.time() - t_train
    em = {k: float(v) for k, v in eval_fn(trees, eval_tok, eval_ids).items()}
    log["heldout_curve"].append({"step": i, **{k: round(v, 5) for k, v in em.items()}})
    print(f"final held-out loss {em['loss']:.4f} (ppl {math.exp(em['loss']):.2f}) mtp {em['mtp_loss']:.4f}",
          flush=True)
    log.update({"steps": i, "tokens_seen": i * bsz * length, "train_seconds": round(train_s, 1),
                "wall_seconds": round(time.time() - t_start, 1), "device": str(jax.devices()[0].device_kind),
                "jax": jax.__version__, "final_heldout": em, "eval_batch": [int(n_eval), length]})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flat = flatten_trees(cfg, *trees)
    write_safetensors(out, hf_tensors(cfg, flat))
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"wrote {out} in {time.time() - t_start:.1f}s total", flush=True)


# ==== finalize: the checkpoint directory ========================================================================

def hf_config_dict() -> dict:
    """config.json through transformers' own config class (so that from_pretrained reads it back)."""
    from transformers import Qwen4ExpTextConfig
    kw = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type", "dtype")}
    conf = Qwen4ExpTextConfig(**kw)
    d = conf.to_dict()
    d["architectures"] = CONFIG["architectures"]
    d["dtype"] = "bfloat16"
    d["layer_types"] = CONFIG["layer_types"]          # the release's spelling, "full_attention"
    d.pop("transformers_version", None)
    return d


def tokenizer_config() -> dict:
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": CONFIG["max_position_embeddings"],
        "eos_token": "<|endoftext|>",
        "bos_token": None,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "chat_template": CHAT_TEMPLATE,
        "errors": "replace",
    }


def finalize(args) -> None:
    src, dst = Path(args.trained), Path(args.to)
    dst.mkdir(parents=True, exist_ok=True)
    for f in list(dst.glob("*.safetensors")) + [dst / "model.safetensors.index.json"]:
        f.unlink(missing_ok=True)
    from fnx.checkpoint.safetensors_io import SafetensorsFile
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        st = SafetensorsFile(f)
        for k in st.keys():
            a = np.array(st.get(k))
            if k.endswith("conv1d.weight") and a.ndim == 2:   # runs before the [C, 1, K] fix wrote [C, K]
                a = a.reshape(a.shape[0], 1, a.shape[1])
            tensors[k] = a
    write_safetensors(dst, tensors)
    shutil.copyfile(src / "train_log.json", dst / "train_log.json")
    (dst / "config.json").write_text(json.dumps(hf_config_dict(), indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": EOS, "eos_token_id": [IM_END, EOS], "pad_token_id": EOS, "do_sample": True,
           "temperature": 0.7, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "max_new_tokens": 256}
    (dst / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    prepared = Path(args.data)
    shutil.copyfile(prepared / "tokenizer.json", dst / "tokenizer.json")
    (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    shutil.copyfile(prepared / "manifest.json", dst / "data_manifest.json")
    total = sum(p.stat().st_size for p in dst.iterdir() if p.is_file())
    print(f"{dst}: {total / 1e6:.1f} MB")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="fetch, clean, split, tokenizer, token arrays (CPU)")
    p.add_argument("--cache", default=str(CACHE))
    t = sub.add_parser("train", help="train and write the tensors to --out")
    t.add_argument("--data", default=str(PREPARED))
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=SEED)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--steps", type=int, default=None, help="fixed step count (default: from --budget-s)")
    t.add_argument("--max-steps", type=int, default=2000)
    t.add_argument("--budget-s", type=float, default=420.0, help="wall clock for the whole command")
    t.add_argument("--reserve-s", type=float, default=25.0, help="kept back for the final eval and writing")
    t.add_argument("--measure-steps", type=int, default=8)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--final-lr-frac", type=float, default=0.1)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--clip", type=float, default=1.0)
    t.add_argument("--mtp-weight", type=float, default=0.3)
    t.add_argument("--mtp-stop-grad", action="store_true")
    t.add_argument("--indexer-weight", type=float, default=1.0)
    t.add_argument("--balance-weight", type=float, default=0.01)
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--eval-every", type=int, default=200)
    t.add_argument("--eval-batch", type=int, default=16)
    f = sub.add_parser("finalize", help="assemble checkpoints/fnx-mini from a train --out directory")
    f.add_argument("trained")
    f.add_argument("--to", default=str(CHECKPOINT))
    f.add_argument("--data", default=str(PREPARED))
    args = ap.parse_args(argv)
    {"prepare": prepare, "train": train, "finalize": finalize}[args.cmd](args)


if __name__ == "__main__":
    main()
