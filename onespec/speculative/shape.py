"""A step's shape: how many rows and cache slots one step of a drafting method takes per
generation request, where each row sits in the position space, and how a graph step's
inputs and results are laid out.

The scheduler reserves slots and counts tokens with these, so a chain and a tree share one
scheduler; the runner, the CUDA-graph runner and kernels/chain.py read a step's flat inputs
(InputLayout) and results (ResultsLayout) through the shape, and a tree's extra verify
inputs (TreeInputs) come from `tree_inputs`. K is the step's draft length (0: a plain
decode step). A new shape implements the same methods.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onespec.engine.kv_cache import slots_per_step
from onespec.speculative.tree import TreeInputs, ancestor_matrix, depths_of, mask_tree_block
from onespec.speculative.tree_step import tree_step

PAD_DRAFT = 0         # stands in for missing drafts; verifying it stays lossless


@dataclass(frozen=True)
class ChainShape:
    """K drafts in a row: the target verifies [t_last, d1..dK] (docs/DECODING.md)."""
    drafting: bool = True          # a drafter is loaded (its passes write past the verify)
    # a DFlash drafter's block size (speculative/dflash.py): its block of rows after the
    # last verified position p writes p + 1 .. p + block
    block: int = 0

    def verify_rows(self, k: int) -> int:
        return k + 1

    def num_drafts(self, k: int) -> int:
        return k

    def gen_slots(self, k: int) -> int:
        if self.block:          # p <= P + K, so up to P + K + block
            return k + 1 + self.block
        return slots_per_step(k, self.drafting)

    def ctx_slots(self, k: int) -> int:
        """Slots past the end of a prompt's last chunk its draft passes write (K - 1; a
        DFlash block: block)."""
        if self.block:
            return self.block
        return max(k - 1, 0) if self.drafting else 0

    def draft_kv_slots(self, k: int) -> int:
        """Draft-KV positions the draft loop writes past the verify's last key."""
        return self.block or k

    def results_layout(self, b: int, k: int) -> ResultsLayout:
        return ResultsLayout(b, k, k, has_parents=False)

    def input_layout(self, b: int, k: int, width: int) -> InputLayout:
        return InputLayout(b, self.verify_rows(k), k, False, width)

    def verified_drafts(self, req, k: int) -> tuple[list[int], list[int] | None]:
        """The drafts a generation request verifies in a step of draft length k, and None
        (a chain has no parents). Missing drafts are padding (PAD_DRAFT)."""
        return (req.draft_tokens[:k] + [PAD_DRAFT] * k)[:k], None

    def row_offsets(self, parents, k: int):
        """Each verify row's position past the request's last computed one: 0..K."""
        return range(k + 1)

    def run_step(self, worker, inp):
        """verify -> accept -> draft K in a row (SpecWorker.chain_step)."""
        return worker.chain_step(inp)

    def tree_inputs(self, k, parents, base, meta, gen_rows, rotary=None) -> None:
        """A chain's verify is causal: no tree inputs."""
        return None

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

    def draft_kv_slots(self, k: int) -> int:
        return self.num_draft_slots if k else 0

    def results_layout(self, b: int, k: int) -> ResultsLayout:
        """A tree step's results (K = depth) carry its nodes' parents; a K = 0 step's none."""
        return ResultsLayout(b, k, self.num_drafts(k), has_parents=k > 0)

    def input_layout(self, b: int, k: int, width: int) -> InputLayout:
        """A tree step's inputs carry its nodes' parents after the nodes."""
        return InputLayout(b, self.verify_rows(k), self.num_drafts(k), k > 0, width)

    def row_offsets(self, parents, k: int):
        """Each verify row's rotary position past the request's last computed one: the
        root's 0, each node's depth (a K = 0 step: the root only)."""
        return depths_of(parents) if k else range(1)

    def run_step(self, worker, inp):
        """Tree-masked verify -> acceptance along one path -> draft the next tree
        (tree_step.py); a K = 0 step is a chain's."""
        if not inp.k:
            return worker.chain_step(inp)
        ctx, accepted, num_accepted, drafts, parents = tree_step(worker, inp, self)
        return worker.results(ctx, accepted, num_accepted, drafts, draft_parents=parents)

    def tree_inputs(self, k, parents, base, meta, gen_rows, rotary=None) -> TreeInputs | None:
        """The tree verify's inputs: each request's rows see the prefix and their own
        ancestors in the block [P, P + N]. parents [b, N] (on the device), base [b] = P,
        gen_rows: the requests' indices in meta; rotary: every row's rotary position, or
        None to derive the generation rows' (P + depth) from the parents on the device."""
        if not k:
            return None
        ancestors = ancestor_matrix(parents, self.depth)                   # [b, R, R]
        if rotary is None:
            rotary = (base[:, None] + ancestors.sum(-1) - 1).reshape(-1)
        return TreeInputs(parents, ancestors, rotary,
                          mask_tree_block(meta, gen_rows, base, ancestors))

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
class InputLayout:
    """A graph step's inputs for a bucket of b requests as one flat int64 buffer:
    input ids [b, R] | positions [b, R] | drafts [b, D] | parents [b, D] (trees only) |
    block tables [b, width] | chain sources [b] (kernels/chain.py: the previous step's row
    a request continues, or -1) | recurrent-state slots [b] (hybrid targets only,
    engine/state_pool.py; a chained step's are its predecessor's, request for request).
    R verify rows, D drafts a request."""
    b: int
    rows: int
    num_drafts: int
    has_parents: bool
    width: int
    has_slots: bool = False

    @property
    def pos_at(self) -> int:
        return self.b * self.rows

    @property
    def drafts_at(self) -> int:
        return 2 * self.b * self.rows

    @property
    def parents_at(self) -> int:
        return self.drafts_at + self.b * self.num_drafts

    @property
    def tables_at(self) -> int:
        return self.parents_at + (self.b * self.num_drafts if self.has_parents else 0)

    @property
    def src_at(self) -> int:
        return self.tables_at + self.b * self.width

    @property
    def slots_at(self) -> int:
        return self.src_at + self.b

    @property
    def size(self) -> int:
        return self.slots_at + (self.b if self.has_slots else 0)

    def views(self, buf) -> dict:
        """ids, pos [b, R], drafts and parents [b, D] (parents None for a chain), tables
        [b, width], src [b], slots [b] (None without): views of a buffer (a tensor or a
        numpy array) in this layout."""
        b = self.b
        return dict(ids=buf[:self.pos_at].reshape(b, self.rows),
                    pos=buf[self.pos_at:self.drafts_at].reshape(b, self.rows),
                    drafts=buf[self.drafts_at:self.parents_at].reshape(b, self.num_drafts),
                    parents=buf[self.parents_at:self.tables_at].reshape(b, self.num_drafts)
                    if self.has_parents else None,
                    tables=buf[self.tables_at:self.src_at].reshape(b, self.width),
                    src=buf[self.src_at:self.slots_at],
                    slots=buf[self.slots_at:self.size] if self.has_slots else None)


