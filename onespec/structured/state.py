"""A constrained request's grammar state (Request.features.grammar): its matcher, fed
every emitted token, and the masks its last graphed draft loop used (structured/step.py).
Only structured/ writes it; it outlives preemption, since the emitted tokens it has seen
are kept, and is dropped when the request finishes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GrammarState:
    matcher: Any                    # xgrammar GrammarMatcher
    draft_masks: Any = None         # structured/step.py DraftMasks (graphed steps)

    def accept(self, token: int, num_before: int) -> tuple[str, str | None] | None:
        """Feeds an emitted token (num_before: output tokens before it). None while the
        request goes on; ("stop", None) once the grammar has terminated; ("error", why) if
        it rejects the token (masking makes that impossible unless something is broken)."""
        if not self.matcher.accept_token(token):
            return "error", f"the grammar rejected token {token} after {num_before} output tokens"
        if self.matcher.is_terminated():
            return "stop", None
        return None
