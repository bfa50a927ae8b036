"""One engine step's grammar masks (docs/ARCHITECTURE.md, "Guided decoding").

Verify: row j of a constrained generation request is masked with its matcher advanced
through drafts 1..j (the state the target's token at that row follows); the matchers are
rolled back as soon as the masks are filled, before the step runs. Draft loop: after
acceptance the worker calls `start` with the step's emitted tokens (one host copy), then
`advance` after each draft step with the drafts just picked; each returns the next draft
step's mask. `rollback` restores every matcher to the request's emitted tokens, which
Scheduler.postprocess then feeds it for good.

Rows whose state has no mask (a draft the grammar rejects, a terminated matcher) are left
unconstrained: their tokens are never emitted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from onespec.engine.scheduler import ScheduledBatch


@dataclass
class RowMask:
    """The constrained rows of a batch of logit rows and their masks."""
    index: torch.Tensor        # [M] int64 rows, on the device
    rows: list[int]            # the same, on the host
    free: torch.Tensor         # [N - M] int64 the other rows
    bitmask: torch.Tensor      # [M, W] int32 xgrammar token bitmask, on the device


class _Slot:
    """A drafting request's matcher and how far this step has advanced it."""

    def __init__(self, matcher, source: tuple[str, int]):
        self.matcher, self.source = matcher, source
        self.advanced = 0
        self.live = True

    def accept(self, token: int):
        if not self.live:
            return
        if not self.matcher.accept_token(token):
            self.live = False
            return
        self.advanced += 1
        if self.matcher.is_terminated():
            self.live = False


class StepGrammar:
    def __init__(self, backend, batch: "ScheduledBatch", drafts: list[list[int]],
                 draft_reqs: list[int], device):
        """backend: the GrammarBackend; drafts: [Bg][K] the drafts each generation request
        verifies; draft_reqs: batch indices of the requests that draft this step (context
        chunks first)."""
        self.xgr, self.vocab_size, self.device = backend.xgr, backend.vocab_size, device
        self.filler = backend.filler
        self.verify = self._verify_mask(batch, drafts)
        num_ctx = len(batch.context)
        reqs = batch.requests
        self.slots: list[_Slot | None] = [
            None if reqs[i].grammar is None else
            _Slot(reqs[i].grammar, ("ctx", i) if i < num_ctx else ("gen", i - num_ctx))
            for i in draft_reqs]

    @staticmethod
    def needed(batch: "ScheduledBatch") -> bool:
        return any(r.grammar is not None for r in batch.requests)

    def _bitmask(self, rows: int) -> torch.Tensor:
        return torch.full(self.xgr.get_bitmask_shape(rows, self.vocab_size), -1,
                          dtype=torch.int32)

    def _row_mask(self, bitmask: torch.Tensor, rows: list[int]) -> RowMask | None:
        if not rows:
            return None
        taken = set(rows)
        free = [i for i in range(bitmask.shape[0]) if i not in taken]
        as_long = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        return RowMask(as_long(rows), rows, as_long(free),
                       bitmask[rows].to(self.device, non_blocking=True))

    # ---- verify rows -------------------------------------------------------------------
    def _verify_mask(self, batch: "ScheduledBatch", drafts: list[list[int]]) -> RowMask | None:
        """Masks of the logit rows: context chunks (one row each) then K+1 rows per
        generation request."""
        k, num_ctx = batch.k, len(batch.context)
        bitmask = self._bitmask(num_ctx + len(batch.generation) * (k + 1))
        rows = [i for i, c in enumerate(batch.context) if c.is_last and c.req.grammar]
        if rows:
            self.filler.batch_fill_next_token_bitmask(
                [batch.context[i].req.grammar for i in rows], bitmask, indices=rows)
        slots = [(_Slot(r.grammar, ("gen", g)), num_ctx + g * (k + 1), drafts[g])
                 for g, r in enumerate(batch.generation) if r.grammar is not None]
        # per generation request: how many of its leading drafts the grammar allows
        self.valid_drafts = [k] * len(batch.generation)
        try:
            for j in range(k + 1):
                live = [(s, base) for s, base, _ in slots if s.live]
                if not live:
                    break
                index = [base + j for _, base in live]
                self.filler.batch_fill_next_token_bitmask([s.matcher for s, _ in live],
                                                          bitmask, indices=index)
                rows += index
                if j < k:
                    for s, _, d in slots:
                        s.accept(d[j])
            for s, _, _ in slots:
                self.valid_drafts[s.source[1]] = s.advanced
        finally:
            for s, _, _ in slots:
                if s.advanced:
                    s.matcher.rollback(s.advanced)
        return self._row_mask(bitmask, rows)

    # ---- draft loop --------------------------------------------------------------------
    def start(self, context_tokens: torch.Tensor,   # [Bc]
              accepted: torch.Tensor,               # [Bg, K+1]
              num_accepted: torch.Tensor,           # [Bg]
              ) -> RowMask | None:                  # masks of draft step 0, per draft row
        """Advances each drafting request's matcher through the tokens this step emits."""
        ctx = context_tokens.tolist()
        acc, num = accepted.tolist(), num_accepted.tolist()
        for s in self.slots:
            if s is None:
                continue
            kind, i = s.source
            for t in [ctx[i]] if kind == "ctx" else acc[i][:num[i]]:
                s.accept(t)
        return self._draft_mask()

    def advance(self, drafts: torch.Tensor) -> RowMask | None:  # [Bd] target ids
        """Advances the matchers through the drafts just picked; the next step's masks."""
        for s, t in zip(self.slots, drafts.tolist()):
            if s is not None:
                s.accept(t)
        return self._draft_mask()

    def _draft_mask(self) -> RowMask | None:
        rows = [r for r, s in enumerate(self.slots) if s is not None and s.live]
        bitmask = self._bitmask(len(self.slots))
        if rows:
            self.filler.batch_fill_next_token_bitmask([self.slots[r].matcher for r in rows],
                                                      bitmask, indices=rows)
        return self._row_mask(bitmask, rows)

    def rollback(self):
        """Every matcher back to the request's emitted tokens (before this step's)."""
        for s in self.slots:
            if s is not None and s.advanced:
                s.matcher.rollback(s.advanced)
                s.advanced = 0
