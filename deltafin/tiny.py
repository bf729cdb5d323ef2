"""Tiny randomly initialised Hugging Face MoE models, built and saved locally (never downloaded).

Used by the tests and by `deltafin demo`: transformers config classes, random weights, save_pretrained.
"""

from __future__ import annotations

import os

import torch

# Small but real shapes: every width a multiple of 32 so MXFP4 can hold the experts.
TINY: dict[str, dict] = {
    "qwen3_moe": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256),
    "mixtral": dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=256),
    "olmoe": dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=256),
    "deepseek_v3": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
                        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=256),
    "glm4_moe_lite": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                          num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                          qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1,
                          max_position_embeddings=256),
    "gpt_oss": dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=4),
}


def build_tiny(model_type: str, path: str | os.PathLike, seed: int = 0, **overrides) -> torch.nn.Module:
    """Build, randomise and save a tiny model; weights are rounded to bf16 so a bf16 pack is lossless."""
    import transformers

    torch.manual_seed(seed)
    kw = dict(TINY[model_type])
    kw.update(overrides)
    kw.setdefault("eos_token_id", None)
    kw.setdefault("bos_token_id", None)
    kw.setdefault("pad_token_id", None)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomise(model)
    model.save_pretrained(str(path))
    return model


def randomise(model: torch.nn.Module) -> None:
    """Random weights rounded to bf16 (so a bf16 pack is lossless); biases and correction biases wide."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "e_score_correction_bias" in name or "bias" in name and p.dim() == 1:
                p.normal_(0, 0.5)
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(1.0, 0.1)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b).to(torch.bfloat16).float() * 0.5)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_byte_tokenizer(path: str | os.PathLike, vocab_size: int, merges: int = 0) -> None:
    """A byte-level tokenizer (256 byte tokens, no merges) with <|im_start|>/<|im_end|> and a chat template.

    Needs vocab_size >= 258: specials take ids 256 and 257. ``merges`` > 0 adds that many two-letter merges first
    (ids from 256 on, specials after them): llama.cpp's converter refuses a BPE tokenizer without merges.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258:
        raise ValueError(f"a byte tokenizer needs vocab_size >= 258, got {vocab_size}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {c: i for i, c in enumerate(byte_chars)}
    pairs = [(a, b) for a in "etaoinsrhl" for b in "etaoinsrhl"][:merges]
    if len(vocab) + len(pairs) + 2 > vocab_size:
        raise ValueError(f"{merges} merges and 2 specials do not fit a vocabulary of {vocab_size}")
    vocab |= {a + b: 256 + i for i, (a, b) in enumerate(pairs)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token=None,
                                   additional_special_tokens=["<|im_start|>"])
    fast.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def _byte_of(ch: str) -> int:
    """Inverse of the GPT-2 byte-to-unicode map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs, strict=True))[ch]