@dataclass(frozen=True)
class ResultsLayout:
    """A generation step's results for a bucket of b requests as one flat int64 tensor:
    accepted [b, K+1] | num_accepted [b] | drafts [d, D] | parents [d, D] (trees only),
    D drafts a row, d draft rows (b in a graph step; an eager step's drafting requests,
    prompts that finished this step included). The model runner, the CUDA-graph runner
    and kernels/chain.py write and read them through this one object (a shape's
    results_layout)."""
    b: int
    k: int
    num_drafts: int
    has_parents: bool
    draft_rows: int | None = None

    @classmethod
    def of(cls, k: int, num_accepted, drafts, parents=None) -> ResultsLayout:
        """The layout of a step's result tensors: num_accepted [b], drafts [d, D]."""
        return cls(num_accepted.numel(), k, drafts.shape[1], parents is not None,
                   drafts.shape[0])

    @property
    def rows_of_drafts(self) -> int:
        return self.b if self.draft_rows is None else self.draft_rows

    @property
    def num_accepted_at(self) -> int:
        return self.b * (self.k + 1)

    @property
    def drafts_at(self) -> int:
        return self.num_accepted_at + self.b

    @property
    def parents_at(self) -> int:
        return self.drafts_at + self.rows_of_drafts * self.num_drafts

    @property
    def size(self) -> int:
        return self.parents_at + (self.rows_of_drafts * self.num_drafts
                                  if self.has_parents else 0)

    def pack(self, accepted, num_accepted, drafts, parents=None):               # [size]
        """accepted [b, K+1], num_accepted [b], drafts [d, D], parents [d, D] or None."""
        extra = [parents.reshape(-1)] if self.has_parents else []
        return torch.cat([accepted.reshape(-1), num_accepted, drafts.reshape(-1), *extra])

    def unpack(self, flat: list[int], n: int, n_drafts: int | None = None
               ) -> tuple[list[int], list[list[int]], list[list[int]], list[list[int]] | None]:
        """The first n requests' (num_accepted, accepted rows) and the first n_drafts
        (default n) draft rows' (drafts, parents or None) of results copied to the host as
        a list."""
        k1, nd = self.k + 1, self.num_drafts
        n_drafts = n if n_drafts is None else n_drafts
        accepted = [flat[i * k1:(i + 1) * k1] for i in range(n)]
        num_acc = flat[self.num_accepted_at:self.num_accepted_at + n]
        at = self.drafts_at
        drafts = [flat[at + i * nd:at + (i + 1) * nd] for i in range(n_drafts)]
        at = self.parents_at
        parents = [flat[at + i * nd:at + (i + 1) * nd] for i in range(n_drafts)] \
            if self.has_parents else None
        return num_acc, accepted, drafts, parents
