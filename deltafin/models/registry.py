"""Family name -> model module. Each module exports ``Config`` (with ``from_dict``) and ``Model``."""

from __future__ import annotations

import importlib
from types import ModuleType

from deltafin.errors import UnsupportedArchitectureError

MODULES = {
    "deepseek_v3": "deltafin.models.deepseek_v3",
    "qwen3_moe": "deltafin.models.qwen3_moe",
    "mixtral": "deltafin.models.mixtral",
    "olmoe": "deltafin.models.olmoe",
    "gpt_oss": "deltafin.models.gpt_oss",
    "kimi_k3": "deltafin.models.kimi_k3",
    "kimi_k25": "deltafin.models.deepseek_v3",  # the text model is DeepSeek-V3's
    "glm4_moe": "deltafin.models.glm4_moe",
    "minimax_m2": "deltafin.models.minimax_m2",
    "qwen3_next": "deltafin.models.qwen3_next",
    "deepseek_v32": "deltafin.models.deepseek_v32",  # DeepSeek-V3.2 and GLM-5 (glm_moe_dsa)
    "qwen3_5_moe": "deltafin.models.qwen3_next",  # the same hybrid, four linear-attention projections
    "deepseek_v4": "deltafin.models.deepseek_v4",
}


def module_for(family: str) -> ModuleType:
    if family not in MODULES:
        raise UnsupportedArchitectureError(f"no model code for family {family!r}; supported: {', '.join(MODULES)}")
    return importlib.import_module(MODULES[family])


def build(family: str, text_config: dict, weights, device="cpu", dtype=None):
    import torch

    mod = module_for(family)
    return mod.Model(mod.Config.from_dict(text_config), weights, device=device, dtype=dtype or torch.float32)
