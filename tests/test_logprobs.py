"""Log-probabilities (SamplingParams(logprobs=N, prompt_logprobs=N)): plain decoding's equal
transformers' log-softmax of the raw logits, token by token and for the prompt; under
speculation (EAGLE-3 and MTP drafts, batched, chunked, preempted) they equal plain
decoding's within 1e-4 in float32; a request asking for prompt logprobs recomputes its
prompt instead of reading the prefix cache."""
from __future__ import annotations

import pytest
import torch

from conftest import TEST_DEVICE, assert_pool_full, make_eagle3_head, make_hf_model
from moe_utils import add_mtp_layers, make_deepseek_model
from onespec import LLM, Eagle3Config, MTPConfig, SamplingParams

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 30, [40, 41],
           list(range(20, 45))]
SP = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=4, prompt_logprobs=3)
ENGINE_KW = {"batch": {}, "chunked": {"max_num_tokens": 9},
             "preempt": {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 64}}


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of tokens. [L, V]"""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def check_against_transformers(hf, out, n: int, n_prompt: int):
    prompt, output = out.prompt_token_ids, out.outputs[0].token_ids
    ref = hf_logprobs(hf, prompt + output)
    for i, (token, entry) in enumerate(zip(output, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(n).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= n + 1
        for t in top:
            assert abs(entry[t].logprob - row[t].item()) < 1e-4
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for q in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[q], ref[q - 1]
        assert abs(entry[prompt[q]].logprob - row[prompt[q]].item()) < 1e-4
        assert set(row.topk(n_prompt).indices.tolist()) <= set(entry)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("lp-target")
    hf = make_hf_model(path, "llama", vocab_size=128)
    head = str(tmp_path_factory.mktemp("lp-head"))
    make_eagle3_head(head, hf, "safeailab", draft_vocab_size=64, seed=3)
    plain = LLM(str(path), dtype="float32", device=TEST_DEVICE).generate(PROMPTS, SP)
    return str(path), hf, head, plain


def test_plain_logprobs_equal_transformers(llama):
    _, hf, _, plain = llama
    for out in plain:
        check_against_transformers(hf, out, 4, 3)


def assert_same_logprobs(outs, plain):
    for a, b in zip(outs, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for got, want in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:],
                             b.outputs[0].logprobs + b.prompt_logprobs[1:]):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 and
                       got[t].rank == want[t].rank for t in got)
        assert len(a.outputs[0].logprobs) == len(a.outputs[0].token_ids)


@pytest.mark.parametrize("engine_kw", list(ENGINE_KW))
def test_eagle3_logprobs_equal_plain(llama, engine_kw):
    path, _, head, plain = llama
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, **ENGINE_KW[engine_kw],
              speculative_config=Eagle3Config(head, max_draft_len=3))
    assert_same_logprobs(llm.generate(PROMPTS, SP), plain)
    assert llm.stats()["num_draft_tokens"] > 0
    if engine_kw == "preempt":
        assert llm.stats()["num_preemptions"] > 0
    assert_pool_full(llm)


@pytest.mark.parametrize("engine_kw", ["batch", "preempt"])
def test_mtp_logprobs_equal_plain(tmp_path_factory, engine_kw):
    path = tmp_path_factory.mktemp("lp-mtp")
    add_mtp_layers(path, make_deepseek_model(path, mtp_layers=1), 1)
    plain = LLM(str(path), dtype="float32", device=TEST_DEVICE).generate(PROMPTS, SP)
    llm = LLM(str(path), dtype="float32", device=TEST_DEVICE, **ENGINE_KW[engine_kw],
              speculative_config=MTPConfig(num_nextn_predict_layers=1))
    assert_same_logprobs(llm.generate(PROMPTS, SP), plain)
    assert llm.stats()["num_draft_tokens"] > 0
    assert_pool_full(llm)


def test_logprobs_of_accepted_drafts_on_the_demo_pair():
    """The demo head's drafts are often accepted: emitted drafts' logprobs come from their
    verify rows, and equal plain decoding's."""
    from onespec.demo import HEAD_DIR, TARGET_DIR
    prompts = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n"]
    sp = SamplingParams(max_tokens=32, logprobs=5, prompt_logprobs=0)
    plain = LLM(TARGET_DIR, dtype="float32", device=TEST_DEVICE, max_batch_size=2)
    eagle = LLM(TARGET_DIR, dtype="float32", device=TEST_DEVICE, max_batch_size=2,
                speculative_config=Eagle3Config(HEAD_DIR, max_draft_len=4))
    try:
        assert_same_logprobs(eagle.generate(prompts, sp), plain.generate(prompts, sp))
        assert eagle.stats()["num_accepted_draft_tokens"] > 10
        out = plain.generate(prompts[0], sp)[0]
        assert all(lp.decoded_token is not None for e in out.outputs[0].logprobs
                   for lp in e.values())
    finally:
        plain.close()
        eagle.close()


def test_prompt_logprobs_skip_the_prefix_cache(llama):
    path, _, _, plain = llama
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, block_size=4)
    long = PROMPTS[4]
    llm.generate(long, SamplingParams(max_tokens=2))                   # cached now
    hit = llm.generate(long, SamplingParams(max_tokens=2))[0]
    scored = llm.generate(long, SP)[0]
    assert hit.num_cached_tokens > 0 and scored.num_cached_tokens == 0
    assert_same_logprobs([scored], [plain[4]])


def test_logprobs_are_checked():
    for kw in (dict(logprobs=21), dict(prompt_logprobs=-1), dict(logprobs=True)):
        with pytest.raises(ValueError, match="logprobs must be None or an integer in"):
            SamplingParams(**kw)
