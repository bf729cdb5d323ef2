"""Routed-expert shapes of the families the synthetic benchmarks stream (``--shape NAME``).

A shape is what decides the read pattern of a token: the size of one expert file (gate/up [inter, hidden], down
[hidden, inter], MXFP4 as packed) and the routing (k of ``experts`` per layer). The numbers are the released
checkpoints' config values; where transformers' config class defaults to the same checkpoint, the class is named.
To add a family, add a row to ``SHAPES``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

SITU_K3 = ("situ", 4.0, 25.0)  # Kimi K3's expert activation: SiTU-GLU, beta 4, linear beta 25
SWIGLU = ("silu",)


@dataclass(frozen=True, slots=True)
class ExpertShape:
    """One routed expert (gate/up [inter, hidden], down [hidden, inter]) and its routing: k of ``experts``."""

    name: str
    hidden: int  # the width experts read and write (Kimi K3: its latent)
    inter: int  # moe_intermediate_size
    experts: int  # routed experts per layer in the released model
    k: int  # experts per token per layer
    moe_layers: int  # MoE layers of the released model (for projections only)
    act: tuple = SWIGLU
    source: str = ""

    def __post_init__(self):
        if min(self.hidden, self.inter, self.experts, self.k, self.moe_layers) < 1 or self.k > self.experts:
            raise ValueError(f"expert shape {self.name}: sizes must be >= 1 and k <= experts")
        if self.hidden % 32 or self.inter % 32:
            raise ValueError(f"expert shape {self.name}: hidden {self.hidden} and inter {self.inter} must be multiples "
                             f"of 32 (MXFP4 blocks)")


SHAPES: dict[str, ExpertShape] = {s.name: s for s in (
    ExpertShape("k3", 3584, 3072, 896, 16, 92, SITU_K3, "Kimi K3 as released (routed experts work in its latent)"),
    ExpertShape("qwen3.5-397b", 4096, 1024, 512, 10, 60, SWIGLU, "Qwen3.5-397B-A17B config.json (text_config)"),
    ExpertShape("qwen3.5-35b", 2048, 512, 256, 8, 40, SWIGLU,
                "Qwen3.5-35B-A3B; transformers' Qwen3_5MoeTextConfig defaults"),
    ExpertShape("qwen3-next-80b", 2048, 512, 512, 10, 48, SWIGLU, "Qwen3-Next-80B-A3B; transformers' Qwen3NextConfig"),
    ExpertShape("glm4.5-air", 4096, 1408, 128, 8, 45, SWIGLU, "GLM-4.5-Air; transformers' Glm4MoeConfig defaults"),
    ExpertShape("minimax-m2", 3072, 1536, 256, 8, 62, SWIGLU, "MiniMax-M2; transformers' MiniMaxM2Config defaults"),
    ExpertShape("deepseek-v3", 7168, 2048, 256, 8, 58, SWIGLU,
                "DeepSeek-V3/V3.2 (671B); transformers' DeepseekV3Config defaults"),
    ExpertShape("kimi-k2.5", 7168, 2048, 384, 8, 60, SWIGLU, "Kimi K2/K2.5 config.json (text_config)"),
    ExpertShape("deepseek-v4-flash", 4096, 2048, 256, 6, 43, SWIGLU,
                "DeepSeek-V4-Flash; transformers' DeepseekV4Config defaults (its SwiGLU is clamped)"),
)}


def resolve(name: str, hidden: int | None = None, inter: int | None = None, experts: int | None = None,
            k: int | None = None):
    """The preset ``name`` with explicit overrides; a bad name or size is one line (``UsageError``)."""
    from deltafin.errors import UsageError

    if name not in SHAPES:
        raise UsageError(f"--shape {name}: no such expert shape; use one of {', '.join(SHAPES)} "
                         f"(or add a row to deltafin/bench/shapes.py)")
    over = {f: v for f, v in (("hidden", hidden), ("inter", inter), ("experts", experts), ("k", k)) if v is not None}
    try:
        return replace(SHAPES[name], **over)
    except ValueError as e:
        raise UsageError(f"--shape {name} with {over}: {e}") from None


def apply(args, files_per_layer: int) -> ExpertShape:
    """Resolve ``args.shape`` (+ --hidden/--inter/--k) into ``args.expert_shape``; fill ``args.k`` (the shape's
    top-k) and ``args.experts`` (files per layer written: the model's count, capped at ``files_per_layer``)
    where not given. Returns the shape."""
    shape = resolve(getattr(args, "shape", "k3"), getattr(args, "hidden", None), getattr(args, "inter", None),
                    k=getattr(args, "k", None))
    if args.k is None:
        args.k = shape.k
    if args.experts is None:
        args.experts = max(min(shape.experts, files_per_layer), args.k)
    args.expert_shape = shape
    return shape


def describe(shape: ExpertShape, experts: int) -> str:
    """One line: the shape, its routing and how much of the model the synthetic files hold."""
    what = shape.source if shape == SHAPES.get(shape.name) else "with overrides"
    return (f"expert shape {shape.name} ({what}): gate/up [{shape.inter}, {shape.hidden}], down "
            f"[{shape.hidden}, {shape.inter}], {shape.act[0]}, top-{shape.k} of {shape.experts}; {experts} expert "
            f"files per layer written")
