"""``deltafin inspect``: what a packed model (or a pack plan) holds, where, and what streams per token."""

from __future__ import annotations

from deltafin.store.model_dir import PackedModel


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"


def model_summary(model: PackedModel) -> dict:
    doc = model.doc
    tc = model.text_config
    per_drive = {d.label: {"path": d.path, "gbps": d.gbps, "files": 0, "bytes": 0} for d in model.drives}
    expert_bytes = 0
    for L in model.moe_layers:
        n = model.file_bytes(L)
        for e in range(model.num_experts):
            for d in model.locations(L, e):
                per_drive[model.drives[d].label]["files"] += 1
                per_drive[model.drives[d].label]["bytes"] += n
            expert_bytes += n
    layout = doc["experts"]["layouts"][str(model.moe_layers[0])] if model.moe_layers else None
    k = tc.get("num_experts_per_tok") or tc.get("num_experts_per_token") or 0
    formats: dict[str, int] = {}
    for t in doc["trunk"]["tensors"].values():
        formats[t["format"]] = formats.get(t["format"], 0) + 1
    return {
        "model_id": model.model_id,
        "family": model.family,
        "model_type": doc["model_type"],
        "layers": tc.get("num_hidden_layers"),
        "moe_layers": len(model.moe_layers),
        "experts_per_layer": model.num_experts,
        "experts_per_token": k,
        "expert_files": len(model.moe_layers) * model.num_experts,
        "expert_file_bytes": layout["file_bytes"] if layout else 0,
        "expert_payload_bytes": layout["payload_bytes"] if layout else 0,
        "expert_formats": sorted({t["format"] for t in layout["tensors"]}) if layout else [],
        "expert_bytes": expert_bytes,
        "trunk_bytes": doc["trunk"]["bytes"],
        "trunk_formats": formats,
        "streamed_bytes_per_token": (layout["file_bytes"] if layout else 0) * k * len(model.moe_layers),
        "per_drive": per_drive,
    }


def format_summary(s: dict) -> str:
    lines = [
        f"model        {s['model_id']}  ({s['family']}, model_type {s['model_type']})",
        f"layers       {s['layers']} ({s['moe_layers']} MoE), {s['experts_per_layer']} experts/layer, "
        f"{s['experts_per_token']} routed per token",
        f"trunk        {_gb(s['trunk_bytes'])} resident  (tensors by format: "
        + ", ".join(f"{k} {v}" for k, v in sorted(s["trunk_formats"].items())) + ")",
        f"experts      {s['expert_files']:,} files x {s['expert_file_bytes']:,} B "
        f"(payload {s['expert_payload_bytes']:,} B, {'/'.join(s['expert_formats'])}) = {_gb(s['expert_bytes'])}",
        f"per token    {_gb(s['streamed_bytes_per_token'])} of routed experts "
        f"({s['experts_per_token']} x {s['moe_layers']} layers) when nothing is cached",
        "drives:",
    ]
    for label, d in s["per_drive"].items():
        lines.append(f"  {label:<8} {d['path']}  {d['gbps']:.2f} GB/s  {d['files']:,} files  {_gb(d['bytes'])}")
    return "\n".join(lines)
