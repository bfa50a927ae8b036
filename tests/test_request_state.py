"""Per-feature request state (Request.features): each feature's state outlives preemption
(the tokens it has seen are kept and recomputed, not regenerated) and is dropped when the
request finishes; the scheduler never looks inside it."""
from onespec.engine.kv_cache import BlockPool
from onespec.engine.request import Request
from onespec.engine.scheduler import ScheduledBatch, Scheduler, StepOutput
from onespec.sampling_params import SamplingParams
from onespec.speculative.host_drafts import SuffixEnhancer, automaton_matched, host_span
from onespec.speculative.thinking import ThinkingPhase, relaxed_delta
from onespec.structured.state import GrammarState


class CountingMatcher:
    """A stand-in for xgrammar's matcher: accepts every token but `reject`, terminates
    after `length` tokens."""

    def __init__(self, length: int, reject: int = -1):
        self.tokens, self.length, self.reject = [], length, reject

    def accept_token(self, token: int) -> bool:
        if token == self.reject:
            return False
        self.tokens.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.tokens) >= self.length


def request(rid: str, prompt_len: int, max_tokens: int = 40) -> Request:
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def prefill(sched: Scheduler, k: int) -> ScheduledBatch:
    """Schedules and postprocesses one step whose context chunks all finish their prompt."""
    batch = sched.schedule(k)
    sched.postprocess(batch, StepOutput([7] * len(batch.context), [], [],
                                        [[8] * k] * len(batch.requests)))
    return batch


def test_preemption_keeps_feature_state_and_finish_releases_it():
    k = 2
    sched = Scheduler(BlockPool(5, 4), 64, 4, 64, True, (2,))
    old, new = request("old", 6), request("new", 6)
    for req in (old, new):
        sched.add(req)
    prefill(sched, k)
    matcher = CountingMatcher(length=3)
    new.features.grammar = GrammarState(matcher)
    SuffixEnhancer(min_match_len=1, max_draft_len=k).propose(new)
    ThinkingPhase(begin_token=7, end_token=None, delta=0.5).walk(new, [7])
    index = new.features.host_drafts.index
    assert relaxed_delta(new) == 0.5 and len(index) == new.num_tokens
    # the next step does not fit both: the newest request is preempted and readmitted to
    # be recomputed, its emitted tokens kept
    batch = sched.schedule(k)
    assert sched.num_preemptions == 1 and new.in_context and new.draft_tokens == []
    assert [c.req for c in batch.context] == [new] and batch.generation == [old]
    assert new.features.grammar.matcher is matcher and new.features.host_drafts.index is index
    assert new.features.thinking.delta == 0.5 and matcher.tokens == []
    sched.abort(old)
    sched.postprocess(batch, StepOutput([6], [[5, 5, 5]], [3], [[8] * k, [8] * k]))
    assert new.output_token_ids == [7, 6] and matcher.tokens == [6]
    assert old.features.grammar is None and old.output_token_ids == [7]
    # ended by its grammar: every feature's state is released
    batch = sched.schedule(k)
    sched.postprocess(batch, StepOutput([], [[9, 9, 9]], [3], [[8] * k]))
    assert new.finish_reason == "stop" and matcher.tokens == [6, 9, 9]
    assert new.output_token_ids == [7, 6, 9, 9]
    assert new.features.grammar is None and new.features.host_drafts is None
    assert new.features.thinking is None and new.features.draft_probs is None
    assert host_span(new) == (0, 0) and not automaton_matched(new) and relaxed_delta(new) == 0.0


def test_grammar_rejecting_a_token_ends_the_request_with_an_error():
    sched = Scheduler(BlockPool(8, 4), 64, 4, 64, True, (2,))
    req = request("r", 5)
    sched.add(req)
    req.features.grammar = GrammarState(CountingMatcher(length=10, reject=9))
    prefill(sched, 2)
    batch = sched.schedule(2)
    sched.postprocess(batch, StepOutput([], [[5, 9, 5]], [3], [[8, 8]]))
    assert req.finish_reason == "error" and req.output_token_ids == [7, 5, 9]
    assert req.error == "the grammar rejected token 9 after 2 output tokens"
    assert req.features.grammar is None


def test_suffix_enhancer_span_and_match_live_in_its_state():
    """The automaton's drafts replace the model's from the first, its span says which."""
    req = request("r", 0)
    req.prompt_token_ids = [1, 2, 3, 1, 2]
    req.draft_tokens = [8, 8, 8]
    SuffixEnhancer(min_match_len=2, max_draft_len=3).propose(req)
    assert req.draft_tokens == [3, 1, 2] and host_span(req) == (0, 3) and automaton_matched(req)
    req.output_token_ids, req.draft_tokens = [5], [8, 8, 8]     # no earlier occurrence
    SuffixEnhancer(min_match_len=2, max_draft_len=3).propose(req, in_flight=False)
    assert req.draft_tokens == [8, 8, 8] and host_span(req) == (0, 0)
    assert not automaton_matched(req)
