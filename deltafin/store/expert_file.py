"""The expert file (.dfx): one routed expert, all of its tensors back to back, readable in one read.

Layout (all offsets multiples of 4 KiB, so the whole file is read with direct I/O into an aligned
buffer)::

    [0, 4096)        header block: b"DFX1", u32 header length, JSON header, zero padding
    [4096, ...)      sections, each starting on a 4 KiB boundary, zero padded to the next one

JSON header: {"version": 1, "layer": L, "expert": E, "tensors": [{"name", "format", "shape",
"sections": [{"kind": "data"|"scale", "dtype", "shape", "offset", "nbytes"}]}]}. The file's xxh3-64
checksum is recorded in the model manifest, not in the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from deltafin.errors import ExpertChecksumError, ExpertFileError
from deltafin.io.direct import ALIGN, align_up
from deltafin.quant.record import QTensor
from deltafin.store.fileio import write_error, write_full

MAGIC = b"DFX1"
VERSION = 1
HEADER_BYTES = ALIGN

DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True, slots=True)
class Section:
    kind: str  # data | scale
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class TensorLayout:
    name: str
    format: str
    shape: tuple[int, ...]
    sections: tuple[Section, ...]


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Where each tensor of an expert sits in its file. Identical for every expert of a layer."""

    tensors: tuple[TensorLayout, ...]
    file_bytes: int

    @property
    def payload_bytes(self) -> int:
        return sum(s.nbytes for t in self.tensors for s in t.sections)


def layout_for(specs: list[tuple[str, str, tuple[int, ...], list[tuple[str, str, tuple[int, ...]]]]]) -> ExpertLayout:
    """Build a layout from (name, format, logical shape, [(kind, dtype, shape)]) in file order."""
    off = HEADER_BYTES
    tensors = []
    for name, fmt, shape, secs in specs:
        out = []
        for kind, dtype, sshape in secs:
            nbytes = int(np.prod(sshape)) * torch.empty((), dtype=DTYPES[dtype]).element_size()
            out.append(Section(kind, dtype, tuple(sshape), off, nbytes))
            off = align_up(off + nbytes)
        tensors.append(TensorLayout(name, fmt, tuple(shape), tuple(out)))
    return ExpertLayout(tuple(tensors), off)


def layout_from_tensors(tensors: dict[str, QTensor]) -> ExpertLayout:
    specs = []
    for name, t in tensors.items():
        secs = [("data", DTYPE_NAMES[t.data.dtype], tuple(t.data.shape))]
        if t.scale is not None:
            secs.append(("scale", DTYPE_NAMES[t.scale.dtype], tuple(t.scale.shape)))
        specs.append((name, t.format, t.shape, secs))
    return layout_for(specs)


def _header_json(layout: ExpertLayout, layer: int, expert: int) -> bytes:
    doc = {
        "version": VERSION,
        "layer": layer,
        "expert": expert,
        "file_bytes": layout.file_bytes,
        "tensors": [
            {
                "name": t.name,
                "format": t.format,
                "shape": list(t.shape),
                "sections": [
                    {"kind": s.kind, "dtype": s.dtype, "shape": list(s.shape), "offset": s.offset, "nbytes": s.nbytes}
                    for s in t.sections
                ],
            }
            for t in layout.tensors
        ],
    }
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if len(raw) + 8 > HEADER_BYTES:
        raise ExpertFileError(f"expert header of {len(raw)} bytes does not fit the {HEADER_BYTES}-byte header block")
    return raw


def encode_into(tensors: dict[str, QTensor], layer: int, expert: int, out: memoryview | None = None) -> memoryview:
    """Serialise one expert into ``out`` (e.g. an aligned buffer for direct writes); returns the file bytes."""
    layout = layout_from_tensors(tensors)
    buf = out[: layout.file_bytes] if out is not None else memoryview(bytearray(layout.file_bytes))
    if len(buf) < layout.file_bytes:
        raise ValueError(f"buffer of {len(buf)} bytes is too small for a {layout.file_bytes}-byte expert file")
    header_into(layout, layer, expert, buf)
    for tl, t in zip(layout.tensors, tensors.values(), strict=True):
        for sec, src in zip(tl.sections, (t.data, t.scale), strict=False):
            flat = src.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            assert flat.nbytes == sec.nbytes
            buf[sec.offset : sec.offset + sec.nbytes] = memoryview(flat)
    return buf


