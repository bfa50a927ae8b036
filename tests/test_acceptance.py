import pytest
import torch

from onespec.layers.sampler import probs_from_logits, sample_from_probs
from onespec.speculative.acceptance import forced_num_accepted, rejection_accept, strict_accept
from onespec.speculative.draft_len import SpeculationGate, draft_len_for_batch


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _long(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


# ---- strict acceptance ------------------------------------------------------------------

STRICT_CASES = [
    # (name, drafts [B, K], targets [B, K+1], expected emitted tokens per row)
    ("spec_worked_example", [[1, 3, 4]], [[1, 3, 2, 4]], [[1, 3, 2]]),
    ("all_accepted", [[5, 6, 7]], [[5, 6, 7, 8]], [[5, 6, 7, 8]]),
    ("none_accepted", [[5, 6, 7]], [[9, 6, 7, 8]], [[9]]),
    ("later_match_does_not_count", [[1, 2, 3]], [[1, 0, 3, 4]], [[1, 0]]),
    ("context_only_k0", [[], []], [[11], [12]], [[11], [12]]),
    ("mixed_batch", [[1, 2], [3, 4], [5, 6]], [[1, 2, 9], [3, 0, 9], [0, 4, 9]],
     [[1, 2, 9], [3, 0], [0]]),
]


@pytest.mark.parametrize("name,drafts,targets,expected", STRICT_CASES,
                         ids=[c[0] for c in STRICT_CASES])
def test_strict_accept(name, drafts, targets, expected):
    drafts_t = _long(drafts).reshape(len(targets), -1)
    accepted, num_accepted = strict_accept(drafts_t, _long(targets))
    assert accepted.shape == (len(targets), drafts_t.shape[1] + 1)
    assert num_accepted.tolist() == [len(e) for e in expected]
    assert [accepted[b, :n].tolist() for b, n in enumerate(num_accepted.tolist())] == expected


# ---- rejection sampling -----------------------------------------------------------------

def _one_hot(tokens, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(_long(tokens), vocab).float()


def test_rejection_one_hot_accepts_iff_same_token():
    vocab = 10
    q_tokens = [[3, 5], [3, 5], [1, 5]]
    p_tokens = [[3, 5, 7], [3, 6, 7], [2, 5, 7]]
    accepted, num_accepted = rejection_accept(
        _long(q_tokens), _one_hot(q_tokens, vocab), _one_hot(p_tokens, vocab),
        [None, _gen(1), None], _gen(0))
    assert num_accepted.tolist() == [3, 2, 1]
    assert [accepted[b, :n].tolist() for b, n in enumerate(num_accepted.tolist())] == \
        [[3, 5, 7], [3, 6], [2]]


def test_rejection_k0_samples_from_p():
    p = _one_hot([[4], [0]], 6)
    accepted, num_accepted = rejection_accept(
        torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0, 6), p, [None, None])
    assert accepted.tolist() == [[4], [0]] and num_accepted.tolist() == [1, 1]


def test_rejection_zero_residual_falls_back_to_p():
    # draft token 2 lies outside both p and q: rejected, and max(p - q, 0) is all zero.
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]]).expand(500, 2, 3)
    q = torch.tensor([[[0.5, 0.5, 0.0]]]).expand(500, 1, 3)
    accepted, num_accepted = rejection_accept(
        torch.full((500, 1), 2, dtype=torch.int64), q, p, [None] * 500, _gen(2))
    assert (num_accepted == 1).all()
    assert set(accepted[:, 0].tolist()) == {0, 1}


def test_rejection_seeded_rows_reproducible():
    p = torch.softmax(torch.randn(3, 4, 12, generator=_gen(3)), -1)
    q = torch.softmax(torch.randn(3, 3, 12, generator=_gen(4)), -1)
    drafts = torch.randint(0, 12, (3, 3), generator=_gen(5))
    a = rejection_accept(drafts, q, p, [_gen(7), _gen(8), _gen(9)])
    b = rejection_accept(drafts, q, p, [_gen(7), _gen(8), _gen(9)])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    support = p > 0
    return float((p[support] * (p[support] / q[support].clamp_min(1e-12)).log()).sum())


