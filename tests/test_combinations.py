"""The table of feature combinations (combinations.py), the dictionary form of the
speculative config, and relaxed acceptance on EAGLE-3."""
from __future__ import annotations

import itertools
import json
import re

import pytest

from conftest import TEST_DEVICE, assert_pool_full, build_eagle_pair
from onespec import LLM, Eagle3Config, MTPConfig, NGramConfig, SamplingParams
from onespec import combinations as C
from onespec.config import speculative_config_from_dict
from onespec.speculative.acceptors import (ForcedAcceptor, RejectionAcceptor, RelaxedAcceptor,
                                           StrictAcceptor, make_acceptor)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [9, 8, 7, 6, 5], [3, 3, 3]]
BEGIN, END = 7, 8

# the config options that turn each speculative feature on
SPEC_OPTIONS = {
    C.TREE: dict(use_dynamic_tree=True),
    C.REJECTION: dict(use_rejection_sampling=True),
    C.RELAXED: dict(use_relaxed_acceptance_for_thinking=True, relaxed_topk=4,
                    relaxed_delta=0.5, begin_thinking_phase_token=BEGIN),
    C.FORCED: dict(force_acceptance_length=2.0),
    C.FORCED_RATES: dict(force_acceptance_rates=(0.5, 0.5, 0.5)),
    C.SA: dict(use_sa_enhancer=True),
    C.AUTO: dict(draft_len_schedule="auto"),
}
DRAFTERS = {
    C.EAGLE3: lambda **kw: Eagle3Config("head", max_draft_len=3, **kw),
    C.MTP: lambda **kw: MTPConfig(num_nextn_predict_layers=3, **kw),
    C.NGRAM: lambda **kw: NGramConfig(max_draft_len=3, **kw),
}


def _expect(on: set[str]) -> C.Refusal | None:
    return next((r for r in C.REFUSED if r.a in on and r.b in on), None)


def _format(refusal: C.Refusal) -> str:
    return f"^{re.escape(refusal.a)} cannot be combined with {re.escape(refusal.b)}: .+"


@pytest.mark.parametrize("refusal", C.REFUSED, ids=lambda r: f"{r.a} x {r.b}")
def test_every_refused_pair_gives_the_one_format(refusal):
    with pytest.raises(C.UnsupportedCombination, match=_format(refusal)):
        C.check_combinations({refusal.a, refusal.b})
    with pytest.raises(ValueError):              # (callers catch ValueError)
        C.check_combinations({refusal.b, refusal.a, "an allowed feature"})


PAIRS = [(d, a, b) for d in DRAFTERS for a, b in itertools.combinations([None, *SPEC_OPTIONS], 2)
         if not (d != C.EAGLE3 and C.TREE in (a, b))]      # trees are EAGLE-3's fields


@pytest.mark.parametrize("drafter,a,b", PAIRS, ids=lambda x: str(x))
def test_each_pair_of_config_options_builds_or_is_refused(drafter, a, b):
    """Every drafter with every pair of speculative options: built when the table allows
    it (with the features it names), refused in the one format otherwise."""
    kw = {**SPEC_OPTIONS.get(a, {}), **SPEC_OPTIONS.get(b, {})}
    if {a, b} == {C.FORCED, C.FORCED_RATES}:
        return                                          # (one or the other: a field check)
    on = {drafter, *(x for x in (a, b) if x)} | ({C.FORCED} if C.FORCED_RATES in (a, b) else set())
    refusal = _expect(on)
    if refusal is None:
        cfg = DRAFTERS[drafter](**kw)
        assert C.spec_features(cfg) == on
    else:
        with pytest.raises(C.UnsupportedCombination, match=_format(refusal)):
            DRAFTERS[drafter](**kw)


