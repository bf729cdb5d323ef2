"""The pack plan: every checkpoint tensor assigned to the trunk, an expert file, or skipped.

Built from config.json and the tensor index alone; shard headers are read when shards are present
(they are authoritative), otherwise shapes come from config.json (``store.shapes``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from deltafin.errors import CheckpointError, UsageError
from deltafin.store import shapes
from deltafin.store.checkpoint import Checkpoint
from deltafin.store.expert_file import ExpertLayout, layout_for
from deltafin.store.families import ExpertPart, Family, Skip, resolve

EXPERT_FORMATS = ("auto", "mxfp4", "bf16", "f32")
TRUNK_FORMATS = ("int8", "bf16")
_PLAIN_OUT = {"BF16": "bf16", "F16": "f16", "F32": "f32", "F8_E4M3": "bf16", "F8_E5M2": "bf16"}
_OUT_DTYPE = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}


@dataclass(frozen=True, slots=True)
class TrunkEntry:
    name: str  # name in the packed model
    source: str  # checkpoint name
    scale_inv: str | None  # FP8 block scales, dequantized on import
    dtype: str  # source safetensors dtype
    shape: tuple[int, ...]
    format: str  # int8 | bf16 | f16 | f32

    @property
    def out_bytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        if self.format == "int8":
            return n + 4 * self.shape[0]
        return n * {"bf16": 2, "f16": 2, "f32": 4}[self.format]

    @property
    def layer(self) -> int | None:
        parts = self.name.split(".")
        return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] else None


@dataclass(frozen=True, slots=True)
class RoleSource:
    """How one expert tensor (role) is produced: source kinds, source format, and the output format."""

    role: str
    src: str  # plain | fp8 | ct_mxfp4 | ct_int4 | oss_mxfp4 | oss_fused | bias
    out: str  # mxfp4 | int4g32 | bf16 | f16 | f32
    shape: tuple[int, ...]  # logical [out, in] (or [n] for biases)
    dtype: str  # source dtype of the main tensor


@dataclass
class PackPlan:
    family: Family
    config: dict
    text_config: dict
    trunk: list[TrunkEntry]
    moe_layers: list[int]
    num_experts: int
    roles: dict[int, list[RoleSource]]  # per MoE layer, in file order
    layouts: dict[int, ExpertLayout]
    expert_names: dict[tuple[int, int | None], dict[str, dict[str, str]]]  # (L, E) -> role -> kind -> name
    skipped: list[tuple[str, str]] = field(default_factory=list)
    shapes_from: str = "headers"

    @property
    def expert_files(self) -> int:
        return len(self.moe_layers) * self.num_experts

    @property
    def expert_payload_bytes(self) -> dict[int, int]:
        return {L: self.layouts[L].payload_bytes for L in self.moe_layers}

    @property
    def expert_bytes(self) -> int:
        return sum(self.layouts[L].file_bytes for L in self.moe_layers) * self.num_experts

    @property
    def trunk_bytes(self) -> int:
        return sum(t.out_bytes for t in self.trunk)


class _Shapes:
    """(dtype, shape) of a checkpoint tensor: shard header when present, else config.json."""

    def __init__(self, ckpt: Checkpoint, family: Family, tc: dict):
        self.ckpt, self.family, self.tc = ckpt, family, tc
        self.from_headers = all(ckpt.has_shard(s) for s in ckpt.shards())
        self._k3 = shapes.k3_shapes(tc) if family.name == "kimi_k3" and not self.from_headers else None

    def __call__(self, name: str, part: ExpertPart | str) -> tuple[str, tuple[int, ...]]:
        if self.from_headers:
            ti = self.ckpt.info(name)
            return ti.dtype, ti.shape
        local = name[len(self.family.prefix) :]
        if self.family.name == "kimi_k3":
            if isinstance(part, ExpertPart):
                return shapes.k3_expert_shape(part.role, part.kind, self.tc)
            got = shapes.k3_trunk_shape(local, self._k3)
            if got is None:
                raise CheckpointError(f"{name}: no shape known from config.json for this tensor; download its shard")
            return got
        if isinstance(part, ExpertPart) and part.kind == "weight" and part.role in ("gate", "up", "down"):
            return _config_dtype(self.tc), shapes.swiglu_expert_shape(part.role, self.tc)
        raise CheckpointError(
            f"{self.ckpt.path}: shard {self.ckpt.weight_map[name]} is not on disk and {name}'s shape cannot be "
            f"derived from config.json; download the shards (only their headers are read for a plan)"
        )


def _config_dtype(tc: dict) -> str:
    dt = str(tc.get("dtype") or tc.get("torch_dtype") or "bfloat16")
    return {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dt, "BF16")


def build_plan(ckpt: Checkpoint, experts: str = "auto", trunk: str = "int8") -> PackPlan:
    if experts not in EXPERT_FORMATS:
        raise UsageError(f"--experts {experts!r}: choose one of {', '.join(EXPERT_FORMATS)}")
    if trunk not in TRUNK_FORMATS:
        raise UsageError(f"--trunk {trunk!r}: choose one of {', '.join(TRUNK_FORMATS)}")
    family, tc = resolve(ckpt.config)
    shape_of = _Shapes(ckpt, family, tc)
    n_layers = tc.get("num_hidden_layers")
    trunk_names, skipped = [], []
    grouped: dict[tuple[int, int | None], dict[str, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for name in ckpt.weight_map:
        part = family.classify(name)
        if isinstance(part, Skip):
            skipped.append((name, part.reason))
        elif _is_mtp(part, n_layers):
            skipped.append((name, "multi-token-prediction layer, not used for decoding"))
        elif isinstance(part, ExpertPart):
            grouped[(part.layer, part.expert)][part.role][part.kind] = name
        else:
            trunk_names.append((name, part))
    trunk_entries = _plan_trunk(trunk_names, family, shape_of, trunk)
    moe_layers = sorted({L for L, _ in grouped})
    num_experts = _num_experts(grouped, moe_layers, shape_of, family)
    roles = {L: _plan_roles(L, grouped, shape_of, experts, family) for L in moe_layers}
    layouts = {L: _layout(roles[L]) for L in moe_layers}
    plan = PackPlan(family, ckpt.config, tc, trunk_entries, moe_layers, num_experts, roles, layouts,
                    dict(grouped), skipped, "headers" if shape_of.from_headers else "config.json")
    return plan


def _is_mtp(part: ExpertPart | str, n_layers: int | None) -> bool:
    if n_layers is None:
        return False
    if isinstance(part, ExpertPart):
        return part.layer >= n_layers
    bits = part.split(".")
    return len(bits) > 2 and bits[:2] == ["model", "layers"] and int(bits[2]) >= n_layers


def _plan_trunk(names: list[tuple[str, str]], family: Family, shape_of: _Shapes, mode: str) -> list[TrunkEntry]:
    by_local = {local: name for name, local in names}
    out = []
    for name, local in names:
        if local.endswith("_scale_inv"):
            continue  # consumed with its weight
        dtype, shape = shape_of(name, local)
        scale_inv = by_local.get(local + "_scale_inv")
        if dtype not in _PLAIN_OUT:
            raise CheckpointError(f"{name}: unexpected dtype {dtype} for a trunk tensor; expected BF16, F16, F32 or FP8")
        if dtype.startswith("F8") and scale_inv is None:
            raise CheckpointError(f"{name}: FP8 weight without {local}_scale_inv; the checkpoint is incomplete")
        fmt = _PLAIN_OUT[dtype]
        if mode == "int8" and len(shape) == 2 and min(shape) > 1 and not family.is_router(local):
            fmt = "int8"
        out.append(TrunkEntry(local, name, scale_inv, dtype, tuple(shape), fmt))
    return out


def _num_experts(grouped, moe_layers: list[int], shape_of: _Shapes, family: Family) -> int:
    if family.name == "gpt_oss":
        L = moe_layers[0]
        kinds = grouped[(L, None)]["down"]
        name = kinds.get("blocks") or kinds["fused"]
        return shape_of(name, ExpertPart(L, None, "down", "x"))[1][0]
    counts = {L: 0 for L in moe_layers}
    for L, e in grouped:
        counts[L] = max(counts[L], e + 1)
    n = set(counts.values())
    if len(n) != 1:
        raise CheckpointError(f"MoE layers disagree on the number of experts: {counts}; the checkpoint is incomplete")
    return n.pop()


def _plan_roles(L: int, grouped, shape_of: _Shapes, experts: str, family: Family) -> list[RoleSource]:
    key = (L, None) if family.name == "gpt_oss" else (L, 0)
    roles = grouped[key]
    out = []
    for role in family.roles:
        if role not in roles:
            if role.endswith("_bias"):
                continue
            raise CheckpointError(f"layer {L}: routed experts have no {role} tensor; the checkpoint is incomplete")
        out.append(_role_source(L, role, roles[role], shape_of, experts))
    return out


def _role_source(L: int, role: str, kinds: dict[str, str], shape_of: _Shapes, experts: str) -> RoleSource:
    def sh(kind: str) -> tuple[str, tuple[int, ...]]:
        return shape_of(kinds[kind], ExpertPart(L, 0, role, kind))

    if "bias" in kinds:
        dt, s = sh("bias")
        return RoleSource(role, "bias", _PLAIN_OUT[dt], tuple(s[1:]), dt)
    if "blocks" in kinds:
        dt, s = sh("blocks")
        return RoleSource(role, "oss_mxfp4", _pick(experts, "mxfp4"), (s[1], s[2] * 32), dt)
    if "fused" in kinds:
        dt, s = sh("fused")
        return RoleSource(role, "oss_fused", _pick(experts, None, dt), (s[2], s[1]), dt)
    if "weight_packed" in kinds:
        dt, s = sh("weight_packed")
        if dt == "U8":
            return RoleSource(role, "ct_mxfp4", _pick(experts, "mxfp4"), (s[0], s[1] * 2), dt)
        if dt == "I32":  # the record keeps the scale dtype: the layout needs it
            return RoleSource(role, "ct_int4", _pick(experts, "int4g32"), (s[0], s[1] * 8), sh("weight_scale")[0])
        raise CheckpointError(f"{kinds['weight_packed']}: unexpected dtype {dt} for packed expert weights")
    dt, s = sh("weight")
    if dt not in _PLAIN_OUT:
        raise CheckpointError(f"{kinds['weight']}: unexpected dtype {dt} for an expert weight")
    if dt.startswith("F8") and "weight_scale_inv" not in kinds:
        raise CheckpointError(f"{kinds['weight']}: FP8 expert weight without weight_scale_inv")
    return RoleSource(role, "fp8" if dt.startswith("F8") else "plain", _pick(experts, None, dt), tuple(s), dt)


def _pick(experts: str, released: str | None, dtype: str | None = None) -> str:
    """Released quantized bytes stay as they are by default; float experts become MXFP4."""
    if experts == "auto":
        return released or "mxfp4"
    return experts


def _layout(roles: list[RoleSource]) -> ExpertLayout:
    specs = []
    for r in roles:
        out, inn = (r.shape[0], r.shape[1]) if len(r.shape) == 2 else (r.shape[0], 1)
        if r.out == "mxfp4":
            if inn % 32:
                raise UsageError(f"{r.role}: input dimension {inn} is not a multiple of 32, so MXFP4 cannot hold it; "
                                 f"pack with --experts bf16")
            secs = [("data", "uint8", (out, inn // 2)), ("scale", "uint8", (out, inn // 32))]
        elif r.out == "int4g32":
            sdt = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(r.dtype, "bfloat16")
            secs = [("data", "int32", (out, inn // 8)), ("scale", sdt, (out, inn // 32))]
        else:
            secs = [("data", _OUT_DTYPE[r.out], tuple(r.shape))]
        specs.append((r.role, r.out, tuple(r.shape), secs))
    return layout_for(specs)
