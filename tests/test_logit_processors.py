"""Logit processors (repetition / frequency / presence penalties, logit_bias, min_tokens):
plain decoding matches transformers' own processors and a reference decoder written here;
greedy speculative decoding with them equals greedy plain decoding with them (EAGLE-3 and
n-gram drafts, batched), including a logit_bias that bans the token plain decoding would
pick; rejection sampling keeps the processed target distribution (chi-square)."""
from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE, assert_pool_full, make_hf_model
from onespec import LLM, Eagle3Config, NGramConfig, SamplingParams
from test_spec_sampling import VOCAB, chi_square_pvalue, sample_many
from test_spec_sampling import setup  # noqa: F401 - the module-scoped fixture
from onespec.layers.sampler import probs_from_logits

EOS = 2


def reference_logits(logits: torch.Tensor, prompt: list[int], output: list[int],
                     sp: SamplingParams) -> torch.Tensor:
    """The processors' rules, written out independently of onespec's implementation."""
    out = logits.clone().double()
    for t, b in (sp.logit_bias or {}).items():
        out[t] += b
    if len(output) < sp.min_tokens:
        for t in [EOS, *sp.stop_token_ids]:
            out[t] = float("-inf")
    if sp.repetition_penalty != 1.0:
        for t in set(prompt + output):
            out[t] = out[t] / sp.repetition_penalty if out[t] > 0 else \
                out[t] * sp.repetition_penalty
    for t in set(output):
        out[t] -= output.count(t) * sp.frequency_penalty + sp.presence_penalty
    return out


def reference_greedy(hf, prompt: list[int], sp: SamplingParams) -> list[int]:
    output: list[int] = []
    while len(output) < sp.max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()
        t = int(reference_logits(logits, prompt, output, sp).argmax())
        output.append(t)
        if t == EOS:
            break
    return output


PROCESSORS = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency+presence": dict(frequency_penalty=1.5, presence_penalty=0.7),
    "logit_bias": dict(logit_bias={5: 4.0, 9: -100.0, 17: 2.5}),
    "min_tokens": dict(min_tokens=6, logit_bias={EOS: 30.0}),
    "all": dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                logit_bias={11: 3.0}, min_tokens=3),
}
PROMPTS = [[5, 17, 42, 5, 17, 42, 5], [7, 8, 9], [100, 3, 100, 3, 12, 40]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("processors")
    hf = make_hf_model(path, "llama", vocab_size=128)
    llm = LLM(str(path), dtype="float32", device=TEST_DEVICE, max_batch_size=4)
    yield hf, llm
    llm.close()


@pytest.mark.parametrize("name", PROCESSORS)
def test_plain_decoding_matches_the_reference(tiny, name):
    hf, llm = tiny
    sp = SamplingParams(max_tokens=12, **PROCESSORS[name])
    outs = llm.generate(PROMPTS, sp)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == reference_greedy(hf, prompt, sp), name
    if name == "min_tokens":          # EOS held back for 6 tokens, then taken at once
        assert all(len(o.outputs[0].token_ids) == 7 for o in outs)
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert_pool_full(llm)


def test_plain_decoding_matches_transformers_processors(tiny):
    """transformers' repetition penalty, sequence bias and min_new_tokens (the real ones)."""
    hf, llm = tiny
    sp = SamplingParams(max_tokens=10, repetition_penalty=1.6, logit_bias={5: 3.0},
                        min_tokens=4)
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                              repetition_penalty=1.6, sequence_bias={(5,): 3.0},
                              min_new_tokens=4, eos_token_id=EOS, pad_token_id=0)
        expected = ref[0, len(prompt):].tolist()
        assert llm.generate(prompt, sp)[0].outputs[0].token_ids == expected


@pytest.fixture(scope="module")
def demo():
    from onespec.demo import HEAD_DIR, TARGET_DIR
    plain = LLM(TARGET_DIR, dtype="float32", device=TEST_DEVICE, max_batch_size=4)
    eagle = LLM(TARGET_DIR, dtype="float32", device=TEST_DEVICE, max_batch_size=4,
                speculative_config=Eagle3Config(HEAD_DIR, max_draft_len=3))
    ngram = LLM(TARGET_DIR, dtype="float32", device=TEST_DEVICE, max_batch_size=4,
                speculative_config=NGramConfig(max_draft_len=3))
    yield plain, eagle, ngram
    for llm in (plain, eagle, ngram):
        llm.close()


