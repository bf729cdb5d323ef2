"""Tiny random models of the families added beside the original six (Kimi K2.5, GLM-4.5, MiniMax-M2), built
from transformers' own config classes and saved with save_pretrained, and the checks every family's test file
runs on them: greedy tokens and prompt logits of the streaming engine against transformers (float32, lossless
codecs), the prompt cache, batching, and the fast path's teacher-forced agreement."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from deltafin.runtime.engine import Engine, EngineOptions
from deltafin.runtime.prompt_cache import PromptCache
from deltafin.store.drives import parse_drives
from deltafin.store.pack import PackOptions, pack
from deltafin.tiny import TINY, randomise

LOSSLESS = PackOptions(experts="bf16", trunk="bf16", progress=False)
DEFAULT = PackOptions(progress=False)  # int8 trunk, MXFP4 experts (INT4 kept as released)
NEW_TOKENS = 32

NEW_TINY: dict[str, dict] = {
    "glm4_moe": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                     n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=256),
    "minimax_m2": dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                       num_experts_per_tok=2, rotary_dim=8, max_position_embeddings=256,
                       # said twice: transformers 5.17 reads the partial RoPE from rope_parameters only
                       rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}),
    "qwen3_next": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
                       max_position_embeddings=256),
    # index_topk below the test prompts' length, so the indexer's choice matters
    "deepseek_v32": {**TINY["deepseek_v3"], "index_topk": 4, "index_n_heads": 2, "index_head_dim": 16},
    "glm_moe_dsa": {**TINY["glm4_moe_lite"], "index_topk": 4, "index_n_heads": 2, "index_head_dim": 16,
                    "mlp_layer_types": ["dense", "sparse", "sparse"], "indexer_types": ["full", "shared", "full"]},
    # the text model's settings; the vision tower is one small block
    "kimi_k25": dict(text_config={**TINY["deepseek_v3"], "model_type": "deepseek_v3"},
                     vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=2),
                     projection_hidden_size=32),
}
# window 8, CSA every 4 tokens with the indexer's top 4, HCA every 16: a 40-token prompt and its 32 new tokens run
# every kind of layer past its window, its top k and several compressed entries; layer 0 hash-routed; 3 Sinkhorn
# iterations, so that each one counts (at transformers' 20 the matrix has converged: one step less changes 7e-6)
# and 8 indexer heads: with 2, a quarter of the entries score exactly 0 (every head's relu 0) and torch.topk breaks
# those ties by the row's length, so a chunked prefill could choose otherwise than a one-shot one
NEW_TINY["deepseek_v4"] = dict(
    vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
    q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=8, o_groups=2, o_lora_rank=16, index_n_heads=8,
    index_head_dim=16, index_topk=4, sliding_window=8, partial_rotary_factor=0.25, max_position_embeddings=512,
    hc_sinkhorn_iters=3,  # transformers default 20 has converged: one step less would change no test
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe", "moe", "moe"])
NEW_TINY["qwen3_5_moe"] = dict(text_config={k: v for k, v in NEW_TINY["qwen3_next"].items()},
                               vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                  out_hidden_size=64))


def build(model_type: str, path: Path, seed: int = 0, like: str | None = None, **overrides) -> torch.nn.Module:
    """Build, randomise and save a tiny ``model_type`` (with the settings of ``like``'s tiny model when given);
    returns the transformers model (the reference)."""
    import transformers

    torch.manual_seed(seed)
    kw = {**(NEW_TINY | TINY)[like or model_type], **overrides}
    for k in ("eos_token_id", "bos_token_id", "pad_token_id"):
        kw.setdefault(k, None)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    if model_type == "kimi_k25":
        from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

        model = Kimi_K25ForConditionalGeneration(cfg).eval()
    elif model_type == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

        model = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomise(model)
    _hash_tables(model, cfg)
    model.save_pretrained(str(path))
    return model


def _hash_tables(model: torch.nn.Module, cfg) -> None:
    """DeepSeek-V4's hash-routed layers: each token's k distinct experts at random (transformers leaves zeros)."""
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            E = cfg.n_routed_experts
            b.copy_(torch.stack([torch.randperm(E)[: b.shape[1]] for _ in range(b.shape[0])]))


def int4_experts(src: Path) -> dict[str, torch.Tensor]:
    """Rewrite a saved checkpoint's routed experts as compressed-tensors pack-quantized INT4 group 32 (as
    Kimi K2.5 is released), after writing the dequantized values back (so the reference reads the same)."""
    from safetensors.torch import load_file, save_file

    from deltafin.quant import int4

    f = src / "model.safetensors"
    sd = load_file(str(f))
    packed = {}
    for name in [n for n in sd if ".experts." in n and n.endswith("_proj.weight")]:
        p, s = int4.quantize_ref(sd[name].float().numpy())
        p, s = torch.from_numpy(p), torch.from_numpy(s).to(torch.bfloat16)
        sd[name] = int4.dequantize(p, s).to(sd[name].dtype)
        base = name.removesuffix("weight")
        packed[base + "weight_packed"] = p
        packed[base + "weight_scale"] = s
        packed[base + "weight_shape"] = torch.tensor(list(sd[name].shape), dtype=torch.int32)
    save_file(sd, str(f), metadata={"format": "pt"})  # the dequantized float copy, for the reference
    return packed


def fp8_blocks(root: Path, pattern: str) -> None:
    """root/float (a saved checkpoint) -> root/src with the 2-D weights whose names match ``pattern`` as FP8 e4m3
    in 128 x 128 blocks with their ``weight_scale_inv`` (MiniMax-M2's and DeepSeek-V3's release format); the scales
    are powers of two, so the dequantized weights are exact in bf16 and root/float is rewritten with them."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    from deltafin.quant import fp8

    shutil.copytree(root / "float", root / "src")
    sd = load_file(str(root / "float" / "model.safetensors"))
    out = {}
    for name, w in sd.items():
        if w.dim() != 2 or re.search(pattern, name) is None:
            out[name] = w
            continue
        _, s = fp8.quantize(w)
        s = torch.exp2(torch.ceil(torch.log2(s)))  # a power of two at least amax / 448
        full = s.repeat_interleave(fp8.BLOCK, 0)[: w.shape[0]].repeat_interleave(fp8.BLOCK, 1)[:, : w.shape[1]]
        out[name], out[name + "_scale_inv"] = (w.float() / full).to(torch.float8_e4m3fn), s
        sd[name] = fp8.dequantize(out[name], s).to(w.dtype)
    save_file(sd, str(root / "float" / "model.safetensors"), metadata={"format": "pt"})
    save_file(out, str(root / "src" / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((root / "src" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                                  "weight_block_size": [fp8.BLOCK, fp8.BLOCK]}
    (root / "src" / "config.json").write_text(json.dumps(cfg))


def kimi_k25(root: Path, **overrides):
    """A tiny Kimi K2.5 with INT4 experts at root/src; returns the reference loaded from the float twin."""
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    build("kimi_k25", root / "float", **overrides)
    packed = int4_experts(root / "float")
    hf = transformers.models.kimi_k25.modeling_kimi_k25.Kimi_K25ForConditionalGeneration.from_pretrained(
        str(root / "float"), dtype=torch.float32).eval()
    shutil.copytree(root / "float", root / "src")
    sd = {n: t for n, t in load_file(str(root / "src" / "model.safetensors")).items()
          if not (".experts." in n and n.endswith("_proj.weight"))}
    save_file({**sd, **packed}, str(root / "src" / "model.safetensors"), metadata={"format": "pt"})
    cfg_path = root / "src" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                      "num_bits": 4, "group_size": 32, "symmetric": True, "type": "int"}}}}
    cfg_path.write_text(json.dumps(cfg))
    return hf


