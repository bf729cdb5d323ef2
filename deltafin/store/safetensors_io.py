"""Safetensors files read and written here, not through the safetensors library: headers checked
field by field against the file's size (so a damaged header is one line naming the file), tensors read
and written in bounded pieces (any size, memory bounded by the piece), and a checksum taken while writing.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import xxhash

from deltafin.errors import DeltafinError
from deltafin.io.direct import HUGE, aligned_buffer
from deltafin.store.fileio import pread_full, write_error, write_full

SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
         "I8": 1, "U8": 1, "BOOL": 1, "F8_E8M0": 1}
TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
         "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
         "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
         "F8_E8M0": torch.float8_e8m0fnu}  # OCP MX scales: DeepSeek-V4's FP4 experts and FP8 blocks
NAMES = {v: k for k, v in TORCH.items()}
MAX_HEADER = 100 << 20  # the safetensors format's own limit on the JSON header


@dataclass(frozen=True, slots=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute file offset
    nbytes: int


def nbytes_of(dtype: str, shape: Iterable[int]) -> int:
    return math.prod(shape) * SIZES[dtype]


def read_header(path: str, error: type[DeltafinError], fix: str) -> tuple[dict[str, Entry], dict, int]:
    """(entries, metadata, file size) of a safetensors file; every entry is checked to lie in the file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise error(f"{path}: cannot open ({e.strerror}); {fix}") from e
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise error(f"{path}: {size} bytes, too short for a safetensors file; {fix}")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise error(f"{path}: safetensors header length {n:,} does not fit the {size:,}-byte file (limit "
                        f"{MAX_HEADER:,}); the file is corrupt: {fix}")
        raw = bytearray(n)
        if pread_full(fd, memoryview(raw), 8, path, error) != n:
            raise error(f"{path}: header cut short; {fix}")
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise error(f"{path}: corrupt safetensors header ({e}); {fix}") from e
    if not isinstance(doc, dict):
        raise error(f"{path}: corrupt safetensors header (not a JSON object); {fix}")
    meta = doc.pop("__metadata__", None) or {}
    return {name: _entry(path, name, d, 8 + n, size, error, fix) for name, d in doc.items()}, meta, size


def _entry(path: str, name: str, d, base: int, size: int, error, fix: str) -> Entry:
    try:
        dtype, shape, (a, b) = d["dtype"], tuple(d["shape"]), d["data_offsets"]
        ok = (dtype in SIZES and all(isinstance(x, int) and x >= 0 for x in (*shape, a, b)) and a <= b
              and b - a == nbytes_of(dtype, shape))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise error(f"{path}: tensor {name}: malformed header entry {json.dumps(d)[:200]}; {fix}")
    if base + b > size:
        raise error(f"{path}: tensor {name} ends at byte {base + b:,} but the file has {size:,} bytes (truncated); "
                    f"{fix}")
    return Entry(name, dtype, shape, base + a, b - a)


def _empty(shape, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """Memory for a tensor read from a file: a matrix of a huge page or more in huge pages where the system gives
    them (``aligned_buffer(huge=True)``: the CPU kernels stream it every token), the rest from torch."""
    if nbytes < HUGE:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(aligned_buffer(nbytes, huge=True), dtype=dtype, count=math.prod(shape)).view(shape)


def read_tensors(path: str, error: type[DeltafinError], fix: str, names: Iterable[str] | None = None
                 ) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (``names`` or all), each read straight into its own memory."""
    entries, _, _ = read_header(path, error, fix)
    want = list(entries) if names is None else list(names)
    missing = [n for n in want if n not in entries]
    if missing:
        raise error(f"{path}: tensor(s) {', '.join(missing[:5])} missing; {fix}")
    out = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        for name in want:
            e = entries[name]
            t = _empty(e.shape, TORCH[e.dtype], e.nbytes)
            view = memoryview(t.view(-1).view(torch.uint8).numpy()) if e.nbytes else memoryview(b"")
            if e.nbytes and pread_full(fd, view, e.offset, path, error) != e.nbytes:
                raise error(f"{path}: short read of {name} at offset {e.offset:,}; {fix}")
            out[name] = t
    finally:
        os.close(fd)
    return out


def write_streamed(path: str, specs: list[tuple[str, str, tuple[int, ...]]],
                   chunks: Callable[[str], Iterable[memoryview | bytes]], metadata: dict[str, str]) -> tuple[int, str]:
    """Write a safetensors file whose tensors come in pieces: ``chunks(name)`` yields each tensor's bytes
    in order. Returns (file bytes, xxh3-64 of the file). The caller renames it into place."""
    header, off = {}, 0
    for name, dtype, shape in specs:
        n = nbytes_of(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps({"__metadata__": metadata} | header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # tensors start 8-byte aligned, as the format recommends
    h = xxhash.xxh3_64()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        raise write_error(e, path, "creating the file") from e
    try:
        for part in (struct.pack("<Q", len(raw)), raw):
            write_full(fd, memoryview(part), path)
            h.update(part)
        for name, dtype, shape in specs:
            want, got = nbytes_of(dtype, shape), 0
            for part in chunks(name):
                write_full(fd, memoryview(part), path)
                h.update(part)
                got += len(memoryview(part).cast("B"))
            assert got == want, (name, got, want)
        try:
            os.fsync(fd)
        except OSError as e:
            raise write_error(e, path, "flushing to the drive") from e
    finally:
        os.close(fd)
    return 8 + len(raw) + off, h.hexdigest()


def file_checksum(path: str, error: type[DeltafinError], fix: str, block: int = 64 << 20) -> str:
    """xxh3-64 of a whole file, read in bounded pieces."""
    h = xxhash.xxh3_64()
    buf = bytearray(block)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise error(f"{path}: cannot open ({e.strerror}); {fix}") from e
    try:
        off = 0
        while True:
            got = pread_full(fd, memoryview(buf), off, path, error)
            h.update(memoryview(buf)[:got])
            off += got
            if got < block:
                return h.hexdigest()
    finally:
        os.close(fd)
