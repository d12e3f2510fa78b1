"""The long-n-gram contamination check: :class:`NgramOverlapIndex`."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from flywheel.dedup.text import tokens


class NgramOverlapIndex:
    """Long-n-gram overlap (the decontamination check of GPT-3, Brown et al. 2020, sec. 4: 13-grams).

    A query text *overlaps* an indexed text when they share a word ``n``-gram of the normalised
    texts. Indexed texts shorter than ``n`` tokens (most production requests) contribute their whole
    token sequence instead, and overlap when it appears contiguously in the query -- but only when it
    has at least ``min_tokens`` tokens: "weather in oslo" inside a longer request is left to the
    MinHash check, not called contamination by itself.
    """

    def __init__(self, n: int = 13, *, min_tokens: int = 8):
        if n < 2:
            raise ValueError(f"n-gram size must be >= 2, got {n}")
        self.n, self.min_tokens = int(n), int(min_tokens)
        self._grams: dict[tuple[str, ...], Hashable] = {}
        self._lengths: set[int] = set()

    def add(self, keys: Sequence[Hashable], texts: Sequence[str]) -> None:
        for key, text in zip(keys, texts, strict=True):
            t = tokens(text)
            if len(t) >= self.n:
                for i in range(len(t) - self.n + 1):
                    self._grams.setdefault(tuple(t[i : i + self.n]), key)
                self._lengths.add(self.n)
            elif len(t) >= self.min_tokens:
                self._grams.setdefault(tuple(t), key)
                self._lengths.add(len(t))

    def query(self, texts: Sequence[str]) -> list[tuple[Hashable, str] | None]:
        """Per text, ``(key, the shared n-gram)`` of the first overlap found, or ``None``."""
        out: list[tuple[Hashable, str] | None] = []
        lengths = sorted(self._lengths, reverse=True)
        for text in texts:
            t = tokens(text)
            hit = None
            for k in lengths:
                for i in range(len(t) - k + 1):
                    g = tuple(t[i : i + k])
                    key = self._grams.get(g)
                    if key is not None:
                        hit = (key, " ".join(g))
                        break
                if hit:
                    break
            out.append(hit)
        return out
