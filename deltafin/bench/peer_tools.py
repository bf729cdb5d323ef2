"""``bench peer``'s inputs: the random Qwen3-MoE checkpoint it compares on, and llama.cpp's own tools.

The checkpoint is the shape of a laptop-size MoE (hidden 2048, 8 layers, 128 experts of width 768, top-8,
vocabulary 32,000; 10.2 GB in bf16), written one safetensors shard per layer so building it never holds the
model in memory; ``--small`` is a shape that converts and runs in seconds. llama.cpp's converter refuses
tokenizers it does not know (it hashes a test string's ids): the random checkpoint's byte tokenizer is one,
so the converter runs with that one check answering "default" (the tokenizer plays no part in llama-bench).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from deltafin.errors import UsageError

SHAPES = {
    "issue": dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8),
    "small": dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  num_experts=16, num_experts_per_tok=4),
    # bench pack --bf16: the widths, 2 layers of 64 experts, vocabulary 16,000 (1.4 GB in bf16)
    "pack": dict(vocab_size=16000, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                 num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 num_experts=64, num_experts_per_tok=8),
}
HOW_TO_GET = ("llama.cpp not found: build it from source, e.g. 'pip download llama-cpp-python --no-binary :all: "
              "--no-deps' and 'cmake -S <sdist>/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release && cmake "
              "--build build --target llama-bench llama-quantize', then put build/bin on PATH or pass --llama-cpp "
              "build/bin (the converter: --converter <sdist>/vendor/llama.cpp/convert_hf_to_gguf.py)")


class LlamaCppMissing(UsageError):
    """llama.cpp's tools are not where bench peer looked."""


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    bench: str
    quantize: str
    converter: str

    def version(self) -> str:
        """llama.cpp's own version line (``version: N (commit)``), from llama-bench --version where it has one."""
        try:
            r = subprocess.run([self.bench, "--version"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"unknown ({e})"
        lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("version")]
        return lines[0].removeprefix("version:").strip() if lines else "unknown"


def _find(name: str, dirs: list[str]) -> str | None:
    for d in dirs:
        p = os.path.join(d, name)
        if os.path.isfile(p) and (name.endswith(".py") or os.access(p, os.X_OK)):
            return p
    return shutil.which(name) if not name.endswith(".py") else None


def find_llama_cpp(where: str | None, converter: str | None, need_converter: bool = True) -> LlamaCpp:
    """llama-bench and llama-quantize in DIR (or DIR/bin, DIR/build/bin) or on PATH; the converter beside them,
    in a parent folder (a source tree holding its build), on PATH's folders, or given. ``need_converter`` False
    (a GGUF already made, kept with --reuse): one not found is '' rather than an error."""
    if where is not None and not os.path.isdir(where):
        raise UsageError(f"--llama-cpp {where}: not a folder; give the folder holding llama-bench")
    dirs = [where, os.path.join(where, "bin"), os.path.join(where, "build", "bin")] if where else []
    bench, quant = _find("llama-bench", dirs), _find("llama-quantize", dirs)
    if bench is None or quant is None:
        raise LlamaCppMissing(HOW_TO_GET)
    if converter is not None:
        if not os.path.isfile(converter):
            raise UsageError(f"--converter {converter}: no such file; give llama.cpp's convert_hf_to_gguf.py")
        return LlamaCpp(bench, quant, os.path.abspath(converter))
    up, seen = os.path.dirname(os.path.realpath(bench)), []
    for _ in range(4):
        seen.append(up)
        up = os.path.dirname(up)
    path_dirs = os.environ.get("PATH", "").split(os.pathsep)
    conv = _find("convert_hf_to_gguf.py", dirs + seen + path_dirs)
    if conv is None and not need_converter:
        return LlamaCpp(bench, quant, "")
    if conv is None:
        raise LlamaCppMissing(f"found {bench} but not llama.cpp's convert_hf_to_gguf.py near it; pass --converter "
                              "<llama.cpp source>/convert_hf_to_gguf.py")
    return LlamaCpp(bench, quant, conv)


def check_checkpoint(path: str) -> dict:
    """The checkpoint's config, checked before any long work: a Qwen3-MoE (the family both engines run here)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise UsageError(f"--checkpoint {path}: no config.json there; give a Hugging Face checkpoint folder")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "qwen3_moe":
        raise UsageError(f"--checkpoint {path}: model_type {cfg.get('model_type')!r}; bench peer compares on "
                         "qwen3_moe checkpoints (leave --checkpoint out to build one)")
    return cfg


def build_checkpoint(path: str, shape: str, seed: int = 0) -> dict:
    """Write the random bf16 checkpoint (config via Qwen3MoeConfig.save_pretrained, a byte tokenizer, one shard
    per layer of N(0, 0.02) weights, norms at 1); returns its config. A finished checkpoint is kept."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from deltafin.tiny import save_byte_tokenizer

    index = os.path.join(path, "model.safetensors.index.json")
    cfg = Qwen3MoeConfig(**SHAPES[shape], norm_topk_prob=True, max_position_embeddings=4096, eos_token_id=None,
                         bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                         architectures=["Qwen3MoeForCausalLM"])  # llama.cpp's converter picks its class by this
    if os.path.isfile(index):
        with open(os.path.join(path, "config.json")) as f:
            have = json.load(f)
        if same_shape(have, shape):
            cfg.save_pretrained(path)
            return cfg.to_dict()
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    save_byte_tokenizer(path, cfg.vocab_size, merges=64)
    with torch.device("meta"):
        names = _per_expert({n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_config(cfg).state_dict().items()})
    g = torch.Generator().manual_seed(seed)
    groups: dict[str, dict[str, tuple]] = {}
    for n, s in names.items():
        part = n.split(".")
        key = f"layer{int(part[2]):03d}" if n.startswith("model.layers.") else "rest"
        groups.setdefault(key, {})[n] = s
    weight_map = {}
    for key, tensors in sorted(groups.items()):
        shard = f"model-{key}.safetensors"
        out = {n: (torch.randn(s, generator=g) * 0.02 if len(s) > 1 else torch.ones(s)).to(torch.bfloat16)
               for n, s in tensors.items()}
        save_file(out, os.path.join(path, shard + ".tmp"), metadata={"format": "pt"})
        os.replace(os.path.join(path, shard + ".tmp"), os.path.join(path, shard))
        weight_map |= dict.fromkeys(out, shard)
        del out
    with open(index + ".tmp", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    os.replace(index + ".tmp", index)
    return cfg.to_dict()


def same_shape(cfg: dict, shape: str) -> bool:
    """Whether a saved config is this shape's (transformers 5 saves ``num_experts`` as ``num_local_experts``)."""
    alias = {"num_experts": "num_local_experts"}
    return all(cfg.get(k, cfg.get(alias.get(k, k))) == v for k, v in SHAPES[shape].items())


def _per_expert(names: dict[str, tuple]) -> dict[str, tuple]:
    """The released layout (``experts.{e}.gate_proj.weight`` ...) for a model class that fuses its experts
    (``experts.gate_up_proj`` [E, 2I, D], ``experts.down_proj`` [E, D, I]), as checkpoints on the Hub are."""
    out = {}
    for n, s in names.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            E, I2, D = s
            for e in range(E):
                out |= {f"{n[:-12]}{e}.{w}_proj.weight": (I2 // 2, D) for w in ("gate", "up")}
        elif n.endswith("mlp.experts.down_proj"):
            E, D, I = s
            out |= {f"{n[:-9]}{e}.down_proj.weight": (D, I) for e in range(E)}
        else:
            out[n] = s
    return out


# Runs llama.cpp's converter unchanged but for the tokenizer check: an unknown pre-tokenizer becomes "default".
_CONVERT = """
import importlib.util, os, sys
conv = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(conv))
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", conv)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
TextModel = getattr(mod, "TextModel", None) or sys.modules["conversion.base"].TextModel
known = TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "default"
TextModel.get_vocab_base_pre = pre
mod.main()
"""


def convert(tools: LlamaCpp, checkpoint: str, bf16_gguf: str, out_gguf: str, threads: int) -> tuple[float, float]:
    """llama.cpp's convert (bf16 GGUF) then ``llama-quantize MXFP4_MOE``: (convert s, quantize s)."""
    import time

    t0 = time.perf_counter()
    _check([sys.executable, "-c", _CONVERT, tools.converter, checkpoint, "--outtype", "bf16", "--outfile", bf16_gguf])
    t1 = time.perf_counter()
    _check([tools.quantize, bf16_gguf, out_gguf, "MXFP4_MOE", str(threads)])
    return t1 - t0, time.perf_counter() - t1


def _check(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{os.path.basename(cmd[3] if cmd[0] == sys.executable else cmd[0])} failed "
                           f"(exit {r.returncode}): {' | '.join(tail)}")
