"""Test-side writers of the quantized release layouts, built from a tiny HF checkpoint with NumPy only (independent
of fnx's loader): the FP8 block release, the ModelOpt NVFP4 release. Each also returns the dequantized tensors, so
a test can compare a quantized load against the float model with exactly those weights."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)

# Weights the FP8 writer leaves in full precision (besides every 1-D tensor and the embeddings).
FP8_KEEP = ("lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight", "block_inject_weight.weight",
            "in_proj_a.weight", "in_proj_b.weight", "conv1d.weight", "index_qk_proj.weight")


def read_all(src: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def fp8_block_np(w: np.ndarray, block=(128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """Block FP8 in the official layout: q (E4M3) and weight_scale_inv (f32, per block), w ~= q * scale_inv."""
    w = np.asarray(w, np.float32)
    out, inp = w.shape
    nbo, nbi = -(-out // block[0]), -(-inp // block[1])
    s = np.ones((nbo, nbi), np.float32)
    q = np.empty(w.shape, FP8)
    for i in range(nbo):
        for j in range(nbi):
            blk = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            amax = np.abs(blk).max()
            s[i, j] = amax * np.float32(1.0 / 448.0) if amax > 0 else 1.0
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (blk / s[i, j]).astype(FP8)
    return q, s


def fp8_block_deq(q, s, block=(128, 128)) -> np.ndarray:
    full = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[: q.shape[0], : q.shape[1]]
    return q.astype(np.float32) * full


def nvfp4_np(w: np.ndarray, group=16):
    """ModelOpt NVFP4: packed E2M1 codes (low nibble = even element), E4M3 scale per 16, global fp32 scale_2."""
    w = np.asarray(w, np.float32)
    out, inp = w.shape
    g = w.reshape(out, inp // group, group)
    amax = np.abs(w).max()
    scale_2 = np.float32(amax / (6.0 * 448.0)) if amax > 0 else np.float32(1.0)
    bs = (np.abs(g).max(-1) / 6.0 / scale_2).astype(FP8)              # [out, in/16]
    bsf = bs.astype(np.float32) * scale_2
    bsf[bsf == 0] = 1.0
    x = g / bsf[..., None]
    mag = np.abs(x)
    code = np.abs(mag[..., None] - E2M1).argmin(-1).astype(np.uint8)  # nearest (ties to the smaller code)
    code |= (x < 0).astype(np.uint8) << 3
    code = code.reshape(out, inp)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).astype(np.uint8)
    vals = np.where(code & 8, -1.0, 1.0) * E2M1[code & 7]
    deq = ((vals.reshape(out, inp // group, group) * bs.astype(np.float32)[..., None]) * scale_2).reshape(out, inp)
    return packed, bs, np.array(scale_2, np.float32), deq.astype(np.float32)


def _split_experts(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj") and not k.startswith("mtp."):
            base, inter = k[: -len("gate_up_proj")], v.shape[1] // 2
            down = sd[base + "down_proj"]
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = v[e, inter:]
                out[f"{base}{e}.down_proj.weight"] = down[e]
        elif not (k.endswith("mlp.experts.down_proj") and not k.startswith("mtp.")):
            out[k] = v
    return out


def _write_dir(src: Path, out: Path, tensors: dict, config_edit) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        if (Path(src) / f).exists():
            shutil.copy(Path(src) / f, out / f)
    if config_edit is not None:
        cfg = json.loads((out / "config.json").read_text())
        config_edit(cfg)
        (out / "config.json").write_text(json.dumps(cfg, indent=1))
    names = sorted(tensors)
    half = len(names) // 2   # two files, so the index matters
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, ks in files.items():
        save_file({k: np.ascontiguousarray(tensors[k]) for k in ks}, out / fname)
    index = {"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def write_fp8(src: Path, out: Path, block=(128, 128)) -> tuple[Path, Path]:
    """The FP8 release layout from a float checkpoint, and the float checkpoint of its dequantized weights."""
    sd = _split_experts(read_all(src))
    qsd, deq = {}, {}
    table_shards = sorted(k for k in sd if ".ngram_embedding.shard_" in k)
    if table_shards:
        amax = max(np.abs(sd[k]).max() for k in table_shards)
        scale = np.array([amax / 448.0], np.float32).astype(BF16)
        prefix = table_shards[0].split("ngram_embedding.")[0] + "ngram_embedding."
        qsd[prefix + "weight_scale"] = scale
        sf = scale.astype(np.float32)
        for k in table_shards:
            qv = (sd[k].astype(np.float32) / sf).astype(FP8)
            qsd[k] = qv
            deq[k] = (qv.astype(np.float32) * sf).astype(BF16).astype(np.float32)
    for k, v in sd.items():
        if k in table_shards:
            continue
        if v.ndim == 2 and k.endswith(".weight") and not k.endswith(FP8_KEEP) and "embed_tokens" not in k:
            qv, s = fp8_block_np(v, block)
            qsd[k], qsd[k[: -len("weight")] + "weight_scale_inv"] = qv, s
            deq[k] = fp8_block_deq(qv, s, block)
        else:
            qsd[k] = v
            deq[k] = v

    def add_qc(cfg):
        target = cfg.get("text_config", cfg)
        target["quantization_config"] = {
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block),
            "modules_to_not_convert": ["lm_head"], "modules_to_convert": ["ple.ple_embedding.ngram_embedding"]}

    return (_write_dir(src, Path(out) / "fp8", qsd, add_qc), _write_dir(src, Path(out) / "fp8_deq", deq, None))


def write_nvfp4(src: Path, out: Path, mtp_block=(128, 128)) -> tuple[Path, Path]:
    """The ModelOpt NVFP4 layout (routed experts NVFP4, MTP FP8 blocks, the rest as stored) and its dequantized
    float twin."""
    sd = _split_experts(read_all(src))
    qsd, deq = {}, {}
    for k, v in sd.items():
        if ".mlp.experts." in k and k.endswith(".weight") and not k.startswith("mtp."):
            packed, bs, s2, d = nvfp4_np(v)
            base = k[: -len("weight")]
            qsd[k], qsd[base + "weight_scale"], qsd[base + "weight_scale_2"] = packed, bs, s2
            qsd[base + "input_scale"] = np.array(0.01 + (zlib.crc32(k.encode()) % 7) * 1e-3, np.float32)
            deq[k] = d
        elif k.startswith("mtp.") and v.ndim == 2 and k.endswith(".weight") and not k.endswith(FP8_KEEP):
            qv, s = fp8_block_np(v, mtp_block)
            qsd[k], qsd[k[: -len("weight")] + "weight_scale_inv"] = qv, s
            deq[k] = fp8_block_deq(qv, s, mtp_block)
        else:
            qsd[k] = deq[k] = v
    out = Path(out)
    q = _write_dir(src, out / "nvfp4", qsd, None)
    (q / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}))
    return q, _write_dir(src, out / "nvfp4_deq", deq, None)


def fro(a, b):
    """||a - b|| / ||b|| over all logits."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def rel_max(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())
