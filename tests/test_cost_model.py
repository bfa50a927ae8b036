"""The auto draft length: the cost model's choices, forced per-position acceptance, the
engine switching K step by step without changing greedy output, config validation, and
(on a GPU) a CUDA graph for every K the policy can choose."""
from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE, assert_pool_full, build_eagle_pair
from onespec import LLM, Eagle3Config, MTPConfig, SamplingParams
from onespec.speculative.acceptance import forced_num_accepted_by_rates
from onespec.speculative.cost_model import DraftLenPolicy, bucket_for, expected_tokens

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [3] * 20, list(range(20, 40))]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
K = 4


def table(buckets=(1, 4), cost=lambda b, k: 1.0):
    return {(b, k): cost(b, k) for b in buckets for k in range(K + 1)}


def drafts_cost(b, k):          # a draft adds 10 % to a step
    return 1.0 + 0.1 * k


def feed(policy, accepted_drafts: int, steps: int, batch: int = 4) -> list[int]:
    """Runs `steps` choices as the engine does: a step verifies the drafts the step before
    made (its K of them; the rest padding), and every request keeps up to accepted_drafts
    of them. Returns the chosen Ks."""
    ks = []
    for _ in range(steps):
        k = policy.choose(batch)
        real = min(k, ks[-1]) if ks else 0
        ks.append(k)
        if real:
            policy.observe_acceptance([(1 + min(real, accepted_drafts), real)] * batch)
    return ks


def test_expected_tokens_worked_example():
    assert expected_tokens([0.5, 0.5], 2) == 1.75
    assert expected_tokens([0.7, 0.57, 0.45], 0) == 1.0
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0
    assert bucket_for([1, 4, 8], 3) == 4 and bucket_for([1, 4, 8], 20) == 8


def test_zero_acceptance_picks_k0():
    policy = DraftLenPolicy(K, table(cost=drafts_cost))
    ks = feed(policy, accepted_drafts=0, steps=200)
    assert ks[-1] in (0, 1) and policy.best(4) == 0
    assert policy.rates[0] < 0.05
    probes = ks[-100:]
    assert probes.count(0) >= 90            # only the probes draft


def test_full_acceptance_equal_cost_picks_largest_k():
    policy = DraftLenPolicy(K, table())
    assert feed(policy, accepted_drafts=K, steps=50)[-10:] == [K] * 10


def test_comes_back_from_k0():
    policy = DraftLenPolicy(K, table(cost=drafts_cost), probe_every=8)
    feed(policy, accepted_drafts=0, steps=200)
    assert policy.best(4) == 0
    ks = feed(policy, accepted_drafts=K, steps=300)       # acceptance recovers
    assert ks[-1] == K and policy.best(4) == K
    assert policy.num_probes > 0 and policy.as_dict()["chosen_k"][0] > 0


def test_step_times_decide_per_bucket():
    """Drafting is cheap at batch 1 and costly at batch 64: same acceptance, other K."""
    cost = {1: lambda k: 1.0 + 0.05 * k, 64: lambda k: 1.0 + 0.6 * k}
    policy = DraftLenPolicy(K, {(b, k): cost[b](k) for b in (1, 64) for k in range(K + 1)},
                            prior=0.6)
    assert policy.best(1) >= 3 and policy.best(64) == 0
    row = [policy.step_times[(64, k)] for k in range(K + 1)]
    for _ in range(200):                    # the machine got twice as slow at batch 64
        policy.observe_step_time(64, 0, 2.0)
    assert [policy.step_times[(64, k)] for k in range(K + 1)] == \
        pytest.approx([2 * t for t in row], rel=1e-3)           # the row follows the level
    assert policy.step_times[(1, 2)] == cost[1](2)               # other buckets stay
    assert policy.best(64) == 0
    policy.observe_step_time(64, 3, 50.0)   # a switch of K: not steady state, not taken
    assert policy.step_times[(64, 3)] == pytest.approx(2 * row[3], rel=1e-3)


def test_padding_drafts_are_not_observations():
    """K grew from 1 to 3: only the first draft was made, the others are padding."""
    policy = DraftLenPolicy(K, table())
    policy.observe_acceptance([(2, 1)] * 16)            # the one real draft accepted
    assert policy.rates[0] > 0.5 and policy.rates[1:] == [0.5] * (K - 1)
    policy.observe_acceptance([(1, 3)] * 16)            # three real drafts, first rejected
    assert policy.rates[0] < 0.5 and policy.rates[1:] == [0.5] * (K - 1)


