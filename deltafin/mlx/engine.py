"""What ``runtime.engine.Engine`` calls for ``--device mlx``: the MLX model and its slab-backed expert source."""

from __future__ import annotations

import platform
import sys

from deltafin.errors import UsageError
from deltafin.kernels import mlx as km

# the decoder class of each family past the plain GQA ones (``model.MLXDecoder``)
DECODERS = {"deepseek_v3": "deltafin.mlx.deepseek:MLXDeepSeek", "kimi_k25": "deltafin.mlx.deepseek:MLXDeepSeek",
            "kimi_k3": "deltafin.mlx.kimi_k3:MLXKimiK3", "glm4_moe": "deltafin.mlx.sigmoid_gqa:MLXSigmoidGQA",
            "minimax_m2": "deltafin.mlx.sigmoid_gqa:MLXSigmoidGQA", "deepseek_v32": "deltafin.mlx.dsa:MLXDSA",
            "qwen3_next": "deltafin.mlx.qwen3_next:MLXQwen3Next", "qwen3_5_moe": "deltafin.mlx.qwen3_next:MLXQwen3Next",
            "deepseek_v4": "deltafin.mlx.deepseek_v4:MLXDeepSeekV4"}


def default_here() -> bool:
    """MLX is the default device on Apple Silicon (macOS arm64) where it is installed."""
    return sys.platform == "darwin" and platform.machine() == "arm64" and not km.available()


def check(packed) -> None:
    """Refuse, before the trunk loads, what the MLX engine cannot run: no MLX here, or a family not ported yet."""
    why = km.available()
    if why:
        raise UsageError(f"--device mlx: {why}")
    from deltafin.mlx.model import FAMILIES

    if packed.family not in FAMILIES:
        raise UsageError(f"--device mlx runs {', '.join(FAMILIES)} so far, not {packed.family}; use --device cpu")


def open_mlx(packed, weights: dict, exact: bool, dtype: str, cache_bytes: int, threads: int, readers, verify: bool,
             deadline):
    """(model, expert source) of a packed model on MLX (``check``ed first)."""
    check(packed)
    import importlib

    from deltafin.mlx.source import MLXExperts

    where, name = DECODERS.get(packed.family, "deltafin.mlx.model:MLXDecoder").split(":")
    decoder = getattr(importlib.import_module(where), name)
    model = decoder(packed.family, packed.text_config, weights, exact, dtype)
    return model, MLXExperts(packed, cache_bytes, threads, readers, verify, deadline)


def device_name() -> str:
    """'mlx (gpu)' on a Mac's GPU, 'mlx (cpu)' on MLX's CPU build."""
    return f"mlx ({km.mx().default_device().type.name})"