def build_any(family: str, path: Path) -> None:
    """Any family's tiny source checkpoint under path: Kimi K3's own writer, the new families' config classes, or
    deltafin.tiny's."""
    from deltafin.k3_tiny import write_tiny_k3
    from deltafin.tiny import build_tiny

    if family == "kimi_k3":
        write_tiny_k3(path)
    elif family in NEW_TINY:
        build(family, path)
    else:
        build_tiny(family, path)


def copy_packed(root: Path, dst: Path, replicas: bool = False) -> Path:
    """A copy of ``root`` (a packed model under ``model`` and its drives beside it) at ``dst``, the manifest's
    drive paths pointing into the copy; with ``replicas`` every expert also on the other of two drives (its
    primary copy stays first in its locations)."""
    import os
    import shutil

    from deltafin.store import manifest as mf

    shutil.copytree(root, dst, symlinks=True)
    doc = json.load(open(dst / "model" / mf.MANIFEST))
    for d in doc["drives"]:
        d["path"] = str(dst / os.path.basename(d["path"]))
    if replicas:
        for L, locs in doc["experts"]["locations"].items():
            for e, loc in enumerate(locs):
                rel = mf.expert_relpath(doc["model_id"], int(L), e)
                target = mf.resolve_under(doc["drives"][1 - loc[0]]["path"], rel)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copyfile(mf.resolve_under(doc["drives"][loc[0]]["path"], rel), target)
                loc.append(1 - loc[0])
    mf.write_json_atomic(str(dst / "model" / mf.MANIFEST), doc)
    return dst


def pack_to(root: Path, opts: PackOptions = LOSSLESS) -> str:
    pack(str(root / "src"), str(root / "model"), parse_drives([f"{root}/d0=2", f"{root}/d1=1"]), opts)
    return str(root / "model")