def test_engine_features_and_graphs():
    from onespec.config import EngineConfig
    cfg = EngineConfig(model="m", tensor_parallel_size=2, attention_backend="triton")
    no_masks = type("Mla", (), {"triton_tree_masks": False})
    assert C.engine_features(cfg, no_masks, sliding_window=4) == \
        {C.TP, C.SLIDING, C.TRITON_NO_TREE_MASKS, C.TRITON}
    assert C.engine_features(EngineConfig(model="m")) == set()
    assert C.engine_features(EngineConfig(model="m", tensor_parallel_size=2,
                                          enable_attention_dp=True)) == {C.TP, C.ATTN_DP}
    assert C.graphs_allowed({C.EAGLE3, C.TREE, C.FORCED})
    assert not C.graphs_allowed({C.EAGLE3, C.REJECTION})
    assert not C.graphs_allowed({C.NGRAM, C.TP})


def test_acceptor_is_chosen_once_from_the_config():
    assert type(make_acceptor(None)) is StrictAcceptor
    assert type(make_acceptor(DRAFTERS[C.EAGLE3]())) is StrictAcceptor
    assert type(make_acceptor(DRAFTERS[C.EAGLE3](**SPEC_OPTIONS[C.REJECTION]))) \
        is RejectionAcceptor
    relaxed = make_acceptor(DRAFTERS[C.EAGLE3](**SPEC_OPTIONS[C.RELAXED]))
    assert type(relaxed) is RelaxedAcceptor and relaxed.topk == 4
    forced = make_acceptor(DRAFTERS[C.MTP](**SPEC_OPTIONS[C.FORCED_RATES]))
    assert type(forced) is ForcedAcceptor and forced.graph_key == (None, (0.5, 0.5, 0.5))
    forced.set(3.0)
    assert forced.graph_key == (3.0, None)
    with pytest.raises(ValueError, match="a length or rates"):
        forced.set(None)


# ---- the dictionary form ------------------------------------------------------------------
@pytest.mark.parametrize("spec,want", [
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 4},
     Eagle3Config("h", max_draft_len=4)),
    ({"method": "eagle3", "model": "h", "use_dynamic_tree": True},
     Eagle3Config("h", use_dynamic_tree=True)),
    ({"method": "mtp", "num_speculative_tokens": 2, "model": None},
     MTPConfig(num_nextn_predict_layers=2)),
    ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
      "prompt_lookup_min": 2},
     NGramConfig(max_draft_len=5, max_matching_ngram_size=4, min_matching_ngram_size=2)),
])
def test_dictionary_maps_onto_the_typed_config(spec, want):
    assert speculative_config_from_dict(spec) == want


@pytest.mark.parametrize("spec,match", [
    ({"method": "eagle3", "model": "h", "num_spec_tokens": 3}, "key 'num_spec_tokens'"),
    ({"method": "ngram", "model": "h"}, "key 'model' is not known for method 'ngram'"),
    ({"method": "mtp", "model": "other"}, "key 'model' is not known for method 'mtp'"),
    ({"method": "medusa"}, r"\['method'\] must be one of \['dflash', 'eagle3', 'mtp', 'ngram'\]"),
    ({"model": "h"}, "'method'.* must be one of"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, "needs 'model'"),
    ({"method": "eagle3", "model": "h", "draft_model": "h"}, "draft_model twice"),
    ({"method": "eagle3", "model": "h", "num_speculative_tokens": 40}, "max_draft_len"),
    ({"method": "eagle3", "model": "h", "use_dynamic_tree": True,
      "use_sa_enhancer": True}, "use_dynamic_tree=True cannot be combined with"),
])
def test_dictionary_refusals_name_the_key(spec, match):
    with pytest.raises(ValueError, match=match):
        speculative_config_from_dict(spec)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_eagle_pair(tmp_path_factory, 4, PROMPTS, GREEDY)


