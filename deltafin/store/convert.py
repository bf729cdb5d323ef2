"""Turn checkpoint tensors into packed records: the one place tensors are renamed, sliced or re-encoded."""

from __future__ import annotations

import math

import torch

from deltafin.errors import CheckpointError
from deltafin.quant import fp8, int4, mxfp4
from deltafin.quant.record import QTensor, from_plain
from deltafin.store.checkpoint import Checkpoint, read_row, read_rows
from deltafin.store.plan import PackPlan, RoleSource, TrunkEntry


def expert_tensors(ckpt: Checkpoint, plan: PackPlan, layer: int, expert: int,
                   allow_nonfinite: bool = False) -> dict[str, QTensor]:
    """All tensors of one routed expert, in file order, in their output formats (NaN/inf refused unless
    ``allow_nonfinite``)."""
    key = (layer, None) if plan.family.name == "gpt_oss" else (layer, expert)
    names = plan.expert_names[key]
    return {r.role: _role(ckpt, r, names[r.role], expert, allow_nonfinite) for r in plan.roles[layer]}


def check_mxfp4_scales(scales: memoryview, name: str, row: int | None = None) -> None:
    """An E8M0 scale of 0xFF is NaN (OCP MX v1.0): released MXFP4 bytes carrying one are damaged."""
    t = torch.frombuffer(scales, dtype=torch.uint8) if len(scales) else torch.empty(0, dtype=torch.uint8)
    if bool((t == 0xFF).any()):
        what = name if row is None else f"{name}[{row}]"
        raise CheckpointError(f"{what}: {int((t == 0xFF).sum()):,} MXFP4 scales are NaN (0xFF); the checkpoint is "
                              f"damaged: re-download it, or pack with --allow-nonfinite to keep them as they are")


def check_expert_sources(ckpt: Checkpoint, plan: PackPlan, layer: int, expert: int) -> None:
    """Checks that need a tensor's values, not only its header: compressed-tensors ``weight_shape``
    must be the logical shape the packed words hold."""
    key = (layer, None) if plan.family.name == "gpt_oss" else (layer, expert)
    names = plan.expert_names[key]
    for r in plan.roles[layer]:
        name = names[r.role].get("weight_shape") if r.src == "ct_int4" else None
        if name is not None:
            got = tuple(int(x) for x in ckpt.read(name).reshape(-1).tolist())
            if got != tuple(r.shape):
                raise CheckpointError(f"{name}: logical shape {list(got)}, but the packed weights hold {list(r.shape)}; "
                                      f"the checkpoint is inconsistent (padded INT4 rows are not supported)")


_PASS = {("ct_mxfp4", "mxfp4"): ("weight_packed", "weight_scale"), ("ct_int4", "int4g32"): ("weight_packed", "weight_scale"),
         ("oss_mxfp4", "mxfp4"): ("blocks", "scales"), ("ds_mxfp4", "mxfp4"): ("weight", "weight_scale_inv")}


def passthrough_sections(plan: PackPlan, layer: int, expert: int) -> list[tuple[str, int | None]] | None:
    """For experts whose every tensor is copied unchanged: the (checkpoint name, row) behind each file
    section in layout order, so the packer can read the bytes straight into the output buffer."""
    key = (layer, None) if plan.family.name == "gpt_oss" else (layer, expert)
    names = plan.expert_names[key]
    out = []
    for r in plan.roles[layer]:
        kinds = _PASS.get((r.src, r.out))
        if kinds is None:
            return None
        row = expert if r.src == "oss_mxfp4" else None
        out.extend((names[r.role][k], row) for k in kinds)
    return out


def _role(ckpt: Checkpoint, r: RoleSource, kinds: dict[str, str], expert: int, allow: bool) -> QTensor:
    name = next(iter(kinds.values()))
    where = f" (expert {expert})" if r.src.startswith("oss") or r.src == "bias" else ""
    q = _role_record(ckpt, r, kinds, expert, None if allow else lambda w: check_finite(w, name, where))
    if not allow:
        if q.format == "mxfp4":
            check_mxfp4_scales(memoryview(q.scale.contiguous().reshape(-1).numpy()), name)
        else:
            check_finite(q.data, name, where)
    return q


def _role_record(ckpt: Checkpoint, r: RoleSource, kinds: dict[str, str], expert: int, check=None) -> QTensor:
    """``check(weight)`` sees every float weight before it is encoded (NaN does not survive into MXFP4's
    scales, so it is caught here, whatever the codec)."""
    if r.src == "ct_mxfp4" and r.out == "mxfp4":  # released QAT bytes: copied unchanged
        return QTensor("mxfp4", r.shape, ckpt.read(kinds["weight_packed"]), ckpt.read(kinds["weight_scale"]))
    if r.src == "ds_mxfp4" and r.out == "mxfp4":  # DeepSeek-V4's FP4 (I8) and E8M0 bytes are MXFP4's
        return QTensor("mxfp4", r.shape, *_ds_fp4(ckpt, kinds))
    if r.src == "ct_int4" and r.out == "int4g32":
        return QTensor("int4g32", r.shape, ckpt.read(kinds["weight_packed"]), ckpt.read(kinds["weight_scale"]))
    if r.src == "oss_mxfp4" and r.out == "mxfp4":
        blocks = read_row(ckpt, kinds["blocks"], expert)  # [out, in/32, 16]
        return QTensor("mxfp4", r.shape, blocks.reshape(r.shape[0], -1), read_row(ckpt, kinds["scales"], expert))
    if r.src == "bias":
        return from_plain(read_row(ckpt, kinds["bias"], expert), r.out)
    w = _dense(ckpt, r, kinds, expert)
    if check is not None:
        check(w)
    return from_plain(w, r.out)