CODE = ["def binary_search(xs, x):\n", "class Stack:\n    def __init__(self):\n",
        "import os\nimport sys\n\n\ndef main():\n"]


@pytest.mark.parametrize("name", ["repetition", "frequency+presence", "all"])
def test_greedy_speculation_with_processors_equals_plain(demo, name):
    plain, eagle, ngram = demo
    kw = {k: v for k, v in PROCESSORS[name].items() if k != "logit_bias"}
    sp = SamplingParams(max_tokens=40, **kw)
    expected = [o.outputs[0].token_ids for o in plain.generate(CODE, sp)]
    for llm in (eagle, ngram):
        assert [o.outputs[0].token_ids for o in llm.generate(CODE, sp)] == expected
        assert_pool_full(llm)
    assert eagle.stats()["num_accepted_draft_tokens"] > 0     # drafts were verified
    unprocessed = [o.outputs[0].token_ids for o in plain.generate(CODE, SamplingParams(
        max_tokens=40))]
    assert unprocessed != expected                   # the processors changed the output


def test_logit_bias_banning_plain_decodings_pick(demo):
    plain, eagle, _ = demo
    free = plain.generate(CODE, SamplingParams(max_tokens=24, ignore_eos=True))
    for prompt, out in zip(CODE, free):
        banned = out.outputs[0].token_ids[1]         # the second token plain decoding picks
        sp = SamplingParams(max_tokens=24, logit_bias={banned: -100.0}, ignore_eos=True)
        expected = plain.generate(prompt, sp)[0].outputs[0].token_ids
        assert banned not in expected
        assert eagle.generate(prompt, sp)[0].outputs[0].token_ids == expected


def processed_joint(hf, sp: SamplingParams, prompt: list[int]) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the processed, temperature-scaled distribution [V]^3."""
    def probs(seqs, outputs):
        with torch.no_grad():
            logits = hf(torch.tensor(seqs)).logits[:, -1].float()
        rows = torch.stack([reference_logits(l, prompt, o, sp).float()
                            for l, o in zip(logits, outputs)])
        n = len(seqs)
        return probs_from_logits(rows, torch.full((n,), sp.temperature),
                                 torch.zeros(n, dtype=torch.int64), torch.ones(n))
    v = range(VOCAB)
    p1 = probs([prompt], [[]])[0]
    p2 = probs([prompt + [a] for a in v], [[a] for a in v])
    p3 = probs([prompt + [a, b] for a in v for b in v],
               [[a, b] for a in v for b in v]).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def test_rejection_sampling_keeps_the_processed_distribution(setup):  # noqa: F811
    target, hf, head = setup
    prompt = [3, 7, 1, 12, 5]
    sp = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True,
                        repetition_penalty=1.5, frequency_penalty=0.6, presence_penalty=0.3,
                        logit_bias={4: 1.5})
    llm = LLM(target, device=TEST_DEVICE, dtype="float32", max_batch_size=256, seed=11,
              speculative_config=Eagle3Config(head, max_draft_len=2,
                                              use_rejection_sampling=True))
    samples = sample_many(llm, sp, prompt)
    assert llm.stats()["num_accepted_draft_tokens"] > 0.05 * len(samples)
    assert chi_square_pvalue(samples, processed_joint(hf, sp, prompt)) > 1e-4
    llm.close()


def test_processors_are_checked(tiny):
    _, llm = tiny
    for kw, message in [(dict(repetition_penalty=0.0), "repetition_penalty must be"),
                        (dict(frequency_penalty=3.0), "frequency_penalty must be"),
                        (dict(logit_bias={1: 101.0}), "logit_bias values must be"),
                        (dict(logit_bias={-1: 1.0}), "logit_bias keys must be"),
                        (dict(min_tokens=-1), "min_tokens must be")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match=r"logit_bias keys must be token ids in \[0, 128\)"):
        llm.generate([1, 2], SamplingParams(logit_bias={128: 1.0}))
