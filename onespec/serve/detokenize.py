"""Incremental detokenization with stop strings.

Each update decodes the whole output again and sends the new suffix, which is simple and
right for every tokenizer (byte-level pieces, SentencePiece spaces, multi-token
characters). Text is held back while it may still change or end up cut:
  - trailing U+FFFD: an incomplete UTF-8 sequence that the next token may complete;
  - the longest suffix that is a prefix of a stop string ("ab" when stop = ["abc"]).
A stop string cuts the text just before it and ends the request (finish_reason "stop").
"""
from __future__ import annotations

from typing import Callable

REPLACEMENT_CHAR = "\ufffd"


def find_stop(text: str, stop: list[str], start: int = 0) -> int | None:
    """Index of the earliest stop string in text[start:], or None."""
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(hits) if hits else None


def stable_length(text: str, stop: list[str]) -> int:
    """How much of text can be sent now without risk of taking it back."""
    end = len(text.rstrip(REPLACEMENT_CHAR))
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, end), hold, -1):
            if text.endswith(s[:n], 0, end):
                hold = n
                break
    return end - hold


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
