"""Prompt lookup (n-gram drafting) over one request's tokens, indexed as they arrive.

The proposal for a sequence t[0..L): for n from max_n down to min_n, the most recent
earlier occurrence of the last n tokens, t[i:i+n] == t[L-n:L] with i + n < L, proposes the
tokens that followed it, t[i+n : i+n+K] (fewer when the sequence ends first). No
occurrence for any n: no drafts.

A scan per step would cost O(L) per request; instead a dict per n maps every n-gram to the
end of its latest occurrence, n-grams entering the index once they are no longer the
sequence's own suffix. Appending a token costs O(max_n - min_n + 1), a query the same.
"""
from __future__ import annotations


class NGramIndex:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.latest_end: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_n, max_n + 1)}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            self._index_suffixes()       # the current suffixes become earlier occurrences
            self.tokens.append(int(t))

    def _index_suffixes(self) -> None:
        end = len(self.tokens)
        for n, index in self.latest_end.items():
            if n <= end:
                index[tuple(self.tokens[end - n:end])] = end

    def propose(self, max_len: int) -> tuple[int, list[int]]:
        """(n of the matched n-gram, up to max_len tokens that followed it); (0, []) when
        no n-gram of the allowed sizes occurred before."""
        size = len(self.tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            end = self.latest_end[n].get(tuple(self.tokens[size - n:]))
            if end is not None:
                return n, self.tokens[end:end + max_len]
        return 0, []