def prompt(n: int = 7, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int = NEW_TOKENS) -> tuple[torch.Tensor, list[int]]:
    x = torch.tensor([ids])
    logits = hf(x).logits[0].float()
    out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return logits, out[0, len(ids):].tolist()


def engine(model_dir: str, **kw) -> Engine:
    return Engine(model_dir, EngineOptions(**{"exact": True, "cache_gb": 0.0, "max_len": 128, "threads": 2, **kw}))


def engine_greedy(eng: Engine, ids: list[int], n: int = NEW_TOKENS) -> tuple[torch.Tensor, list[int]]:
    """Expert-major prefill of the whole prompt (all its logits), then n - 1 streamed one-token steps."""
    st = eng.new_state()
    with torch.inference_mode():
        first = eng.step([(torch.tensor(ids, device=eng.device), st)], all_logits=True)[0].cpu()
    tokens = [int(first[-1].argmax())]
    while len(tokens) < n:
        tokens.append(int(eng.forward([tokens[-1]], st).argmax()))
    return first, tokens


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def check_matches_hf(hf, model_dir: str, ids: list[int] | None = None, device: str = "cpu", n: int = NEW_TOKENS
                     ) -> None:
    """Streaming engine (nothing cached: every expert read from the drives) == transformers, float32."""
    ids = ids or prompt()
    eng = engine(model_dir, device=device)
    try:
        logits, tokens = engine_greedy(eng, ids, n)
    finally:
        eng.close()
    ref_logits, ref_tokens = hf_greedy(hf, ids, n)
    err = rel_err(logits, ref_logits)
    assert err < 1e-4, f"prompt logits {err:.3g} from transformers'"
    assert tokens == ref_tokens, f"tokens {tokens} against transformers' {ref_tokens}"


def check_prompt_cache_and_batch(model_dir: str, a_len: int = 10, b_len: int = 4) -> None:
    """A restored prefix continues like a full prefill; two sequences in one pass equal each alone; a chunked
    prefill equals the one-shot one."""
    a, b = prompt(a_len, 2), prompt(b_len, 3)
    eng = engine(model_dir, cache_gb=0.05)
    try:
        ref_st = eng.new_state()
        (ref_lg,), _ = eng.prefill([a + b], [ref_st])
        pc = PromptCache(64 << 20)
        st = eng.new_state()
        (lg,), _ = eng.prefill([a], [st])
        assert pc.store(a, st, lg)
        st2 = eng.new_state()
        assert pc.resume(a + b, st2)[0] == len(a)
        (lg2,), _ = eng.prefill([b], [st2])
        torch.testing.assert_close(lg2, ref_lg, rtol=1e-4, atol=1e-4)
        nxt = int(ref_lg.argmax())
        torch.testing.assert_close(eng.forward([nxt], st2), eng.forward([nxt], ref_st), rtol=1e-4, atol=1e-4)
        s1, s2, s3, s4 = (eng.new_state() for _ in range(4))
        both = eng.forward_batch([(a, s1), (b, s2)])
        torch.testing.assert_close(both[0], eng.forward(a, s3), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(both[1], eng.forward(b, s4), rtol=1e-5, atol=1e-5)
        assert torch.equal(eng.forward(a, eng.new_state()), eng.forward(a, eng.new_state()))  # run to run
        chunked = eng.new_state()
        eng.forward(a[:4], chunked)
        torch.testing.assert_close(eng.forward(a[4:], chunked), eng.forward(a, eng.new_state()), rtol=1e-5, atol=1e-5)
    finally:
        eng.close()


def fast_path_agreement(model_dir: str, vocab: int = 256) -> float:
    from tests.test_fast_path import _agreement

    return _agreement(model_dir, vocab)


# DeepSeek-V4's linears that ship FP8 (the compressor's and the indexer's kv / gate / weights projections stay float)
V4_FP8 = r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.indexer\.wq_b|\.shared_experts\.w[123])\.weight$"


