"""The store: expert files, manifests, and `pack` of every family over two emulated drives (folders).

Tiny random Hugging Face checkpoints are built in the test (never downloaded); the packed experts are
compared with the checkpoint's own tensors, by their Hugging Face names.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deltafin.errors import (
    CheckpointError,
    DriveError,
    ExpertChecksumError,
    ExpertFileError,
    ManifestError,
    NotEnoughSpaceError,
    UnsupportedArchitectureError,
)
from deltafin.quant import fp8, int4, int8, mxfp4
from deltafin.quant.record import QTensor, dequantize
from deltafin.store import drives as drives_mod
from deltafin.store import expert_file as ef
from deltafin.store import manifest as mf
from deltafin.store.drives import parse_drives
from deltafin.store.families import SUPPORTED
from deltafin.store.model_dir import PackedModel
from deltafin.store.pack import PackOptions, pack
from deltafin.store.verify import verify
from deltafin.tiny import build_tiny

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe_lite", "gpt_oss")
# Expert widths differ from the hidden size, so a transposed expert cannot pass for the right one.
NON_SQUARE = {
    "qwen3_moe": dict(moe_intermediate_size=96),
    "mixtral": dict(intermediate_size=96),
    "olmoe": dict(intermediate_size=96),
    "deepseek_v3": dict(moe_intermediate_size=96),
    "glm4_moe_lite": dict(moe_intermediate_size=96),
    "gpt_oss": dict(intermediate_size=96),
}
ROUTER_SUFFIXES = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight")
K3_SPECS = Path(__file__).resolve().parents[2] / "shared" / "specs" / "kimi-k3"


# ---------------------------------------------------------------- helpers


def _two_drives(root: Path, a: str = "da", b: str = "db"):
    return parse_drives([f"a:{root / a}=2", f"b:{root / b}=1"])


def _pack(src: Path, out: Path, root: Path | None = None, **opts):
    root = root or out.parent
    return pack(str(src), str(out), _two_drives(root), PackOptions(progress=False, **opts))


def _load_all(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _hf_experts(t: dict[str, torch.Tensor], family: str, L: int, e: int) -> dict[str, torch.Tensor]:
    """The checkpoint's weights of expert (L, e), by Hugging Face name, as logical [out, in]."""
    p = f"model.layers.{L}."
    if family == "gpt_oss":  # plain layout: gate_up_proj [E, H, 2I], down_proj [E, I, H] (x @ W)
        x = p + "mlp.experts."
        return {"gate_up": t[x + "gate_up_proj"][e].T, "gate_up_bias": t[x + "gate_up_proj_bias"][e],
                "down": t[x + "down_proj"][e].T, "down_bias": t[x + "down_proj_bias"][e]}
    if family == "mixtral":
        x = f"{p}block_sparse_moe.experts.{e}."
        return {"gate": t[x + "w1.weight"], "up": t[x + "w3.weight"], "down": t[x + "w2.weight"]}
    x = f"{p}mlp.experts.{e}."
    return {"gate": t[x + "gate_proj.weight"], "up": t[x + "up_proj.weight"], "down": t[x + "down_proj.weight"]}


def _expert_files(*roots: Path) -> list[Path]:
    return sorted(p for r in roots for p in r.rglob("*") if p.is_file() and p.name != ".deltafin-owner.json")


def _manifest(out: Path) -> dict:
    return json.loads((out / mf.MANIFEST).read_text())


