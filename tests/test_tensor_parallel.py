"""Tensor parallelism on the CPU: two gloo ranks (this process and one spawned worker) give
the same greedy tokens as transformers and as one rank, for each Llama-family architecture,
batched with chunked prefill and preemption; EAGLE-3 stays lossless with the same target
steps; seeded sampling gives one rank's tokens; a dead or failing worker is an error in
the caller, not a hang. Each 2-rank engine is started once per module (spawning is slow)."""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from conftest import (assert_pool_full, hf_greedy, make_eagle3_head, make_hf_model,
                      step_beside_one_rank)
from onespec import LLM, Eagle3Config, NGramConfig, SamplingParams, StructuredOutputsParams
from onespec.config import EngineConfig
from onespec.distributed import WorkerFailure

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 30, [40, 41],
           list(range(20, 45))]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
# chunked prefill (9 tokens a step) and a pool too small for every request (preemption)
TIGHT = dict(dtype="float32", device="cpu", block_size=4, max_model_len=64, num_kv_blocks=20,
             max_num_tokens=9)
# llama: untied, a vocabulary that 2 ranks split unevenly; qwen2: tied embeddings, qkv
# bias, one KV head (held by both ranks); qwen3: per-head q/k norm, head_dim 24
ARCHS = {"llama": dict(vocab_size=127), "qwen2": dict(num_key_value_heads=1),
         "qwen3": {}}


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module", params=list(ARCHS))
def arch_pair(request, tmp_path_factory):
    """(path, HF model, the 2-rank LLM) for one architecture."""
    path = tmp_path_factory.mktemp(f"tp-{request.param}")
    hf = make_hf_model(path, request.param, **ARCHS[request.param])
    with LLM(str(path), tensor_parallel_size=2, **TIGHT) as llm:
        yield str(path), hf, llm
    assert all(not p.is_alive() for p in llm.engine.ranks.procs or [])


