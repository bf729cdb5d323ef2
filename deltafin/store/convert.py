"""Turn checkpoint tensors into packed records: the one place tensors are renamed, sliced or re-encoded."""

from __future__ import annotations

import torch

from deltafin.errors import CheckpointError
from deltafin.quant import fp8, int4, mxfp4
from deltafin.quant.record import QTensor, from_plain
from deltafin.store.checkpoint import Checkpoint, read_row
from deltafin.store.plan import PackPlan, RoleSource, TrunkEntry


def expert_tensors(ckpt: Checkpoint, plan: PackPlan, layer: int, expert: int) -> dict[str, QTensor]:
    """All tensors of one routed expert, in file order, in their output formats."""
    key = (layer, None) if plan.family.name == "gpt_oss" else (layer, expert)
    names = plan.expert_names[key]
    return {r.role: _role(ckpt, r, names[r.role], expert) for r in plan.roles[layer]}


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
         ("oss_mxfp4", "mxfp4"): ("blocks", "scales")}


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


def _role(ckpt: Checkpoint, r: RoleSource, kinds: dict[str, str], expert: int) -> QTensor:
    if r.src == "ct_mxfp4" and r.out == "mxfp4":  # released QAT bytes: copied unchanged
        return QTensor("mxfp4", r.shape, ckpt.read(kinds["weight_packed"]), ckpt.read(kinds["weight_scale"]))
    if r.src == "ct_int4" and r.out == "int4g32":
        return QTensor("int4g32", r.shape, ckpt.read(kinds["weight_packed"]), ckpt.read(kinds["weight_scale"]))
    if r.src == "oss_mxfp4" and r.out == "mxfp4":
        blocks = read_row(ckpt, kinds["blocks"], expert)  # [out, in/32, 16]
        return QTensor("mxfp4", r.shape, blocks.reshape(r.shape[0], -1), read_row(ckpt, kinds["scales"], expert))
    if r.src == "bias":
        return from_plain(read_row(ckpt, kinds["bias"], expert), r.out)
    return from_plain(_dense(ckpt, r, kinds, expert), r.out)


def _dense(ckpt: Checkpoint, r: RoleSource, kinds: dict[str, str], expert: int) -> torch.Tensor:
    """The float weight [out, in] of a role, dequantizing imported formats."""
    if r.src == "plain":
        return ckpt.read(kinds["weight"])
    if r.src == "fp8":
        return fp8.dequantize(ckpt.read(kinds["weight"]), ckpt.read(kinds["weight_scale_inv"]))
    if r.src == "ct_mxfp4":
        return mxfp4.dequantize(ckpt.read(kinds["weight_packed"]), ckpt.read(kinds["weight_scale"]))
    if r.src == "ct_int4":
        return int4.dequantize(ckpt.read(kinds["weight_packed"]), ckpt.read(kinds["weight_scale"]))
    if r.src == "oss_mxfp4":
        blocks = read_row(ckpt, kinds["blocks"], expert)
        return mxfp4.dequantize(blocks.reshape(r.shape[0], -1), read_row(ckpt, kinds["scales"], expert))
    if r.src == "oss_fused":
        return read_row(ckpt, kinds["fused"], expert).T.contiguous()  # stored [in, out]
    raise AssertionError(r.src)


def trunk_tensor(ckpt: Checkpoint, t: TrunkEntry) -> QTensor:
    w = ckpt.read(t.source)
    if t.scale_inv is not None:
        w = fp8.dequantize(w, ckpt.read(t.scale_inv)).to(torch.bfloat16)  # as DeepSeek's reference does
    return from_plain(w, t.format)
