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
    bos_id: int | None = None  # put before a plain prompt: set only where the tokenizer config asks for it

    @property
    def has_chat_template(self) -> bool:
        return self.kind == "kimi" or bool(getattr(self.impl, "chat_template", None))

    def prompt_ids(self, text: str) -> list[int]:
        """A plain-text prompt as the model saw text in training: BOS first where the tokenizer config says so."""
        ids = self.encode(text)
        return [self.bos_id] + ids if self.bos_id is not None and ids[:1] != [self.bos_id] else ids

    def encode(self, text: str) -> list[int]:
        if self.kind == "kimi":
            return self.impl.encode(text)
        return self.impl.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        if self.kind == "kimi":
            return self.impl.decode(ids)
        return self.impl.decode(ids, skip_special_tokens=False)

    def chat(self, messages: list[dict], thinking: bool | None = None, add_generation_prompt: bool = True,
             effort: str | None = None, template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[int]:
        """Prompt ids for a conversation from the checkpoint's chat template. ``thinking`` None keeps the
        template's default; ``effort`` is Kimi K3's thinking_effort, or a template's ``reasoning_effort``
        (gpt-oss); ``template_kwargs`` go to a Jinja template as variables (Qwen3: enable_thinking);
        ``tools``: OpenAI tool declarations, written where the template puts them."""
        if self.kind == "kimi":
            from deltafin.tokenizers.xtml import encode_chat

            kw = template_kwargs or {}
            think = kw.get("thinking", kw.get("enable_thinking", True)) if thinking is None else thinking
            return encode_chat(self.impl, messages, tools=tools, thinking=bool(think),
                               add_generation_prompt=add_generation_prompt,
                               thinking_effort=effort or kw.get("thinking_effort") or kw.get("reasoning_effort"))
        template = getattr(self.impl, "chat_template", None)
        if not template:
            raise UsageError("this model's checkpoint has no chat template; use 'deltafin run -p' with plain text")
        if not messages:
            return []
        kw = dict(template_kwargs or {})
        if thinking is not None:
            kw.setdefault("enable_thinking", thinking)
            kw.setdefault("thinking", thinking)
        if effort is not None:
            kw.setdefault("reasoning_effort", effort)
        if tools:
            kw["tools"] = tools
        return list(self.impl.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=True, return_dict=False, **kw))

    def check_thinking(self, thinking: bool | None, effort: str | None) -> None:
        """Refuse --think/--no-think or --effort where the chat template has no such switch."""
        if self.kind == "kimi":
            from deltafin.tokenizers.xtml import check_thinking_effort

            check_thinking_effort(effort)
            return
        template = str(getattr(self.impl, "chat_template", "") or "")
        if thinking is not None and "thinking" not in template:  # enable_thinking (Qwen3), thinking
            raise UsageError("this model's chat template has no thinking switch; leave out --think/--no-think")
        if effort is not None and "reasoning_effort" not in template:
            raise UsageError("this model's chat template has no effort levels; leave out --effort")

    def special_names(self) -> tuple[str, ...]:
        """Text of the tokenizer's special tokens (never shown to a reader)."""
        if self.kind == "kimi":
            return tuple(self.impl.special_tokens)
        return tuple(getattr(self.impl, "all_special_tokens", ()) or ())


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
        bos = tok.bos_token_id if _asks_for_bos(model_dir) else None
        return TextCodec(tok, "hf", tuple(sorted(set(eos_ids) | set(extra))), bos)
    return None


def _asks_for_bos(model_dir: str) -> bool:
    """tokenizer_config.json's add_bos_token (Llama-style tokenizers set it; most MoE checkpoints do not)."""
    import json

    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("add_bos_token", False))
    except (OSError, ValueError):
        return False