def test_greedy_equals_transformers_and_one_rank(arch_pair):
    path, hf, llm = arch_pair
    got = token_ids(llm.generate(PROMPTS, GREEDY))
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    one = LLM(path, **TIGHT)
    assert token_ids(one.generate(PROMPTS, GREEDY)) == got
    assert llm.stats()["num_preemptions"] > 0
    # rank 0 really holds half: 2 of 4 query heads, half the KV heads (one, shared, for
    # qwen2's single head), half the MLP rows, half the (padded) vocabulary
    model, cfg = llm.engine.model, hf.config
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, max(1, cfg.num_key_value_heads // 2))
    assert attn.k_cache.shape[1] == attn.num_kv_heads
    assert model.model.layers[0].mlp.down_proj.weight.shape[1] == cfg.intermediate_size // 2
    assert model.lm_head.weight.shape[0] == -(-cfg.vocab_size // 2)
    assert_pool_full(llm)


def test_seeded_sampling_equals_one_rank(arch_pair):
    path, _, llm = arch_pair
    params = [sampled(seed=7 + i) for i in range(len(PROMPTS) - 1)] + [GREEDY]
    got = token_ids(llm.generate(PROMPTS, params))
    assert got == token_ids(LLM(path, **TIGHT).generate(PROMPTS, params))
    assert got[0] != token_ids(llm.generate([PROMPTS[0]], sampled(seed=99)))[0]
    assert_pool_full(llm)


@pytest.fixture(scope="module")
def eagle_dirs(tmp_path_factory):
    """A llama target and an EAGLE-3 head that reads the target's (split) embedding."""
    path = tmp_path_factory.mktemp("tp-eagle-target")
    head = tmp_path_factory.mktemp("tp-eagle-head")
    hf = make_hf_model(path, "llama")
    make_eagle3_head(head, hf, draft_vocab_size=64, seed=3)
    return str(path), str(head)


@pytest.fixture(scope="module", params=["strict", "rejection"])
def eagle_pair(request, eagle_dirs):
    """The 2-rank speculative LLM, with exact-match acceptance or rejection sampling (the
    draft distributions travel to the other rank with the step's inputs)."""
    path, head = eagle_dirs
    spec = Eagle3Config(head, max_draft_len=3,
                        use_rejection_sampling=request.param == "rejection")
    with LLM(path, speculative_config=spec, tensor_parallel_size=2, **TIGHT) as llm:
        yield path, spec, llm


def test_eagle3_lossless_with_one_rank_drafts_and_target_steps(eagle_pair):
    """Run side by side with a one-rank engine, step by step: the same drafts after every
    step, the same tokens as plain decoding, the same target steps per request."""
    path, spec, llm = eagle_pair
    one = LLM(path, speculative_config=spec, **TIGHT)
    reqs = step_beside_one_rank(llm, one, PROMPTS, GREEDY)
    plain = token_ids(LLM(path, **TIGHT).generate(PROMPTS, GREEDY))
    assert [r.output_token_ids for r in reqs] == plain
    assert llm.stats()["num_preemptions"] > 0
    assert_pool_full(llm)


def test_eagle3_seeded_sampling_equals_one_rank(eagle_pair):
    path, spec, llm = eagle_pair
    params = [sampled(seed=30 + i) for i in range(len(PROMPTS))]
    one = LLM(path, speculative_config=spec, **TIGHT)
    assert token_ids(llm.generate(PROMPTS, params)) == token_ids(one.generate(PROMPTS, params))
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    with pytest.raises(ValueError, match=r"structured_outputs cannot be combined with tensor_parallel_size > 1"):
        llm.engine.add_request(PROMPTS[0], constrained)
    assert_pool_full(llm)


@pytest.fixture
def small_model(tmp_path):
    make_hf_model(tmp_path, "llama", num_layers=2)
    return str(tmp_path)


def _assert_fails_fast(llm, match: str):
    """Generates until the failure shows (at most seconds after it happened), then checks
    that it stays failed and that closing stops every worker."""
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=match):
        while time.monotonic() - start < 60:
            llm.generate(PROMPTS[:2], SamplingParams(max_tokens=100, ignore_eos=True))
    assert time.monotonic() - start < 15
    with pytest.raises(WorkerFailure, match=match):
        llm.generate(PROMPTS[:1], GREEDY)
    llm.close()
    assert all(not p.is_alive() for p in llm.engine.ranks.procs)


def test_worker_killed_during_generation_is_an_error_not_a_hang(small_model):
    llm = LLM(small_model, tensor_parallel_size=2, dtype="float32", device="cpu")
    proc = llm.engine.ranks.procs[0]
    threading.Timer(0.5, os.kill, (proc.pid, signal.SIGKILL)).start()
    _assert_fails_fast(llm, r"rank 1 \(pid \d+\) died")


def test_worker_that_raises_is_an_error(small_model):
    """Rank 1 fails on the inputs it is sent (an unreadable message)."""
    llm = LLM(small_model, tensor_parallel_size=2, dtype="float32", device="cpu")
    llm.engine.ranks.conns[0].send_bytes(b"not a pickle")
    _assert_fails_fast(llm, "rank 1 raised")


def _workers() -> set:
    return {p for p in multiprocessing.active_children() if p.name.startswith("onespec")}


def test_unsupported_splits_are_refused_before_starting(small_model, tmp_path):
    before = _workers()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model=small_model, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="must divide num_attention_heads=4"):
        LLM(small_model, tensor_parallel_size=3, device="cpu")
    with pytest.raises(ValueError, match="attention_backend='triton' needs a CUDA device"):
        LLM(small_model, tensor_parallel_size=2, device="cpu", attention_backend="triton")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="not supported for 'GPT2LMHeadModel'"):
        LLM(str(other), tensor_parallel_size=2, device="cpu")
    assert _workers() <= before


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_two_gpus_greedy_equals_transformers(tmp_path, backend):
    hf = make_hf_model(tmp_path, "llama", vocab_size=127)
    with LLM(str(tmp_path), tensor_parallel_size=2, dtype="float32", device="cuda",
             max_num_tokens=9, attention_backend=backend) as llm:
        assert llm.engine.kernel_settings.triton == (backend == "triton")
        got = token_ids(llm.generate(PROMPTS, GREEDY))
    assert got == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


def test_host_drafts_with_two_ranks_equal_plain(eagle_dirs):
    """The n-gram drafter and the suffix-automaton enhancer draft on rank 0 (host work);
    their drafts reach the other rank with the step's inputs, and the output is plain's."""
    path, head = eagle_dirs
    prompts = PROMPTS + [[7, 8, 9, 10] * 5]
    plain = token_ids(LLM(path, **TIGHT).generate(prompts, GREEDY))
    for spec in (NGramConfig(max_draft_len=3),
                 Eagle3Config(head, max_draft_len=3, use_sa_enhancer=True, sa_min_match_len=2)):
        with LLM(path, speculative_config=spec, tensor_parallel_size=2, **TIGHT) as llm:
            assert token_ids(llm.generate(prompts, GREEDY)) == plain
            assert llm.stats()["num_accepted_draft_tokens"] > 0
            assert_pool_full(llm)


def test_auto_draft_length_and_trees_are_refused(eagle_dirs):
    path, head = eagle_dirs
    for spec, field in ((Eagle3Config(head, draft_len_schedule="auto"), "draft_len_schedule"),
                        (Eagle3Config(head, use_dynamic_tree=True), "use_dynamic_tree")):
        with pytest.raises(ValueError, match=f"{field}.* cannot be combined with "
                                             "tensor_parallel_size > 1"):
            LLM(path, speculative_config=spec, tensor_parallel_size=2, **TIGHT)
