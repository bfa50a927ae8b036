"""A suffix automaton over one request's tokens (prompt + output), for model-free drafts.

The automaton of a sequence S has one state per class of substrings that end at the same
set of positions (their endpos set). It grows by one token in amortised O(1) (the classic
online construction: a new state for the whole sequence, a walk up the suffix links that is
paid for by the links it shortens, at most one clone). It answers the question the drafts
need in O(1): the longest suffix of S that also ended earlier in S, and where.

Why that answer is the suffix link of the last state: the last state holds the suffixes of S
that end only at the last position; its suffix link is the state of the longest suffix
whose endpos set is larger, i.e. the longest suffix that occurred before. Every state
remembers the end of its first occurrence (a clone inherits it from the state it splits),
so that occurrence is an earlier one, and the tokens after it are the proposal.

Tokens come from vocabularies of 10^5 ids and more, so transitions are dicts.
"""
from __future__ import annotations


class SuffixAutomaton:
    def __init__(self):
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]    # transitions per state
        self.link: list[int] = [-1]               # suffix link (root: -1)
        self.length: list[int] = [0]              # longest string of the state
        self.first_end: list[int] = [-1]          # index of the last token of its first occurrence
        self.last = 0                             # the state of the whole sequence

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        for t in tokens:
            self._add(int(t))

    def _new_state(self, length: int, first_end: int, link: int = -1,
                   trans: dict[int, int] | None = None) -> int:
        self.next.append({} if trans is None else dict(trans))
        self.link.append(link)
        self.length.append(length)
        self.first_end.append(first_end)
        return len(self.length) - 1

    def _add(self, t: int) -> None:
        pos = len(self.tokens)
        self.tokens.append(t)
        cur = self._new_state(self.length[self.last] + 1, pos)
        p = self.last
        while p != -1 and t not in self.next[p]:
            self.next[p][t] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][t]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:            # split q: the part as long as p + t moves to a clone
                clone = self._new_state(self.length[p] + 1, self.first_end[q], self.link[q],
                                        self.next[q])
                while p != -1 and self.next[p].get(t) == q:
                    self.next[p][t] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur

    def longest_match(self) -> tuple[int, int]:
        """(length, end): the longest suffix of the sequence that also occurred earlier, and
        the index of the last token of its first earlier occurrence. (0, -1) when no suffix,
        not even the last token alone, occurred before."""
        state = self.link[self.last] if self.tokens else -1
        if state <= 0:
            return 0, -1
        return self.length[state], self.first_end[state]

    def continuation(self, max_len: int) -> tuple[int, list[int]]:
        """(match length, up to max_len tokens that followed the earlier occurrence)."""
        length, end = self.longest_match()
        if length == 0:
            return 0, []
        return length, self.tokens[end + 1:end + 1 + max_len]
