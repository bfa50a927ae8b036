"""Model-free drafts: the suffix automaton and the n-gram index against brute-force
searches, the enhancer and the n-gram drafter in the engine (greedy output equals plain
output: batched, chunked prefill, preemption; drafts equal the brute-force answer after
every step), configuration errors."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from conftest import TEST_DEVICE, assert_pool_full, build_eagle_pair
from onespec import LLM, Eagle3Config, NGramConfig, SamplingParams
from onespec.speculative.ngram import NGramIndex
from onespec.speculative.suffix_automaton import SuffixAutomaton

# repeats inside the prompts give the automaton and the n-gram lookup something to find
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 30,
           [40, 41], list(range(20, 45)) + list(range(20, 32))]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
ENGINE_KW = {"batch": {}, "chunked": {"max_num_tokens": 9},
             "preempt": {"num_kv_blocks": 20, "block_size": 4, "max_model_len": 64}}


# ---- brute-force references --------------------------------------------------------------
def brute_longest_match(seq: list[int]) -> tuple[int, int]:
    """(length, end of first earlier occurrence) of the longest suffix that occurred before."""
    n = len(seq)
    for m in range(n - 1, 0, -1):
        for end in range(m - 1, n - 1):
            if seq[end - m + 1:end + 1] == seq[n - m:]:
                return m, end
    return 0, -1


def brute_ngram(seq: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    size = len(seq)
    for n in range(min(max_n, size), min_n - 1, -1):
        for i in range(size - n - 1, -1, -1):        # most recent first, i + n < size
            if seq[i:i + n] == seq[size - n:]:
                return seq[i + n:i + n + k]
    return []


def sa_reference_drafts(seq: list[int], k: int, min_match: int) -> list[int]:
    """The enhancer's drafts by brute force: what followed the first earlier occurrence of
    the longest repeated suffix, if it has min_match tokens or more."""
    length, end = brute_longest_match(seq)
    return seq[end + 1:end + 1 + k] if length >= min_match else []


def random_sequences(seed: int):
    """Random sequences over small and large alphabets, some with planted repeats."""
    rng = random.Random(seed)
    for alphabet in (2, 3, 5, 50, 150_000):
        for _ in range(4):
            seq = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 80))]
            if rng.random() < 0.5 and len(seq) > 4:       # copy a span to the end
                i = rng.randrange(len(seq) - 2)
                seq += seq[i:i + rng.randrange(2, 20)]
            yield seq


# ---- the indexes alone ---------------------------------------------------------------------
def test_automaton_longest_match_equals_brute_force():
    rng = random.Random(1)
    checked = 0
    for seq in random_sequences(0):
        sa, fed = SuffixAutomaton(), 0
        while fed < len(seq):                # extended in pieces of 1..5 tokens
            step = rng.randrange(1, 6)
            sa.extend(seq[fed:fed + step])
            fed = min(fed + step, len(seq))
            assert sa.longest_match() == brute_longest_match(seq[:fed]), seq[:fed]
            length, end = brute_longest_match(seq[:fed])
            assert sa.continuation(4) == (length, seq[end + 1:min(end + 5, fed)] if length
                                          else [])
            checked += 1
        assert len(sa.length) <= 2 * len(seq)        # at most 2n - 1 states (+ the root)
    assert checked > 100


def test_automaton_worked_example():
    sa = SuffixAutomaton()
    sa.extend([1, 2, 3, 9, 1, 2])
    assert sa.longest_match() == (2, 1)              # [1, 2] first ended at index 1
    assert sa.continuation(3) == (2, [3, 9, 1])
    sa.extend([3])
    assert sa.continuation(3) == (3, [9, 1, 2])
    sa.extend([7])
    assert sa.continuation(3) == (0, [])


@pytest.mark.parametrize("min_n,max_n", [(1, 3), (2, 2), (1, 5)])
def test_ngram_proposals_equal_brute_force(min_n, max_n):
    for seq in random_sequences(min_n * 10 + max_n):
        index = NGramIndex(min_n, max_n)
        for i, t in enumerate(seq):
            index.extend([t])
            for k in (1, 3, 6):
                assert index.propose(k)[1] == brute_ngram(seq[:i + 1], k, min_n, max_n)


def test_ngram_worked_example():
    index = NGramIndex(1, 3)
    index.extend([4, 5, 6, 7, 5, 6])
    assert index.propose(3) == (2, [7, 5, 6])        # [5, 6] at 1..2, followed by 7, 5, 6
    index.extend([8, 6])
    assert index.propose(3) == (1, [8, 6])           # only [6] matches; its latest: index 5


# ---- in the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, _, head, plain = build_eagle_pair(tmp_path_factory, 4, PROMPTS, GREEDY)
    return target, head, plain


def run_checking_drafts(llm, check) -> list[list[int]]:
    """Generates PROMPTS step by step; after each step check(req) for every request that
    goes on. Returns the outputs."""
    eng = llm.engine
    reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
    while eng.has_unfinished():
        for req in eng.step():
            if not req.is_finished:
                assert req.features.host_drafts.index.tokens == req.token_ids     # preemption included
                check(req)
    assert_pool_full(llm)
    assert all(r.features.host_drafts is None for r in reqs)     # released when finished
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("engine_kw", list(ENGINE_KW))
def test_sa_enhancer_greedy_lossless(pair, engine_kw):
    target, head, plain = pair
    k, min_match = 4, 2
    llm = LLM(target, device=TEST_DEVICE, dtype="float32", **ENGINE_KW[engine_kw],
              speculative_config=Eagle3Config(head, max_draft_len=k, use_sa_enhancer=True,
                                              sa_min_match_len=min_match))

    def check(req):
        want = sa_reference_drafts(req.token_ids, k, min_match)
        assert req.features.host_drafts.span == (0, len(want))
        assert req.draft_tokens[:len(want)] == want and len(req.draft_tokens) == k

    assert run_checking_drafts(llm, check) == plain
    st = llm.stats()
    assert 0 < st["num_sa_accepted_draft_tokens"] <= st["num_sa_draft_tokens"]
    assert st["num_sa_draft_tokens"] <= st["num_draft_tokens"]
    if engine_kw == "preempt":
        assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("engine_kw", list(ENGINE_KW))
def test_ngram_drafter_greedy_lossless(pair, engine_kw):
    target, _, plain = pair
    cfg = NGramConfig(max_draft_len=3, max_matching_ngram_size=3, min_matching_ngram_size=2)
    llm = LLM(target, device=TEST_DEVICE, dtype="float32", **ENGINE_KW[engine_kw],
              speculative_config=cfg)

    def check(req):
        assert req.draft_tokens == brute_ngram(req.token_ids, 3, 2, 3)

    assert run_checking_drafts(llm, check) == plain
    st = llm.stats()
    assert st["num_accepted_draft_tokens"] > 0 and st["acceptance_length"] > 1.0
    assert st["num_sa_draft_tokens"] == 0
    if engine_kw == "preempt":
        assert llm.stats()["num_preemptions"] > 0


def test_request_metrics_count_automaton_drafts(pair):
    target, head, plain = pair
    llm = LLM(target, device=TEST_DEVICE, dtype="float32",
              speculative_config=Eagle3Config(head, max_draft_len=3, use_sa_enhancer=True,
                                              sa_min_match_len=1))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    m = [o.metrics for o in outs]
    assert sum(x.num_sa_draft_tokens for x in m) == llm.stats()["num_sa_draft_tokens"] > 0
    for x in m:
        assert x.num_sa_accepted_draft_tokens <= x.num_accepted_draft_tokens
        assert x.num_sa_draft_tokens <= x.num_draft_tokens


@pytest.mark.parametrize("cfg, message", [
    (lambda: NGramConfig(max_draft_len=0), "max_draft_len must be an integer in [1, 32]"),
    (lambda: NGramConfig(min_matching_ngram_size=4, max_matching_ngram_size=3),
     "max_matching_ngram_size must be an integer in [4, 64]"),
    (lambda: NGramConfig(min_matching_ngram_size=0), "min_matching_ngram_size"),
    (lambda: Eagle3Config("h", use_sa_enhancer=True, sa_min_match_len=0),
     "sa_min_match_len must be an integer >= 1"),
    (lambda: Eagle3Config("h", use_sa_enhancer=1), "use_sa_enhancer must be True or False"),
    (lambda: NGramConfig(draft_len_schedule="auto"), "NGramConfig cannot be combined with draft_len_schedule='auto'"),
])
def test_configuration_errors(cfg, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        cfg()


# ---- command line ------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--ngram", "3", "--draft", "D"], "--ngram is a drafter of its own"),
    (["--ngram", "0"], "--ngram must be >= 1, got 0"),
    (["--ngram", "3", "--k", "2"], "with --ngram K the draft length is K"),
    (["--sa-enhancer", "4"], "--sa-enhancer enhances a model drafter: pass --draft or --mtp"),
    (["--draft", "D", "--sa-enhancer", "0"], "--sa-enhancer must be >= 1, got 0"),
])
def test_cli_usage_errors(argv, message, capsys):
    from onespec.cli import main
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "M", "--prompt-ids", "1,2", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--ngram", "3"], ["--sa-enhancer", "2", "--k", "3"]])
def test_cli_generate_with_host_drafts(pair, flags):
    target, head, plain = pair
    flags = [*flags, "--draft", head] if "--sa-enhancer" in flags else flags
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    prompt = ",".join(map(str, PROMPTS[0]))
    proc = subprocess.run(
        [sys.executable, "-m", "onespec", "generate", "--model", target, "--prompt-ids",
         prompt, "--max-tokens", str(GREEDY.max_tokens), "--ignore-eos", "--device", "cpu",
         "--dtype", "float32", *flags], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert [int(t) for t in proc.stdout.split()] == plain[0]
    assert "acceptance length" in proc.stderr
    assert ("automaton drafts accepted" in proc.stderr) == ("--sa-enhancer" in flags)
