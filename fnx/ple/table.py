"""Where the n-gram table's rows live on disk, checked before anything reads them.

A `TableSource` is a list of extents (file, byte offset, rows) that together hold the table row after row, plus
its dtype, row width, FP8 scale and a content fingerprint. Two layouts are read:

* the checkpoint's own safetensors files: `...ngram_embedding.shard_{i}.weight` tensors stacked along rows in
  shard order (in any files, in any order inside a file), `...ngram_embedding.weight_scale` for FP8, and the
  optional `layer_multipliers` / `ngram_heads_vocab_sizes` / `ngram_heads_offsets` buffers;
* a raw row file written by `convert_to_raw`: a 4 KiB header (magic `FNXPLE01`, then a little-endian u32
  length and a JSON object: rows, width, dtype, scale, fingerprint, the hash constants), then the rows
  contiguous from byte 4096, so a row's address is one multiply.

Only `os.pread` touches file bytes here, so a short or unreadable file raises OSError, never SIGBUS."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from fnx._safetensors import read_header
from fnx.ple.ngram import NgramConstants

RAW_MAGIC = b"FNXPLE01"
RAW_HEADER = 4096
FINGERPRINT_SAMPLES = 64

DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}
_SCALE_DTYPES = ("BF16", "F16", "F32")
_ST_DTYPES = {**DTYPES, "F64": np.float64, "I64": np.int64, "I32": np.int32}

_PREFIX = r"(?:^|\.)(?:layers\.(\d+)\.)?(?:ple\.)?(?:ple_embedding\.)?"
_SHARD = re.compile(_PREFIX + r"ngram_embedding\.shard_(\d+)\.weight$")
_WHOLE = re.compile(_PREFIX + r"ngram_embedding\.weight$")
_SCALE = re.compile(_PREFIX + r"ngram_embedding\.weight_scale$")
_BUFFER = re.compile(_PREFIX + r"(layer_multipliers|ngram_heads_vocab_sizes|ngram_heads_offsets)$")


class TableError(ValueError):
    """The table on disk does not match what the model needs, or cannot be read."""


@dataclass(frozen=True)
class Extent:
    path: str
    offset: int  # byte offset of the first row in the file
    rows: int


@dataclass
class TableSource:
    extents: list[Extent]
    rows: int
    width: int
    dtype: str  # a DTYPES key
    scale: np.ndarray | None  # shape [], in its own dtype (F8 tables only)
    buffers: dict[str, np.ndarray] = field(default_factory=dict)  # stored hash constants, int64
    kind: str = "safetensors"  # or "raw"
    stored_fingerprint: str | None = None  # raw files only
    fingerprint: str = ""

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])

    @property
    def row_bytes(self) -> int:
        return self.width * self.np_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def paths(self) -> list[str]:
        return sorted({e.path for e in self.extents})

    def describe(self) -> str:
        scale = "" if self.scale is None else f", scale {self.scale.item()!r} ({self.scale.dtype})"
        return (f"{self.kind} n-gram table: {self.rows} rows x {self.width} {self.dtype}{scale}, "
                f"{self.nbytes / 2**30:.2f} GiB in {len(self.extents)} extents of {len(self.paths)} files")

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """rows [n] int64 -> (extent index [n], byte offset inside that extent's file [n])."""
        starts = np.cumsum([0] + [e.rows for e in self.extents[:-1]], dtype=np.int64)
        idx = np.searchsorted(starts, rows, side="right") - 1
        base = np.array([e.offset for e in self.extents], dtype=np.int64)
        return idx, base[idx] + (rows - starts[idx]) * self.row_bytes

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        """pread the given rows: [n, row_bytes] uint8. Raises OSError on a short read."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), self.row_bytes), dtype=np.uint8)
        idx, off = self.locate(rows)
        fds = {}
        try:
            for i, (e, o) in enumerate(zip(idx.tolist(), off.tolist())):
                path = self.extents[e].path
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                got = os.pread(fds[path], self.row_bytes, o)
                if len(got) != self.row_bytes:
                    raise OSError(f"{path}: short read of row {int(rows[i])} at byte {o} "
                                  f"({len(got)} of {self.row_bytes} bytes); the file is truncated")
                out[i] = np.frombuffer(got, dtype=np.uint8)
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def compute_fingerprint(self) -> str:
        """blake2b-64 of the layout, the scale bytes and 64 rows spread over the table (one pread each)."""
        h = hashlib.blake2b(digest_size=8)
        h.update(json.dumps([self.rows, self.width, self.dtype]).encode())
        if self.scale is not None:
            h.update(str(self.scale.dtype).encode() + self.scale.tobytes())
        sample = np.unique(np.linspace(0, self.rows - 1, FINGERPRINT_SAMPLES).astype(np.int64))
        h.update(self.read_rows(sample).tobytes())
        return h.hexdigest()


def _safetensors_header(path: str) -> tuple[int, dict]:
    base, header, _ = read_header(path, TableError)
    header.pop("__metadata__", None)
    return base, header


def _checkpoint_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise TableError(f"{path!r} is neither a checkpoint directory nor a safetensors file")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as exc:
            raise TableError(f"{index} is not a valid safetensors index: {exc}") from exc
        # A standalone PLE file next to the trunk (e.g. ple-fp8.safetensors) is read too.
        extra = sorted(f for f in os.listdir(path) if f.endswith(".safetensors") and f not in names)
        names += extra
    else:
        names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not names:
        raise TableError(f"no .safetensors files in {path}")
    return [os.path.join(path, n) for n in names]


def from_checkpoint(path: str | os.PathLike, layer: int | None = None) -> TableSource:
    """The n-gram table of one PLE layer (0-based decoder layer index; None = the only one) in a checkpoint
    directory or a standalone safetensors file."""
    path = os.fspath(path)
    found: dict = {}  # layer -> {"shards": {i: (path, offset, entry)}, "whole": ..., "scale": ..., buffers}

    for file in _checkpoint_files(path):
        base, header = _safetensors_header(file)
        size = os.path.getsize(file)
        for name, e in header.items():
            for kind, rx in (("shard", _SHARD), ("whole", _WHOLE), ("scale", _SCALE), ("buffer", _BUFFER)):
                m = rx.search(name)
                if m:
                    break
            else:
                continue
            lyr = None if m.group(1) is None else int(m.group(1))
            start, end = e["data_offsets"]
            if e.get("dtype") not in _ST_DTYPES:
                raise TableError(f"{file}: tensor {name!r} has dtype {e.get('dtype')!r}; the n-gram table must be "
                                 f"one of {sorted(DTYPES)}")
            want = int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(_ST_DTYPES[e["dtype"]]).itemsize
            if end - start != want:
                raise TableError(f"{file}: tensor {name!r} ({e['dtype']} {e['shape']}) does not fit its byte range "
                                 f"{start}..{end}; the header is corrupt")
            if base + end > size:
                raise TableError(f"{file}: tensor {name!r} ends at byte {base + end}, but the file holds {size} "
                                 "bytes; the file is truncated (re-download or re-convert it)")
            slot = found.setdefault(lyr, {"shards": {}, "buffers": {}})
            item = (file, base + start, e, name)
            if kind == "shard":
                slot["shards"][int(m.group(2))] = item
            elif kind == "buffer":
                slot["buffers"][m.group(2)] = item
            else:
                slot[kind] = item

    tables = {k: v for k, v in found.items() if v["shards"] or "whole" in v}
    if not tables:
        raise TableError(f"no n-gram table (`...ngram_embedding.shard_*.weight` or `...ngram_embedding.weight`) "
                         f"in {path}")
    if layer is None:
        if len(tables) > 1:
            raise TableError(f"{path} holds n-gram tables for layers {sorted(tables, key=str)}; pass layer=")
        layer = next(iter(tables))
    elif layer not in tables:
        raise TableError(f"{path} has no n-gram table for layer {layer}; it has {sorted(tables, key=str)}")
    slot = tables[layer]
    if slot["shards"] and "whole" in slot:
        raise TableError(f"{path}: layer {layer} has both a whole n-gram table and shards; keep one")
    if slot["shards"]:
        idx = sorted(slot["shards"])
        if idx != list(range(len(idx))):
            raise TableError(f"{path}: n-gram table shards {idx} are not a complete 0..N-1 range")
        items = [slot["shards"][i] for i in idx]
    else:
        items = [slot["whole"]]
    dtypes = {it[2]["dtype"] for it in items}
    widths = {tuple(it[2]["shape"][1:]) for it in items}
    if len(dtypes) != 1 or len(widths) != 1 or any(len(it[2]["shape"]) != 2 for it in items):
        raise TableError(f"{path}: n-gram table shards disagree or are not 2-D: dtypes {dtypes}, shapes "
                         f"{[it[2]['shape'] for it in items][:4]}")
    dtype = dtypes.pop()
    if dtype not in DTYPES:
        raise TableError(f"{path}: n-gram table dtype {dtype} is not one of {sorted(DTYPES)}")
    extents = [Extent(it[0], it[1], int(it[2]["shape"][0])) for it in items]

    scale = None
    if "scale" in slot:
        file, off, e, name = slot["scale"]
        if e["dtype"] not in _SCALE_DTYPES or int(np.prod(e["shape"])) != 1:
            raise TableError(f"{name}: the FP8 scale must be one {'/'.join(_SCALE_DTYPES)} value, got "
                             f"{e['dtype']} {e['shape']}")
        scale = _pread_array(file, off, e).reshape(())
    buffers = {k: _pread_array(it[0], it[1], it[2]).astype(np.int64) for k, it in slot["buffers"].items()}
    return TableSource(extents, sum(e.rows for e in extents), int(widths.pop()[0]), dtype, scale, buffers)


def _pread_array(file: str, off: int, entry: dict) -> np.ndarray:
    dt = np.dtype(_ST_DTYPES[entry["dtype"]])
    n = int(np.prod(entry["shape"], dtype=np.int64))
    fd = os.open(file, os.O_RDONLY)
    try:
        data = os.pread(fd, n * dt.itemsize, off)
    finally:
        os.close(fd)
    if len(data) != n * dt.itemsize:
        raise TableError(f"{file}: short read at byte {off}; the file is truncated")
    return np.frombuffer(data, dtype=dt).reshape(entry["shape"]).copy()


def from_raw(path: str | os.PathLike) -> TableSource:
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(RAW_HEADER)
    if len(head) < 12 or head[:8] != RAW_MAGIC:
        raise TableError(f"{path}: not an fnx raw row file (magic {head[:8]!r}, expected {RAW_MAGIC!r})")
    (n,) = struct.unpack("<I", head[8:12])
    try:
        meta = json.loads(head[12:12 + n])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TableError(f"{path}: corrupt raw row file header ({exc})") from exc
    dtype = meta.get("dtype")
    if dtype not in DTYPES:
        raise TableError(f"{path}: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    rows, width = int(meta["rows"]), int(meta["width"])
    need = RAW_HEADER + rows * width * np.dtype(DTYPES[dtype]).itemsize
    if size < need:
        raise TableError(f"{path}: holds {size} bytes but its header describes {rows} rows x {width} {dtype} "
                         f"({need} bytes); the file is truncated (re-run the conversion)")
    scale = None
    if meta.get("scale_dtype") is not None:
        scale = np.frombuffer(bytes.fromhex(meta["scale_hex"]), dtype=DTYPES[meta["scale_dtype"]]).reshape(())
    buffers = {k: np.asarray(v, dtype=np.int64) for k, v in meta.get("buffers", {}).items()}
    return TableSource([Extent(path, RAW_HEADER, rows)], rows, width, dtype, scale, buffers, kind="raw",
                       stored_fingerprint=meta.get("fingerprint"))


def open_source(path: str | os.PathLike, layer: int | None = None) -> TableSource:
    """A raw row file (by its magic) or a checkpoint directory / safetensors file."""
    path = os.fspath(path)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if f.read(8) == RAW_MAGIC:
                return from_raw(path)
    return from_checkpoint(path, layer)


_BUFFER_FIELDS = {"layer_multipliers": "multipliers", "ngram_heads_vocab_sizes": "head_vocab_sizes",
                  "ngram_heads_offsets": "head_offsets"}


def validate(src: TableSource, consts: NgramConstants | None = None, embed_dim: int | None = None,
             expected_fingerprint: str | None = None) -> TableSource:
    """Start-up checks; raises TableError naming the first mismatch. Sets src.fingerprint."""
    where = src.paths[0] if len(src.paths) == 1 else f"{len(src.paths)} files under {os.path.dirname(src.paths[0])}"
    if src.rows < 1 or src.width < 1:
        raise TableError(f"{where}: empty n-gram table ({src.rows} x {src.width})")
    if src.dtype == "F8_E4M3":
        if src.scale is None:
            raise TableError(f"{where}: FP8 n-gram table without `...ngram_embedding.weight_scale`; the rows cannot "
                             "be dequantized")
        s = float(src.scale.astype(np.float32))
        if not np.isfinite(s) or s <= 0:
            raise TableError(f"{where}: the FP8 scale must be finite and positive, got {s}")
    elif src.scale is not None:
        raise TableError(f"{where}: a {src.dtype} n-gram table comes with an FP8 scale; refusing an ambiguous table")
    if consts is not None:
        if src.rows != consts.num_rows:
            raise TableError(f"{where}: the table has {src.rows} rows but the config's hash layout needs "
                             f"{consts.num_rows}; check ngram_vocab_size_base, heads_per_ngram and ple_layer_ids")
        for key, value in src.buffers.items():
            want = getattr(consts, _BUFFER_FIELDS[key])
            if value.shape != want.shape or not np.array_equal(value, want):
                raise TableError(f"{where}: stored {key} = {value.tolist()} does not match the values computed from "
                                 f"the config ({want.tolist()}); check seed, vocab_size, ngram_size, heads_per_ngram")
        if embed_dim is not None and src.width * consts.num_heads != embed_dim:
            raise TableError(f"{where}: rows of width {src.width} x {consts.num_heads} heads != ple_embed_dim "
                             f"{embed_dim}")
    try:
        src.fingerprint = src.compute_fingerprint()
    except OSError as exc:
        raise TableError(f"{where}: cannot read the table for its fingerprint: {exc}") from exc
    if src.stored_fingerprint is not None and src.stored_fingerprint != src.fingerprint:
        raise TableError(f"{where}: content fingerprint {src.fingerprint} != {src.stored_fingerprint} written at "
                         "conversion; the file was modified or corrupted, re-run the conversion")
    if expected_fingerprint is not None and expected_fingerprint != src.fingerprint:
        raise TableError(f"{where}: fingerprint {src.fingerprint} != the expected {expected_fingerprint}; this is "
                         "a different table")
    return src


def raw_header(meta: dict) -> bytes:
    """The 4 KiB header of a raw row file: magic, u32 length, JSON (rows, width, dtype, scale_dtype, scale_hex,
    fingerprint, buffers)."""
    blob = json.dumps(meta).encode()
    if 12 + len(blob) > RAW_HEADER:
        raise TableError(f"raw header of {len(blob)} bytes does not fit in {RAW_HEADER}")
    return (RAW_MAGIC + struct.pack("<I", len(blob)) + blob).ljust(RAW_HEADER, b"\0")


def convert_to_raw(src: TableSource, out_path: str | os.PathLike, consts: NgramConstants | None = None,
                   chunk_bytes: int = 64 << 20, progress=None) -> TableSource:
    """Write the table as one raw row file (written to `out_path.tmp`, fsynced, then renamed).

    The header records the source's fingerprint, so the new file validates as the same table."""
    out_path = os.fspath(out_path)
    if not src.fingerprint:
        validate(src, consts)
    meta = {"rows": src.rows, "width": src.width, "dtype": src.dtype, "fingerprint": src.fingerprint,
            "scale_dtype": None if src.scale is None else next(k for k, v in DTYPES.items()
                                                                 if np.dtype(v) == src.scale.dtype),
            "scale_hex": None if src.scale is None else src.scale.tobytes().hex(),
            "buffers": {k: v.tolist() for k, v in src.buffers.items()}}
    if consts is not None:
        meta["buffers"] = {"layer_multipliers": consts.multipliers.tolist(),
                           "ngram_heads_vocab_sizes": consts.head_vocab_sizes.tolist(),
                           "ngram_heads_offsets": consts.head_offsets.tolist()}
    tmp = out_path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, raw_header(meta), 0)
        pos = RAW_HEADER
        for e in src.extents:
            rfd = os.open(e.path, os.O_RDONLY)
            try:
                todo, off = e.rows * src.row_bytes, e.offset
                while todo:
                    data = os.pread(rfd, min(chunk_bytes, todo), off)
                    if not data:
                        raise TableError(f"{e.path}: unexpected end of file at byte {off}")
                    os.pwrite(fd, data, pos)
                    pos, off, todo = pos + len(data), off + len(data), todo - len(data)
                    if progress:
                        progress(pos - RAW_HEADER, src.nbytes)
            finally:
                os.close(rfd)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, out_path)
    return validate(from_raw(out_path), consts)
