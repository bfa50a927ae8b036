"""Sampled speculative decoding keeps the target's distribution (docs/DECODING.md,
"acceptance"): exact-match acceptance (default) and rejection sampling, checked against the
exact joint distribution of the first three tokens computed with transformers, by a
chi-square test."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_pool_full, make_hf_model
from onespec import LLM, Eagle3Config, NGramConfig, SamplingParams
from onespec.layers.sampler import probs_from_logits
from onespec.speculative.suffix_automaton import SuffixAutomaton
from train_utils import trained_head

VOCAB, PROMPT, NUM_SAMPLES = 16, [3, 7, 1, 12, 5], 12000


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tdir = tmp_path_factory.mktemp("target")
    hf = make_hf_model(tdir, "llama", num_layers=5, vocab_size=VOCAB, hidden_size=64, seed=4)
    head = trained_head(str(tdir), str(tmp_path_factory.mktemp("head")), "safeailab")
    return str(tdir), hf, head


def exact_joint(hf, temperature: float, top_k: int, top_p: float,
                prompt: list[int] = PROMPT, vocab: int = VOCAB) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the filtered sampling distribution. [V, V, V]"""
    def probs(seqs):
        with torch.no_grad():
            logits = hf(torch.tensor(seqs)).logits[:, -1].float()
        n = len(seqs)
        return probs_from_logits(logits, torch.full((n,), temperature),
                                 torch.full((n,), top_k), torch.full((n,), top_p))
    v = range(vocab)
    p1 = probs([prompt])[0]
    p2 = probs([prompt + [a] for a in v])                                    # [V, V]
    p3 = probs([prompt + [a, b] for a in v for b in v]).view(vocab, vocab, vocab)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_pvalue(samples: list[list[int]], joint: torch.Tensor, vocab: int = VOCAB
                      ) -> float:
    counts = torch.zeros(vocab ** 3, dtype=torch.float64)
    for t in samples:
        counts[(t[0] * vocab + t[1]) * vocab + t[2]] += 1
    expected = joint.flatten().double() * len(samples)
    big = expected >= 5                       # pool the sparse cells into one
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         stat / 2))


def repeating_prompt(hf, top_k: int) -> list[int]:
    """Of 256 random 8-token prompts, the one where the first model-free draft (what followed
    the sampled first token earlier in the prompt) is likeliest to be accepted, so the test
    sees many accepted drafts from a near-uniform random target."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, VOCAB, (256, 8), generator=g).tolist()
    t = torch.tensor(VOCAB)
    with torch.no_grad():
        p1 = probs_from_logits(hf(torch.tensor(prompts)).logits[:, -1].float(),
                               torch.ones(256), t.new_full((256,), top_k), torch.ones(256))
        longer = [p + [a] for p in prompts for a in range(VOCAB)]
        p2 = probs_from_logits(hf(torch.tensor(longer)).logits[:, -1].float(),
                               torch.ones(len(longer)), t.new_full((len(longer),), top_k),
                               torch.ones(len(longer)))
    score = torch.zeros(256)
    for i, seq in enumerate(longer):
        sa = SuffixAutomaton()
        sa.extend(seq)
        _, cont = sa.continuation(1)
        if cont:
            score[i // VOCAB] += p1[i // VOCAB, seq[-1]] * p2[i, cont[0]]
    return prompts[int(score.argmax())]


def sample_many(llm, sp, prompt: list[int] = PROMPT) -> list[list[int]]:
    outs = llm.generate([prompt] * NUM_SAMPLES, sp)
    assert_pool_full(llm)
    return [o.outputs[0].token_ids for o in outs]


CASES = [
    dict(rejection=False, temperature=1.0, top_k=0, top_p=1.0),
    dict(rejection=True, temperature=1.0, top_k=0, top_p=1.0),
    dict(rejection=True, temperature=0.8, top_k=6, top_p=0.9),
]


@pytest.mark.parametrize("case", CASES, ids=["exact-match", "rejection", "rejection-topk-topp"])
def test_sampled_speculation_keeps_target_distribution(setup, case):
    target, hf, head = setup
    sp = SamplingParams(max_tokens=3, temperature=case["temperature"], top_k=case["top_k"],
                        top_p=case["top_p"], ignore_eos=True)
    llm = LLM(target, device="cpu", dtype="float32", max_batch_size=256, seed=11,
              speculative_config=Eagle3Config(head, max_draft_len=2,
                                              use_rejection_sampling=case["rejection"]))
    samples = sample_many(llm, sp)
    stats = llm.stats()
    # drafts really accepted (only emitted ones count: max_tokens=3 leaves one per request)
    assert stats["num_accepted_draft_tokens"] > 0.05 * NUM_SAMPLES
    joint = exact_joint(hf, case["temperature"], case["top_k"], case["top_p"])
    assert chi_square_pvalue(samples, joint) > 1e-4


def test_chi_square_has_power(setup):
    """Control: accepting every draft (forced acceptance) is not lossless, and the test says so."""
    target, hf, head = setup
    sp = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    llm = LLM(target, device="cpu", dtype="float32", max_batch_size=256, seed=11,
              speculative_config=Eagle3Config(head, max_draft_len=2,
                                              force_acceptance_length=3.0))
    samples = sample_many(llm, sp)
    assert chi_square_pvalue(samples, exact_joint(hf, 1.0, 0, 1.0)) < 1e-6


@pytest.mark.parametrize("drafts, rejection", [("sa-enhancer", True), ("ngram", False)],
                         ids=["sa-enhancer-rejection", "ngram-exact-match"])
def test_model_free_drafts_keep_target_distribution(setup, drafts, rejection):
    """Drafts from the request's own tokens (suffix automaton over EAGLE-3, n-gram lookup)
    are deterministic: their q is one-hot, so rejection sampling stays lossless with the
    automaton's rows of q one-hot beside the head's own rows, and so does exact match.
    (Both rules ran with both drafters when this was written; two cases keep the time.)"""
    target, hf, head = setup
    top_k = 2          # the target's two likeliest tokens: drafts that match them often
    sp = SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, ignore_eos=True)
    spec = Eagle3Config(head, max_draft_len=2, use_rejection_sampling=rejection,
                        use_sa_enhancer=True, sa_min_match_len=1) if drafts == "sa-enhancer" \
        else NGramConfig(max_draft_len=2, use_rejection_sampling=rejection)
    llm = LLM(target, device="cpu", dtype="float32", max_batch_size=256, seed=11,
              speculative_config=spec)
    prompt = repeating_prompt(hf, top_k)
    samples = sample_many(llm, sp, prompt)
    stats = llm.stats()
    accepted = stats["num_sa_accepted_draft_tokens" if drafts == "sa-enhancer"
                     else "num_accepted_draft_tokens"]
    assert accepted > 0.05 * NUM_SAMPLES
    joint = exact_joint(hf, 1.0, top_k, 1.0, prompt)
    assert chi_square_pvalue(samples, joint) > 1e-4
