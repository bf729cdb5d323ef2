"""Checkpoint naming per architecture family: the one place where checkpoint names are understood.

A family says which tensors are routed experts (and which role each is: gate / up / down, or the
gpt-oss fused gate_up with biases), which are trunk, and which are skipped (vision, MTP). Trunk tensors
keep their checkpoint names with any multimodal prefix removed; the runtime reads nothing else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from deltafin.errors import UnsupportedArchitectureError

# model_type (or alias) -> family
ALIASES = {
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "glm4_moe_lite": "deepseek_v3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
    "gpt_oss": "gpt_oss",
    "kimi_k3": "kimi_k3",
}
SUPPORTED = sorted(ALIASES)


@dataclass(frozen=True, slots=True)
class ExpertPart:
    """One checkpoint tensor that belongs to routed experts.

    ``expert`` is None for fused tensors holding every expert of a layer along dim 0 (gpt-oss).
    ``kind``: weight | weight_scale_inv (FP8) | weight_packed | weight_scale | weight_shape
    (compressed-tensors) | blocks | scales (gpt-oss MXFP4) | bias | fused (gpt-oss plain [E, in, out]).
    """

    layer: int
    expert: int | None
    role: str
    kind: str


@dataclass(frozen=True, slots=True)
class Skip:
    reason: str


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    prefix: str  # stripped from every text tensor name ("" or "language_model.")
    expert_re: re.Pattern[str]
    role_of: dict[str, str]  # checkpoint sub-name -> role
    skip_prefixes: tuple[str, ...] = ()
    roles: tuple[str, ...] = ("gate", "up", "down")
    routers: tuple[str, ...] = field(default=(".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight"))

    def classify(self, name: str) -> ExpertPart | Skip | str:
        """ExpertPart for expert tensors, Skip for unused ones, else the trunk name."""
        for p in self.skip_prefixes:
            if name.startswith(p):
                return Skip(f"not part of the text model ({p}*)")
        if not name.startswith(self.prefix):
            return Skip(f"outside the text model prefix {self.prefix!r}")
        local = name[len(self.prefix) :]
        m = self.expert_re.fullmatch(local)
        if m is None:
            return local
        d = m.groupdict()
        expert = int(d["expert"]) if d.get("expert") is not None else None
        return _normalise(ExpertPart(int(d["layer"]), expert, self.role_of[d["sub"]], d["kind"]))

    def is_router(self, trunk_name: str) -> bool:
        return trunk_name.endswith(self.routers)


_PER_EXPERT_KINDS = r"(?P<kind>weight|weight_scale_inv|weight_packed|weight_scale|weight_shape)"
_SWIGLU = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_W123 = {"w1": "gate", "w3": "up", "w2": "down"}


def _per_expert(block: str, subs: str) -> re.Pattern[str]:
    return re.compile(rf"model\.layers\.(?P<layer>\d+)\.{block}\.experts\.(?P<expert>\d+)\.(?P<sub>{subs})\.{_PER_EXPERT_KINDS}")


_SWIGLU_RE = _per_expert("mlp", "gate_proj|up_proj|down_proj")

FAMILIES: dict[str, Family] = {
    "deepseek_v3": Family("deepseek_v3", "", _SWIGLU_RE, _SWIGLU),
    "qwen3_moe": Family("qwen3_moe", "", _SWIGLU_RE, _SWIGLU),
    "olmoe": Family("olmoe", "", _SWIGLU_RE, _SWIGLU),
    "mixtral": Family("mixtral", "", _per_expert("block_sparse_moe", "w1|w2|w3"), _W123),
    "gpt_oss": Family(
        "gpt_oss",
        "",
        re.compile(
            r"model\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<sub>gate_up_proj|down_proj)"
            r"(?:_(?P<kind>blocks|scales|bias))?"
        ),
        {"gate_up_proj": "gate_up", "down_proj": "down"},
        roles=("gate_up", "gate_up_bias", "down", "down_bias"),
    ),
    "kimi_k3": Family(
        "kimi_k3",
        "language_model.",
        _per_expert("block_sparse_moe", "w1|w2|w3"),
        _W123,
        skip_prefixes=("vision_tower.", "mm_projector."),
    ),
}


def resolve(config: dict) -> tuple[Family, dict]:
    """(family, text config) for a checkpoint's config.json; clear error for unsupported ones."""
    model_type = config.get("model_type")
    if model_type not in ALIASES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    family = FAMILIES[ALIASES[model_type]]
    text = config.get("text_config", config) if family.name == "kimi_k3" else config
    return family, text


def _normalise(part: ExpertPart) -> ExpertPart:
    """gpt-oss plain fused tensors carry no kind suffix: name them 'fused' (or the bias role)."""
    if part.kind is None:
        return ExpertPart(part.layer, part.expert, part.role, "fused")
    if part.kind == "bias":
        return ExpertPart(part.layer, part.expert, part.role + "_bias", "bias")
    return part
