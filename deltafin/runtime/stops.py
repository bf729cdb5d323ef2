"""Stop strings found in generated text in time linear in the new text, whatever the stop strings' length.

Each stop string keeps a Knuth-Morris-Pratt state: the length of its longest prefix that the text ends
with. Feeding one character costs amortised O(1) per stop string, so a token costs O(stops x its
characters), never a rescan of the text or a prefix-by-prefix comparison (which made a 500,000-character
stop string cost seconds per token).
"""

from __future__ import annotations


def _failure(s: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of s[: i + 1]."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Feed text as it grows; learn where the first stop string ends and how much of the tail might
    still become one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.fail = [_failure(s) for s in self.stops]
        self.state = [0] * len(self.stops)
        self.fed = ""  # the text fed so far (to notice a decode that rewrote earlier characters)

    def reset(self) -> None:
        self.state = [0] * len(self.stops)
        self.fed = ""

    def feed(self, text: str) -> int | None:
        """``text``: everything decoded so far (it normally extends what was fed before). Returns where the
        earliest stop string that ends in the new characters begins, or None."""
        if not self.stops:
            return None
        if not text.startswith(self.fed):  # a tokenizer rewrote earlier text: start over
            self.reset()
        start, self.fed = len(self.fed), text
        best = None
        for j, s in enumerate(self.stops):
            k, fail = self.state[j], self.fail[j]
            for i in range(start, len(text)):
                c = text[i]
                while k and c != s[k]:
                    k = fail[k - 1]
                if c == s[k]:
                    k += 1
                if k == len(s):
                    hit = i + 1 - len(s)
                    best = hit if best is None else min(best, hit)
                    k = fail[k - 1]
                    break
            self.state[j] = k
        return best

    @property
    def held(self) -> int:
        """Characters at the end of the text that begin some stop string (to hold back from a reader)."""
        return max(self.state, default=0)
