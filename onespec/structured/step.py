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
    host: torch.Tensor | None = None   # [N, W] every row's bitmask on the host (a row
    #                                    without a mask allows every token)


def allow_all(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab_size / 32)] int32 bitmask that allows every token (xgrammar's
    layout: bit t % 32 of word t // 32 set when token t is allowed)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class GraphMasks:
    """The grammar masks of a graphed constrained step (engine/cuda_graph.py): every row of
    a bucket is masked from fixed device buffers, which the host fills before each replay
    (rows without a mask, padding rows included, allow every token)."""

    def __init__(self, bucket: int, k: int, vocab_size: int, device):
        rows = bucket * (k + 1)
        dev = lambda n: allow_all(n, vocab_size).to(device)    # noqa: E731
        every = lambda n: torch.arange(n, device=device)       # noqa: E731
        none = torch.empty(0, dtype=torch.int64, device=device)
        self.verify = RowMask(every(rows), list(range(rows)), none, dev(rows))
        self.draft = RowMask(every(bucket), list(range(bucket)), none, dev(bucket))
        self.valid = torch.full((bucket,), k, dtype=torch.int64, device=device)

    def valid_drafts_on(self, device) -> torch.Tensor:
        return self.valid

    @staticmethod
    def load(target: RowMask, source: RowMask | None):
        """Copies a StepGrammar mask's host rows into a graph buffer (the rest allow all)."""
        n = 0 if source is None else source.host.shape[0]
        if n:
            target.bitmask[:n].copy_(source.host, non_blocking=True)
        if n < target.bitmask.shape[0]:
            target.bitmask[n:].fill_(-1)

    def set_verify(self, grammar: "StepGrammar"):
        self.load(self.verify, grammar.verify)
        valid = grammar.valid_drafts
        self.valid[:len(valid)].copy_(torch.tensor(valid), non_blocking=True)

    def set_draft(self, mask: RowMask | None):
        self.load(self.draft, mask)


@dataclass
class DraftMasks:
    """The grammar masks a request's last graphed draft loop used, one per draft step: the
    mask of step j is the state after the emitted tokens and drafts 1..j, which is also
    the state of verify row j when the next step verifies those drafts. Valid while the
    request has emitted exactly num_outputs tokens and verifies exactly these drafts."""
    num_outputs: int
    drafts: list[int]
    rows: list[torch.Tensor | None]    # [K] host bitmask row of step j (None: not masked)

    def matches(self, req, drafts: list[int], k: int) -> bool:
        return (len(self.rows) == k and self.drafts == drafts
                and self.num_outputs == len(req.output_token_ids))


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
                 draft_reqs: list[int], device, host_only: bool = False):
        """backend: the GrammarBackend; drafts: [Bg][K] the drafts each generation request
        verifies; draft_reqs: batch indices of the requests that draft this step (context
        chunks first). host_only: masks are kept on the host only (RowMask.rows and .host:
        a graphed step copies them into its own buffers, GraphMasks), and verify rows reuse
        the draft loop's masks (DraftMasks)."""
        self.vocab_size, self.device = backend.vocab_size, device
        self.fill, self.host_only = backend.fill, host_only
        self.reused = 0          # verify rows whose mask came from the last draft loop
        self.verify = self._verify_mask(batch, drafts)
        num_ctx = len(batch.context)
        reqs = batch.requests
        self.slots: list[_Slot | None] = [
            None if (g := reqs[i].features.grammar) is None else
            _Slot(g.matcher, ("ctx", i) if i < num_ctx else ("gen", i - num_ctx))
            for i in draft_reqs]

    @staticmethod
    def needed(batch: "ScheduledBatch") -> bool:
        return any(r.features.grammar is not None for r in batch.requests)

    def _bitmask(self, rows: int) -> torch.Tensor:
        return allow_all(rows, self.vocab_size)

    def _row_mask(self, bitmask: torch.Tensor, rows: list[int]) -> RowMask | None:
        if not rows:
            return None
        if self.host_only:
            return RowMask(None, rows, None, None, bitmask)
        taken = set(rows)
        free = [i for i in range(bitmask.shape[0]) if i not in taken]
        as_long = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        return RowMask(as_long(rows), rows, as_long(free),
                       bitmask[rows].to(self.device, non_blocking=True), bitmask)

    # ---- verify rows -------------------------------------------------------------------
    def _verify_mask(self, batch: "ScheduledBatch", drafts: list[list[int]]) -> RowMask | None:
        """Masks of the logit rows: context chunks (one row each) then K+1 rows per
        generation request."""
        k, num_ctx = batch.k, len(batch.context)
        bitmask = self._bitmask(num_ctx + len(batch.generation) * (k + 1))
        rows = [i for i, c in enumerate(batch.context) if c.is_last and c.req.features.grammar]
        if rows:
            self.fill([batch.context[i].req.features.grammar.matcher for i in rows], bitmask,
                      indices=rows)
        slots = [(_Slot(r.features.grammar.matcher, ("gen", g)), num_ctx + g * (k + 1), drafts[g])
                 for g, r in enumerate(batch.generation) if r.features.grammar is not None]
        # masks of rows 0..K-1 the last draft loop filled for these very drafts and states
        reuse = {g: m.rows for g, r in enumerate(batch.generation)
                 if self.host_only and r.features.grammar is not None
                 and (m := r.features.grammar.draft_masks) is not None
                 and m.matches(r, drafts[g], k)}
        # per generation request: how many of its leading drafts the grammar allows
        self.valid_drafts = [k] * len(batch.generation)
        try:
            for j in range(k + 1):
                live = [(s, base) for s, base, _ in slots if s.live]
                if not live:
                    break
                index = [base + j for _, base in live]
                fresh = []
                for s, base in live:
                    kept = reuse[s.source[1]][j] if j < k and s.source[1] in reuse else None
                    if kept is None:
                        fresh.append((s, base + j))
                    else:
                        bitmask[base + j] = kept
                        self.reused += 1
                if fresh:
                    self.fill([s.matcher for s, _ in fresh], bitmask,
                              indices=[i for _, i in fresh])
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
    def valid_drafts_on(self, device) -> torch.Tensor:       # [Bg]
        return torch.tensor(self.valid_drafts, device=device)

    def start(self, ctx: list[int],              # [Bc] context tokens
              acc: list[list[int]],              # [Bg][K+1] accepted rows
              num: list[int],                    # [Bg] accepted counts
              ) -> RowMask | None:               # masks of draft step 0, per draft row
        """Advances each drafting request's matcher through the tokens this step emits."""
        for s in self.slots:
            if s is None:
                continue
            kind, i = s.source
            for t in [ctx[i]] if kind == "ctx" else acc[i][:num[i]]:
                s.accept(t)
        return self._draft_mask()

    def advance(self, drafts: list[int]) -> RowMask | None:  # [Bd] target ids
        """Advances the matchers through the drafts just picked; the next step's masks."""
        for s, t in zip(self.slots, drafts):
            if s is not None:
                s.accept(t)
        return self._draft_mask()

    def _draft_mask(self) -> RowMask | None:
        rows = [r for r, s in enumerate(self.slots) if s is not None and s.live]
        bitmask = self._bitmask(len(self.slots))
        if rows:
            self.fill([self.slots[r].matcher for r in rows], bitmask, indices=rows)
        return self._row_mask(bitmask, rows)

    def keep_draft_masks(self, reqs, masks: list[RowMask | None], drafts: list[list[int]],
                         num_outputs: list[int]):
        """After a graphed draft loop: each constrained request keeps the masks its draft
        steps used (masks[j], step j's) for the next step's verify rows, which are masked
        with the same states. drafts [Bg][K]: the drafts picked; num_outputs: each
        request's emitted-token count once this step's tokens are appended."""
        for g, req in enumerate(reqs):
            state = req.features.grammar
            if state is None:
                continue
            rows = [m.host[g].clone() if m is not None and g in m.rows else None
                    for m in masks]
            state.draft_masks = DraftMasks(num_outputs[g], list(drafts[g]), rows)

    def rollback(self):
        """Every matcher back to the request's emitted tokens (before this step's)."""
        for s in self.slots:
            if s is not None and s.advanced:
                s.matcher.rollback(s.advanced)
                s.advanced = 0
