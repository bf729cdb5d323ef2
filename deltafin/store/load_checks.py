"""What ``run`` (and every reader) checks when it opens a packed model, before the trunk loads: the config
is the one packed (its sha256 is in the manifest), the manifest's counts agree with it, and no two drives
are one folder."""

from __future__ import annotations

import json
import os

from deltafin.errors import ManifestError
from deltafin.store import manifest as mf

EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "experts_per_token")


def read_config(path: str, doc: dict) -> dict:
    cfg_path = mf.resolve_under(path, doc["config"])
    want = doc.get("config_sha256")
    try:
        with open(cfg_path, "rb") as f:
            raw = f.read(1 << 24)
        config = json.loads(raw)
    except (OSError, ValueError) as e:
        raise ManifestError(f"{cfg_path}: cannot read the model config ({e}); copy config.json back from the "
                            f"checkpoint, or repack the model") from e
    if want is not None:
        import hashlib

        got = hashlib.sha256(raw).hexdigest()
        if got != want:
            raise ManifestError(f"{cfg_path}: changed since the model was packed (sha256 {got[:16]}..., packed "
                                f"{want[:16]}...); a changed config changes the output: copy config.json back from "
                                f"{doc.get('source', {}).get('path', 'the checkpoint')}, or repack the model")
    if not isinstance(config, dict):
        raise ManifestError(f"{cfg_path}: not a JSON object; copy config.json back from the checkpoint")
    return config


def check_against_config(doc: dict, config: dict, where: str) -> None:
    """The manifest's expert count and layers against the config the model is built from."""
    tc = config.get("text_config", config) if doc["family"] == "kimi_k3" else config
    if not isinstance(tc, dict):
        raise ManifestError(f"{where}: the config's text_config is not an object; repack the model")
    ex = doc["experts"]
    n = ex["num_experts"]
    total = next((tc[k] for k in EXPERT_COUNT_KEYS if isinstance(tc.get(k), int)), None)
    if ex["layers"] and total is not None and n != total:
        raise ManifestError(f"{where}: experts.num_experts = {n}, but the config has {total} experts per layer; "
                            f"the manifest is damaged: repack the model (or restore {mf.MANIFEST} from a backup)")
    layers = tc.get("num_hidden_layers")
    if isinstance(layers, int) and ex["layers"] and max(ex["layers"]) >= layers:
        raise ManifestError(f"{where}: MoE layer {max(ex['layers'])} is past the config's {layers} layers; the "
                            f"manifest is damaged: repack the model")
    top = next((tc[k] for k in TOP_K_KEYS if isinstance(tc.get(k), int)), None)
    if ex["layers"] and top is not None and top > n:
        raise ManifestError(f"{where}: the config routes {top} experts per token, but the manifest has {n} per layer; "
                            f"repack the model")


def check_distinct_drives(drives, where: str) -> None:
    """Two drives resolving to one folder would count one file as two copies: a placement change could delete
    the only one."""
    seen: dict[str, str] = {}
    for d in drives:
        real = os.path.realpath(d.path)
        if real in seen:
            raise ManifestError(f"{where}: drives {seen[real]} and {d.label} resolve to the same folder ({real}); "
                                f"give each drive its own folder (--drive-map LABEL=PATH)")
        seen[real] = d.label
