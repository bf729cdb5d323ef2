"""Small pieces shared by the DeepSeek-V3 and gpt-oss modules: a growing cache, masks."""

from __future__ import annotations

import torch

INITIAL_ROWS = 64
SCORE_BUDGET = 1 << 26  # attention scores held at once (elements): bounds prefill memory


class GrowingCache:
    """Rows [0, length) of a per-token buffer [capacity, *row] that doubles when full (amortised O(1)
    appends; never a torch.cat per step). Writing at ``pos`` truncates anything after it."""

    def __init__(self, row: tuple[int, ...], max_len: int, device, dtype, initial: int = INITIAL_ROWS):
        self.row, self.max_len = tuple(row), max_len
        self.buf = torch.empty((max(1, min(initial, max_len)), *self.row), device=device, dtype=dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.buf.shape[0]

    def write(self, pos: int, rows: torch.Tensor) -> torch.Tensor:
        """Store rows [T, *row] at pos .. pos+T-1; return the view of rows [0, pos+T)."""
        end = pos + rows.shape[0]
        assert pos <= self.length, f"cache write at {pos} leaves a gap after {self.length}"
        assert end <= self.max_len, f"sequence of {end} tokens exceeds the state's max_len {self.max_len}"
        if end > self.capacity:
            self._grow(min(max(2 * self.capacity, end), self.max_len))
        self.buf[pos:end] = rows
        self.length = end
        return self.buf[:end]

    def _grow(self, rows: int) -> None:
        buf = self.buf.new_empty((rows, *self.row))
        buf[: self.length] = self.buf[: self.length]
        self.buf = buf

    def rows(self) -> torch.Tensor:
        return self.buf[: self.length]


def attention_mask(pos: int, T: int, start: int, end: int, window: int | None, device) -> torch.Tensor | None:
    """Keep-mask [T, end-start] for queries at pos .. pos+T-1 over keys start .. end-1 (causal, and
    within ``window`` tokens when given: key j is seen from query p iff p - window < j <= p); None if
    every key is visible."""
    if T == 1 and (window is None or start > pos - window):
        return None
    q = torch.arange(pos, pos + T, device=device)[:, None]  # [T, 1]
    k = torch.arange(start, end, device=device)[None, :]  # [1, S]
    keep = k <= q
    if window is not None:
        keep &= k > q - window
    return keep


def attention_probs(
    scores: torch.Tensor, keep: torch.Tensor | None, sinks: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Softmax of scores [H, T, S] over S in float32, masked by keep [T, S]; with sinks [H], each head's
    sink logit joins its softmax and is then dropped (gpt-oss)."""
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is None:
        return torch.softmax(scores.float(), dim=-1).to(dtype)
    H, T, _ = scores.shape
    logits = torch.cat((scores, sinks.view(H, 1, 1).expand(H, T, 1).to(scores.dtype)), dim=-1).float()
    logits = logits - logits.amax(-1, keepdim=True)
    return torch.softmax(logits, dim=-1)[..., :-1].to(dtype)


def blockwise_attention(
    scores_of,
    values_of,
    T: int,
    H: int,
    S: int,
    keep: torch.Tensor | None,
    dtype: torch.dtype,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over query blocks small enough that H x block x S scores fit SCORE_BUDGET.

    ``scores_of(t0, t1)`` -> scaled scores [H, t1-t0, S]; ``values_of(p, t0, t1)`` -> [H, t1-t0, dv] for
    probabilities p [H, t1-t0, S]. Returns [H, T, dv].
    """
    block = max(1, SCORE_BUDGET // max(1, H * S))
    outs = []
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        p = attention_probs(scores_of(t0, t1), None if keep is None else keep[t0:t1], sinks, dtype)
        outs.append(values_of(p, t0, t1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