def test_a_probe_verifies_the_extra_draft():
    """At K = 1 a probe runs two steps at K = 2: the first makes the second draft, the
    second verifies it; position 2 is observed even though K = 1 stays best."""
    policy = DraftLenPolicy(K, table(cost=lambda b, k: 1.0 + 0.5 * k), prior=0.6,
                            probe_every=4)
    ks = feed(policy, accepted_drafts=1, steps=64)
    assert policy.best(4) == 1 and ks.count(2) >= 2 * (ks.count(2) // 2)
    assert policy.rates[1] < 0.2                        # draft 2 never accepted


def test_policy_rejects_incomplete_table():
    with pytest.raises(ValueError, match="every K"):
        DraftLenPolicy(K, {(1, 0): 1.0})


def test_forced_rates_give_expected_acceptance():
    rates = torch.tensor([0.7, 0.57, 0.45, 0.38, 0.31])
    counts = torch.cat([forced_num_accepted_by_rates(rates, 64, 5, torch.tensor(s))
                        for s in range(300)])                           # 19,200 draws
    want = expected_tokens(rates.tolist(), 5)
    assert counts.float().mean().item() == pytest.approx(want, abs=0.03)
    for j, a in enumerate(rates.tolist()):          # conditional rate of each position
        tried = (counts - 1 >= j).sum().item()
        kept = (counts - 1 > j).sum().item()
        assert kept / tried == pytest.approx(a, abs=0.03)
    again = forced_num_accepted_by_rates(rates, 64, 5, torch.tensor(7))
    assert torch.equal(again, forced_num_accepted_by_rates(rates, 64, 5, torch.tensor(7)))
    assert forced_num_accepted_by_rates(torch.tensor([1.0, 0.0, 1.0]), 8, 3,
                                        torch.tensor(0)).tolist() == [2] * 8


@pytest.mark.parametrize("kw, match", [
    (dict(draft_len_schedule="fast"), "draft_len_schedule"),
    (dict(draft_len_schedule="auto", max_concurrency=4), "not both"),
    (dict(force_acceptance_rates=(0.5, 0.5)), "each of the"),
    (dict(force_acceptance_rates=(0.5, 1.5, 0.5)), r"in \[0, 1\]"),
    (dict(force_acceptance_rates="0.5"), "sequence"),
    (dict(force_acceptance_rates=(0.5,) * 3, force_acceptance_length=2.0), "not both"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        Eagle3Config("head", max_draft_len=3, **kw)


def test_config_accepts_auto_and_rates():
    cfg = Eagle3Config("head", max_draft_len=2, draft_len_schedule="auto",
                       force_acceptance_rates=[0.7, 0.5, 0.3])
    assert cfg.draft_len_schedule == "auto" and cfg.force_acceptance_rates == (0.7, 0.5, 0.3)
    assert MTPConfig(num_nextn_predict_layers=2, draft_len_schedule="auto").max_draft_len == 2
    with pytest.raises(ValueError, match="draft_len_schedule"):
        MTPConfig(num_nextn_predict_layers=2, draft_len_schedule="always")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, _, head, plain = build_eagle_pair(tmp_path_factory, 6, PROMPTS, GREEDY)
    return target, head, plain


def auto_llm(target, head, **spec):
    return LLM(target, device=TEST_DEVICE, dtype="float32", max_batch_size=4,
               speculative_config=Eagle3Config(head, max_draft_len=3,
                                               draft_len_schedule="auto", **spec))


def test_auto_switches_k_and_stays_lossless(pair):
    target, head, plain = pair
    llm = auto_llm(target, head)
    policy = llm.engine.policy
    assert set(policy.step_times) == {(b, k) for b in (1, 2, 4) for k in range(4)}
    assert all(t > 0 for t in policy.step_times.values())
    assert llm.stats()["target_steps"] == 0       # the timed dummy steps are not counted
    policy.probe_every, policy.hysteresis = 2, 0.0     # switch K often
    policy.rates = [0.9, 0.0, 0.0]
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.stats()
    used = {k for k, n in stats["steps_by_draft_len"].items() if n}
    assert len(used) >= 2, stats["steps_by_draft_len"]
    shown = stats["draft_len_policy"]
    assert sum(shown["chosen_k"].values()) >= sum(stats["steps_by_draft_len"].values())
    assert len(shown["acceptance_rate_estimates"]) == 3 and len(shown["step_ms"]) == 12
    assert_pool_full(llm)


def test_auto_turns_speculation_off_when_drafts_fail(pair):
    """Every draft rejected (forced rates 0): drafting only costs time, so auto runs K = 0
    but for its probes."""
    target, head, _ = pair
    llm = auto_llm(target, head, force_acceptance_rates=(0.0, 0.0, 0.0))
    policy = llm.engine.policy
    # drafts cost 10 % a step (the measured table on a loaded 2-core CPU can tie K = 0
    # with K = 1, and then either is right)
    policy.step_times = {(b, k): 1e-3 * (1 + 0.1 * k) for b, k in policy.step_times}
    llm.generate(PROMPTS * 2, SamplingParams(max_tokens=40, ignore_eos=True))
    assert policy.rates[0] < 0.2 and policy.best(len(PROMPTS)) == 0
    steps = llm.stats()["steps_by_draft_len"]
    assert steps[0] > 2 * sum(n for k, n in steps.items() if k)
    assert_pool_full(llm)


def test_auto_with_forced_rates_measures_them(pair):
    target, head, _ = pair
    rates = (0.8, 0.5, 0.5)
    llm = auto_llm(target, head, force_acceptance_rates=rates)
    llm.engine.policy.probe_every = 1       # every K < 3 also tries one more position
    llm.generate(PROMPTS * 2, SamplingParams(max_tokens=40, ignore_eos=True))
    est = llm.engine.policy.rates
    assert est[0] == pytest.approx(0.8, abs=0.2) and est[1] == pytest.approx(0.5, abs=0.25)
    per_pos = llm.stats()["acceptance_rate_per_position"]
    assert per_pos[0] == pytest.approx(0.8, abs=0.15)
    assert_pool_full(llm)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_captures_a_graph_for_every_k(pair):
    target, head, plain = pair
    llm = LLM(target, device="cuda", dtype="float32", max_batch_size=4,
              attention_backend="triton",
              speculative_config=Eagle3Config(head, max_draft_len=3, draft_len_schedule="auto"))
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    forced = llm.engine.runner.worker.forced_key
    for b in graphs.buckets:
        for k in range(4):
            assert (b, k, forced) in graphs.graphs, (b, k)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    assert_pool_full(llm)


def test_step_times_are_made_monotone_in_k():
    """A noisy table (K=1 measured faster than K=0) is pooled, not trusted."""
    times = {(1, 0): 71.0, (1, 1): 23.0, (1, 2): 38.0, (1, 3): 65.0, (1, 4): 91.0}
    policy = DraftLenPolicy(K, times)
    assert policy.bucket_times(1) == pytest.approx([44.0, 44.0, 44.0, 65.0, 91.0])
    policy = DraftLenPolicy(K, table(cost=drafts_cost))
    assert policy.bucket_times(4) == pytest.approx([1.0, 1.1, 1.2, 1.3, 1.4])


def test_metrics_export_chosen_k_and_the_policy(pair):
    from prometheus_client.parser import text_string_to_metric_families

    from onespec.serve.async_engine import EngineSnapshot
    from onespec.serve.metrics import ServerMetrics
    target, head, _ = pair
    llm = auto_llm(target, head)
    metrics = ServerMetrics(3)

    def scrape() -> dict:
        text = metrics.render(EngineSnapshot(stats=llm.stats())).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    llm.generate(PROMPTS[:2], GREEDY)
    first = scrape()
    steps = llm.stats()["steps_by_draft_len"]
    for k, n in steps.items():
        assert first[("onespec_draft_len_steps_total", (("k", str(k)),))] == n
    llm.generate(PROMPTS[:2], GREEDY)
    second = scrape()             # counters move on by the new steps only
    for k, n in llm.stats()["steps_by_draft_len"].items():
        assert second[("onespec_draft_len_steps_total", (("k", str(k)),))] == n
    est = llm.engine.policy.rates
    assert second[("onespec_draft_len_acceptance_estimate", (("position", "1"),))] == \
        pytest.approx(est[0], abs=1e-4)
    assert second[("onespec_draft_len_step_seconds", (("bucket", "1"), ("k", "0")))] > 0


def test_compare_script_on_the_demo_pair():
    """scripts/compare_auto_k.py, short: plain, K = 1..2 and auto on the bundled pair give
    the same greedy text (it exits 1 otherwise) and print the table."""
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(repo, "scripts", "compare_auto_k.py"),
                           "--trials", "1", "--max-tokens", "8", "--max-k", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "auto / fastest fixed" in proc.stdout
    assert '"config": "auto"' in proc.stdout and '"same_as_plain": true' in proc.stdout