def test_llm_takes_the_dictionary(pair):
    target, _, head, plain = pair
    llm = LLM(target, device=TEST_DEVICE, dtype="float32", speculative_config={
        "method": "eagle3", "model": head, "num_speculative_tokens": 3})
    assert llm.engine.spec_config == Eagle3Config(head, max_draft_len=3)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    with pytest.raises(ValueError, match="key 'k'"):
        LLM(target, device=TEST_DEVICE, speculative_config={"method": "ngram", "k": 3})


def test_generate_cli_takes_the_dictionary(pair, capfd):
    from onespec.cli import generate_main
    target, _, head, _ = pair
    spec = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 2})
    base = ["--model", target, "--device", TEST_DEVICE, "--dtype", "float32",
            "--prompt-ids", "1,2,3,4", "--max-tokens", "12", "--ignore-eos"]
    assert generate_main([*base, "--speculative-config", spec]) == 0
    err = capfd.readouterr().err          # (stdout: as bound when onespec.cli was imported)
    assert "acceptance length" in err and "12 tokens" in err
    assert generate_main([*base, "--speculative-config",
                          json.dumps({"method": "ngram", "lookup": 2})]) == 2
    assert "key 'lookup'" in capfd.readouterr().err
    with pytest.raises(SystemExit):
        generate_main([*base, "--speculative-config", spec, "--draft", head])
    assert "pass --draft inside it" in capfd.readouterr().err
    with pytest.raises(SystemExit):
        generate_main([*base, "--speculative-config", "{not json"])
    assert "not valid JSON" in capfd.readouterr().err


def test_engine_level_pairs_are_refused_before_any_rank_starts(pair):
    target, _, head, _ = pair
    for spec, first in ((Eagle3Config(head, draft_len_schedule="auto"), C.AUTO),
                        (Eagle3Config(head, use_dynamic_tree=True), C.TREE)):
        with pytest.raises(C.UnsupportedCombination,
                           match=_format(C.Refusal(first, C.TP, ""))):
            LLM(target, device=TEST_DEVICE, speculative_config=spec, tensor_parallel_size=2)


# ---- relaxed acceptance on EAGLE-3 --------------------------------------------------------
THINKING = [[5, 6, BEGIN], [9, BEGIN, 11, 12, 13], [BEGIN] + list(range(20, 30))]


def relaxed_eagle(target, head, topk, delta, end=None):
    return LLM(target, device=TEST_DEVICE, dtype="float32", speculative_config=Eagle3Config(
        head, max_draft_len=3, use_relaxed_acceptance_for_thinking=True, relaxed_topk=topk,
        relaxed_delta=delta, begin_thinking_phase_token=BEGIN, end_thinking_phase_token=end))


def test_relaxed_acceptance_on_eagle3(pair):
    """topk 1 is strict (outputs equal plain greedy, nothing accepted by the relaxed rule
    alone); inside the phase, drafts among the target's top 64 are accepted: some tokens
    are accepted by the relaxed rule only, and the counters add up."""
    target, _, head, _ = pair
    want = [o.outputs[0].token_ids for o in
            LLM(target, device=TEST_DEVICE, dtype="float32").generate(THINKING, GREEDY)]
    strict = relaxed_eagle(target, head, 1, 1.0)
    assert [o.outputs[0].token_ids for o in strict.generate(THINKING, GREEDY)] == want
    assert strict.stats()["num_relaxed_accepted_tokens"] == 0
    llm = relaxed_eagle(target, head, 64, 1.0)
    outs = llm.generate(THINKING, GREEDY)
    stats = llm.stats()
    assert stats["num_relaxed_accepted_tokens"] > 0
    assert stats["num_relaxed_accepted_tokens"] == \
        sum(o.metrics.num_relaxed_accepted_tokens for o in outs)
    for o in outs:
        m = o.metrics
        assert m.num_relaxed_accepted_tokens <= m.num_accepted_draft_tokens
        assert m.target_steps + m.num_accepted_draft_tokens == m.num_generated_tokens
    assert_pool_full(llm)
