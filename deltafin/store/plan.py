"""The pack plan: every checkpoint tensor assigned to the trunk, an expert file, or skipped.

Built from config.json and the tensor index alone; shard headers are read when shards are present
(they are authoritative), otherwise shapes come from config.json (``store.shapes``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from deltafin.errors import CheckpointError, UsageError
from deltafin.quant import fp8
from deltafin.store import shapes
from deltafin.store.checkpoint import Checkpoint
from deltafin.store.config_check import check_config, check_embedding, check_layers, check_tokenizer
from deltafin.store.expert_file import ExpertLayout, layout_for
from deltafin.store.families import ExpertPart, Family, Skip, resolve

EXPERT_FORMATS = ("auto", "mxfp4", "bf16", "f32")
TRUNK_FORMATS = ("int8", "bf16")
_PLAIN_OUT = {"BF16": "bf16", "F16": "f16", "F32": "f32", "F8_E4M3": "bf16", "F8_E5M2": "bf16"}
_INDEX_OUT = {"I64": "f32", "I32": "f32"}  # index tables (DeepSeek-V4's tid2eid): exact in float32 below 2**24
_SWIGLU_FAMILIES = ("deepseek_v3", "qwen3_moe", "mixtral", "olmoe", "kimi_k25", "glm4_moe", "minimax_m2",
                    "qwen3_next", "qwen3_5_moe", "deepseek_v32", "deepseek_v4")
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
    src: str  # plain | fp8 | ct_mxfp4 | ct_int4 | ds_mxfp4 | oss_mxfp4 | oss_fused | bias
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
    unused: list[str] = field(default_factory=list)  # trunk tensors (checkpoint names) the model code never reads

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

    @property
    def routed_bytes_per_token(self) -> int:
        """Expert file bytes one decode token reads (num_experts_per_tok files in every MoE layer, none cached):
        over the drives' aggregate read rate, the decode bound."""
        tc = self.text_config
        k = tc.get("num_experts_per_tok") or tc.get("num_experts_per_token") or 0
        return k * sum(self.layouts[L].file_bytes for L in self.moe_layers)


