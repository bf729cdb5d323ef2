"""Checks of a command's numbers and paths made before any model loads (a Kimi K3 trunk is 57 GB): each
bad value gets one line naming it and the fix."""

from __future__ import annotations

import json
import logging
import math
import os

from deltafin.errors import UsageError

log = logging.getLogger(__name__)


def _name(flag: str, kw: str, style: str) -> str:
    return flag if style == "cli" else f"{kw}="


def check_engine_numbers(cache_gb=None, io_threads=None, max_len=None, threads=None, style: str = "cli") -> None:
    """Memory, thread and context numbers of every command that loads a model."""
    if cache_gb is not None and not (math.isfinite(cache_gb) and cache_gb >= 0):
        raise UsageError(f"{_name('--cache-gb', 'cache_gb', style)} {cache_gb}: give GB of memory for cached "
                         f"experts, 0 or more (0 caches none), e.g. --cache-gb 8")
    if io_threads is not None and io_threads < 1:
        raise UsageError(f"{_name('--io-threads', 'io_threads', style)} {io_threads}: reader threads per drive must "
                         f"be 1 or more (4 is the default; 8 suits fast NVMe drives)")
    if max_len is not None and max_len < 1:
        raise UsageError(f"{_name('-c/--ctx-size', 'max_len', style)} {max_len}: the context limit must be 1 token "
                         f"or more, e.g. -c 4096")
    if threads is not None and threads < 1:
        raise UsageError(f"-t/--threads {threads}: compute threads must be >= 1")


def check_output_path(path: str | None, flag: str) -> None:
    """A file the command writes at its end: its folder must exist and be writable now, not after the run."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path}: is a folder; give a file name, e.g. {flag} {os.path.join(path, 'stats.json')}")
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist; create it (mkdir -p {folder}) or give "
                         f"another path")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: folder {folder} is not writable; give a path you can write")


def model_config(model_dir: str) -> dict | None:
    """The packed model's text config (config.json beside the manifest), read without opening the model."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) and cfg.get("model_type") == "kimi_k3" else cfg


def check_context(model_dir: str, max_len: int | None, style: str = "cli") -> None:
    """-c over the model's max_position_embeddings: positions past it were never trained, so refuse."""
    if max_len is None:
        return
    tc = model_config(model_dir) or {}
    limit = tc.get("max_position_embeddings")
    if isinstance(limit, int) and max_len > limit:
        raise UsageError(f"{_name('-c/--ctx-size', 'max_len', style)} {max_len:,}: this model was trained for "
                         f"{limit:,} positions (max_position_embeddings); give -c {limit} or less")


def check_prompt_ids(model_dir: str, spec: str) -> list[int]:
    """--prompt-ids: comma-separated integers, each inside the model's vocabulary."""
    try:
        ids = [int(t) for t in spec.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt-ids {spec!r}: expected comma-separated integers, e.g. --prompt-ids 1,2,3") from None
    if not ids:
        raise UsageError(f"--prompt-ids {spec!r}: no token ids; give at least one, e.g. --prompt-ids 1,2,3")
    vocab = (model_config(model_dir) or {}).get("vocab_size")
    if isinstance(vocab, int):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise UsageError(f"--prompt-ids: token id {bad[0]} is outside this model's vocabulary (0..{vocab - 1})")
    return ids


def check_max_tokens(n: int) -> None:
    if n < 1:
        raise UsageError(f"-n/--max-tokens {n}: give the number of tokens to generate, 1 or more, e.g. -n 128")


def check_port(port: int) -> None:
    if not 0 < port < 65536:
        raise UsageError(f"--port {port}: a TCP port is 1-65535; e.g. --port 8000")
