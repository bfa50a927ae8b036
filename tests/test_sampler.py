import torch

from onespec.layers.sampler import (DRAFT_DRAW, TARGET_DRAW, SamplingTensors, counter_uniform,
                                    probs_from_logits, sample, sample_from_probs)
from onespec.sampling_params import SamplingParams


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _filters(n: int, temperature=1.0, top_k=0, top_p=1.0):
    return (torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int64),
            torch.full((n,), top_p))


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=_gen(0))
    st = SamplingTensors.build([SamplingParams()] * 6, None, "cpu")
    assert st.all_greedy
    assert torch.equal(sample(logits, st), logits.argmax(-1))
    probs = probs_from_logits(logits.bfloat16(), *_filters(6, temperature=0.0))
    assert probs.dtype == torch.float32
    one_hot = torch.nn.functional.one_hot(logits.bfloat16().argmax(-1), 50).float()
    assert torch.equal(probs, one_hot)


def test_greedy_rows_in_mixed_batch_are_argmax():
    logits = torch.randn(4, 30, generator=_gen(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, seed=3),
              SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=0.8)]
    st = SamplingTensors.build(params, [5, 5, 5, 5], "cpu")
    assert not st.all_greedy and st.seeded.host_index == (1,)
    for _ in range(20):
        out = sample(logits, st)
        assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def _seeded(seeds, positions, temperature=1.0, top_p=1.0) -> SamplingTensors:
    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=s) for s in seeds]
    return SamplingTensors.build(params, positions, "cpu")


def test_seeded_rows_reproducible_and_distinct():
    flat = torch.zeros(10, 1000)
    run = lambda seed: sample(flat, _seeded([seed] * 10, list(range(10))))  # noqa: E731
    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))
    assert len(set(run(7).tolist())) >= 8           # positions give different draws


def test_seeded_row_is_a_function_of_seed_and_position_only():
    logits = torch.randn(5, 200, generator=_gen(2))
    alone = sample(logits[2:3], _seeded([42], [17], top_p=0.95))
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=s) for s in (None, 1, 42)] + \
        [SamplingParams(temperature=1.0, top_p=0.95)] * 2
    st = SamplingTensors.build(params, [3, 9, 17, 4, 5], "cpu")
    for g in (_gen(9), _gen(10)):
        assert sample(logits, st, default_generator=g)[2] == alone[0]
    other_position = [int(sample(logits[2:3], _seeded([42], [p], top_p=0.95))) for p in
                      range(18, 40)]
    assert len(set(other_position)) > 1


def test_seeded_draws_follow_the_distribution():
    """Counter-based noise over many (seed, position) pairs samples softmax(logits / T)."""
    n, v, temperature = 100_000, 10, 0.7
    row = torch.randn(v, generator=_gen(9)) * 1.5
    seeds = torch.arange(n) % 1000 - 500
    st = _seeded(seeds.tolist(), (torch.arange(n) // 1000).tolist(), temperature=temperature)
    tokens = sample(row.expand(n, v), st)
    empirical = torch.bincount(tokens, minlength=v).float() / n
    expected = (row / temperature).softmax(-1)
    assert 0.5 * (empirical - expected).abs().sum() < 0.01


def test_counter_uniform_range_and_moments():
    u = counter_uniform(torch.tensor([0, -1, 2**62]), torch.tensor([0, 5, 2**31 - 1]),
                        TARGET_DRAW, 50_000)
    assert u.shape == (3, 50_000) and bool((u > 0).all()) and bool((u < 1).all())
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert not torch.equal(u, counter_uniform(torch.tensor([0, -1, 2**62]),
                                              torch.tensor([0, 5, 2**31 - 1]), DRAFT_DRAW,
                                              50_000))


def test_top_k_never_emits_filtered_token():
    n, v, k = 4000, 50, 5
    row = torch.randn(v, generator=_gen(3))
    allowed = set(row.topk(k).indices.tolist())
    logits = row.expand(n, v)
    probs = probs_from_logits(logits, *_filters(n, temperature=1.3, top_k=k))
    assert int((probs[0] > 0).sum()) == k
    tokens = sample_from_probs(probs, _gen(4))
    assert set(tokens.tolist()) <= allowed
    assert len(set(tokens.tolist())) == k


def test_top_p_keeps_smallest_prefix_reaching_p():
    # softmax probs 0.5, 0.25, 0.125, 0.0625, 0.0625 (token order shuffled)
    p = torch.tensor([0.0625, 0.25, 0.0625, 0.5, 0.125])
    logits = p.log().expand(3, 5)
    top_p = torch.tensor([0.6, 0.75, 0.76])
    probs = probs_from_logits(logits, torch.ones(3), torch.zeros(3, dtype=torch.int64), top_p)
    kept = [set(torch.nonzero(r).flatten().tolist()) for r in probs]
    assert kept == [{3, 1}, {3, 1}, {3, 1, 4}]
    assert torch.allclose(probs[0], torch.tensor([0.0, 1 / 3, 0.0, 2 / 3, 0.0]))
    n = 3000
    tokens = sample_from_probs(probs[:1].expand(n, 5), _gen(5))
    assert set(tokens.tolist()) == {1, 3}


def test_top_p_always_keeps_top_token():
    logits = torch.randn(3, 40, generator=_gen(6))
    probs = probs_from_logits(logits, *_filters(3, temperature=2.0, top_p=1e-6))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 40).float())


def test_top_k_then_top_p_and_off_values():
    logits = torch.randn(2, 100, generator=_gen(7))
    off = probs_from_logits(logits, *_filters(2, temperature=0.9))
    assert torch.allclose(off, (logits / 0.9).softmax(-1), atol=1e-6)
    both = probs_from_logits(logits, *_filters(2, top_k=10, top_p=0.5))
    assert ((both > 0).sum(-1) <= 10).all()
    assert torch.allclose(both.sum(-1), torch.ones(2))


def test_zero_prob_tokens_never_win():
    probs = torch.zeros(20000, 8)
    probs[:, 6] = 1e-30
    probs[:, 2] = 1.0
    tokens = sample_from_probs(probs, _gen(8))
    assert set(tokens.tolist()) <= {2, 6}


def test_empirical_distribution_matches_softmax():
    n, v, temperature = 200_000, 10, 0.7
    row = torch.randn(v, generator=_gen(9)) * 1.5
    st = SamplingTensors.build([SamplingParams(temperature=temperature)] * n, None, "cpu")
    tokens = sample(row.expand(n, v), st, default_generator=_gen(10))
    empirical = torch.bincount(tokens, minlength=v).float() / n
    expected = (row / temperature).softmax(-1)
    total_variation = 0.5 * (empirical - expected).abs().sum()
    assert total_variation < 0.01, total_variation