def header_into(layout: ExpertLayout, layer: int, expert: int, buf: memoryview) -> None:
    """Header block plus zeroed padding after every section (buffers are reused); the caller fills the
    section bytes."""
    raw = _header_json(layout, layer, expert)
    buf[:HEADER_BYTES] = MAGIC + struct.pack("<I", len(raw)) + raw + bytes(HEADER_BYTES - 8 - len(raw))
    for t in layout.tensors:
        for sec in t.sections:
            end = sec.offset + sec.nbytes
            buf[end : align_up(end)] = bytes(align_up(end) - end)


def encode(tensors: dict[str, QTensor], layer: int, expert: int) -> bytes:
    """Serialise one expert into the .dfx byte layout."""
    return bytes(encode_into(tensors, layer, expert))


def checksum(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


# "layer" and "expert" as encode writes them, first after "version": the rest of a header is the layout, which
# every expert of a layer (of a model, mostly) shares, so a parsed layout is kept under that rest
_IDS = re.compile(rb'^\{"version":\d+,"layer":(\d+),"expert":(\d+),')
_LAYOUTS: dict[bytes, ExpertLayout] = {}
_LAYOUTS_MAX = 256


def parse_header(buf: bytes | memoryview, where: str = "expert file") -> tuple[ExpertLayout, int, int]:
    """(layout, layer, expert) from the first 4 KiB of an expert file; every section is checked to lie
    aligned inside the file, so a header that parses can be decoded without reading out of bounds. A header
    whose layout was parsed before (another expert's, the same but for its layer and expert) takes that
    layout without parsing it again: once per expert read, a parse cost a tenth of a millisecond."""
    head = bytes(buf[:HEADER_BYTES])
    if len(head) < 8 or head[:4] != MAGIC:
        raise ExpertFileError(f"{where}: not a Deltafin expert file (bad magic {head[:4]!r}); repack this expert")
    (n,) = struct.unpack("<I", head[4:8])
    text = head[8 : 8 + n]
    m = _IDS.match(text)
    key = text[: m.start(1) - len(b'"layer":')] + text[m.end() :] if m else None
    if key is not None and (b'"layer"' in key or b'"expert"' in key):
        key = None  # a second "layer" or "expert" field: json's reading (the last wins) decides
    if key is not None and (layout := _LAYOUTS.get(key)) is not None:
        return layout, int(m[1]), int(m[2])
    layout, layer, expert = _parse_header_json(text, where)
    if key is not None and len(_LAYOUTS) < _LAYOUTS_MAX:
        _LAYOUTS[key] = layout
    return layout, layer, expert


def _parse_header_json(text: bytes, where: str) -> tuple[ExpertLayout, int, int]:
    try:
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ExpertFileError(f"{where}: corrupt expert header ({e}); repack this expert") from e
    if not isinstance(doc, dict):
        raise ExpertFileError(f"{where}: corrupt expert header (not a JSON object); repack this expert")
    if doc.get("version") != VERSION:
        raise ExpertFileError(f"{where}: expert file version {doc.get('version')} is not {VERSION}; repack with this Deltafin")
    try:
        tensors = tuple(
            TensorLayout(
                str(t["name"]),
                str(t["format"]),
                tuple(int(x) for x in t["shape"]),
                tuple(Section(str(s["kind"]), str(s["dtype"]), tuple(int(x) for x in s["shape"]), int(s["offset"]),
                              int(s["nbytes"])) for s in t["sections"]),
            )
            for t in doc["tensors"]
        )
        layout, layer, expert = ExpertLayout(tensors, int(doc["file_bytes"])), int(doc["layer"]), int(doc["expert"])
    except (KeyError, TypeError, ValueError) as e:
        raise ExpertFileError(f"{where}: corrupt expert header (bad or missing field {e}); repack this expert") from e
    problem = _layout_problem(layout)
    if problem:
        raise ExpertFileError(f"{where}: corrupt expert header ({problem}); repack this expert")
    return layout, layer, expert


def _layout_problem(layout: ExpertLayout) -> str | None:
    end = HEADER_BYTES
    if layout.file_bytes % ALIGN:
        return f"file size {layout.file_bytes} is not a multiple of {ALIGN}"
    for t in layout.tensors:
        for s in t.sections:
            if s.dtype not in DTYPES:
                return f"{t.name}: unknown dtype {s.dtype!r}"
            size = int(np.prod(s.shape)) * torch.empty((), dtype=DTYPES[s.dtype]).element_size()
            if s.offset % ALIGN or s.offset < end or size != s.nbytes or s.offset + s.nbytes > layout.file_bytes:
                return f"{t.name}: {s.kind} section at offset {s.offset} of {s.nbytes} bytes does not fit the layout"
            end = s.offset + s.nbytes
    return None


class Expert(dict):
    """An expert's records by role. A dict that also takes attributes: what a kernel derives from the records once
    (``kernels.cpu``'s pointer table of a 4-bit expert) stays with them for as long as they are in memory."""


def byte_tensor(buf: memoryview | bytes, count: int) -> torch.Tensor:
    """uint8 [count] over ``buf``'s bytes, no copy. A read-only buffer (a mapped file, ``io.mapped``) is taken as it
    is, without torch's warning: nothing writes into landed experts."""
    if isinstance(buf, memoryview) and buf.readonly:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(buf, dtype=torch.uint8, count=count)
    return torch.frombuffer(buf, dtype=torch.uint8, count=count)


def decode(buf: memoryview | bytes, layout: ExpertLayout | None = None, where: str = "expert file") -> dict[str, QTensor]:
    """Zero-copy views of an expert's tensors over ``buf`` (the whole file), as an ``Expert``."""
    if layout is None:
        layout, _, _ = parse_header(buf, where)
    if len(buf) < layout.file_bytes:
        raise ExpertFileError(f"{where}: truncated ({len(buf)} of {layout.file_bytes} bytes); repack this expert")
    out: dict[str, QTensor] = Expert()
    whole = byte_tensor(buf, layout.file_bytes)
    for t in layout.tensors:
        parts = []
        for s in t.sections:
            parts.append(whole[s.offset : s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape))
        out[t.name] = QTensor(t.format, t.shape, parts[0], parts[1] if len(parts) > 1 else None)
    return out


def write_tmp(path: str, data: bytes | memoryview, direct: bool = False, sync: bool = True) -> str:
    """Write ``data`` under a temporary name beside ``path``; returns that name.

    ``direct`` writes with O_DIRECT (``data`` must be a 4 KiB-aligned buffer of whole 4 KiB blocks),
    which keeps large packs out of the page cache; filesystems that refuse it get a buffered write.
    With ``sync=False`` the caller makes the data durable (one flush for a batch) before renaming.
    """
    d = os.path.dirname(path)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = None
    try:
        os.makedirs(d, exist_ok=True)
        if direct and hasattr(os, "O_DIRECT") and len(data) % ALIGN == 0:
            try:
                fd = os.open(tmp, flags | os.O_DIRECT, 0o644)
            except OSError:
                fd = None
        if fd is None:
            fd = os.open(tmp, flags, 0o644)
    except OSError as e:
        raise write_error(e, tmp, "creating the file") from e
    try:
        write_full(fd, memoryview(data), path)
        if sync:
            try:
                os.fsync(fd)
            except OSError as e:
                raise write_error(e, path, "flushing to the drive") from e
    except BaseException:  # a full disk or Ctrl-C: no partial file stays behind
        os.close(fd)
        fd = None
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return tmp


def write_atomic(path: str, data: bytes | memoryview, direct: bool = False) -> None:
    """Write to a temporary name, fsync, rename: a final name never holds a partial file."""
    os.replace(write_tmp(path, data, direct), path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check(data: bytes | memoryview, expected: str, where: str, fix: str) -> None:
    got = checksum(data)
    if got != expected:
        raise checksum_error(where, expected, got, fix)


def checksum_error(where: str, expected: str, got: str, fix: str) -> ExpertChecksumError:
    return ExpertChecksumError(f"{where}: checksum mismatch (expected {expected}, got {got}); {fix}")
