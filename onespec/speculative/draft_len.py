"""When and how much to draft (docs/DECODING.md, "around the loop"): draft_len_schedule and
the speculation gate."""
from __future__ import annotations

from collections import deque


def draft_len_for_batch(schedule: dict[int, int] | None, max_draft_len: int,
                        batch_size: int) -> int:
    """K for a batch of `batch_size` requests: the value at the first key >= batch_size.

    {1: 4, 4: 2, 8: 1}: n=1 -> 4, n=3 -> 2, n=8 -> 1, n=9 -> 0 (above the largest key).
    No schedule -> max_draft_len. Values are validated against max_draft_len by the config.
    """
    if schedule is None:
        return max_draft_len
    for max_batch in sorted(schedule):
        if max_batch >= batch_size:
            return schedule[max_batch]
    return 0


class SpeculationGate:
    """Turns speculation off for good once the rolling mean of (acceptance_length - 1), i.e.
    accepted drafts per step, over the last `window` finished requests drops below
    `threshold`. Decides only once `window` requests are recorded; (None, None) never gates.
    """

    def __init__(self, window: int | None, threshold: float | None):
        if (window is None) != (threshold is None):
            raise ValueError("window and threshold go together (both None = always on)")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        self.window = window
        self.threshold = threshold
        self._recent: deque[float] = deque(maxlen=window)
        self._enabled = True

    @property
    def enabled(self) -> bool:
        return self._enabled

    def record(self, acceptance_length: float) -> None:
        """Called once per finished request that had drafts."""
        if self.window is None or not self._enabled:
            return
        self._recent.append(acceptance_length - 1.0)
        if len(self._recent) == self.window:
            if sum(self._recent) / self.window < self.threshold:
                self._enabled = False