def _dense(ckpt: Checkpoint, r: RoleSource, kinds: dict[str, str], expert: int) -> torch.Tensor:
    """The float weight [out, in] of a role, dequantizing imported formats."""
    if r.src == "plain":
        return ckpt.read(kinds["weight"])
    if r.src == "fp8":
        return fp8.dequantize(ckpt.read(kinds["weight"]), ckpt.read(kinds["weight_scale_inv"]))
    if r.src == "ct_mxfp4":
        return mxfp4.dequantize(ckpt.read(kinds["weight_packed"]), ckpt.read(kinds["weight_scale"]))
    if r.src == "ds_mxfp4":
        return mxfp4.dequantize(*_ds_fp4(ckpt, kinds))
    if r.src == "ct_int4":
        return int4.dequantize(ckpt.read(kinds["weight_packed"]), ckpt.read(kinds["weight_scale"]))
    if r.src == "oss_mxfp4":
        blocks = read_row(ckpt, kinds["blocks"], expert)
        return mxfp4.dequantize(blocks.reshape(r.shape[0], -1), read_row(ckpt, kinds["scales"], expert))
    if r.src == "oss_fused":
        return read_row(ckpt, kinds["fused"], expert).T.contiguous()  # stored [in, out]
    raise AssertionError(r.src)


def _ds_fp4(ckpt: Checkpoint, kinds: dict[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales) as uint8 views of DeepSeek-V4's FP4 expert weight and its E8M0 scale (no conversion)."""
    return ckpt.read(kinds["weight"]).view(torch.uint8), ckpt.read(kinds["weight_scale_inv"]).view(torch.uint8)


ROW_BLOCK_BYTES = 32 << 20  # float32 bytes of one block of rows converted at a time (bounds pack's memory)
_ST_OUT = {"int8": "I8", "bf16": "BF16", "f16": "F16", "f32": "F32"}


def check_finite(w: torch.Tensor, name: str, where: str = "") -> None:
    """NaN or inf in a weight is damage (a bad download, a broken conversion), never a value to pack."""
    if w.is_floating_point() and has_nonfinite(w):
        bad = int((~torch.isfinite(w)).sum())
        raise CheckpointError(f"{name}: {bad:,} NaN/inf values{where}; the checkpoint is damaged: re-download it, or "
                              f"pack with --allow-nonfinite to keep them as they are")


_EXPONENT_FIELD = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
                   torch.float32: (torch.int32, 0x7F800000)}
FINITE_STEP = 1 << 17  # elements checked per step: small temporaries, reused from the heap


def has_nonfinite(w: torch.Tensor) -> bool:
    """Whether a float tensor holds NaN or inf: an exponent field of all ones, found as the largest masked
    field a block at a time (isfinite's bool temporaries cost about 20 times as much)."""
    kind = _EXPONENT_FIELD.get(w.dtype)
    if kind is None:
        return not bool(torch.isfinite(w).all())
    flat = w.reshape(-1).view(kind[0])
    return any(int((flat[a : a + FINITE_STEP] & kind[1]).amax()) == kind[1]
               for a in range(0, flat.numel(), FINITE_STEP))


class TrunkStream:
    """One trunk tensor converted a block of rows at a time: ``specs`` names what it writes (the weight,
    then its int8 row scales); ``chunks(name)`` yields the bytes, so memory holds one block, not the tensor."""

    def __init__(self, ckpt: Checkpoint, t: TrunkEntry, allow_nonfinite: bool = False):
        self.ckpt, self.t, self.allow = ckpt, t, allow_nonfinite
        self._scales: list[torch.Tensor] = []

    @property
    def specs(self) -> list[tuple[str, str, tuple[int, ...]]]:
        t = self.t
        out = [(t.name, _ST_OUT[t.format], t.shape)]
        return out + ([(t.name + "#scale", "F32", (t.shape[0],))] if t.format == "int8" else [])

    def _rows_per_block(self) -> int:
        per_row = max(1, math.prod(self.t.shape[1:])) * 4
        n = max(1, ROW_BLOCK_BYTES // per_row)
        return max(fp8.BLOCK, n // fp8.BLOCK * fp8.BLOCK) if self.t.scale_inv is not None else n

    def _blocks(self):
        t = self.t
        if not t.shape:  # a scalar
            yield 0, self.ckpt.read(t.source).reshape(())
            return
        step = self._rows_per_block()
        for a in range(0, t.shape[0], step):
            b = min(a + step, t.shape[0])
            w = read_rows(self.ckpt, t.source, a, b)
            if t.scale_inv is not None:  # 128-row blocks of scales, as the weight's blocks of rows
                s = read_rows(self.ckpt, t.scale_inv, a // fp8.BLOCK, (b + fp8.BLOCK - 1) // fp8.BLOCK)
                w = fp8.dequantize(w, s).to(torch.bfloat16)  # as DeepSeek's reference does
            if not self.allow:
                check_finite(w, t.source, f" in rows {a}..{b - 1}")
            yield a, w

    def chunks(self, name: str):
        if name.endswith("#scale"):
            yield memoryview(torch.cat(self._scales).numpy())
            self._scales = []
            return
        for _a, w in self._blocks():
            q = from_plain(w, self.t.format)
            if q.scale is not None:
                self._scales.append(q.scale.reshape(-1).to(torch.float32))
            yield memoryview(q.data.contiguous().reshape(-1).view(torch.uint8).numpy())