@pytest.mark.parametrize("filtered", [False, True], ids=["plain", "top_k_top_p"])
def test_rejection_emits_target_distribution(filtered):
    n, k, vocab = 50_000, 3, 20
    logits_p = torch.randn(vocab, generator=_gen(10)) * 1.5
    logits_q = torch.randn(vocab, generator=_gen(11)) * 1.5
    temperature = torch.tensor([0.9, 0.9])
    top_k = torch.tensor([12 if filtered else 0] * 2)
    top_p = torch.tensor([0.9 if filtered else 1.0] * 2)
    p, q = probs_from_logits(torch.stack([logits_p, logits_q]), temperature, top_k, top_p)
    assert _kl(p, q) > 0.05   # the drafter really is different

    drafts = sample_from_probs(q.expand(n * k, vocab), [None] * (n * k), _gen(12)).view(n, k)
    accepted, num_accepted = rejection_accept(
        drafts, q.expand(n, k, vocab), p.expand(n, k + 1, vocab), [None] * n, _gen(13))
    assert ((num_accepted >= 1) & (num_accepted <= k + 1)).all()
    assert (num_accepted > 1).any() and (num_accepted == 1).any()

    first = accepted[:, 0]
    assert (p[first] > 0).all()   # never a token filtered out of p
    empirical = torch.bincount(first, minlength=vocab).float() / n
    assert _kl(p, empirical) < 0.01

    # every position draws from the same p, so the token after an accepted draft is also ~ p
    second = accepted[num_accepted >= 2, 1]
    empirical_second = torch.bincount(second, minlength=vocab).float() / second.numel()
    assert _kl(p, empirical_second) < 0.01


# ---- forced acceptance ------------------------------------------------------------------

def test_forced_mean_matches_acceptance_length():
    steps = [forced_num_accepted(2.5, 8, 3, s, "cpu") for s in range(1000)]
    n = torch.stack(steps).float()
    assert abs(n.mean().item() - 2.5) < 0.05
    assert set(n.long().unique().tolist()) == {2, 3}


def test_forced_is_deterministic_and_capped():
    assert torch.equal(forced_num_accepted(1.7, 16, 4, 33, "cpu"),
                       forced_num_accepted(1.7, 16, 4, 33, "cpu"))
    assert not torch.equal(forced_num_accepted(1.5, 16, 4, 0, "cpu"),
                           forced_num_accepted(1.5, 16, 4, 1, "cpu"))
    assert forced_num_accepted(4.7, 32, 2, 5, "cpu").max().item() == 3
    assert forced_num_accepted(1.0, 32, 0, 5, "cpu").tolist() == [1] * 32
    assert forced_num_accepted(3.0, 32, 4, 9, "cpu").tolist() == [3] * 32
    assert forced_num_accepted(2.0, 4, 3, 0, "cpu").dtype == torch.int64


# ---- draft_len_schedule and the speculation gate ----------------------------------------

@pytest.mark.parametrize("batch_size,expected", [(1, 4), (2, 2), (3, 2), (4, 2), (5, 1),
                                                 (8, 1), (9, 0), (100, 0)])
def test_draft_len_schedule(batch_size, expected):
    assert draft_len_for_batch({8: 1, 1: 4, 4: 2}, 4, batch_size) == expected


def test_draft_len_without_schedule():
    assert draft_len_for_batch(None, 3, 1) == 3 and draft_len_for_batch(None, 3, 999) == 3


def test_gate_waits_for_window_then_turns_off_for_good():
    gate = SpeculationGate(window=3, threshold=0.5)
    gate.record(1.2)
    gate.record(1.2)
    assert gate.enabled                  # only 2 of 3 recorded: no decision yet
    gate.record(1.2)                     # mean(0.2, 0.2, 0.2) < 0.5
    assert not gate.enabled
    gate.record(5.0)
    assert not gate.enabled


def test_gate_uses_rolling_window():
    gate = SpeculationGate(window=2, threshold=0.5)
    for a, enabled in [(3.0, True), (3.0, True), (1.0, True), (1.0, False)]:
        gate.record(a)                   # means of (a - 1): -, 2.0, 1.0, 0.0
        assert gate.enabled == enabled


def test_gate_stays_on_above_threshold_and_when_unset():
    gate = SpeculationGate(window=2, threshold=1.0)
    for _ in range(10):
        gate.record(2.0)                 # mean 1.0 is not below 1.0
    assert gate.enabled
    always = SpeculationGate(None, None)
    for _ in range(10):
        always.record(1.0)
    assert always.enabled
    with pytest.raises(ValueError):
        SpeculationGate(3, None)
