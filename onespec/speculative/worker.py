"""The one-model speculative step (docs/DECODING.md, "one engine step", "draft loop"):
target verify -> accept -> draft loop.

A batch holds Bc context chunks (rows first) and Bg generation requests of K+1 rows each.
All work stays on the device; the caller copies the small results to the host once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from onespec.layers.attention import (AttentionMetadata, advance_decode_metadata,
                                      build_attention_metadata)
from onespec.layers.logprobs import LogprobRows, TokenLogprobs, token_logprobs
from onespec.layers.processors import RowProcessors
from onespec.layers.sampler import (DRAFT_DRAW, SamplingTensors, masked_logits,
                                    probs_from_logits, sample, sample_from_probs)
from onespec.speculative.acceptors import StrictAcceptor
from onespec.speculative.drafter import Drafter
from onespec.speculative.parallel import parallel_forward
from onespec.speculative.shape import ChainShape, TreeShape
from onespec.speculative.tree import TreeInputs
from onespec.structured.step import RowMask, StepGrammar


@dataclass
class StepInputs:
    input_ids: torch.Tensor          # [T]
    positions: torch.Tensor          # [T]
    meta: AttentionMetadata
    block_tables: torch.Tensor       # [B, nb]
    num_ctx: int
    num_gen: int
    k: int
    logit_rows: torch.Tensor         # [Bc + Bg·(K+1)] rows whose logits are needed
    ctx_last_rows: torch.Tensor      # [Bc] last row of each context chunk
    draft_ctx_rows: torch.Tensor     # [Bdc] last rows of chunks that end their prompt
    draft_reqs: torch.Tensor         # [Bdc + Bg] batch index of each request that drafts
    gen_start: int                   # first generation row (= context rows)
    shift_ids: torch.Tensor          # [T] step-0 draft inputs: x(p+1) where known already
    draft_tokens: torch.Tensor       # [Bg, K] drafts being verified
    draft_probs: torch.Tensor | None  # [Bg, K, V] q of those drafts (rejection sampling)
    row_sampling: SamplingTensors    # per logit row
    gen_sampling: SamplingTensors    # per generation request
    draft_sampling: SamplingTensors  # per drafting request (draft_reqs)
    max_kv_draft: int                # host bound on draft-step key lengths
    block_size: int
    relaxed_delta: torch.Tensor | None = None  # [Bg] thinking delta (relaxed acceptance)
    grammar: StepGrammar | None = None   # masks of constrained requests (structured outputs)
    tree: TreeInputs | None = None       # tree verify of the generation requests (trees)
    processors: RowProcessors | None = None  # logit rows with logit processors
    logprob_rows: LogprobRows | None = None  # logit rows whose tokens' logprobs are wanted
    prompt_logprob_rows: LogprobRows | None = None  # hidden rows scoring prompt tokens


@dataclass
class DraftLoop:
    """The draft loop's state between its steps: hidden rows, positions and block tables
    of the drafting requests, the attention metadata of the last step, drafts so far."""
    h: torch.Tensor                        # [Bd, H]
    pos: torch.Tensor                      # [Bd]
    block_tables: torch.Tensor             # [Bd, nb]
    meta: AttentionMetadata | None = None
    tokens: list = field(default_factory=list)   # [Bd] target ids per step
    probs: list = field(default_factory=list)    # [Bd, V] q per step (rejection sampling)
    ahead: torch.Tensor | None = None      # [K, Bd, H] every step's hidden (parallel drafting)

    def result(self, with_probs: bool):
        """drafts [Bd, K] and, with rejection sampling, their q [Bd, K, V]."""
        return torch.stack(self.tokens, 1), torch.stack(self.probs, 1) if with_probs else None


@dataclass
class StepResults:
    context_tokens: torch.Tensor     # [Bc]
    accepted: torch.Tensor           # [Bg, K+1]
    num_accepted: torch.Tensor       # [Bg]
    drafts: torch.Tensor             # [Bd, K] target ids, one row per draft_reqs entry
    draft_probs: torch.Tensor | None  # [Bd, K, V] in target-vocab space (rejection sampling)
    relaxed: torch.Tensor | None = None  # [Bg, K] drafts accepted by the relaxed rule only
    draft_parents: torch.Tensor | None = None  # [Bd, N] parent of each drafted node (trees)
    logprobs: TokenLogprobs | None = None      # of inp.logprob_rows' chosen tokens
    prompt_logprobs: TokenLogprobs | None = None   # of inp.prompt_logprob_rows' tokens


class Verifier:
    """The target's side of acceptance: the logits, greedy tokens and samples of hidden
    rows [R, H], grammar-masked rows masked. Acceptors (acceptors.py) read it."""

    def __init__(self, target, generator=None):
        self.target = target
        self.generator = generator           # for rows of unseeded requests

    def logits(self, rows, mask: RowMask | None,
               proc: RowProcessors | None = None):                            # [R, V]
        """The rows' logits, processed (logit processors) and then masked (grammars)."""
        logits = self.target.compute_logits(rows)
        if proc is not None:
            logits = logits.float()
            logits[proc.index] = proc.apply(logits[proc.index])
        if mask is not None:
            logits = logits.float()
            logits[mask.index] = masked_logits(logits[mask.index], mask.bitmask)
        return logits

    def greedy(self, rows, mask: RowMask | None, proc: RowProcessors | None = None):  # [R]
        """The fused argmax for free rows, the argmax of masked logits for constrained ones."""
        if proc is not None:
            return self.logits(rows, mask, proc).argmax(-1)
        if mask is None:
            return self.target.greedy_tokens(rows)
        tokens = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
        if mask.free.numel():
            tokens[mask.free] = self.target.greedy_tokens(rows[mask.free])
        logits = self.target.compute_logits(rows[mask.index])
        tokens[mask.index] = masked_logits(logits, mask.bitmask).argmax(-1)
        return tokens

    def tokens(self, rows, st: SamplingTensors, mask: RowMask | None,
               proc: RowProcessors | None = None):                            # [R]
        """The target's token of each row: greedy, or sampled with the rows' settings."""
        if st.all_greedy:
            return self.greedy(rows, mask, proc)
        return sample(self.logits(rows, mask, proc), st, self.generator)


