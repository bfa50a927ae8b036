"""The thinking phase of each request, for relaxed acceptance (docs/DECODING.md, "Acceptance").

A request's ThinkingState.delta is relaxed_delta inside a thinking phase and 0 outside it:
walking its tokens in order, `begin_thinking_phase_token` opens the phase and
`end_thinking_phase_token` closes it (the last one wins). Prompt tokens count as they are
prefilled, chunk by chunk; a request recomputed after preemption walks them again.
"""
from __future__ import annotations

from dataclasses import dataclass

from onespec.engine.request import Request


@dataclass
class ThinkingState:
    """Request.features.thinking, written only by ThinkingPhase.walk."""
    delta: float = 0.0


def relaxed_delta(req: Request) -> float:
    """The delta relaxed acceptance uses for req's next step: its phase's, for greedy
    requests only (0 otherwise)."""
    state = req.features.thinking
    if state is None or req.sampling_params.temperature != 0.0:
        return 0.0
    return state.delta


class ThinkingPhase:
    def __init__(self, begin_token: int, end_token: int | None, delta: float):
        self.begin_token, self.end_token, self.delta = begin_token, end_token, delta

    def walk(self, req: Request, tokens: list[int], restart: bool = False):
        """Moves req's phase over tokens (restart: from the sequence's start)."""
        if req.features.thinking is None:
            req.features.thinking = ThinkingState()
        state = req.features.thinking
        if restart:
            state.delta = 0.0
        for t in tokens:
            if t == self.begin_token:
                state.delta = self.delta
            elif t == self.end_token:
                state.delta = 0.0