class _Shapes:
    """(dtype, shape) of a checkpoint tensor: its shard's header when the shard is on disk, else config.json."""

    def __init__(self, ckpt: Checkpoint, family: Family, tc: dict):
        self.ckpt, self.family, self.tc = ckpt, family, tc
        self.present = {s for s in ckpt.shards() if ckpt.has_shard(s)}
        self.from_headers = len(self.present) == len(ckpt.shards())
        self.source = "headers" if self.from_headers else "headers+config.json" if self.present else "config.json"
        self._k3 = shapes.k3_shapes(tc) if family.name == "kimi_k3" and not self.from_headers else None
        self.dtype = _config_dtype({**ckpt.config, **tc})  # a multimodal text_config may leave it to the top
        self._v4 = shapes.v4_release_dtypes(ckpt.config) if family.name == "deepseek_v4" else None

    def on_disk(self, name: str) -> bool:
        return self.ckpt.weight_map[name] in self.present

    def file(self, name: str) -> str:
        return f"{self.ckpt.path}/{self.ckpt.weight_map[name]}"

    def __call__(self, name: str, part: ExpertPart | str) -> tuple[str, tuple[int, ...]]:
        if self.on_disk(name):
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
        scale = name + "_scale_inv"  # DeepSeek-style FP8 blocks beside the weight (V4's release: ``.scale``)
        if self._v4 is not None and name.endswith(".weight"):
            scale = name.removesuffix("weight") + "scale"
        scaled = scale in self.ckpt.weight_map
        if isinstance(part, ExpertPart) and part.role in ("gate", "up", "down"):
            out, inn = shapes.swiglu_expert_shape(part.role, self.tc)
            fp4 = self._v4 is not None and self._v4[0] == "I8"
            if part.kind == "weight":
                return ("I8", (out, inn // 2)) if scaled and fp4 else ("F8_E4M3" if scaled else self.dtype, (out, inn))
            if part.kind == "weight_scale_inv" and self._v4 is not None:
                return ("F8_E8M0", (out, inn // 32)) if fp4 else (self._v4[1], (-(-out // 128), -(-inn // 128)))
            got = shapes.expert_kind_shape(part.role, part.kind, self.tc)
            if got is not None:
                return got
        elif isinstance(part, str) and self.family.name in shapes.CONFIG_SHAPED:
            local = self.family.local_name(local)
            shape = shapes.trunk_shape(self.family.name, local.removesuffix("_scale_inv"), self.tc)
            if shape is not None and local.endswith("_scale_inv"):
                return self._v4[1] if self._v4 else "F32", tuple(-(-n // 128) for n in shape)
            if shape is not None:
                dt = "F32" if local.endswith("e_score_correction_bias") else "F8_E4M3" if scaled else self.dtype
                return shapes.fixed_dtype(self.family.name, local) or dt, shape
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
    where = f"{ckpt.path}/config.json"
    cfg = check_config(family.name, tc, where)
    check_tokenizer(ckpt.path, getattr(cfg, "vocab_size", None))
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
    embed = next((t.source for t in trunk_entries if t.name == "model.embed_tokens.weight"), None)
    check_embedding(shape_of, embed, cfg, where)
    moe_layers = sorted({L for L, _ in grouped})
    check_layers(tc, ckpt.weight_map, bool(moe_layers), where)
    num_experts = _num_experts(grouped, moe_layers, shape_of, family)
    roles = {L: _plan_roles(L, grouped, shape_of, experts, family) for L in moe_layers}
    _check_experts(grouped, moe_layers, num_experts, shape_of, family)
    layouts = {L: _layout(roles[L]) for L in moe_layers}
    plan = PackPlan(family, ckpt.config, tc, trunk_entries, moe_layers, num_experts, roles, layouts,
                    dict(grouped), skipped, shape_of.source, unused_trunk(family.name, trunk_entries))
    return plan


def unused_trunk(family: str, trunk: list[TrunkEntry]) -> list[str]:
    """The trunk tensors (checkpoint names) that the family's model code never reads (its module's ``READS``):
    a sign that the checkpoint is another architecture's (DeepSeek-V3.2's indexer read as DeepSeek-V3)."""
    import re

    from deltafin.models.registry import module_for

    reads = re.compile("|".join(f"(?:{r})" for r in module_for(family).READS))
    return [t.source for t in trunk if reads.fullmatch(t.name) is None]


def refuse_unused(plan: PackPlan, allow: bool) -> None:
    """One CheckpointError naming the trunk tensors the model would never read, unless ``allow``
    (``pack --allow-unused``: they are then packed as they are)."""
    if plan.unused and not allow:
        n = len(plan.unused)
        raise CheckpointError(
            f"{n} trunk tensor(s) that the {plan.family.name} model code never reads, e.g. "
            f"{', '.join(plan.unused[:3])}: the checkpoint is another architecture's (check model_type in "
            f"config.json), or pack with --allow-unused to keep them anyway")


def _check_experts(grouped, moe_layers: list[int], n: int, shape_of: _Shapes, family: Family) -> None:
    """Every expert has expert 0's tensors, with its dtypes and shapes (checked where shards are on disk),
    so a pack never fails half way through on an incomplete or inconsistent checkpoint."""
    if family.name == "gpt_oss":  # one fused tensor per layer: all experts along dim 0
        for L in moe_layers:
            for role, kinds in grouped[(L, None)].items():
                for kind, name in kinds.items():
                    dt, s = shape_of(name, ExpertPart(L, None, role, kind))
                    if not s or s[0] != n:
                        raise CheckpointError(f"{name}: {dt} {list(s)} holds {s[0] if s else 0} experts, expected {n} "
                                              f"like the other MoE layers; the checkpoint is inconsistent")
        return
    for L in moe_layers:
        ref = grouped[(L, 0)]
        ref_shapes = {name: shape_of(name, ExpertPart(L, 0, role, kind))
                      for role, kinds in ref.items() for kind, name in kinds.items() if shape_of.on_disk(name)}
        for e in range(1, n):
            got = grouped.get((L, e))
            if got is None:
                raise CheckpointError(f"layer {L} expert {e}: no tensors in the checkpoint index (layer {L} has experts "
                                      f"up to {n - 1}); the checkpoint is incomplete, re-download its index and shards")
            for role, kinds in ref.items():
                for kind, name0 in kinds.items():
                    name = got.get(role, {}).get(kind)
                    if name is None:
                        raise CheckpointError(f"layer {L} expert {e}: no {role} tensor ({kind}) in the checkpoint index, "
                                              f"though expert 0 has {name0}; the checkpoint is incomplete")
                    if name0 in ref_shapes and shape_of.on_disk(name):
                        dt, s = shape_of(name, ExpertPart(L, e, role, kind))
                        dt0, s0 = ref_shapes[name0]
                        if (dt, tuple(s)) != (dt0, tuple(s0)):
                            raise CheckpointError(f"{shape_of.file(name)}: {name}: {dt} {list(s)}, expected {dt0} "
                                                  f"{list(s0)} as {name0}"
                                                  + (" (transposed)" if tuple(s) == tuple(s0)[::-1] else "")
                                                  + "; the checkpoint is inconsistent (corrupt or mixed shards)")
            for role, kinds in got.items():
                for kind, name in kinds.items():
                    if kind not in ref.get(role, {}):
                        raise CheckpointError(f"layer {L} expert 0: no {role} tensor ({kind}) in the checkpoint index, "
                                              f"though expert {e} has {name}; the checkpoint is incomplete")


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
        if dtype in _INDEX_OUT and family.is_router(local):
            out.append(TrunkEntry(local, name, None, dtype, tuple(shape), _INDEX_OUT[dtype]))
            continue
        if dtype not in _PLAIN_OUT:
            raise CheckpointError(f"{name}: unexpected dtype {dtype} for a trunk tensor; expected BF16, F16, F32 or FP8")
        if dtype.startswith("F8") and scale_inv is None:
            raise CheckpointError(f"{name}: FP8 weight without {local}_scale_inv; the checkpoint is incomplete")
        if dtype.startswith("F8"):
            _check_fp8_scale(scale_inv, tuple(shape), shape_of(scale_inv, local + "_scale_inv"))
        fmt = _PLAIN_OUT[dtype]
        if mode == "int8" and len(shape) == 2 and min(shape) > 1 and not family.is_router(local):
            fmt = "int8"
        out.append(TrunkEntry(local, name, scale_inv, dtype, tuple(shape), fmt))
    return out


def _check_fp8_scale(name: str, weight: tuple[int, ...], got: tuple[str, tuple[int, ...]]) -> None:
    """DeepSeek-V3 FP8: one float32 scale per 128x128 block of the weight."""
    want = tuple((d + fp8.BLOCK - 1) // fp8.BLOCK for d in weight)
    if tuple(got[1]) != want:
        raise CheckpointError(f"{name}: shape {list(got[1])} does not match {want[0]}x{want[1]} blocks of "
                              f"{fp8.BLOCK}x{fp8.BLOCK} over the {list(weight)} weight; only DeepSeek's 128x128 "
                              f"FP8 blocks are supported")


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
    if dt in ("I8", "U8") and "weight_scale_inv" in kinds:
        return _ds_fp4_source(role, kinds, shape_of, experts, dt, tuple(s), sh("weight_scale_inv"))
    if dt not in _PLAIN_OUT:
        raise CheckpointError(f"{kinds['weight']}: unexpected dtype {dt} for an expert weight")
    if shape_of.family.name in _SWIGLU_FAMILIES and role in ("gate", "up", "down"):
        want = shapes.swiglu_expert_shape(role, shape_of.tc)
        if tuple(s) != want:
            raise CheckpointError(f"{shape_of.file(kinds['weight'])}: {kinds['weight']}: {list(s)}, but config.json "
                                  f"makes a {role} expert [out, in] = {list(want)}"
                                  + (" (the tensor is transposed)" if tuple(s) == want[::-1] else "")
                                  + "; the checkpoint and its config do not match")
    if dt.startswith("F8") and "weight_scale_inv" not in kinds:
        raise CheckpointError(f"{kinds['weight']}: FP8 expert weight without weight_scale_inv")
    if dt.startswith("F8"):
        _check_fp8_scale(kinds["weight_scale_inv"], tuple(s), sh("weight_scale_inv"))
    return RoleSource(role, "fp8" if dt.startswith("F8") else "plain", _pick(experts, None, dt), tuple(s), dt)


def _ds_fp4_source(role: str, kinds: dict[str, str], shape_of: _Shapes, experts: str, dt: str,
                   s: tuple[int, ...], scale: tuple[str, tuple[int, ...]]) -> RoleSource:
    """DeepSeek-V4's released FP4 routed experts (``expert_dtype: "fp4"``), which are MXFP4 exactly as Deltafin
    stores it, so by default their bytes are copied unchanged.

    The layout, as DeepSeek's ``inference/model.py`` declares it and transformers 5.24 (``FP8Experts`` with
    ``expert_dtype="fp4"``, ``Fp8Dequantize._unpack_fp4``) and vLLM (``Mxfp4MoEMethod``) read it:
    ``layers.{L}.ffn.experts.{E}.w{1,3,2}.weight`` is ``float4_e2m1fn_x2`` stored as safetensors I8,
    [out, in/2], two E2M1 codes per byte along the input dimension, the even element in the low nibble;
    ``...w{1,3,2}.scale`` is ``float8_e8m0fnu`` (safetensors F8_E8M0), [out, in/32], one power of two
    2**(byte - 127) per 32 inputs. The trunk (attention, shared expert) is FP8 e4m3 with one E8M0 ``.scale`` per
    128 x 128 block (``quantization_config``: ``quant_method fp8``, ``scale_fmt ue8m0``, ``weight_block_size
    [128, 128]``), the indexer's ``wq_b`` too; the compressors' and the indexer's kv / gate / weights projections,
    norms, mHC and routers ship unquantized.
    """
    sdt, ss = scale
    inn = s[1] * 2
    where = shape_of.file(kinds["weight"])
    if sdt not in ("F8_E8M0", "U8") or tuple(ss) != (s[0], inn // 32) or inn % 32:
        raise CheckpointError(f"{where}: {kinds['weight']}: FP4 {dt} {list(s)} needs an E8M0 scale [{s[0]}, "
                              f"{inn // 32}] (one per 32 inputs), but {kinds['weight_scale_inv']} is {sdt} {list(ss)};"
                              f" FP4 is read as DeepSeek-V4 ships it (MXFP4) only: the file is damaged (re-download "
                              f"it) or in another FP4 format (dequantize its experts to bf16 first)")
    want = shapes.swiglu_expert_shape(role, shape_of.tc)
    if (s[0], inn) != want:
        raise CheckpointError(f"{where}: {kinds['weight']}: FP4 [{s[0]}, {inn}] logical, but config.json makes a "
                              f"{role} expert [out, in] = {list(want)}; the checkpoint and its config do not match")
    return RoleSource(role, "ds_mxfp4", _pick(experts, "mxfp4"), (s[0], inn), dt)


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