def _v4_release_name(name: str) -> str:
    """transformers' save_pretrained names -> the release's (no ``model.`` prefix, ``embed`` / ``hc_head_fn``)."""
    import re

    name = {"model.embed_tokens.weight": "embed.weight"}.get(name, name)
    name = re.sub(r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1", name)
    return name.removeprefix("model.")


def _ds_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 as DeepSeek quantizes it: per 32 inputs the scale 2**ceil(log2(amax / 6)), then the nearest E2M1 code
    (low nibble first). Where amax / 2**k lies in (3, 4) that scale is twice Deltafin's reference choice, so a
    re-encoded copy would differ from the shipped bytes."""
    from deltafin.quant import mxfp4

    out, inn = w.shape
    b = w.float().reshape(out, inn // 32, 32)
    e = torch.ceil(torch.log2(b.abs().amax(-1).clamp_min(6 * 2.0**-126) / 6))
    q = (b / torch.exp2(e)[..., None]).clamp(-6, 6)
    codes = (q[..., None] - torch.from_numpy(mxfp4.E2M1_VALUES)).abs().argmin(-1).to(torch.uint8).reshape(out, inn)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), (e + 127).to(torch.uint8)


def deepseek_v4_release(root: Path, experts: str = "fp4", **overrides):
    """A tiny DeepSeek-V4 at root/src in the release's format: routed experts FP4 (I8 [out, in/2], low nibble
    first, F8_E8M0 ``.scale`` [out, in/32]), the linears of ``V4_FP8`` FP8 e4m3 with an F8_E8M0 ``.scale`` per
    128 x 128 block, names and config as released; ``experts="fp8"``: V4-Flash-Base's format instead (every
    linear, experts too, FP8 with float32 block scales). root/float holds the dequantized float twin; returns
    (transformers' model loaded from it, the release's tensors)."""
    import re
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    from deltafin.quant import fp8, mxfp4

    build("deepseek_v4", root / "float", **overrides)
    sd = load_file(str(root / "float" / "model.safetensors"))
    out, e8m0 = {}, torch.float8_e8m0fnu
    for name, w in sd.items():
        rel = _v4_release_name(name)
        if experts == "fp4" and re.search(r"\.experts\.\d+\.w[123]\.weight$", name):
            p, s = _ds_fp4(w)
            sd[name] = mxfp4.dequantize(p, s).to(w.dtype)
            out[rel], out[rel.removesuffix("weight") + "scale"] = p.view(torch.int8), s.view(torch.float8_e8m0fnu)
        elif re.search(V4_FP8, name) or re.search(r"\.experts\.\d+\.w[123]\.weight$", name):
            _, s = fp8.quantize(w)
            s = torch.exp2(torch.ceil(torch.log2(s)))  # E8M0: a power of two at least amax / 448
            full = s.repeat_interleave(fp8.BLOCK, 0)[: w.shape[0]].repeat_interleave(fp8.BLOCK, 1)[:, : w.shape[1]]
            out[rel], out[rel.removesuffix("weight") + "scale"] = ((w.float() / full).to(torch.float8_e4m3fn),
                                                                   s.to(e8m0 if experts == "fp4" else torch.float32))
            sd[name] = fp8.dequantize(out[rel], s).to(w.dtype)
        else:
            out[rel] = w
    save_file(sd, str(root / "float" / "model.safetensors"), metadata={"format": "pt"})
    (root / "src").mkdir()
    for f in (root / "float").iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, root / "src" / f.name)
    save_file(out, str(root / "src" / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((root / "src" / "config.json").read_text())
    cfg["expert_dtype"] = experts
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [fp8.BLOCK, fp8.BLOCK]}
    if experts == "fp4":
        cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    (root / "src" / "config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(root / "float"), dtype=torch.float32).eval()
    return hf, out


def v4_flash_config() -> dict:
    """DeepSeek-V4-Flash's config.json as released, for plans and memory figures: transformers' default
    DeepseekV4Config (Flash's widths) with the release's own layer list, ``compress_ratios`` (2 sliding-window
    layers, then CSA (4) and HCA (128) alternating; one more entry for the MTP layer), 3 hash-routed layers, FP4
    experts and FP8 with E8M0 block scales."""
    import transformers

    cfg = transformers.DeepseekV4Config().to_dict()
    for k in ("layer_types", "mlp_layer_types"):
        cfg.pop(k)
    n = cfg["num_hidden_layers"]
    return {**cfg, "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, n)] + [0],
            "num_hash_layers": 3, "expert_dtype": "fp4",
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}}


def v4_flash_index(tiny: dict[str, torch.Tensor]) -> list[str]:
    """The release's tensor names at V4-Flash's depth and width, read off a tiny release-format checkpoint's
    (``deepseek_v4_release``: layer 0 sliding and hash-routed, 1 CSA, 2 HCA): each layer takes its kind's
    attention names and its router's, expert 0's names repeated for every expert."""
    import re

    cfg = v4_flash_config()
    n, E = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    out = [x for x in tiny if not x.startswith("layers.")]
    like = {0: 0, 4: 1, 128: 2}
    for L in range(n):
        attn, ffn = like[cfg["compress_ratios"][L]], 0 if L < cfg["num_hash_layers"] else 1
        for x in tiny:
            m = re.fullmatch(r"layers\.(\d+)\.(.+)", x)
            if m is None:
                continue
            i, rest = int(m.group(1)), m.group(2)
            if i != (ffn if rest.startswith("ffn.") else attn):
                continue
            if ".experts." not in rest:
                out.append(f"layers.{L}.{rest}")
            elif ".experts.0." in rest:
                out += [f"layers.{L}.{rest.replace('.experts.0.', f'.experts.{e}.')}" for e in range(E)]
    return out
