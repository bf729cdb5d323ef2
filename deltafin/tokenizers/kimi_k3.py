"""Kimi K3 tokenizer: tiktoken rank-BPE with the Kimi pre-tokenizer split (spec §5.1).

Ids 0..N-1 are the BPE ranks of `tiktoken.model`; ids 163584..163839 are 256 special slots.
Named slots come from `tokenizer_config.json`'s `added_tokens_decoder` when present, else from
the spec table; every other slot is `<|reserved_token_{id}|>`. A small ranks file (tests) leaves
a gap of unused ids between the ranks and the specials.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import tiktoken

from deltafin.errors import CheckpointError, UsageError

RANKS_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"

# Pre-tokenizer: the o200k-style split with a leading Han rule and Han removed from letter runs.
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_LEAD = r"[^\r\n\p{L}\p{N}]?"
PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        _LEAD + _UPPER + "*" + _LOWER + "+" + _CONTRACTION,  # "Hello", " don't"
        _LEAD + _UPPER + "+" + _LOWER + "*" + _CONTRACTION,  # "HTTP", " I'LL"
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

SPECIAL_BASE = 163584
NUM_SPECIAL_SLOTS = 256
END_OF_MSG = "<|end_of_msg|>"

# Spec §5.1 table; used when the model directory has no `added_tokens_decoder`.
SPEC_SPECIAL_TOKENS: dict[int, str] = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: END_OF_MSG,
    163587: "<|open|>",
    163588: "<|close|>",
    163589: "<|sep|>",
    163590: "[start_header_id]",
    163591: "[end_header_id]",
    163593: "[EOT]",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163649: "<osagent_mode>",
    163838: "[UNK]",
    163839: "[PAD]",
}

# tiktoken is only safe up to ~400k chars per call, and very long runs of one character class are
# quadratic in its BPE; the Kimi tokenizer cuts both, and we cut at the same places to match ids.
MAX_ENCODE_CHARS = 400_000
MAX_SAME_CLASS_RUN = 25_000


def reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def load_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken rank file: one `base64(token) rank` per line, ranks exactly 0..N-1."""
    try:
        lines = path.read_text(encoding="ascii").splitlines()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: tokenizer ranks file not found; copy '{RANKS_FILE}' from the model repo"
        ) from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"{path}: not a tiktoken rank file ({exc}); expected base64 and ranks in ASCII"
        ) from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            token, rank = _parse_rank_line(path, lineno, line)
            ranks[token] = rank
    _check_dense(path, ranks)
    return ranks


def _parse_rank_line(path: Path, lineno: int, line: str) -> tuple[bytes, int]:
    parts = line.split()
    try:
        if len(parts) != 2:
            raise ValueError(f"expected 2 fields, got {len(parts)}")
        return base64.b64decode(parts[0], validate=True), int(parts[1])
    except (ValueError, binascii.Error) as exc:
        raise CheckpointError(
            f"{path}:{lineno}: bad rank line {line[:60]!r} ({exc}); expected 'BASE64TOKEN RANK'"
        ) from None


def _check_dense(path: Path, ranks: dict[bytes, int]) -> None:
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(
            f"{path}: ranks are not exactly 0..{len(ranks) - 1} (duplicates or gaps); the file is corrupt, re-download it"
        )


def read_added_tokens(model_dir: Path) -> dict[int, str] | None:
    """`added_tokens_decoder` of `tokenizer_config.json` as {id: text}, or None when absent."""
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        decoder = json.loads(path.read_text(encoding="utf-8")).get("added_tokens_decoder")
        if decoder is None:
            return None
        return {int(key): str(entry["content"]) for key, entry in decoder.items()}
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f'{path}: unreadable added_tokens_decoder ({exc!r}); expected {{"ID": {{"content": TEXT}}}}'
        ) from None


def special_table(named: dict[int, str], num_base_tokens: int) -> dict[str, int]:
    """Name -> id for every special: the named ones plus reserved names for empty slots."""
    table = {
        reserved_name(i): i for i in range(SPECIAL_BASE, SPECIAL_BASE + NUM_SPECIAL_SLOTS) if i not in named
    }
    for token_id, name in sorted(named.items()):
        if token_id < num_base_tokens:
            raise CheckpointError(
                f"special token {name!r} has id {token_id}, inside the {num_base_tokens} BPE ranks; "
                f"the ranks file and {CONFIG_FILE} belong to different tokenizers"
            )
        if name in table:
            raise CheckpointError(
                f"special token {name!r} is defined twice (ids {table[name]} and {token_id})"
            )
        table[name] = token_id
    return table


