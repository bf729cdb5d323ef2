"""Constrained decoding through xgrammar: a JSON schema (or any JSON object, or a tool call in the
checkpoint's own format) compiled once into a grammar, then per token a bitmask of the tokens that keep
the text inside it. Optional: without xgrammar, asking for a constraint is a clear error.

The vocabulary given to xgrammar is the model's (its logits' width), so ids the tokenizer never produces
are masked too. The checkpoint's stop tokens end a completed grammar.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from deltafin.errors import UsageError

MISSING = "constrained decoding (response_format, tool_choice) needs xgrammar: pip install 'deltafin[grammar]'"


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise UsageError(MISSING) from None
    return xgrammar


@dataclass
class GrammarStats:
    """Time spent on masks, for the per-token cost of constrained decoding."""

    tokens: int = 0
    mask_s: float = 0.0


class Grammars:
    """Compiles grammars for one tokenizer; ``compile_*`` return a ``Compiled`` whose ``constraint()`` gives
    each sequence its own matcher."""

    def __init__(self, codec, vocab_size: int):
        self.codec, self.vocab_size = codec, vocab_size
        self._compiler = None
        self.stats = GrammarStats()

    @property
    def compiler(self):
        if self._compiler is None:
            xgr = _xgr()
            if self.codec is None:
                raise UsageError("constrained decoding needs the model's tokenizer; this model has none")
            info = tokenizer_info(xgr, self.codec, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def json_schema(self, schema: dict) -> Compiled:
        try:
            g = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        except UsageError:
            raise
        except Exception as e:  # xgrammar's own message says what in the schema it cannot take
            raise UsageError(f"the JSON schema cannot be compiled: {e}") from None
        return Compiled(g, self)

    def json_object(self) -> Compiled:
        return self.json_schema({"type": "object"})

    def sequence(self, parts: list[str | dict]) -> Compiled:
        """Literal strings and JSON schemas, one after the other (a tool call: its markup around the
        arguments' schema); a list of such sequences is their union."""
        xgr = _xgr()
        self.compiler  # noqa: B018  (a missing tokenizer fails here, with its message)
        try:
            g = xgr.Grammar.concat(*[_part(xgr, p) for p in parts])
            return Compiled(self.compiler.compile_grammar(g), self)
        except Exception as e:
            raise UsageError(f"the tool's parameters cannot be compiled to a grammar: {e}") from None

    def union(self, sequences: list[list[str | dict]]) -> Compiled:
        xgr = _xgr()
        self.compiler  # noqa: B018
        try:
            g = xgr.Grammar.union(*[xgr.Grammar.concat(*[_part(xgr, p) for p in seq]) for seq in sequences])
            return Compiled(self.compiler.compile_grammar(g), self)
        except Exception as e:
            raise UsageError(f"the tools' parameters cannot be compiled to a grammar: {e}") from None


def _part(xgr, p: str | dict):
    if isinstance(p, str):
        return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(p)}")
    return xgr.Grammar.from_json_schema(json.dumps(p), any_whitespace=False)


def tokenizer_info(xgr, codec, vocab_size: int):
    eos = list(codec.eos_ids)
    if codec.kind == "hf":
        return xgr.TokenizerInfo.from_huggingface(codec.impl, vocab_size=vocab_size, stop_token_ids=eos)
    tok = codec.impl  # Kimi's tiktoken ranks: raw bytes per id; specials and unused ids empty (never text)
    # (only ids the model can emit: a small test model may have fewer logits than the tokenizer has ids)
    vocab = [tok.id_to_bytes(i) if i < tok.num_base_tokens else b"" for i in range(min(tok.vocab_size, vocab_size))]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[t for t in eos if t < vocab_size])


@dataclass
class Compiled:
    grammar: object  # xgrammar.CompiledGrammar (immutable, shared by sequences)
    owner: Grammars = field(repr=False)

    def constraint(self) -> Constraint:
        return Constraint(self)


class Constraint:
    """One sequence's place in a grammar: ``mask`` sets disallowed logits to -inf, ``accept`` moves on."""

    def __init__(self, compiled: Compiled):
        xgr = _xgr()
        self.xgr, self.owner = xgr, compiled.owner
        self.matcher = xgr.GrammarMatcher(compiled.grammar)
        self.bitmask = xgr.allocate_token_bitmask(1, compiled.owner.vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        t0 = time.perf_counter()
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(self.bitmask)
            self.xgr.apply_token_bitmask_inplace(logits.view(1, -1), self.bitmask, vocab_size=logits.numel())
        st = self.owner.stats
        st.tokens += 1
        st.mask_s += time.perf_counter() - t0

    def accept(self, tok: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(tok)
