"""The acceptance rule of an engine, chosen once when it is built (make_acceptor): strict
(exact match), rejection sampling, relaxed (inside a thinking phase) or forced
(benchmarks). The rules themselves are the pure functions of acceptance.py and tree.py;
an acceptor picks which one a batch takes and feeds it the target's tokens or logits.

Every acceptor returns the same Acceptance for a chain step and (accepted, num_accepted,
path) for a tree step; the caller (the step shape) does not know which rule ran.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onespec.layers.sampler import probs_from_logits, sample_from_probs
from onespec.speculative.acceptance import (forced_num_accepted, forced_num_accepted_by_rates,
                                            forced_run, rejection_accept, relaxed_accept,
                                            strict_accept)
from onespec.speculative.tree import forced_tree_accept, tree_accept


@dataclass
class Acceptance:
    context_tokens: torch.Tensor       # [Bc] the next token of each context chunk
    accepted: torch.Tensor             # [Bg, K+1]
    num_accepted: torch.Tensor         # [Bg]
    relaxed: torch.Tensor | None = None  # [Bg, K] drafts accepted by the relaxed rule only


class StrictAcceptor:
    """Exact match: a draft is accepted while it equals the target's token at its row (the
    argmax for greedy rows, a sample for sampled ones). Lossless for greedy requests."""
    needs_draft_probs = False           # the drafts' q (rejection sampling)
    uses_thinking_phase = False         # reads each request's relaxed delta (relaxed)

    @property
    def graph_key(self) -> tuple:
        """What a CUDA graph of a step bakes in of this acceptor (graphs are keyed by it)."""
        return ()

    def accept(self, target, inp, rows) -> Acceptance:
        """target: the Verifier (worker.py); rows [R, H]: the hidden rows whose next tokens
        are chosen (context chunks' last rows, then K+1 per generation request)."""
        bc, bg, k = inp.num_ctx, inp.num_gen, inp.k
        sampled = target.tokens(rows, inp.row_sampling, _verify_mask(inp), inp.processors)
        accepted = sampled[bc:].view(bg, k + 1)
        return Acceptance(sampled[:bc], *self._count(inp, accepted))

    def _count(self, inp, accepted):
        """accepted [Bg, K+1] target tokens -> (accepted, num_accepted [Bg])."""
        return strict_accept(inp.draft_tokens, accepted)

    def accept_tree(self, inp, depth: int, target_tokens):
        """target_tokens [Bg, N+1]: the target's token at each verify row. Returns accepted
        [Bg, D+1], num_accepted [Bg] and the accepted path's rows [Bg, D+1]."""
        tree = inp.tree
        return tree_accept(inp.draft_tokens, tree.parents, tree.ancestors, target_tokens, depth)


class RejectionAcceptor(StrictAcceptor):
    """Rejection sampling (acceptance.rejection_accept): lossless for sampled requests; the
    drafts are sampled from q, kept per step (needs_draft_probs). Steps run eagerly."""
    needs_draft_probs = True

    def accept(self, target, inp, rows) -> Acceptance:
        bc, bg, k = inp.num_ctx, inp.num_gen, inp.k
        if not (bg and k):
            return super().accept(target, inp, rows)
        st = inp.row_sampling
        logits = target.logits(rows, _verify_mask(inp), inp.processors)             # [R, V]
        probs = probs_from_logits(logits, st.temperature, st.top_k, st.top_p)         # [R, V]
        tokens = sample_from_probs(probs[:bc], target.generator, st.seeded_head(bc))
        accepted, num_accepted = rejection_accept(
            inp.draft_tokens, inp.draft_probs, probs[bc:].view(bg, k + 1, -1),
            inp.gen_sampling.seeded, target.generator)
        return Acceptance(tokens, accepted, num_accepted)


class RelaxedAcceptor(StrictAcceptor):
    """Relaxed acceptance for requests inside a thinking phase (acceptance.relaxed_accept):
    a draft among the target's relaxed_topk tokens within the request's delta is accepted.
    Batches with a sampled request, or no relaxed_delta, are accepted strictly."""
    uses_thinking_phase = True

    def __init__(self, topk: int):
        self.topk = topk

    def accept(self, target, inp, rows) -> Acceptance:
        bc, bg, k = inp.num_ctx, inp.num_gen, inp.k
        if not (inp.relaxed_delta is not None and bg and k and inp.row_sampling.all_greedy):
            return super().accept(target, inp, rows)
        mask = _verify_mask(inp)
        if mask is not None or inp.processors is not None:
            logits = target.logits(rows, mask, inp.processors)                       # [R, V]
            tokens, logits = logits[:bc].argmax(-1), logits[bc:].view(bg, k + 1, -1)
        else:
            tokens = target.greedy(rows[:bc], None)                                  # [Bc]
            logits = target.logits(rows[bc:], None).view(bg, k + 1, -1)          # [Bg, K+1, V]
        accepted, num_accepted, relaxed = relaxed_accept(inp.draft_tokens, logits,
                                                         inp.relaxed_delta, self.topk)
        return Acceptance(tokens, accepted, num_accepted, relaxed)


class ForcedAcceptor(StrictAcceptor):
    """Forced acceptance for benchmarks: the accepted counts are drawn to average `length`
    tokens a step, or from per-position conditional `rates`, whatever the drafts are. Built
    by the engine from the config; set() changes the forcing of an engine that a benchmark
    runs at several acceptance lengths (the graphs are keyed by it)."""

    def __init__(self, length: float | None, rates: tuple[float, ...] | None):
        self.length, self.rates = length, rates
        self.step_counter = None              # [] int64 on the device (graph-safe)
        self._rate_tensors: dict[tuple, torch.Tensor] = {}

    def set(self, length: float | None, rates: tuple[float, ...] | None = None):
        if (length is None) == (rates is None):
            raise ValueError("forced acceptance needs a length or rates, one of them")
        self.length, self.rates = length, None if rates is None else tuple(rates)

    @property
    def graph_key(self) -> tuple:
        return self.length, self.rates

    def _count(self, inp, accepted):
        bg, k = accepted.shape[0], inp.k
        if not bg:
            return super()._count(inp, accepted)
        num_accepted = self.num_accepted(bg, k, accepted.device)
        grammar = inp.grammar
        if grammar is not None and k:       # emit the drafts the grammar allows, then the
            valid = grammar.valid_drafts_on(accepted.device)                  # target's
            num_accepted = torch.minimum(num_accepted, valid + 1)
            accepted = forced_run(inp.draft_tokens, accepted, num_accepted)
        return accepted, num_accepted

    def accept_tree(self, inp, depth: int, target_tokens):
        forced = self.num_accepted(inp.num_gen, depth, target_tokens.device)
        return forced_tree_accept(inp.tree.ancestors, target_tokens, depth, forced)

    def num_accepted(self, bg: int, k: int, device):                       # [Bg] int64
        """This step's forced counts (the step counter lives on the device)."""
        if self.step_counter is None:
            self.step_counter = torch.zeros((), dtype=torch.int64, device=device)
        self.step_counter.add_(1)
        if self.rates is None:
            return forced_num_accepted(self.length, bg, k, self.step_counter, device)
        key = (self.rates, str(device))
        if key not in self._rate_tensors:    # built outside graph capture (warm-up runs first)
            self._rate_tensors[key] = torch.tensor(self.rates, dtype=torch.float32,
                                                   device=device)
        return forced_num_accepted_by_rates(self._rate_tensors[key], bg, k, self.step_counter)


def _verify_mask(inp):
    return inp.grammar.verify if inp.grammar is not None else None


def make_acceptor(sc) -> StrictAcceptor:
    """The acceptor a speculative config asks for (combinations.py keeps the rules apart)."""
    if sc is None:
        return StrictAcceptor()
    if sc.force_acceptance_length is not None or sc.force_acceptance_rates is not None:
        return ForcedAcceptor(sc.force_acceptance_length, sc.force_acceptance_rates)
    if sc.use_rejection_sampling:
        return RejectionAcceptor()
    if sc.use_relaxed_acceptance_for_thinking:
        return RelaxedAcceptor(sc.relaxed_topk)
    return StrictAcceptor()
