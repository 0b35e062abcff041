"""Load speed and peak host memory of the streaming checkpoint loader on a synthetic multi-GB checkpoint.

    python scripts/bench_load.py /tmp/fnx_bench --gb 3.5            # write (once) and measure bf16 load
    python scripts/bench_load.py /tmp/fnx_bench --mode fp8          # online quant="fp8"
    python scripts/bench_load.py /tmp/fnx_bench --mode convert      # what `fnx convert` does: load, save with orbax
    python scripts/bench_load.py /tmp/fnx_bench --mode restore      # what `fnx.load(DST)` does
    (convert-fp8 / restore-fp8: the same with --quant fp8)

Each measurement runs in a fresh subprocess so that ru_maxrss is the peak of that load alone. On a CPU the
"device" is host memory, so peak RSS = the loaded params + the loader's overhead; the overhead (peak minus the
params and the baseline) is the number the loader controls. The checkpoint is read from the page cache (it was
just written), so the speed is the loader's, not the disk's. Ends with one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bench_config(layers: int) -> dict:
    """A scaled-down Flash-Next: release structure (GDN x3 + QSA, HC 4, PLE on layer 1, fused experts)."""
    return {
        "model_type": "qwen4_exp_text", "vocab_size": 32768, "hidden_size": 1024, "num_hidden_layers": layers,
        "full_attention_interval": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [6, 5, 5]},
        "linear_num_key_heads": 8, "linear_num_value_heads": 16, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "output_gate_type": "sigmoid",
        "num_experts": 64, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "hc_count": 4, "hc_lowrank": 128,
        "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 64, "indexer_budget": 2048,
        "indexer_compress_ratio": 4, "ple_layer_ids": [2], "ple_embed_dim": 1024, "ngram_size": 3,
        "heads_per_ngram": 8, "ngram_vocab_size_base": 200000, "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 16, "eos_token_id": 2, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "tie_word_embeddings": False, "dtype": "bfloat16",
    }


def _bf16_bits(n: int, rng) -> np.ndarray:
    """n random finite bf16 values (as uint16 bits) of magnitude about 2^-7..2^3, without a float round trip."""
    mant = rng.integers(0, 128, n, dtype=np.uint16)
    exp = rng.integers(120, 130, n, dtype=np.uint16)
    sign = rng.integers(0, 2, n, dtype=np.uint16)
    return (sign << 15) | (exp << 7) | mant


def write_synthetic(out: Path, gb: float) -> dict:
    """Write config.json + a few multi-GB safetensors files, one tensor at a time (never the whole model)."""
    import ml_dtypes  # noqa: F401  (bf16 registration for the header dtype)
    from fnx.config import ModelConfig
    from fnx.model.transformer import layer_param_shapes
    per_layer = 2 * 64 * 1024 * 1024 * 3 // 2 + 40e6  # experts + the rest, bytes in bf16 (rough)
    layers = max(4, int(round(gb * 1e9 / per_layer / 4)) * 4)
    raw = bench_config(layers)
    cfg = ModelConfig.from_dict(raw)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    tensors: list[tuple[str, tuple]] = [("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)),
                                        ("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))]
    for k, s in {"hc_norm": (cfg.hc_dim,), "input_mix_weight_down": (cfg.hc_lowrank, cfg.hc_dim),
                 "input_mix_weight_up": (cfg.hc_dim, cfg.hc_lowrank)}.items():
        tensors.append((f"model.hyper_connection_mixer.{k}.weight", s))

    def walk(tree, prefix):
        for k, v in tree.items():
            if isinstance(v, dict):
                yield from walk(v, prefix + k + ".")
            else:
                yield prefix + k, v

    for i in range(layers):
        for name, shape in walk(layer_param_shapes(cfg, i), f"model.layers.{i}."):
            if name.endswith("ngram_embedding"):
                parts = cfg.split_ngram_parts
                for p in range(parts):
                    tensors.append((f"{name}.shard_{p}.weight", (shape[0] // parts, shape[1])))
                continue
            if name.endswith("conv1d"):
                shape = (shape[0], 1, shape[1])
            suffix = "" if name.rsplit(".", 1)[-1] in ("dt_bias", "A_log", "gate_up_proj", "down_proj") else ".weight"
            tensors.append((name + suffix, shape))
    rng = np.random.default_rng(0)
    limit, files, cur, size = 1 << 30, [], [], 0
    for t in tensors:
        cur.append(t)
        size += int(np.prod(t[1])) * 2
        if size >= limit:
            files.append(cur)
            cur, size = [], 0
    if cur:
        files.append(cur)
    weight_map, total = {}, 0
    for fi, group in enumerate(files):
        fname = f"model-{fi + 1:05d}-of-{len(files):05d}.safetensors"
        header, off = {}, 0
        for name, shape in group:
            n = int(np.prod(shape)) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(out / fname, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for name, shape in group:
                f.write(_bf16_bits(int(np.prod(shape)), rng).tobytes())
        total += off
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    return {"layers": layers, "bytes": total, "files": len(files), "tensors": len(tensors)}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(ckpt: str, mode: str, dst: str | None) -> dict:
    """Runs inside the subprocess."""
    import jax
    import jax.numpy as jnp
    base = _rss_mb()
    from fnx.checkpoint import load_checkpoint
    from fnx.model import quant  # noqa: F401 - its import is part of the import RSS measured next
    after_import = _rss_mb()
    t0 = time.perf_counter()
    if mode.startswith("restore"):
        from fnx.checkpoint.orbax_io import restore
        out = restore(dst)
    else:
        out = load_checkpoint(ckpt, dtype=jnp.bfloat16, quant="fp8" if mode.endswith("fp8") else None)
    jax.block_until_ready(out.params)
    seconds = time.perf_counter() - t0
    nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(out.params))
    res = {"mode": mode, "seconds": round(seconds, 2), "params_gb": round(nbytes / 1e9, 3),
           "peak_rss_gb": round(_rss_mb() / 1024, 3), "baseline_rss_gb": round(after_import / 1024, 3),
           "start_rss_gb": round(base / 1024, 3)}
    if mode in ("bf16", "fp8", "convert", "convert-fp8"):
        res["read_gb"] = round(out.stats["bytes"] / 1e9, 3)
        res["read_gb_per_s"] = round(out.stats["bytes"] / 1e9 / seconds, 3)
        res["overhead_gb"] = round(res["peak_rss_gb"] - res["baseline_rss_gb"] - nbytes / 2**30, 3)
    if mode.startswith("convert"):
        from fnx.checkpoint.orbax_io import save
        t1 = time.perf_counter()
        save(out, dst, source=ckpt, quant="fp8" if mode.endswith("fp8") else None)
        res["save_seconds"] = round(time.perf_counter() - t1, 2)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--gb", type=float, default=3.5, help="approximate checkpoint size to write")
    ap.add_argument("--mode", choices=["bf16", "fp8", "convert", "restore", "convert-fp8", "restore-fp8"],
                    default="bf16")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ckpt, dst = args.dir / "hf", args.dir / ("orbax-fp8" if args.mode.endswith("fp8") else "orbax")
    if args._child:
        print("RESULT " + json.dumps(measure(str(ckpt), args.mode, str(dst))), flush=True)
        return
    info = {}
    if not (ckpt / "model.safetensors.index.json").exists():
        t0 = time.perf_counter()
        info = write_synthetic(ckpt, args.gb)
        info["write_seconds"] = round(time.perf_counter() - t0, 1)
        print("wrote", info, flush=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, str(args.dir), "--mode", args.mode, "--_child"],
                          capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"measurement failed (exit {proc.returncode})")
    res = json.loads(line[len("RESULT "):])
    res.update({"checkpoint_gb": round(sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 1e9, 3),
                "machine": f"{os.cpu_count()}-core CPU", **info})
    print(json.dumps(res))


if __name__ == "__main__":
    main()