class SpecWorker:
    """One speculative step on this rank: the step shape's verify -> accept -> draft
    (steps.py), the acceptance rule chosen once at build (acceptors.py)."""

    def __init__(self, target, drafter: Drafter | None = None,
                 acceptor: StrictAcceptor | None = None, generator=None,
                 attn_backend: str = "torch", tree: TreeShape | None = None, states=None):
        self.target, self.drafter = target, drafter
        self.states = states                  # a hybrid target's StatePool (state_pool.py)
        self.tree = tree                      # dynamic-tree drafting (EAGLE-3)
        # runs the step: verify -> accept -> draft (a DFlash block writes further ahead)
        self.shape = tree or ChainShape(block=getattr(drafter, "block_size", 0))
        self.acceptor = acceptor or StrictAcceptor()
        self.verifier = Verifier(target, generator)
        self.generator = generator
        self.attn_backend = attn_backend
        self._vocab_ids = drafter.draft_vocab_target_ids() if drafter else None

    @property
    def use_rejection_sampling(self) -> bool:
        """Drafts are sampled from q and their q kept (the rejection-sampling acceptor)."""
        return self.acceptor.needs_draft_probs

    @property
    def forced_key(self) -> tuple:
        """What a graph of a step bakes in of the acceptor (the graphs are keyed by it)."""
        return self.acceptor.graph_key

    @torch.inference_mode()
    def step(self, inp: StepInputs) -> StepResults:
        try:
            return self._step(inp)
        finally:          # the grammar matchers keep only what postprocess feeds them
            if inp.grammar is not None:
                inp.grammar.rollback()

    def _step(self, inp: StepInputs) -> StepResults:
        return self.shape.run_step(self, inp)

    @staticmethod
    def results(context_tokens, accepted, num_accepted, drafts, draft_probs=None,
                **extra) -> StepResults:
        return StepResults(context_tokens, accepted, num_accepted, drafts, draft_probs, **extra)

    def chain_step(self, inp: StepInputs) -> StepResults:
        """A chain step: verify [t_last, d1..dK] -> accept -> draft K in a row."""
        hidden, captured = self.verify_rows(inp, inp.positions, inp.meta)
        rows = hidden[inp.logit_rows]
        acc = self.acceptor.accept(self.verifier, inp, rows)
        logprobs, prompt_logprobs = self.logprobs(inp, hidden, rows, acc)
        drafts, draft_probs = self._propose(inp, hidden, captured, acc.context_tokens,
                                            acc.accepted, acc.num_accepted)
        # last: a step that raises before this leaves every recurrent state as it was
        # (the engine may run it again in parts); the drafters keep no recurrent state
        self.commit_states(inp, acc.num_accepted)
        return StepResults(acc.context_tokens, acc.accepted, acc.num_accepted, drafts,
                           draft_probs, acc.relaxed, logprobs=logprobs,
                           prompt_logprobs=prompt_logprobs)

    def logprobs(self, inp: StepInputs, hidden, rows, acc):
        """The raw log-probabilities the step was asked for: of the tokens chosen at
        inp.logprob_rows (verify rows: those of emitted tokens are read), and of the prompt
        tokens inp.prompt_logprob_rows score. (None, None) when none were asked for."""
        out, prompt = None, None
        lr = inp.logprob_rows
        if lr is not None:
            chosen = torch.cat([acc.context_tokens, acc.accepted.reshape(-1)])[lr.index]
            out = token_logprobs(self.target.compute_logits(rows[lr.index]), chosen,
                                 lr.num_top)
        pr = inp.prompt_logprob_rows
        if pr is not None:
            prompt = token_logprobs(self.target.compute_logits(hidden[pr.index]), pr.tokens,
                                    pr.num_top)
        return out, prompt

    def commit_states(self, inp: StepInputs, num_accepted):
        """Hybrid targets: each request's recurrent state at its accepted length
        (ChainShape.commit_states)."""
        if self.states is not None and inp.meta.recurrent is not None:
            ChainShape.commit_states(self.states, inp.meta.recurrent, num_accepted)

    def verify_rows(self, inp: StepInputs, positions, meta):
        """The target over the step's rows: hidden [T, H] and the drafter's captured layers."""
        capture = self.drafter.capture_layers if self.drafter else ()
        return self.target(inp.input_ids, positions, meta, capture)

    # ---- draft loop --------------------------------------------------------------------
    def _propose(self, inp: StepInputs, hidden, captured, context_tokens, accepted,
                 num_accepted):
        loop = self.draft_begin(inp, hidden, captured, context_tokens, accepted, num_accepted)
        if loop is None:
            return inp.input_ids.new_empty(len(inp.draft_reqs), 0), None
        grammar = inp.grammar
        mask = None if grammar is None else grammar.start(
            context_tokens.tolist(), accepted.tolist(), num_accepted.tolist())
        for step in range(inp.k):
            token = self.draft_next(inp, loop, step, mask)
            if grammar is not None and step < inp.k - 1:  # a host round trip per draft step
                mask = grammar.advance(token.tolist())
        return loop.result(self.use_rejection_sampling)

    def verify(self, inp: StepInputs) -> tuple:
        """The step up to the draft loop, for callers that drive the loop with draft_next
        themselves (the constrained CUDA-graph step): target verify, acceptance, draft step
        0's forward. Returns (context tokens, accepted, accepted counts, DraftLoop | None)."""
        hidden, captured = self.verify_rows(inp, inp.positions, inp.meta)
        acc = self.acceptor.accept(self.verifier, inp, hidden[inp.logit_rows])
        self.commit_states(inp, acc.num_accepted)
        loop = self.draft_begin(inp, hidden, captured, acc.context_tokens, acc.accepted,
                                acc.num_accepted)
        return acc.context_tokens, acc.accepted, acc.num_accepted, loop

    def draft_begin(self, inp: StepInputs, hidden, captured, context_tokens, accepted,
                    num_accepted) -> DraftLoop | None:
        """Draft step 0's forward over every row (it writes the draft KV of every
        position), then the loop at the rows the drafting requests continue from; None
        when nothing is drafted (no drafter, K = 0, or prompt chunks only, none ending its
        prompt)."""
        if self.drafter is None:
            return None
        if getattr(self.drafter, "parallel", False):      # one forward drafts all K
            propose = getattr(self.drafter, "propose_block", None)     # (DFlash: dflash.py)
            out = propose(inp, captured, context_tokens, accepted, num_accepted,
                          self.attn_backend) if propose is not None else \
                parallel_forward(self.drafter, inp, captured, context_tokens, accepted,
                                 num_accepted, self.attn_backend)
            if out is None:
                return None
            ahead, pos = out                                # [K, Bd, H], [Bd]
            return DraftLoop(ahead[0], pos, None, ahead=ahead)
        h = self.first_pass(inp, hidden, captured, context_tokens, accepted)
        if inp.k == 0 or len(inp.draft_reqs) == 0:
            return None
        return DraftLoop(*self.roots(inp, h, num_accepted, inp.k + 1))

    def draft_next(self, inp: StepInputs, loop: DraftLoop, step: int,
                   mask: RowMask | None) -> torch.Tensor:
        """Draft step `step` (its forward for step > 0, then the pick): the drafts [Bd]."""
        if step > 0 and loop.ahead is not None:
            loop.pos = loop.pos + 1
            loop.h = loop.ahead[step]
        elif step > 0:
            loop.pos = loop.pos + 1
            loop.meta = build_attention_metadata(
                loop.block_tables, 1, loop.pos, inp.block_size, inp.max_kv_draft,
                inp.meta.sliding_window, self.attn_backend) if loop.meta is None else \
                advance_decode_metadata(loop.meta, loop.pos)
            loop.h = self.drafter.forward(loop.tokens[-1], loop.pos, loop.h, loop.meta,
                                          step=step)
        token, q = self._pick(loop.h, inp.draft_sampling, loop.pos, mask)
        loop.tokens.append(token)
        loop.probs.append(q)
        return token

    def first_pass(self, inp: StepInputs, hidden, captured, context_tokens, accepted):
        """Draft step 0 over every row (shifted-by-one inputs), writing draft KV for every
        position; accepted [Bg, rows of a generation request]. Returns its hidden [T, H]."""
        if inp.num_ctx:
            ids = inp.shift_ids.clone()
            ids[inp.ctx_last_rows] = torch.where(ids[inp.ctx_last_rows] < 0, context_tokens,
                                                 ids[inp.ctx_last_rows])
            ids[inp.gen_start:] = accepted.reshape(-1)
        else:       # generation rows only: their inputs are the accepted tokens as they are
            ids = accepted.reshape(-1)
        h = self.drafter.initial_hidden(captured, hidden)
        return self.drafter.forward(ids, inp.positions, h, inp.meta)           # [T, H]

    def roots(self, inp: StepInputs, h, num_accepted, rows_per_gen: int):
        """The step-0 rows the drafting requests continue from (a context chunk's last row,
        a generation request's last accepted row): hidden [Bd, H], positions [Bd] and the
        requests' block tables [Bd, nb]."""
        gen_last = torch.arange(inp.gen_start - 1,
                                inp.gen_start - 1 + inp.num_gen * rows_per_gen, rows_per_gen,
                                device=h.device) + num_accepted
        rows = torch.cat([inp.draft_ctx_rows, gen_last]) if inp.num_ctx else gen_last  # [Bd]
        # without context chunks every request drafts, in batch order
        block_tables = inp.block_tables[inp.draft_reqs] if inp.num_ctx else inp.block_tables
        return h[rows], inp.positions[rows], block_tables

    def _pick(self, h, st: SamplingTensors, pos, mask: RowMask | None = None):
        """Draft token per request from the draft hidden rows h at positions pos [Bd]: argmax,
        or a sample from q with rejection sampling. Returns [Bd] target ids and q [Bd, V]
        (None without rejection sampling). mask: grammar masks of constrained rows."""
        if mask is not None:
            return self._pick_masked(h, st, pos, mask)
        if not self.use_rejection_sampling:
            return self.drafter.greedy_target_ids(h), None
        draft_logits = self.drafter.compute_logits(h)                        # [B, Vd]
        q = probs_from_logits(draft_logits, st.temperature, st.top_k, st.top_p)  # [B, Vd]
        seeded = st.seeded_at(pos + 1)                     # the draft is token pos + 1
        token = self.drafter.to_target_ids(sample_from_probs(q, self.generator, seeded,
                                                             DRAFT_DRAW))
        q_target = q.new_zeros(q.shape[0], self.target.config.vocab_size)
        q_target[:, self._vocab_ids] = q
        return token, q_target                                               # [B], [B, V]

    def _pick_masked(self, h, st: SamplingTensors, pos, mask: RowMask):
        """_pick with the draft logits spread over the target vocabulary and grammar-masked.
        A row whose grammar allows no token of the draft vocabulary stays unmasked (its draft
        is rejected by verification)."""
        draft_logits = self.drafter.compute_logits(h).float()               # [B, Vd]
        full = draft_logits.new_full((h.shape[0], self.target.config.vocab_size),
                                     float("-inf"))
        full[:, self._vocab_ids] = draft_logits                              # [B, V]
        rows = full[mask.index]
        masked = masked_logits(rows.clone(), mask.bitmask)
        none_allowed = torch.isneginf(masked.amax(-1, keepdim=True))
        full[mask.index] = torch.where(none_allowed, rows, masked)
        if not self.use_rejection_sampling:
            return full.argmax(-1), None
        q = probs_from_logits(full, st.temperature, st.top_k, st.top_p)     # [B, V]
        return sample_from_probs(q, self.generator, st.seeded_at(pos + 1), DRAFT_DRAW), q