def pretokenize(text: str) -> list[str]:
    """The pieces the Kimi regex cuts `text` into (BPE never merges across them)."""
    import regex  # only needed here; tiktoken compiles PAT_STR itself

    # V1 enables the `&&` class intersection the pattern uses.
    return regex.findall(PAT_STR, text, flags=regex.V1)


def split_long_runs(text: str, limit: int = MAX_SAME_CLASS_RUN) -> Iterator[str]:
    """Cut `text` so no piece holds more than `limit` consecutive space / non-space chars."""
    start = 0
    run = 0
    in_space = text[:1].isspace()
    for i, ch in enumerate(text):
        if ch.isspace() != in_space:
            in_space = not in_space
            run = 1
            continue
        run += 1
        if run > limit:
            yield text[start:i]
            start = i
            run = 1
    yield text[start:]


def _encode_chunks(text: str) -> Iterator[str]:
    for offset in range(0, max(len(text), 1), MAX_ENCODE_CHARS):
        yield from split_long_runs(text[offset : offset + MAX_ENCODE_CHARS])


class KimiTokenizer:
    """tiktoken BPE over the Kimi split, with the 256 Kimi special slots.

    Every special (including `<|open|>`, `<|close|>`, `<|sep|>`, which the config marks
    non-special) is recognised in text only when `allow_special=True`, and decodes to its text.
    """

    def __init__(self, ranks: dict[bytes, int], specials: dict[str, int], name: str = "kimi_k3") -> None:
        if END_OF_MSG not in specials:
            raise CheckpointError(
                f"tokenizer has no {END_OF_MSG} special token; it is not a Kimi K3 tokenizer"
            )
        self.num_base_tokens = len(ranks)
        self._ranks = ranks
        self._specials = dict(specials)
        self._special_names = frozenset(specials)
        self._id_to_special = {i: s for s, i in specials.items()}
        self._id_to_bytes = {i: b for b, i in ranks.items()}
        self._enc = tiktoken.Encoding(
            name, pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=self._specials
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> KimiTokenizer:
        """Load `tiktoken.model` and, if present, `tokenizer_config.json` from a model directory."""
        model_dir = Path(model_dir)
        ranks = load_ranks(model_dir / RANKS_FILE)
        named = read_added_tokens(model_dir)
        return cls(ranks, special_table(SPEC_SPECIAL_TOKENS if named is None else named, len(ranks)))

    @property
    def eos_id(self) -> int:
        """The stop token, `<|end_of_msg|>` (config `eos_token_id`)."""
        return self._specials[END_OF_MSG]

    @property
    def vocab_size(self) -> int:
        """One past the largest id (163840 for Kimi K3), unused gap ids included."""
        return max(self.num_base_tokens, *self._id_to_special) + 1

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`; special-token text becomes its id only when `allow_special`."""
        allowed = self._special_names if allow_special else frozenset()
        ids: list[int] = []
        for chunk in _encode_chunks(text):
            ids.extend(self._enc.encode(chunk, allowed_special=allowed, disallowed_special=()))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; specials print as their names, invalid UTF-8 as U+FFFD."""
        ids = list(ids)
        for token_id in ids:
            self._check_id(token_id)
        return self._enc.decode(ids, errors="replace")

    def id_to_bytes(self, token_id: int) -> bytes:
        self._check_id(token_id)
        special = self._id_to_special.get(token_id)
        return special.encode("utf-8") if special is not None else self._id_to_bytes[token_id]

    def id_to_token(self, token_id: int) -> str:
        """A token's text; a BPE token that is not valid UTF-8 on its own shows U+FFFD."""
        return self.id_to_bytes(token_id).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int:
        """Id of a special name or of a single BPE token's text."""
        token_id = self._specials.get(token)
        if token_id is None:
            token_id = self._ranks.get(token.encode("utf-8"))
        if token_id is None:
            raise UsageError(f"{token!r} is not a single token of this vocabulary; use encode() for text")
        return token_id

    def is_special(self, token_id: int) -> bool:
        return token_id in self._id_to_special

    def _check_id(self, token_id: int) -> None:
        if token_id not in self._id_to_special and not 0 <= token_id < self.num_base_tokens:
            raise UsageError(
                f"token id {token_id} is not in this vocabulary (BPE ids 0..{self.num_base_tokens - 1} "
                f"and special ids {min(self._id_to_special)}..{max(self._id_to_special)}); check the model's tokenizer"
            )