@pytest.fixture(scope="module")
def family_packs(tmp_path_factory):
    """Every family built tiny and packed once with bf16 experts (int8 trunk by default)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for fam in FAMILIES:
        base = root / fam
        build_tiny(fam, base / "src", seed=7, **NON_SQUARE[fam])
        summary = _pack(base / "src", base / "model", base, experts="bf16")
        out[fam] = (base, summary)
    return out


# ---------------------------------------------------------------- expert files


def _records(seed: int = 0) -> dict[str, QTensor]:
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (96, 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (96, 2), generator=g, dtype=torch.uint8)
    words = torch.randint(-(2**31), 2**31 - 1, (40, 8), generator=g, dtype=torch.int32)
    return {
        "gate": QTensor("mxfp4", (96, 64), packed, scales),
        "up": QTensor("int4g32", (40, 64), words, (torch.rand(40, 2, generator=g) + 0.5).to(torch.bfloat16)),
        "down": QTensor("bf16", (64, 96), (torch.randn(64, 96, generator=g) + 0.1).to(torch.bfloat16)),
        "down_bias": QTensor("f32", (64,), torch.randn(64, generator=g) + 3.0),
    }


def test_expert_file_round_trip_and_4k_alignment():
    recs = _records()
    data = ef.encode(recs, 5, 17)
    assert len(data) % 4096 == 0
    layout, L, e = ef.parse_header(data, "x.dfx")
    assert (L, e) == (5, 17) and layout.file_bytes == len(data)
    assert layout.payload_bytes == sum(r.nbytes for r in recs.values())
    end = ef.HEADER_BYTES
    for t in layout.tensors:
        for s in t.sections:
            assert s.offset % 4096 == 0 and s.offset >= end, (t.name, s)
            assert not any(data[end : s.offset]), "padding between sections must be zero"
            end = s.offset + s.nbytes
    assert not any(data[end:])
    back = ef.decode(memoryview(bytearray(data)))
    assert list(back) == list(recs)
    for name, r in recs.items():
        b = back[name]
        assert (b.format, b.shape) == (r.format, r.shape)
        assert torch.equal(b.data, r.data)
        assert (b.scale is None) == (r.scale is None)
        if r.scale is not None:
            assert b.scale.dtype == r.scale.dtype and torch.equal(b.scale, r.scale)
    assert ef.checksum(data) == ef.checksum(ef.encode(recs, 5, 17))  # deterministic bytes


def test_expert_header_layout_kept_per_layout_not_per_expert():
    a, b = ef.encode(_records(), 5, 17), ef.encode(_records(), 61, 3)
    la, L, e = ef.parse_header(a, "a.dfx")
    lb, L2, e2 = ef.parse_header(b, "b.dfx")
    assert (L, e, L2, e2) == (5, 17, 61, 3)
    assert lb is la  # parsed once, the second expert's header takes it
    # an edit of the layout is a header of its own: parsed and checked, not taken from the first
    wrong = a.replace(b'"offset":4096', b'"offset":4097', 1)
    with pytest.raises(ExpertFileError, match=r"w.dfx: corrupt expert header"):
        ef.parse_header(wrong, "w.dfx")
    # a second "layer" field: JSON's reading (the last one) decides, never the kept layout's shortcut
    n = struct.unpack("<I", a[4:8])[0]
    text = a[8 : 8 + n].replace(b'"file_bytes"', b'"layer":9,"file_bytes"', 1)
    twice = a[:4] + struct.pack("<I", len(text)) + text + a[8 + len(text) :]
    assert ef.parse_header(twice, "t.dfx")[1:] == (9, 17)
    assert ef.parse_header(twice, "t.dfx")[1:] == (9, 17)


def test_expert_file_errors_name_the_file(tmp_path):
    data = bytearray(ef.encode(_records(), 1, 2))
    where = str(tmp_path / "L001" / "E0002.dfx")
    bad = bytearray(data)
    bad[:4] = b"GGUF"
    with pytest.raises(ExpertFileError, match=rf"{where}: not a Deltafin expert file \(bad magic b'GGUF'\)"):
        ef.decode(memoryview(bad), where=where)
    v2 = bytes(data).replace(b'"version":1', b'"version":2', 1)
    with pytest.raises(ExpertFileError, match=rf"{where}: expert file version 2 is not 1"):
        ef.parse_header(v2, where)
    with pytest.raises(ExpertFileError, match=rf"{where}: truncated \({len(data) - 4096} of {len(data)} bytes\)"):
        ef.decode(memoryview(data[:-4096]), where=where)
    with pytest.raises(ExpertFileError, match=rf"{where}: corrupt expert header"):
        ef.parse_header(bytes(data[:8]) + b"{" * 4088, where)
    wrong = bytes(data).replace(b'"offset":4096', b'"offset":4097', 1)  # valid JSON, impossible layout
    with pytest.raises(ExpertFileError, match=rf"{where}: corrupt expert header"):
        ef.parse_header(wrong, where)
    with pytest.raises(ExpertChecksumError, match=rf"{where}: checksum mismatch \(expected 0000000000000000, got "):
        ef.check(data, "0" * 16, where, "repack it")


def test_read_expert_on_disk_errors_name_the_file(packed_copy):
    model = PackedModel.open(str(packed_copy / "model"))
    p = Path(model.expert_path(1, 0))
    raw = bytearray(p.read_bytes())
    p.write_bytes(raw[:-4096])
    with pytest.raises(ExpertChecksumError, match=f"{p}: checksum mismatch"):
        model.read_expert(1, 0)
    with pytest.raises(ExpertFileError, match=f"{p}: truncated"):
        model.read_expert(1, 0, verify=False)
    raw[:4] = b"XXXX"
    p.write_bytes(raw)
    with pytest.raises(ExpertFileError, match=f"{p}: not a Deltafin expert file"):
        model.read_expert(1, 0, verify=False)


# ---------------------------------------------------------------- manifest


@pytest.fixture
def packed_copy(family_packs, tmp_path):
    """A private pack of the qwen3_moe checkpoint (tests edit and break it): tmp/m/{src,model,da,db}."""
    base, _ = family_packs["qwen3_moe"]
    shutil.copytree(base / "src", tmp_path / "m" / "src")
    _pack(tmp_path / "m" / "src", tmp_path / "m" / "model", tmp_path / "m", experts="bf16")
    return tmp_path / "m"


def _edit_manifest(model: Path, edit) -> None:
    doc = _manifest(model)
    edit(doc)
    (model / mf.MANIFEST).write_text(json.dumps(doc))


def test_manifest_validation_errors(packed_copy):
    model = packed_copy / "model"
    mf.load(str(model))  # the untouched copy is valid
    where = str(model / mf.MANIFEST)

    _edit_manifest(model, lambda d: d.update(version=99))
    with pytest.raises(ManifestError, match=rf"{where}: manifest version 99 is not supported .*repack"):
        mf.load(str(model))
    _edit_manifest(model, lambda d: d.update(version=mf.VERSION))

    _edit_manifest(model, lambda d: d.pop("experts"))
    with pytest.raises(ManifestError, match=rf"{where}: manifest is missing field\(s\) experts; repack the model"):
        mf.load(str(model))


def test_manifest_drive_index_out_of_range(packed_copy):
    model = packed_copy / "model"

    def edit(d):
        d["experts"]["locations"]["2"][3] = [5]

    _edit_manifest(model, edit)
    with pytest.raises(ManifestError, match="layer 2 names a drive that is not in the drive list"):
        PackedModel.open(str(model))


def test_manifest_that_is_not_an_object(tmp_path):
    (tmp_path / mf.MANIFEST).write_text("[1, 2, 3]\n")
    with pytest.raises(ManifestError, match="not a Deltafin model manifest"):
        mf.load(str(tmp_path))


@pytest.mark.parametrize("bad", [{"label": "a"}, {"label": "a", "path": "/x", "gbps": "fast"}, "d0"])
def test_manifest_malformed_drive_entry(packed_copy, bad):
    model = packed_copy / "model"
    _edit_manifest(model, lambda d: d["drives"].__setitem__(0, bad))
    with pytest.raises(ManifestError, match="drive entry"):
        mf.load(str(model))


def test_resolve_under_refuses_escapes(tmp_path):
    root = tmp_path / "drive"
    (root / "m" / "L001").mkdir(parents=True)
    assert mf.resolve_under(str(root), "m/L001/E0000.dfx") == str(root / "m" / "L001" / "E0000.dfx")
    with pytest.raises(ManifestError, match=r"path '\.\./outside/E0000\.dfx' escapes its drive root"):
        mf.resolve_under(str(root), "../outside/E0000.dfx")
    with pytest.raises(ManifestError, match=r"path '/etc/passwd' escapes its drive root"):
        mf.resolve_under(str(root), "/etc/passwd")
    (tmp_path / "elsewhere").mkdir()
    (root / "m" / "L002").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ManifestError, match=r"path 'm/L002/E0000\.dfx' resolves outside its drive root"):
        mf.resolve_under(str(root), "m/L002/E0000.dfx")
    with pytest.raises(ManifestError, match="model id '../m' is not a safe folder name"):
        mf.check_model_id("../m")


def test_manifest_paths_cannot_escape(packed_copy):
    model = packed_copy / "model"
    _edit_manifest(model, lambda d: d.update(config="../../../etc/passwd"))
    with pytest.raises(ManifestError, match="escapes its drive root"):
        PackedModel.open(str(model))
    _edit_manifest(model, lambda d: d.update(config="config.json", model_id="../../etc"))
    with pytest.raises(ManifestError, match="not a safe folder name"):
        PackedModel.open(str(model))


# ---------------------------------------------------------------- pack: every family


@pytest.mark.parametrize("family", FAMILIES)
def test_pack_family_over_two_drives(family_packs, family):
    base, summary = family_packs[family]
    model = PackedModel.open(str(base / "model"))
    src = _load_all(base / "src")
    assert model.family == ("deepseek_v3" if family == "glm4_moe_lite" else family)
    E = model.num_experts
    assert model.moe_layers and E >= 4

    # every expert file exists exactly once, on the drive the manifest names; nothing else is there
    expected = {}
    for L in model.moe_layers:
        for e in range(E):
            (d,) = model.locations(L, e)
            expected[Path(model.expert_path(L, e, d))] = model.file_bytes(L)
    found = _expert_files(base / "da", base / "db")
    assert found == sorted(expected) and len(found) == len(model.moe_layers) * E
    assert all(p.stat().st_size == n for p, n in expected.items())

    # per layer, bytes split by read rate 2:1, within one expert file of the exact share
    for L in model.moe_layers:
        on_a = sum(model.file_bytes(L) for e in range(E) if model.locations(L, e) == [0])
        share = on_a / (model.file_bytes(L) * E)
        assert abs(share - 2 / 3) <= 1 / E + 1e-9, (L, share)
        assert 0 < on_a < model.file_bytes(L) * E
    assert summary.per_drive["a"]["bytes"] > summary.per_drive["b"]["bytes"] > 0

    rep = verify(model)
    assert rep.ok and rep.files == len(found), rep.bad

    # experts='bf16': the packed experts are the checkpoint's weights, exactly
    for L in model.moe_layers:
        for e in range(E):
            got = model.read_expert(L, e)
            want = _hf_experts(src, family, L, e)
            assert list(got) == list(want)
            for role, w in want.items():
                fmt = "f32" if role.endswith("_bias") else "bf16"  # biases keep their checkpoint dtype
                assert got[role].format == fmt and got[role].shape == tuple(w.shape), (L, e, role)
                assert torch.equal(dequantize(got[role]), w.float()), (L, e, role)
    _check_trunk(model, src, family)


def _check_trunk(model: PackedModel, src: dict[str, torch.Tensor], family: str) -> None:
    trunk = model.trunk_records()
    expert_names = {n for n in src if ".experts." in n and ".shared_experts." not in n}
    assert set(trunk) == set(src) - expert_names
    routers = [n for n in trunk if n.endswith(ROUTER_SUFFIXES)]
    assert len(routers) == len(model.moe_layers)
    n_int8 = 0
    for name, rec in trunk.items():
        w = src[name]
        if name in routers or w.dim() != 2 or min(w.shape) == 1:
            assert rec.format in ("f32", "bf16"), name  # routers and vectors stay plain, exactly
            assert torch.equal(dequantize(rec), w.float()), name
        else:
            assert rec.format == "int8", name
            q, s = int8.quantize(w)
            assert torch.equal(rec.data, q) and torch.equal(rec.scale, s), name
            assert bool(((dequantize(rec) - w).abs() <= s[:, None] / 2 * (1 + 1e-4)).all()), name
            n_int8 += 1
    assert n_int8 >= 4 * model.text_config["num_hidden_layers"]


def test_packed_dir_holds_config_and_no_leftovers(family_packs):
    base, summary = family_packs["deepseek_v3"]
    out = base / "model"
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" in names and mf.MANIFEST in names and "trunk" in names
    assert "pack-state.json" not in names
    assert not [p for p in base.rglob("*") if ".tmp-" in p.name]
    assert json.loads((out / "config.json").read_text()) == json.loads((base / "src" / "config.json").read_text())
    assert summary.written == summary.expert_files and summary.skipped == 0
    assert summary.peak_rss_bytes > 0


# ---------------------------------------------------------------- imports: FP8, compressed-tensors, gpt-oss MXFP4


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A DeepSeek-V3 checkpoint in the released layout: FP8 e4m3 weights + weight_scale_inv [128x128 blocks]."""
    root = tmp_path_factory.mktemp("fp8")
    build_tiny("deepseek_v3", root / "bf16", seed=3, hidden_size=160, moe_intermediate_size=192, intermediate_size=192)
    tensors = _load_all(root / "bf16")
    out = {}
    for name, w in tensors.items():
        keep = w.dim() != 2 or name.endswith(".mlp.gate.weight") or "embed_tokens" in name or "lm_head" in name
        if keep:
            out[name] = w.to(torch.bfloat16)
        else:
            out[name], out[name + "_scale_inv"] = fp8.quantize(w)
    src = root / "src"
    src.mkdir()
    save_file(out, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((root / "bf16" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    return src, out


def _fp8_dense(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return fp8.dequantize(t[name], t[name + "_scale_inv"])


def test_pack_fp8_checkpoint_experts_become_mxfp4_or_bf16(fp8_checkpoint, tmp_path):
    src, t = fp8_checkpoint
    assert t["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(t["model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv"].shape) == (2, 2)  # [192, 160]

    _pack(src, tmp_path / "m4", tmp_path / "d4")
    m4 = PackedModel.open(str(tmp_path / "m4"))
    _pack(src, tmp_path / "m16", tmp_path / "d16", experts="bf16", trunk="bf16")
    m16 = PackedModel.open(str(tmp_path / "m16"))
    assert m4.moe_layers == m16.moe_layers == [1, 2]
    for L in m4.moe_layers:
        for e in range(m4.num_experts):
            q4, q16 = m4.read_expert(L, e), m16.read_expert(L, e)
            for role, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                w = _fp8_dense(t, f"model.layers.{L}.mlp.experts.{e}.{hf}.weight")
                packed, scales = mxfp4.quantize(w)
                assert q4[role].format == "mxfp4" and q4[role].shape == tuple(w.shape)
                assert torch.equal(q4[role].data, packed) and torch.equal(q4[role].scale, scales), (L, e, role)
                assert q16[role].format == "bf16" and torch.equal(q16[role].data, w.to(torch.bfloat16))

    # trunk: FP8 weights dequantized on import (bf16 as DeepSeek's reference), then int8 by default
    name = "model.layers.0.mlp.gate_proj.weight"
    ref = _fp8_dense(t, name).to(torch.bfloat16)
    tr16, tr8 = m16.trunk_records(), m4.trunk_records()
    assert tr16[name].format == "bf16" and torch.equal(tr16[name].data, ref)
    q, s = int8.quantize(ref)
    assert tr8[name].format == "int8" and torch.equal(tr8[name].data, q) and torch.equal(tr8[name].scale, s)
    assert not [n for n in tr16 if n.endswith("_scale_inv")]
    router = "model.layers.1.mlp.gate.weight"
    assert tr8[router].format == "bf16" and torch.equal(tr8[router].data, t[router])


def _k3_config(tiny: dict) -> dict:
    """The real K3 config.json scaled down (a hand-written skeleton in the same layout if specs are absent)."""
    if (K3_SPECS / "config.json").exists():
        cfg = json.loads((K3_SPECS / "config.json").read_text())
    else:
        cfg = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": {
            "model_type": "kimi_linear", "hidden_act": "situ", "attn_res_block_size": 2, "num_attention_heads": 2,
            "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}}
    cfg["text_config"].update(tiny)
    n = tiny["num_hidden_layers"]  # the layer schedule covers the layers the checkpoint has
    la = cfg["text_config"].setdefault("linear_attn_config", {"num_heads": 2, "head_dim": 32})
    la.update(kda_layers=list(range(1, n)), full_attn_layers=[n])
    return cfg


@pytest.fixture(scope="module")
def k3_checkpoint(tmp_path_factory):
    """A tiny checkpoint with Kimi K3's names: MXFP4 experts as compressed-tensors bytes, two text shards
    (one per layer group), and vision tensors in a shard of their own."""
    src = tmp_path_factory.mktemp("k3") / "src"
    src.mkdir()
    D, I, LAT, E, NL = 64, 96, 64, 4, 3
    tiny = dict(hidden_size=D, vocab_size=128, num_hidden_layers=NL, intermediate_size=128,
                moe_intermediate_size=I, routed_expert_hidden_size=LAT, num_experts=E, num_experts_per_token=2,
                num_shared_experts=1, first_k_dense_replace=1)
    g = torch.Generator().manual_seed(11)

    def bf(*shape):
        return (torch.randn(*shape, generator=g) * 0.05 + 0.01).to(torch.bfloat16)

    def u8(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8)

    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00003.safetensors": {},
                                                  "model-00002-of-00003.safetensors": {},
                                                  "model-00003-of-00003.safetensors": {}}
    s1, s2, s3 = shards.values()
    lm = "language_model."
    s1[lm + "model.embed_tokens.weight"] = bf(128, D)
    s1[lm + "lm_head.weight"] = bf(128, D)
    s1[lm + "model.norm.weight"] = bf(D)
    s1[lm + "model.layers.0.mlp.gate_proj.weight"] = bf(128, D)
    s1[lm + "model.layers.0.mlp.up_proj.weight"] = bf(128, D)
    s1[lm + "model.layers.0.mlp.down_proj.weight"] = bf(D, 128)
    for L in range(NL):
        shard = s1 if L == 0 else s2
        p = f"{lm}model.layers.{L}."
        shard[p + "input_layernorm.weight"] = bf(D)
        shard[p + "self_attn.q_proj.weight"] = bf(D, D)
        shard[p + "self_attn.A_log"] = torch.randn(128, generator=g)
        shard[p + "self_attn.q_conv1d.weight"] = torch.randn(D, 1, 4, generator=g)
        shard[p + "mlp_res_proj.weight"] = bf(1, D)
        if L == 0:
            continue
        shard[p + "block_sparse_moe.gate.weight"] = bf(E, D)
        shard[p + "block_sparse_moe.gate.e_score_correction_bias"] = torch.randn(E, generator=g)
        shard[p + "block_sparse_moe.routed_expert_down_proj.weight"] = bf(LAT, D)
        shard[p + "block_sparse_moe.shared_experts.gate_proj.weight"] = bf(I, D)
        for e in range(E):
            for w, (o, i) in (("w1", (I, LAT)), ("w2", (LAT, I)), ("w3", (I, LAT))):
                x = f"{p}block_sparse_moe.experts.{e}.{w}."
                shard[x + "weight_packed"] = u8(o, i // 2)
                shard[x + "weight_scale"] = u8(o, i // 32, lo=110, hi=140)
    s3["vision_tower.encoder.blocks.0.wqkv.weight"] = bf(48, 16)
    s3["vision_tower.patch_embed.proj.weight"] = bf(16, 3, 2, 2)
    s3["mm_projector.proj.0.weight"] = bf(D, 16)
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(src / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps(_k3_config(tiny)))
    # a small valid rank file (pack checks it against the vocabulary, then copies it)
    (src / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(16)))
    tensors = {n: t for s in shards.values() for n, t in s.items()}
    return src, tensors


def test_pack_k3_compressed_tensors_mxfp4_is_byte_identical(k3_checkpoint, tmp_path):
    src, t = k3_checkpoint
    s = _pack(src, tmp_path / "model", tmp_path)  # defaults: released MXFP4 bytes copied unchanged
    model = PackedModel.open(str(tmp_path / "model"))
    assert model.family == "kimi_k3" and model.moe_layers == [1, 2] and model.num_experts == 4
    assert model.doc["skipped"] == 3  # vision_tower.* and mm_projector.*
    for L in model.moe_layers:
        for e in range(model.num_experts):
            path = Path(model.expert_path(L, e))
            raw = path.read_bytes()
            layout, _, _ = ef.parse_header(raw, str(path))
            got = model.read_expert(L, e)
            assert list(got) == ["gate", "up", "down"]
            for tl, w in zip(layout.tensors, ("w1", "w3", "w2"), strict=True):
                x = f"language_model.model.layers.{L}.block_sparse_moe.experts.{e}.{w}."
                data, scale = tl.sections
                assert raw[data.offset : data.offset + data.nbytes] == t[x + "weight_packed"].numpy().tobytes()
                assert raw[scale.offset : scale.offset + scale.nbytes] == t[x + "weight_scale"].numpy().tobytes()
                rec = got[tl.name]
                assert rec.format == "mxfp4" and rec.shape == (t[x + "weight_packed"].shape[0],
                                                               t[x + "weight_packed"].shape[1] * 2)
    assert model.read_expert(1, 0)["down"].shape == (64, 96)
    trunk = model.trunk_records()
    want = {n[len("language_model."):] for n in t if n.startswith("language_model.") and ".experts." not in n}
    assert set(trunk) == want
    assert trunk["model.layers.1.block_sparse_moe.gate.weight"].format == "bf16"
    assert trunk["model.layers.1.self_attn.q_proj.weight"].format == "int8"
    assert trunk["model.layers.1.self_attn.q_conv1d.weight"].format == "f32"
    assert (tmp_path / "model" / "tiktoken.model").exists()
    assert verify(model).ok and s.expert_files == 8


def _int4_checkpoint(tmp_path, wrong_in: int = 0):
    """Kimi K2-Thinking layout (model_type kimi_k2 = DeepSeek-V3) with compressed-tensors INT4 group-32
    experts; ``wrong_in`` makes every weight_shape disagree with its packed data by that many columns."""
    build_tiny("deepseek_v3", tmp_path / "bf16", seed=5)
    out = {}
    for name, w in _load_all(tmp_path / "bf16").items():
        if ".mlp.experts." in name:
            packed, s = int4.quantize_ref(w.numpy())
            base = name[: -len("weight")]
            out[base + "weight_packed"] = torch.from_numpy(packed)
            out[base + "weight_scale"] = torch.from_numpy(s).to(torch.bfloat16)
            out[base + "weight_shape"] = torch.tensor([w.shape[0], w.shape[1] - wrong_in], dtype=torch.int64)
        else:
            out[name] = w.to(torch.bfloat16)
    src = tmp_path / "src"
    src.mkdir()
    save_file(out, str(src / "model.safetensors"))
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32,
                                                                            "symmetric": True, "type": "int"}}}}
    (src / "config.json").write_text(json.dumps(cfg))
    return src, out


def test_pack_int4_pack_quantized_experts_are_kept(tmp_path):
    """INT4 group-32 experts stay int4g32, byte for byte."""
    src, out = _int4_checkpoint(tmp_path)
    _pack(src, tmp_path / "model", tmp_path)
    model = PackedModel.open(str(tmp_path / "model"))
    for L in model.moe_layers:
        for e in range(model.num_experts):
            got = model.read_expert(L, e)
            for role, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                x = f"model.layers.{L}.mlp.experts.{e}.{hf}."
                rec = got[role]
                assert rec.format == "int4g32" and rec.shape == tuple(out[x + "weight_shape"].tolist())
                assert torch.equal(rec.data, out[x + "weight_packed"])
                assert rec.scale.dtype == torch.bfloat16 and torch.equal(rec.scale, out[x + "weight_scale"])
                want = int4.dequantize_ref(out[x + "weight_packed"].numpy(), out[x + "weight_scale"].float().numpy())
                assert np.array_equal(dequantize(rec).numpy(), want)


def test_pack_int4_weight_shape_disagreement_is_an_error(tmp_path):
    src, _ = _int4_checkpoint(tmp_path, wrong_in=3)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight_shape"):
        _pack(src, tmp_path / "model", tmp_path)


def test_pack_gpt_oss_mxfp4_blocks_are_byte_identical(tmp_path):
    tf_mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    build_tiny("gpt_oss", tmp_path / "plain", seed=9, intermediate_size=96)
    t = _load_all(tmp_path / "plain")
    g = torch.Generator().manual_seed(2)
    out = {}
    for name, w in t.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            E, inn, o = w.shape  # plain [E, in, out]
            out[name + "_blocks"] = torch.randint(0, 256, (E, o, inn // 32, 16), generator=g, dtype=torch.uint8)
            out[name + "_scales"] = torch.randint(115, 135, (E, o, inn // 32), generator=g, dtype=torch.uint8)
        else:
            out[name] = w.to(torch.bfloat16)
    (tmp_path / "src").mkdir()
    save_file(out, str(tmp_path / "src" / "model.safetensors"))
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    _pack(tmp_path / "src", tmp_path / "model", tmp_path)
    model = PackedModel.open(str(tmp_path / "model"))
    x = "model.layers.{}.mlp.experts.{}"
    for L in model.moe_layers:
        ref = {p: tf_mxfp4.convert_moe_packed_tensors(out[x.format(L, p) + "_blocks"], out[x.format(L, p) + "_scales"],
                                                      dtype=torch.float32) for p in ("gate_up_proj", "down_proj")}
        for e in range(model.num_experts):
            got = model.read_expert(L, e)
            assert list(got) == ["gate_up", "gate_up_bias", "down", "down_bias"]
            for role, p in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
                blocks, scales = out[x.format(L, p) + "_blocks"][e], out[x.format(L, p) + "_scales"][e]
                rec = got[role]
                assert rec.format == "mxfp4" and rec.shape == (blocks.shape[0], blocks.shape[1] * 32)
                assert rec.data.numpy().tobytes() == blocks.numpy().tobytes()
                assert rec.scale.numpy().tobytes() == scales.numpy().tobytes()
                assert torch.equal(dequantize(rec), ref[p][e].T)  # transformers' dequantizer, [in, out]
            assert torch.equal(got["down_bias"].data, out[x.format(L, "down_proj") + "_bias"][e])
    assert model.read_expert(0, 0)["gate_up"].shape == (192, 64)


# ---------------------------------------------------------------- resumable, crash-safe, repair


def _checksums(model_dir: Path) -> tuple[dict, dict]:
    doc = _manifest(model_dir)
    return doc["experts"]["checksums"], doc["experts"]["locations"]


def test_pack_resumes_after_a_crash_and_matches_an_uninterrupted_pack(tmp_path, monkeypatch):
    """Killed after N expert files (the Nth half written): no manifest, no partial file under a final
    name; the re-run writes only what is missing and ends identical to a pack that never stopped.
    The drives' rates are measured (and differ between the runs): the re-run keeps the first placement."""
    src = tmp_path / "src"
    build_tiny("qwen3_moe", src, seed=7, num_experts=40)  # several write batches per layer
    _pack(src, tmp_path / "ref" / "model", tmp_path / "ref", experts="mxfp4")
    ref_sums, ref_locs = _checksums(tmp_path / "ref" / "model")
    total = sum(len(v) for v in ref_sums.values())

    rates = iter([2.0, 1.0, 0.5, 3.0])  # the first run measures 2:1, a re-run would measure 1:6
    monkeypatch.setattr("deltafin.store.pack_layout.measured_rates", lambda ds: {d.label: next(rates) for d in ds})
    run = tmp_path / "run"
    drives = parse_drives([f"a:{run / 'da'}", f"b:{run / 'db'}"])
    out = run / "model"
    real_write = ef.write_tmp
    calls, written = [], []
    lock = threading.Lock()
    N = 21

    def crashing(path, data, *args, **kwargs):
        with lock:
            calls.append(path)
            n = len(calls)
        if n == N:  # dies half way through writing this file
            with open(f"{path}.tmp-{os.getpid()}", "wb") as f:
                f.write(bytes(data)[: len(data) // 2])
            raise OSError(28, "No space left on device (simulated crash)")
        return real_write(path, data, *args, **kwargs)

    monkeypatch.setattr(ef, "write_tmp", crashing)
    with pytest.raises(OSError, match="simulated crash"):
        pack(str(src), str(out), drives, PackOptions(experts="mxfp4", progress=False))
    assert len(calls) >= N
    assert not (out / mf.MANIFEST).exists() and (out / "pack-state.json").exists()
    with pytest.raises(ManifestError, match="interrupted: re-run 'deltafin pack' to finish it"):
        PackedModel.open(str(out))
    files = _expert_files(run / "da", run / "db")
    finals = [p for p in files if p.name.endswith(".dfx")]
    assert 0 < len(finals) < total
    others = [p for p in files if p not in finals]
    assert others and all(".tmp-" in p.name for p in others)
    for p in finals:  # every file under a final name is complete and correct
        L, e = int(p.parent.name[1:]), int(p.stem[1:])
        assert ef.checksum(p.read_bytes()) == ref_sums[str(L)][e], p

    def counting(path, data, *args, **kwargs):
        with lock:
            written.append(path)
        return real_write(path, data, *args, **kwargs)

    monkeypatch.setattr(ef, "write_tmp", counting)
    s = pack(str(src), str(out), drives, PackOptions(experts="mxfp4", progress=False))
    assert s.written == len(written) == total - len(finals)  # only the missing files
    assert s.skipped == len(finals)
    assert not {Path(p) for p in written} & set(finals)
    assert _checksums(out) == (ref_sums, ref_locs)  # same bytes, same placement as the first run
    assert [d["gbps"] for d in _manifest(out)["drives"]] == [2.0, 1.0]
    assert not (out / "pack-state.json").exists()
    assert not [p for p in run.rglob("*") if ".tmp-" in p.name], "temporary files were left behind"
    assert verify(PackedModel.open(str(out))).ok


def test_verify_names_bad_files_and_repair_rewrites_only_those(packed_copy):
    model_dir = packed_copy / "model"
    model = PackedModel.open(str(model_dir))
    corrupt, gone = Path(model.expert_path(1, 2)), Path(model.expert_path(2, 5))
    raw = bytearray(corrupt.read_bytes())
    raw[ef.HEADER_BYTES + 100] ^= 0x01  # one bit of the payload
    corrupt.write_bytes(raw)
    gone.unlink()
    rep = verify(model)
    assert not rep.ok
    bad = dict(rep.bad)
    assert set(bad) == {str(corrupt), str(gone)}
    assert bad[str(corrupt)].startswith("checksum mismatch") and bad[str(gone)] == "missing"

    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in _expert_files(packed_copy / "da", packed_copy / "db")}
    trunk_before = {p: p.stat().st_mtime_ns for p in (model_dir / "trunk").iterdir()}
    s = pack(str(packed_copy / "src"), str(model_dir), [], PackOptions(experts="bf16", repair=True, progress=False))
    assert s.written == 2 and s.repaired == 2 and s.skipped == s.expert_files - 2
    after = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in _expert_files(packed_copy / "da", packed_copy / "db")}
    assert set(after) == set(before) | {gone}
    changed = {p for p in after if before.get(p) != after[p]}
    assert changed == {corrupt, gone}
    assert {p: p.stat().st_mtime_ns for p in (model_dir / "trunk").iterdir()} == trunk_before
    assert verify(PackedModel.open(str(model_dir))).ok


def test_rerun_of_a_finished_pack_writes_nothing(packed_copy):
    s = pack(str(packed_copy / "src"), str(packed_copy / "model"), [], PackOptions(experts="bf16", progress=False))
    assert s.written == 0 and s.skipped == s.expert_files


def test_repack_with_other_settings_drops_the_old_manifest_first(packed_copy, monkeypatch):
    out = packed_copy / "model"

    def boom(*a, **k):
        assert not (out / mf.MANIFEST).exists(), "old manifest still names files being rewritten"
        raise OSError(5, "stop here")

    monkeypatch.setattr(ef, "write_tmp", boom)
    with pytest.raises(OSError, match="stop here"):
        pack(str(packed_copy / "src"), str(out), [], PackOptions(experts="mxfp4", progress=False))


# ---------------------------------------------------------------- drives and checkpoint errors


def test_not_enough_space_names_the_drive(family_packs, tmp_path, monkeypatch):
    base, _ = family_packs["olmoe"]
    real = drives_mod.free_bytes
    monkeypatch.setattr(drives_mod, "free_bytes",
                        lambda p: 10_000 if Path(p).resolve().is_relative_to(tmp_path / "db") else real(p))
    with pytest.raises(NotEnoughSpaceError) as ei:
        _pack(base / "src", tmp_path / "model", tmp_path)
    msg = str(ei.value)
    # the drive folders and the model folder are on one filesystem here: one need against its free space
    assert "drives a, b, model directory (one filesystem, " in msg and "has 10,000 bytes free" in msg
    assert not [p for p in _expert_files(tmp_path) if p.suffix == ".dfx"], "nothing is written before the check"
    assert not (tmp_path / "model" / mf.MANIFEST).exists()

    monkeypatch.setattr(drives_mod, "free_bytes", real)  # with the space there, the same pack goes through
    _pack(base / "src", tmp_path / "model", tmp_path)
    experts = sum(p.stat().st_size for p in _expert_files(tmp_path) if p.suffix == ".dfx")
    need = int(msg.split(" needs ")[1].split(" bytes")[0].replace(",", ""))
    assert experts < need < 2 * experts  # the expert files on both drives plus the trunk


def test_unwritable_drive(family_packs, tmp_path):
    base, _ = family_packs["olmoe"]
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as root: chmod does not make a folder unwritable here")
        with pytest.raises(DriveError, match=rf"drive b \({ro}\) is not writable: .*check the mount and permissions"):
            pack(str(base / "src"), str(tmp_path / "model"),
                 parse_drives([f"a:{tmp_path / 'da'}=2", f"b:{ro}=1"]), PackOptions(progress=False))
    finally:
        ro.chmod(0o755)


def test_drive_that_cannot_be_created(family_packs, tmp_path):
    """Unwritable even for root: the drive path runs through a regular file."""
    base, _ = family_packs["olmoe"]
    (tmp_path / "file").write_text("x")
    bad = tmp_path / "file" / "drive"
    with pytest.raises(DriveError, match=rf"drive b \({bad}\) is not writable"):
        pack(str(base / "src"), str(tmp_path / "model"), parse_drives([f"a:{tmp_path / 'da'}=2", f"b:{bad}=1"]),
             PackOptions(progress=False))


def test_unsupported_model_type_lists_supported(tmp_path):
    (tmp_path / "src").mkdir()
    save_file({"model.embed_tokens.weight": torch.ones(4, 4)}, str(tmp_path / "src" / "model.safetensors"))
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "llama4_text"}))
    with pytest.raises(UnsupportedArchitectureError) as ei:
        _pack(tmp_path / "src", tmp_path / "model", tmp_path)
    msg = str(ei.value)
    assert "model_type 'llama4_text' is not supported" in msg
    for name in ("deepseek_v3", "kimi_k2", "glm4_moe_lite", "qwen3_moe", "mixtral", "olmoe", "gpt_oss", "kimi_k3"):
        assert name in msg and name in SUPPORTED


def test_missing_shard_is_named(tmp_path):
    model = build_tiny("mixtral", tmp_path / "one", seed=1)
    model.save_pretrained(str(tmp_path / "src"), max_shard_size="200KB")
    index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    (tmp_path / "src" / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match=rf"{shards[-1]}.*(missing|not on disk).*download"):
        _pack(tmp_path / "src", tmp_path / "model", tmp_path)
    assert not (tmp_path / "da").exists() or not _expert_files(tmp_path / "da")


def test_expert_with_unexpected_shape_is_named(tmp_path):
    build_tiny("olmoe", tmp_path / "ok", seed=1)
    t = _load_all(tmp_path / "ok")
    bad = "model.layers.2.mlp.experts.5.up_proj.weight"
    t[bad] = t[bad][:, :32].contiguous()
    (tmp_path / "src").mkdir()
    save_file(t, str(tmp_path / "src" / "model.safetensors"))
    shutil.copy(tmp_path / "ok" / "config.json", tmp_path / "src" / "config.json")
    with pytest.raises(CheckpointError, match=rf"{bad}(:| is) .*\[64, 32\].*expected .*\[64, 64\]"):
        _pack(tmp_path / "src", tmp_path / "model", tmp_path)


def test_missing_expert_tensor_is_named(tmp_path):
    build_tiny("olmoe", tmp_path / "ok", seed=1)
    t = _load_all(tmp_path / "ok")
    del t["model.layers.1.mlp.experts.3.down_proj.weight"]
    (tmp_path / "src").mkdir()
    save_file(t, str(tmp_path / "src" / "model.safetensors"))
    shutil.copy(tmp_path / "ok" / "config.json", tmp_path / "src" / "config.json")
    with pytest.raises(CheckpointError, match=r"layer 1 expert 3: no down tensor"):
        _pack(tmp_path / "src", tmp_path / "model", tmp_path)


def test_drive_moved_needs_drive_map(packed_copy, tmp_path):
    model_dir = packed_copy / "model"
    moved = tmp_path / "new-mount"
    (packed_copy / "db").rename(moved)
    with pytest.raises(DriveError, match=rf"drive b: {packed_copy / 'db'} holds no .* --drive-map b=/new/mount/point"):
        PackedModel.open(str(model_dir))
    model = PackedModel.open(str(model_dir), drive_map={"b": str(moved)})
    on_b = [(L, e) for L in model.moe_layers for e in range(model.num_experts) if model.locations(L, e) == [1]]
    assert on_b and model.expert_path(*on_b[0]).startswith(str(moved))
    model.read_expert(*on_b[0])
    assert verify(model).ok
    with pytest.raises(ManifestError, match=r"unknown drive label\(s\) \['z'\]"):
        PackedModel.open(str(model_dir), drive_map={"b": str(moved), "z": "/tmp"})
