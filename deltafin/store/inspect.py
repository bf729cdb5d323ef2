"""``deltafin inspect``: what a packed model (or a pack plan) holds, where, and what streams per token."""

from __future__ import annotations

from deltafin.store.model_dir import PackedModel


def _gb(n: float) -> str:
    from deltafin import fmt

    return fmt.size(n)


def model_summary(model: PackedModel) -> dict:
    doc = model.doc
    tc = model.text_config
    per_drive = {d.label: {"path": d.path, "gbps": d.gbps, "files": 0, "bytes": 0} for d in model.drives}
    expert_bytes = 0
    for L in model.moe_layers:
        n = model.file_bytes(L)
        pieces = model.stripe(L)  # striped: one piece of every expert per drive
        for e in range(model.num_experts):
            for d, nbytes in ([(p.drive, p.nbytes) for p in pieces] if pieces else
                              [(d, n) for d in model.locations(L, e)]):
                per_drive[model.drives[d].label]["files"] += 1
                per_drive[model.drives[d].label]["bytes"] += nbytes
            expert_bytes += n
    layout = doc["experts"]["layouts"][str(model.moe_layers[0])] if model.moe_layers else None
    k = tc.get("num_experts_per_tok") or tc.get("num_experts_per_token") or 0
    formats: dict[str, int] = {}
    for t in doc["trunk"]["tensors"].values():
        formats[t["format"]] = formats.get(t["format"], 0) + 1
    from deltafin.store.memory import sequence_memory, trunk_bytes_both

    int8, bf16 = trunk_bytes_both(doc["trunk"]["tensors"])
    return {
        "trunk_bytes_int8": int8,
        "trunk_bytes_bf16": bf16,
        **sequence_memory(tc),
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
        **_layout(model),
    }


def _layout_line(s: dict) -> str:
    if s.get("striped_layers"):
        how = (f"{s['striped_layers']} of {s['moe_layers']} layers striped ({'/'.join(s['stripe_modes'])}): "
               f"every expert in one piece per drive, read in parallel")
    else:
        how = "one file per expert" + (f" plus {s['replica_files']:,} replicas" if s.get("replica_files") else "")
    return f"layout       placement {s['placement']}: {how}"


def _layout(model: PackedModel) -> dict:
    """How expert files are laid out: whole files (and the placement policy) or striped over drives."""
    ex = model.doc["experts"]
    striped = sorted(int(L) for L in (ex.get("stripe") or {}))
    modes = sorted({ex["stripe"][str(L)]["mode"] for L in striped})
    replicas = sum(len(loc) - 1 for L in model.moe_layers for loc in ex["locations"][str(L)]) if not striped else 0
    return {"placement": ex.get("placement", "bandwidth"), "striped_layers": len(striped), "stripe_modes": modes,
            "replica_files": replicas}


def plan_summary(src: str) -> dict:
    """The same projection for a checkpoint that is not packed yet (config.json + index; no weights)."""
    from deltafin.store.checkpoint import Checkpoint
    from deltafin.store.memory import sequence_memory
    from deltafin.store.plan import build_plan

    ckpt = Checkpoint(src)
    p8, p16 = build_plan(ckpt, trunk="int8"), build_plan(ckpt, trunk="bf16")
    tc = p8.text_config
    L0 = p8.moe_layers[0]
    k = tc.get("num_experts_per_tok") or tc.get("num_experts_per_token") or 0
    return {
        "model_id": f"(plan of {src})", "family": p8.family.name, "model_type": p8.config.get("model_type"),
        "layers": tc.get("num_hidden_layers"), "moe_layers": len(p8.moe_layers), "experts_per_layer": p8.num_experts,
        "experts_per_token": k, "expert_files": p8.expert_files, "expert_file_bytes": p8.layouts[L0].file_bytes,
        "expert_payload_bytes": p8.layouts[L0].payload_bytes,
        "expert_formats": sorted({r.out for r in p8.roles[L0]}), "expert_bytes": p8.expert_bytes,
        "trunk_bytes": p8.trunk_bytes, "trunk_bytes_int8": p8.trunk_bytes, "trunk_bytes_bf16": p16.trunk_bytes,
        "trunk_formats": {}, "streamed_bytes_per_token": p8.layouts[L0].file_bytes * k * len(p8.moe_layers),
        "per_drive": {}, **sequence_memory(tc),
    }


def format_summary(s: dict) -> str:
    lines = [
        f"model        {s['model_id']}  ({s['family']}, model_type {s['model_type']})",
        f"layers       {s['layers']} ({s['moe_layers']} MoE), {s['experts_per_layer']} experts/layer, "
        f"{s['experts_per_token']} routed per token",
        f"trunk        {_gb(s['trunk_bytes'])} resident as stored; {_gb(s['trunk_bytes_int8'])} at int8, "
        f"{_gb(s['trunk_bytes_bf16'])} at bf16"
        + (" (tensors by format: " + ", ".join(f"{k} {v}" for k, v in sorted(s["trunk_formats"].items())) + ")"
           if s["trunk_formats"] else ""),
        "state        "
        + (f"{_gb(s['recurrent_state_bytes'])} per sequence of recurrent state ({s['recurrent_layers']} KDA "
           f"layers, fixed); " if s["recurrent_layers"] else "")
        + f"{s['cache_kind']}: "
        f"{_gb(s['cache_bytes_per_1k_tokens'])} per 1k tokens in float32 "
        f"({_gb(s['cache_bytes_per_1k_tokens_bf16'])} in bf16)",
        f"context      one sequence's state at 128K tokens {_gb(s['state_bytes_128k'])} in float32 "
        f"({_gb(s['state_bytes_128k_bf16'])} in bf16), at 1M {_gb(s['state_bytes_1m'])} "
        f"({_gb(s['state_bytes_1m_bf16'])})",
        f"experts      {s['expert_files']:,} files x {s['expert_file_bytes']:,} B "
        f"(payload {s['expert_payload_bytes']:,} B, {'/'.join(s['expert_formats'])}) = {_gb(s['expert_bytes'])}",
        f"per token    {_gb(s['streamed_bytes_per_token'])} of routed experts "
        f"({s['experts_per_token']} x {s['moe_layers']} layers) when nothing is cached",
        *([_layout_line(s)] if "placement" in s else []),
        "drives:",
    ]
    if not s["per_drive"]:
        lines[-1] = "drives:      (not packed yet: see 'deltafin pack --plan')"
    for label, d in s["per_drive"].items():
        lines.append(f"  {label:<8} {d['path']}  {d['gbps']:.2f} GB/s  {d['files']:,} files  {_gb(d['bytes'])}")
    return "\n".join(lines)
