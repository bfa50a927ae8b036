"""Incremental detokenization with stop strings.

Each update decodes the whole output again and sends the new suffix, which is simple and
right for every tokenizer (byte-level pieces, SentencePiece spaces, multi-token
characters). Text is held back while it may still change or end up cut:
  - trailing U+FFFD: an incomplete UTF-8 sequence that the next token may complete;
  - the longest suffix that is a prefix of a stop string ("ab" when stop = ["abc"]).
A stop string cuts the text just before it and ends the request (finish_reason "stop").
Stop strings are looked for in the new text only (plus the last len(stop) - 1 characters
before it), so a step costs the same however long the output has grown.
"""
from __future__ import annotations

from typing import Callable

REPLACEMENT_CHAR = "\ufffd"


def find_stop(text: str, stop: list[str], start: int = 0) -> int | None:
    """Index of the earliest stop string in text[start:], or None."""
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(hits) if hits else None


def stable_length(text: str, stop: list[str]) -> int:
    """How much of text can be sent now without risk of taking it back. Only the last
    len(s) - 1 characters are examined for each stop string s."""
    end = len(text.rstrip(REPLACEMENT_CHAR))
    return end - max((held_prefix(text, end, s) for s in stop), default=0)


def held_prefix(text: str, end: int, s: str) -> int:
    """Length of the longest suffix of text[:end] that is a proper prefix of s."""
    i = text.find(s[0], max(0, end - len(s) + 1), end)
    while i >= 0:                    # the first candidate that fits is the longest
        if s.startswith(text[i:end]):
            return end - i
        i = text.find(s[0], i + 1, end)
    return 0


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | None = None):
        self.decode = decode
        self.stop = list(stop or [])
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = []
        self.text = ""                 # the text sent so far
        self.stopped = False           # a stop string was found: the request is over

    def update(self, new_token_ids: list[int], finished: bool) -> str:
        """Adds tokens; returns the text delta that can be sent now. After a stop string
        (self.stopped) or with finished=True, everything left is returned."""
        self.token_ids.extend(new_token_ids)
        full = self.decode(self.token_ids)
        if self.stop:
            cut = find_stop(full, self.stop, max(0, len(self.text) - self.max_stop_len + 1))
            if cut is not None:
                full, finished, self.stopped = full[:cut], True, True
        ready = full if finished else full[:stable_length(full, self.stop)]
        if not ready.startswith(self.text):
            if not finished:           # decoding changed text already sent: wait it out
                return ""
            ready = self.text + ready[len(self.text):]
        delta = ready[len(self.text):]
        self.text = ready
        return delta
