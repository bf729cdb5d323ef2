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
    "kimi_k25": "kimi_k25",
    "glm4_moe": "glm4_moe",
    "minimax_m2": "minimax_m2",
    "qwen3_next": "qwen3_next",
    "deepseek_v32": "deepseek_v32",
    "glm_moe_dsa": "deepseek_v32",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "deepseek_v4": "deepseek_v4",
}
# families whose text model sits under a multimodal config's ``text_config``; the top level's
# ``tie_word_embeddings`` decides the tie in the last two, as in transformers
TEXT_CONFIG_FAMILIES = ("kimi_k3", "kimi_k25", "qwen3_5_moe")
_TOP_LEVEL_TIE = ("kimi_k25", "qwen3_5_moe")
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
    renames: tuple[tuple[str, str], ...] = ()  # (old, new) prefixes of text names, normalised before anything else
    rewrites: tuple[tuple[re.Pattern[str], str], ...] = ()  # (pattern, replacement) applied in order after those

    def classify(self, name: str) -> ExpertPart | Skip | str:
        """ExpertPart for expert tensors, Skip for unused ones, else the trunk name."""
        for p in self.skip_prefixes:
            if name.startswith(p):
                return Skip(f"not part of the text model ({p}*)")
        if not name.startswith(self.prefix):
            return Skip(f"outside the text model prefix {self.prefix!r}")
        local = self.local_name(name[len(self.prefix) :])
        m = self.expert_re.fullmatch(local)
        if m is None:
            return local
        d = m.groupdict()
        expert = int(d["expert"]) if d.get("expert") is not None else None
        return _normalise(ExpertPart(int(d["layer"]), expert, self.role_of[d["sub"]], d["kind"]))

    def local_name(self, local: str) -> str:
        for old, new in self.renames:
            if local.startswith(old):
                local = new + local[len(old) :]
                break
        for pattern, new in self.rewrites:
            local = pattern.sub(new, local)
        return local

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
    # Kimi K2.5 / K2.6: the DeepSeek-V3 text model under language_model.; transformers 5 writes its layers as
    # ``model.blocks.N`` (the released checkpoints: ``model.layers.N``)
    "kimi_k25": Family(
        "kimi_k25",
        "language_model.",
        _SWIGLU_RE,
        _SWIGLU,
        skip_prefixes=("vision_tower.", "mm_projector.", "model.mm_projector.", "model.vision_tower."),
        renames=(("model.blocks.", "model.layers."),),
    ),
    "glm4_moe": Family("glm4_moe", "", _SWIGLU_RE, _SWIGLU),
    "minimax_m2": Family("minimax_m2", "", _per_expert("block_sparse_moe", "w1|w2|w3"), _W123),
    "deepseek_v32": Family("deepseek_v32", "", _SWIGLU_RE, _SWIGLU),
    "qwen3_next": Family("qwen3_next", "", _SWIGLU_RE, _SWIGLU, skip_prefixes=("mtp.",)),
    # Qwen3.5-MoE: the text model under model.language_model., the vision tower under model.visual.
    "qwen3_5_moe": Family("qwen3_5_moe", "", _SWIGLU_RE, _SWIGLU, skip_prefixes=("model.visual.", "mtp."),
                          renames=(("model.language_model.", "model."),)),
}


# DeepSeek-V4's checkpoint names (as released, or as transformers' save_pretrained writes them back) -> the
# module names of transformers' DeepseekV4ForCausalLM, routed experts kept one per expert as gate/up/down_proj
_V4_REWRITES = tuple((re.compile(p), r) for p, r in (
    (r"(?<!_hc)\.scale$", ".weight_scale_inv"),  # the release's block scales (FP8 128x128, FP4 1x32), as transformers
    (r"^(layers|embed|norm|hc_head)", r"model.\1"), (r"^model\.embed\.weight$", "model.embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"), (r"^model\.hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"), (r"(self_attn(\.compressor(\.indexer)?)?)\.norm\.", r"\1.kv_norm."),
    (r"\.ape$", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"self_attn\.wq_b\.", "self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."), (r"self_attn\.q_norm\.", "self_attn.q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
))
# float32 in transformers' model (mHC, position biases, the hash table): kept float like the routers
_V4_FLOAT = (".mlp.gate.weight", "_hc.fn", "hc_head.hc_fn", ".position_bias", ".mlp.gate.tid2eid")
FAMILIES["deepseek_v4"] = Family("deepseek_v4", "", _SWIGLU_RE, _SWIGLU, skip_prefixes=("mtp.", "model.mtp."),
                                 routers=_V4_FLOAT, rewrites=_V4_REWRITES)


def resolve(config: dict) -> tuple[Family, dict]:
    """(family, text config) for a checkpoint's config.json; clear error for unsupported ones."""
    model_type = config.get("model_type")
    if model_type not in ALIASES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    family = FAMILIES[ALIASES[model_type]]
    return family, text_config_of(family.name, config)


def text_config_of(family: str, config: dict) -> dict:
    """The settings the text model reads: ``text_config`` for the multimodal families (Kimi K2.5 and
    Qwen3.5 with the top level's ``tie_word_embeddings``, which decides the tie there), else the config itself."""
    if family not in TEXT_CONFIG_FAMILIES or not isinstance(config.get("text_config"), dict):
        return config
    text = config["text_config"]
    if family in _TOP_LEVEL_TIE and "tie_word_embeddings" in config:
        text = {**text, "tie_word_embeddings": config["tie_word_embeddings"]}
    return text


def _normalise(part: ExpertPart) -> ExpertPart:
    """gpt-oss plain fused tensors carry no kind suffix: name them 'fused' (or the bias role)."""
    if part.kind is None:
        return ExpertPart(part.layer, part.expert, part.role, "fused")
    if part.kind == "bias":
        return ExpertPart(part.layer, part.expert, part.role + "_bias", "bias")
    return part
