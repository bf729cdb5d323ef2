"""Tiny models for the tests: the builder that ships with the package (also used by `deltafin demo`) and
one helper that builds, optionally gives a tokenizer, and packs over two drive folders."""

from __future__ import annotations

from pathlib import Path

from deltafin.store.drives import parse_drives
from deltafin.store.pack import PackOptions, pack
from deltafin.tiny import TINY, build_tiny, save_byte_tokenizer

__all__ = ["TINY", "build_tiny", "pack_tiny", "save_byte_tokenizer"]


def pack_tiny(root: Path, model_type: str, tokenizer: bool = False, **pack_opts) -> str:
    """Build a tiny ``model_type`` under root/src (with a byte tokenizer when asked), pack it to
    root/model over root/d0 and root/d1 at 2:1 read rates (given, so no probe runs); returns root/model."""
    vocab = {"vocab_size": 320} if tokenizer else {}
    build_tiny(model_type, root / "src", **vocab)
    if tokenizer:
        save_byte_tokenizer(root / "src", 320)
    pack(str(root / "src"), str(root / "model"), parse_drives([f"{root}/d0=2", f"{root}/d1=1"]),
         PackOptions(progress=False, **pack_opts))
    return str(root / "model")
