"""How many rows and cache slots one step of a drafting method takes, per generation request.

The scheduler reserves slots and counts tokens with these, so a chain and a tree share one
scheduler. K is the step's draft length (0: a plain decode step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onespec.engine.kv_cache import slots_per_step

PAD_DRAFT = 0         # stands in for missing drafts; verifying it stays lossless


@dataclass(frozen=True)
class ChainShape:
    """K drafts in a row: the target verifies [t_last, d1..dK] (docs/DECODING.md)."""
    drafting: bool = True          # a drafter is loaded (its passes write past the verify)

    def verify_rows(self, k: int) -> int:
        return k + 1

    def num_drafts(self, k: int) -> int:
        return k

    def gen_slots(self, k: int) -> int:
        return slots_per_step(k, self.drafting)

    def ctx_slots(self, k: int) -> int:
        """Slots past the end of a prompt's last chunk its draft passes write (K - 1)."""
        return max(k - 1, 0) if self.drafting else 0

    def results_layout(self, b: int, k: int) -> ResultsLayout:
        return ResultsLayout(b, k, k, has_parents=False)

    def verified_drafts(self, req, k: int) -> tuple[list[int], list[int] | None]:
        """The drafts a generation request verifies in a step of draft length k, and None
        (a chain has no parents). Missing drafts are padding (PAD_DRAFT)."""
        return (req.draft_tokens[:k] + [PAD_DRAFT] * k)[:k], None

    @staticmethod
    def commit_states(states, rb, num_accepted: torch.Tensor):
        """The one place per-position recurrent state is committed (hybrid targets,
        engine/state_pool.py): a generation request's verify rows [t_last, d1..dK] left
        the state after each row; with n tokens accepted the inputs t_last, d1..d(n-1)
        are kept, so its slot takes the state after row n - 1, and the rejected drafts'
        states are dropped. A prompt chunk keeps the state after its last row."""
        states.commit(rb, num_accepted - 1)


@dataclass(frozen=True)
class TreeShape:
    """A dynamic tree (docs/DECODING.md, "dynamic trees"): `depth` levels, `top_k` frontier
    nodes a level with `top_k` children each, `num_nodes` nodes kept and verified. A step
    with K > 0 drafts the whole tree; K = 0 is a plain decode step."""
    depth: int
    top_k: int
    num_nodes: int

    @property
    def num_candidates(self) -> int:
        """Nodes the expansion scores: top_k at depth 1, top_k² at each later depth."""
        return self.top_k + (self.depth - 1) * self.top_k * self.top_k

    @property
    def num_draft_slots(self) -> int:
        """Draft-KV slots past the root for the nodes the expansion runs (depths 1..D-1)."""
        return (self.depth - 1) * self.top_k

    def verify_rows(self, k: int) -> int:
        return self.num_nodes + 1 if k else 1

    def num_drafts(self, k: int) -> int:
        return self.num_nodes if k else 0

    def gen_slots(self, k: int) -> int:
        """The verify writes P..P+N; the expansion writes the root's slot P + n - 1 <= P + N
        plus num_draft_slots after it."""
        return self.num_nodes + 1 + self.num_draft_slots if k else 1

    def ctx_slots(self, k: int) -> int:
        return self.num_draft_slots if k else 0

    def results_layout(self, b: int, k: int) -> ResultsLayout:
        """A tree step's results (K = depth) carry its nodes' parents; a K = 0 step's none."""
        return ResultsLayout(b, k, self.num_drafts(k), has_parents=k > 0)

    def verified_drafts(self, req, k: int) -> tuple[list[int], list[int] | None]:
        """The nodes a generation request verifies and their parents; K = 0 is a chain's
        (no drafts). A request without a whole tree (its first step, or after a K = 0
        step) verifies N padding nodes under the root."""
        if not k:
            return [], None
        n = self.num_nodes
        if len(req.draft_tokens) == n and len(req.draft_parents) == n:
            return list(req.draft_tokens), list(req.draft_parents)
        return [PAD_DRAFT] * n, [0] * n


@dataclass(frozen=True)
class ResultsLayout:
    """A generation step's results for a bucket of b requests as one flat int64 tensor:
    accepted [b, K+1] | num_accepted [b] | drafts [b, D] | parents [b, D] (trees only),
    D drafts a request. The CUDA-graph runner writes and reads them, and kernels/chain.py
    reads them, through this one object (a shape's results_layout)."""
    b: int
    k: int
    num_drafts: int
    has_parents: bool

    @property
    def num_accepted_at(self) -> int:
        return self.b * (self.k + 1)

    @property
    def drafts_at(self) -> int:
        return self.num_accepted_at + self.b

    @property
    def parents_at(self) -> int:
        return self.drafts_at + self.b * self.num_drafts

    @property
    def size(self) -> int:
        return self.parents_at + (self.b * self.num_drafts if self.has_parents else 0)

    def pack(self, accepted, num_accepted, drafts, parents=None):               # [size]
        """accepted [b, K+1], num_accepted [b], drafts [b, D], parents [b, D] or None."""
        extra = [parents.reshape(-1)] if self.has_parents else []
        return torch.cat([accepted.reshape(-1), num_accepted, drafts.reshape(-1), *extra])

    def unpack(self, flat: list[int], n: int) -> tuple[list[int], list[list[int]],
                                                     list[list[int]], list[list[int]] | None]:
        """The first n requests' (num_accepted, accepted rows, drafts, parents or None) of
        results copied to the host as a list."""
        k1, nd = self.k + 1, self.num_drafts
        accepted = [flat[i * k1:(i + 1) * k1] for i in range(n)]
        num_acc = flat[self.num_accepted_at:self.num_accepted_at + n]
        at = self.drafts_at
        drafts = [flat[at + i * nd:at + (i + 1) * nd] for i in range(n)]
        at = self.parents_at
        parents = [flat[at + i * nd:at + (i + 1) * nd] for i in range(n)] \
            if self.has_parents else None
        return num_acc, accepted, drafts, parents
