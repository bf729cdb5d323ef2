"""Tokenizers and chat templates from the packed model folder (copied there from the checkpoint)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from deltafin.errors import UsageError


@dataclass
class TextCodec:
    """encode / decode / chat for one model; ``eos_ids`` are its stop tokens."""

    impl: object
    kind: str  # "hf" | "kimi"
    eos_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        if self.kind == "kimi":
            return self.impl.encode(text)
        return self.impl.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self.kind == "kimi":
            return self.impl.decode(ids)
        return self.impl.decode(ids, skip_special_tokens=False)

    def chat(self, messages: list[dict], thinking: bool = True, add_generation_prompt: bool = True,
             tools: list[dict] | None = None) -> list[int]:
        """Prompt ids for a conversation from the checkpoint's chat template (``tools``: OpenAI tool
        declarations, written where the template puts them)."""
        if self.kind == "kimi":
            from deltafin.tokenizers.xtml import encode_chat

            return encode_chat(self.impl, messages, tools=tools, thinking=thinking,
                               add_generation_prompt=add_generation_prompt)
        if not getattr(self.impl, "chat_template", None):
            raise UsageError("this model's checkpoint has no chat template; use 'deltafin run -p' with plain text")
        if not messages:
            return []
        extra = {"tools": tools} if tools else {}
        return list(self.impl.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=True, return_dict=False, **extra))


def load_codec(model_dir: str, config: dict) -> TextCodec | None:
    """None when the checkpoint shipped no tokenizer (then prompts must be given as ids)."""
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if os.path.exists(os.path.join(model_dir, "tiktoken.model")):
        from deltafin.tokenizers.kimi_k3 import KimiTokenizer

        tok = KimiTokenizer.from_dir(model_dir)
        return TextCodec(tok, "kimi", tuple(sorted(set(eos_ids) | {tok.eos_id})))
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")) or os.path.exists(
            os.path.join(model_dir, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        extra = [tok.eos_token_id] if tok.eos_token_id is not None else []
        return TextCodec(tok, "hf", tuple(sorted(set(eos_ids) | set(extra))))
    return None
