"""``deltafin bench grammar``: the per-token cost of constrained decoding (xgrammar token masks) beside the
cost of the logits it masks, measured in the same run.

No checkpoint is read: a byte-level BPE tokenizer of ``--vocab`` tokens is trained on Python's own source
files (a vocabulary shaped like a real model's: merges of code and English), a JSON schema and plain JSON
mode are compiled for it, and ``--tokens`` tokens are chosen from random logits under the mask (seeded).
Limits, timed on this machine in the same run: the lm_head product that makes one token's logits at Kimi
K3's width (7168 x vocab, float32, CPU; timed on a block of 8,192 rows and scaled, being bound by memory
reads), and plain sampling (softmax, top-p, draw) over the same vocabulary without a mask.
"""

from __future__ import annotations

import os
import sysconfig
import tempfile
import time

import torch

from deltafin.errors import UsageError

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "qty": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "ok": {"type": "boolean"}}, "required": ["name", "qty", "tags", "ok"], "additionalProperties": False}
K3_HIDDEN = 7168


def _corpus(limit_bytes: int = 24 << 20):
    root = sysconfig.get_paths()["stdlib"]
    seen = 0
    for folder, _, files in os.walk(root):
        for f in sorted(files):
            if f.endswith(".py") and seen < limit_bytes:
                try:
                    with open(os.path.join(folder, f), encoding="utf-8") as fh:
                        text = fh.read()
                except (OSError, UnicodeDecodeError):
                    continue
                seen += len(text)
                yield text


def train_tokenizer(vocab: int, folder: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.save_pretrained(folder)
    return fast


def _per_token(constraint, vocab: int, tokens: int, gen: torch.Generator) -> tuple[float, int]:
    """Seconds per masked token, and tokens chosen (the grammar may end first)."""
    from deltafin.runtime.sampling import Sampler, SamplingParams

    sampler = Sampler(SamplingParams(1.0, seed=0), constraint=constraint)
    n, mask_s0 = 0, constraint.owner.stats.mask_s
    for _ in range(tokens):
        sampler(torch.randn(vocab, generator=gen))
        n += 1
        if constraint.matcher.is_terminated():
            break
    return (constraint.owner.stats.mask_s - mask_s0) / n, n


def _lm_head_s(vocab: int, rows: int = 8192, repeats: int = 5) -> float:
    w, h = torch.randn(rows, K3_HIDDEN), torch.randn(K3_HIDDEN)
    w @ h  # warm
    t0 = time.perf_counter()
    for _ in range(repeats):
        w @ h
    return (time.perf_counter() - t0) / repeats * vocab / rows


def _plain_sampling_s(vocab: int, gen: torch.Generator, repeats: int = 50) -> float:
    from deltafin.runtime.sampling import Sampler, SamplingParams

    sampler = Sampler(SamplingParams(1.0, top_p=0.95, seed=0))
    logits = [torch.randn(vocab, generator=gen) for _ in range(repeats)]
    t0 = time.perf_counter()
    for lg in logits:
        sampler(lg)
    return (time.perf_counter() - t0) / repeats


def run(args) -> dict:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        raise UsageError("bench grammar needs xgrammar: pip install 'deltafin[grammar]'") from None
    from deltafin.runtime.grammar import Grammars
    from deltafin.runtime.tokenizer import TextCodec

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        fast = train_tokenizer(args.vocab, tmp)
    train_s = time.perf_counter() - t0
    vocab = len(fast)
    codec = TextCodec(fast, "hf", (fast.eos_token_id,))
    grammars = Grammars(codec, vocab)
    t0 = time.perf_counter()
    schema = grammars.json_schema(SCHEMA)
    compile_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(args.seed)
    schema_s, schema_n = _per_token(schema.constraint(), vocab, args.tokens, gen)
    object_s, object_n = _per_token(grammars.json_object().constraint(), vocab, args.tokens, gen)
    head_s = _lm_head_s(vocab)
    plain_s = _plain_sampling_s(vocab, gen)
    rec = {"bench": "grammar", "vocab": vocab, "tokens_schema": schema_n, "tokens_json_object": object_n,
           "mask_s_per_token_schema": schema_s, "mask_s_per_token_json_object": object_s,
           "lm_head_s_per_token": head_s, "plain_sampling_s_per_token": plain_s, "ratio_schema": schema_s / head_s, "ratio_json_object": object_s / head_s,
           "compile_s": compile_s, "tokenizer_train_s": train_s, "threads": torch.get_num_threads()}
    print(f"grammar: token mask {schema_s * 1e6:.0f} us/token (JSON schema, {schema_n} tokens) and "
          f"{object_s * 1e6:.0f} us/token (json_object, {object_n} tokens) vs the lm_head alone "
          f"({K3_HIDDEN} x {vocab:,}, float32, CPU) {head_s * 1e6:.0f} us/token = {rec['ratio_schema']:.3f}x / "
          f"{rec['ratio_json_object']:.3f}x of it; plain sampling over the vocabulary {plain_s * 1e6:.0f} us/token; "
          f"schema compiled in {compile_s:.2f} s")
    if args.json:
        from deltafin.store.manifest import write_json_atomic

        write_json_atomic(args.json, rec)
    return rec
