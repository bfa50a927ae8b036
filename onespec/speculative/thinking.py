"""The thinking phase of each request, for relaxed acceptance (docs/DECODING.md, "Acceptance").

A request's `thinking_delta` is relaxed_delta inside a thinking phase and 0 outside it:
walking its tokens in order, `begin_thinking_phase_token` opens the phase and
`end_thinking_phase_token` closes it (the last one wins). Prompt tokens count as they are
prefilled, chunk by chunk; a request recomputed after preemption walks them again.
"""
from __future__ import annotations

from onespec.engine.request import Request


class ThinkingPhase:
    def __init__(self, begin_token: int, end_token: int | None, delta: float):
        self.begin_token, self.end_token, self.delta = begin_token, end_token, delta

    def walk(self, req: Request, tokens: list[int], restart: bool = False):
        """Updates req.thinking_delta over tokens (restart: from the sequence's start)."""
        if restart:
            req.thinking_delta = 0.0
        for t in tokens:
            if t == self.begin_token:
                req.thinking_delta = self.delta
            elif t == self.end_token:
                req.thinking_delta = 0.0
