"""Drafts proposed on the host from a request's own tokens (docs/DECODING.md, "model-free
drafts"): the suffix-automaton enhancer on top of a model drafter, and the n-gram drafter
for targets without one.

Both run in the engine after a step's results are postprocessed: each request that goes on
keeps an index of its tokens (a SuffixAutomaton or an NGramIndex, in its HostDraftState,
Request.features.host_drafts), extended by the tokens it gained, and its draft_tokens for
the next step are set from it. The device step is untouched; the next step simply verifies
what the request holds.

Drafts from an index are deterministic given the tokens so far (their q is one-hot), so
every acceptance rule stays lossless: strict and exact-match compare, and rejection
sampling accepts d with probability p(d) and otherwise samples from p without d. With
rejection sampling, the runner gives the drafts in HostDraftState.span a one-hot q.
"""
from __future__ import annotations

from dataclasses import dataclass

from onespec.config import NGramConfig
from onespec.engine.request import Request
from onespec.speculative.ngram import NGramIndex
from onespec.speculative.suffix_automaton import SuffixAutomaton


@dataclass
class HostDraftState:
    """One request's host-draft state, written only here. A preempted request keeps its
    tokens (they are recomputed, not regenerated), so the index stays valid across
    preemption and resumption; it is dropped when the request finishes."""
    index: SuffixAutomaton | NGramIndex    # of the request's tokens so far
    span: tuple[int, int] = (0, 0)  # [start, end) of draft_tokens the index proposed
    matched: bool = False   # the automaton matched at the last proposal (used or not)


def host_span(req: Request) -> tuple[int, int]:
    """[start, end) of req's draft_tokens that came from its host index."""
    state = req.features.host_drafts
    return (0, 0) if state is None else state.span


def automaton_matched(req: Request) -> bool:
    state = req.features.host_drafts
    return state is not None and state.matched


def sync_index(req: Request, make) -> HostDraftState:
    """req's host-draft state, its index created by make() on first use and extended by
    the tokens it has not seen."""
    if req.features.host_drafts is None:
        req.features.host_drafts = HostDraftState(make())
    state = req.features.host_drafts
    index, prompt = state.index, req.prompt_token_ids
    seen = len(index)
    if seen < len(prompt):
        index.extend(prompt[seen:])
        seen = len(prompt)
    index.extend(req.output_token_ids[seen - len(prompt):])
    return state


class SuffixEnhancer:
    """Replaces a model drafter's drafts by the automaton's continuation when the current
    suffix occurred before with at least min_match_len tokens: from the first draft, as
    many as the continuation has (the model's drafts fill the rest). docs/DECODING.md says
    why this rule and not a splice after the model's first drafts."""

    def __init__(self, min_match_len: int, max_draft_len: int):
        self.min_match_len, self.max_draft_len = min_match_len, max_draft_len

    def propose(self, req: Request, in_flight: bool = False) -> None:
        """Sets req's next drafts. in_flight: req's next step was launched already (the
        overlap scheduler chained it, verifying the model's drafts on the device), so its
        drafts stay; HostDraftState.matched only says whether the automaton would have
        replaced them, which stops the engine from chaining the step after."""
        state = sync_index(req, SuffixAutomaton)
        state.span = (0, 0)
        length, cont = state.index.continuation(self.max_draft_len)
        state.matched = length >= self.min_match_len and bool(cont)
        if not state.matched or in_flight:
            return
        req.draft_tokens = cont + req.draft_tokens[len(cont):]
        state.span = (0, len(cont))


class NGramDrafter:
    """Prompt lookup: the whole draft from the request's own tokens (ngram.NGramIndex);
    none when nothing matches (the step verifies padding, which stays lossless)."""

    def __init__(self, min_n: int, max_n: int, max_draft_len: int):
        self.min_n, self.max_n, self.max_draft_len = min_n, max_n, max_draft_len

    def propose(self, req: Request, in_flight: bool = False) -> None:
        assert not in_flight, "n-gram drafts are the whole draft: no step runs ahead of them"
        state = sync_index(req, lambda: NGramIndex(self.min_n, self.max_n))
        _, req.draft_tokens = state.index.propose(self.max_draft_len)


def make_host_drafter(spec_config) -> SuffixEnhancer | NGramDrafter | None:
    if isinstance(spec_config, NGramConfig):
        return NGramDrafter(spec_config.min_matching_ngram_size,
                            spec_config.max_matching_ngram_size, spec_config.max_draft_len)
    if spec_config is not None and spec_config.use_sa_enhancer:
        return SuffixEnhancer(spec_config.sa_min_match_len, spec_config.max_draft_len)
    return None


def record_sa_outcome(req: Request, k: int, span: tuple[int, int], emitted: int) -> None:
    """Counts a verified step's automaton drafts: drafts span[0]..span[1]-1 of its k came
    from the automaton, `emitted` tokens were emitted (drafts accepted + 1)."""
    start, end = min(span[0], k), min(span[1], k)
    req.metrics.num_sa_draft_tokens += end - start
    req.metrics.num_sa_accepted_draft_tokens += max(min(end, emitted - 1) - start, 0)
