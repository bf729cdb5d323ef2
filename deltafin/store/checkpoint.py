"""Lazy reads of a Hugging Face safetensors checkpoint: headers parsed on demand, tensors by pread.

Nothing is memory-mapped, so reading a 1.5 TB checkpoint keeps memory bounded by the tensors in hand.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from deltafin.errors import CheckpointError
from deltafin.store.fileio import read_exact
from deltafin.store.safetensors_io import read_header

ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E8M0": torch.float8_e8m0fnu,  # OCP MX scales: DeepSeek-V4's FP4 experts and FP8 blocks
}
ST_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
            "I8": 1, "U8": 1, "BOOL": 1, "F8_E8M0": 1}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shard: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    offset: int  # absolute file offset
    nbytes: int


class Checkpoint:
    """A checkpoint directory: config.json plus model.safetensors or an index with shards."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{path}: checkpoint directory not found; pass the folder holding config.json")
        self.config = self._read_json("config.json")
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{os.path.join(self.path, 'config.json')}: a JSON {type(self.config).__name__}, not "
                                  f"an object; a Hugging Face config.json is an object of settings: re-download it")
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self.weight_map, self.total_size = self._read_index()

    def _read_json(self, name: str) -> dict:
        p = os.path.join(self.path, name)
        if not os.path.exists(p):
            raise CheckpointError(f"{p}: missing; a Hugging Face checkpoint needs {name}")
        try:
            with open(p) as f:
                return json.load(f)
        except ValueError as e:
            raise CheckpointError(f"{p}: invalid JSON ({e})") from e

    def _read_index(self) -> tuple[dict[str, str], int | None]:
        for idx in ("model.safetensors.index.json", "model.safetensors.index.json.gz"):
            p = os.path.join(self.path, idx)
            if os.path.exists(p):
                if idx.endswith(".gz"):
                    import gzip

                    with gzip.open(p, "rt") as f:
                        doc = json.load(f)
                else:
                    doc = self._read_json(idx)
                return _check_index(self.path, p, doc)
        single = os.path.join(self.path, "model.safetensors")
        if os.path.exists(single):
            return {n: "model.safetensors" for n in self._header("model.safetensors")}, None
        raise CheckpointError(
            f"{self.path}: no model.safetensors or model.safetensors.index.json; "
            f"is this a Hugging Face safetensors checkpoint?"
        )

    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def has_shard(self, shard: str) -> bool:
        return os.path.exists(os.path.join(self.path, shard))

    def shard_path(self, shard: str) -> str:
        """Where a shard's bytes are read from (a streamed download waits here until the shard has landed)."""
        return os.path.join(self.path, shard)

    def _header(self, shard: str) -> dict[str, TensorInfo]:
        if shard in self._headers:
            return self._headers[shard]
        p = os.path.join(self.path, shard)
        if not os.path.exists(p):
            raise CheckpointError(f"{p}: shard missing (named in the index); download it, then re-run")
        entries, _, _ = read_header(p, CheckpointError, "re-download this shard")
        out = {name: TensorInfo(name, shard, e.dtype, e.shape, e.offset, e.nbytes) for name, e in entries.items()}
        self._headers[shard] = out
        return out

    def info(self, name: str) -> TensorInfo:
        shard = self.weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self.path}: tensor {name} not in the checkpoint index")
        h = self._header(shard)
        if name not in h:
            raise CheckpointError(f"{shard}: tensor {name} named in the index is missing from the shard; re-download it")
        return h[name]

    def read_bytes(self, name: str) -> bytearray:
        buf = bytearray(self.info(name).nbytes)
        read_into(self, name, memoryview(buf))
        return buf

    def read(self, name: str) -> torch.Tensor:
        ti = self.info(name)
        if ti.dtype not in ST_DTYPES:
            raise CheckpointError(f"{ti.shard}: tensor {name} has unsupported dtype {ti.dtype}")
        buf = self.read_bytes(name)
        if ti.nbytes == 0:
            return torch.empty(ti.shape, dtype=ST_DTYPES[ti.dtype])
        return torch.frombuffer(buf, dtype=ST_DTYPES[ti.dtype]).reshape(ti.shape)


def _check_index(root: str, p: str, doc) -> tuple[dict[str, str], int | None]:
    """The index's weight map, every shard a plain file name inside the checkpoint folder."""
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"{p}: no weight_map object; the index is corrupt: re-download it")
    real = os.path.realpath(root)
    for name, shard in wm.items():
        bad = not isinstance(shard, str) or not shard or os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/")
        if not bad:
            bad = os.path.commonpath([real, os.path.realpath(os.path.join(real, shard))]) != real
        if bad:
            raise CheckpointError(f"{p}: tensor {name} names shard {shard!r}, which is not a file inside {root}; the "
                                  f"index is corrupt or hostile: re-download it")
    meta = doc.get("metadata")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    return dict(wm), total if isinstance(total, int) else None


def read_row(ckpt: Checkpoint, name: str, i: int) -> torch.Tensor:
    """Row ``i`` along dim 0 of a stacked tensor (e.g. one expert of gpt-oss's [E, ...] tensors)."""
    ti = ckpt.info(name)
    buf = bytearray(ti.nbytes // ti.shape[0])
    read_into(ckpt, name, memoryview(buf), i)
    return torch.frombuffer(buf, dtype=ST_DTYPES[ti.dtype]).reshape(ti.shape[1:])


def read_rows(ckpt: Checkpoint, name: str, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) along dim 0: a big tensor is converted a block of rows at a time."""
    ti = ckpt.info(name)
    if ti.dtype not in ST_DTYPES:
        raise CheckpointError(f"{ti.shard}: tensor {name} has unsupported dtype {ti.dtype}")
    per_row = ti.nbytes // ti.shape[0] if ti.shape and ti.shape[0] else 0
    buf = bytearray(per_row * (stop - start))
    if buf:
        read_into(ckpt, name, memoryview(buf), (start, stop))
    return torch.frombuffer(buf, dtype=ST_DTYPES[ti.dtype]).reshape((stop - start, *ti.shape[1:])) if buf else \
        torch.empty((stop - start, *ti.shape[1:]), dtype=ST_DTYPES[ti.dtype])


def read_into(ckpt: Checkpoint, name: str, out: memoryview, row: int | tuple[int, int] | None = None) -> None:
    """Copy a tensor's bytes (or row ``row`` along dim 0, or rows [a, b)) straight into ``out`` (no
    intermediate buffer)."""
    ti = ckpt.info(name)
    a, b = (0, 1) if row is None else (row, row + 1) if isinstance(row, int) else row
    per_row = ti.nbytes if row is None else ti.nbytes // ti.shape[0]
    size, off = per_row * (b - a), ti.offset + per_row * a
    if len(out) != size:
        raise CheckpointError(f"{name}: {size} bytes do not fit a {len(out)}-byte section; the plan is stale")
    p = ckpt.shard_path(ti.shard)
    what = name if row is None else f"{name}[{row}]" if isinstance(row, int) else f"{name}[{a}:{b}]"
    read_exact(p, out, off, CheckpointError, "the shard is truncated or unreadable: download it again", what)
