"""One-model EAGLE-3: lossless greedy decoding, draft correctness against a from-scratch
reference, checkpoint formats, schedules, gate, forced acceptance, metrics."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import (TEST_DEVICE, assert_drafts_match_reference, assert_pool_full,
                      assert_schedule_keeps_output, make_eagle3_head, make_hf_model)
from draft_reference import HeadReference
from onespec import LLM, Eagle3Config, SamplingParams

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 30, [40, 41],
           list(range(20, 45))]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 6-layer target and random heads for it in both formats (draft vocab 64 of 128)."""
    tdir = tmp_path_factory.mktemp("target")
    hf = make_hf_model(tdir, "llama", num_layers=6)
    heads = {}
    for fmt in ("safeailab", "speculators"):
        heads[fmt] = str(tmp_path_factory.mktemp(fmt))
        make_eagle3_head(heads[fmt], hf, fmt, draft_vocab_size=64, seed=3)
    plain = LLM(str(tdir), device=TEST_DEVICE, dtype="float32").generate(PROMPTS, GREEDY)
    return str(tdir), hf, heads, [o.outputs[0].token_ids for o in plain]


def spec_llm(target, head, k, device=TEST_DEVICE, **kw):
    return LLM(target, device=device, dtype="float32",
               speculative_config=Eagle3Config(head, max_draft_len=k), **kw)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("engine_kw", [{}, {"max_num_tokens": 9},
                                       {"num_kv_blocks": 20, "block_size": 4,
                                        "max_model_len": 64}],
                         ids=["batch", "chunked", "preempt"])
def test_greedy_lossless(pair, k, engine_kw):
    target, _, heads, plain = pair
    llm = spec_llm(target, heads["safeailab"], k, **engine_kw)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
    if "num_kv_blocks" in engine_kw:
        assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["num_draft_tokens"] > 0
    assert_pool_full(llm)


def test_schedule_cycling_k(pair):
    """K changes every step (4,4,2,2,0,0,2,2,...): drafts are truncated, padded, skipped."""
    target, _, heads, plain = pair
    llm = spec_llm(target, heads["speculators"], 4)
    assert_schedule_keeps_output(llm, [4, 4, 2, 2, 0, 0, 2, 2], PROMPTS, GREEDY, plain)


def test_formats_give_identical_drafts_and_metrics(pair):
    target, _, heads, _ = pair
    runs = []
    for fmt in ("safeailab", "speculators"):
        llm = spec_llm(target, heads[fmt], 3)
        outs = llm.generate(PROMPTS, GREEDY)
        eng = llm.engine
        req = eng.add_request(PROMPTS[1], GREEDY)
        eng.step()
        runs.append((token_ids(outs), [vars(o.metrics) for o in outs], list(req.draft_tokens),
                     llm.stats()))
        eng.abort(req.request_id)
        assert_pool_full(llm)
    assert runs[0] == runs[1]
    assert len(runs[0][2]) == 3


# ---- draft correctness against a from-scratch reference ------------------------------------

def reference_drafts(hf, head, capture, tokens: list[int], k: int):
    """Drafts for a request whose committed tokens are `tokens`, recomputed without any
    cache from transformers' hidden states, with each step's top-2 logit margin (so
    near-ties, which float noise decides, can be told apart from bugs)."""
    return HeadReference(hf, head, capture, tokens).chain(k)


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_match_from_scratch_reference(pair, k):
    target, hf, heads, _ = pair
    llm = spec_llm(target, heads["safeailab"], k, device="cpu", max_num_tokens=10)
    drafter = llm.engine.drafter
    assert_drafts_match_reference(
        llm, PROMPTS[:4], GREEDY,
        lambda ids: reference_drafts(hf, drafter.head, drafter.capture_layers, ids, k), k)


def test_capture_layer_conventions(pair, tmp_path):
    """A checkpoint's aux ids are inputs-to; onespec captures outputs-of (one less)."""
    target, hf, _, plain = pair
    make_eagle3_head(tmp_path, hf, "safeailab", aux_layer_ids=[2, 3, 5])
    llm = spec_llm(target, str(tmp_path), 2)
    assert llm.engine.drafter.capture_layers == (1, 2, 4)
    assert token_ids(llm.generate(PROMPTS[:2], GREEDY)) == plain[:2]
    default = spec_llm(target, heads_default(tmp_path, hf), 2)
    assert default.engine.drafter.capture_layers == (1, 2, 2)        # L = 6
    override = LLM(target, device=TEST_DEVICE, dtype="float32", speculative_config=Eagle3Config(
        str(tmp_path), max_draft_len=2, layers_to_capture=(0, 1, 3)))
    assert override.engine.drafter.capture_layers == (0, 1, 3)


def heads_default(tmp_path, hf):
    path = tmp_path / "default"
    make_eagle3_head(path, hf, "speculators", seed=5)
    return str(path)


@pytest.mark.parametrize("variant", [dict(own_embedding=True), dict(norm_before_residual=True),
                                     dict(num_layers=2)])
def test_head_variants_lossless(pair, tmp_path, variant):
    target, hf, _, plain = pair
    make_eagle3_head(tmp_path, hf, "speculators", **variant)
    llm = spec_llm(target, str(tmp_path), 3)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
    assert_pool_full(llm)


def test_draft_len_schedule_and_gate(pair):
    target, _, heads, plain = pair
    sched = LLM(target, device=TEST_DEVICE, dtype="float32", speculative_config=Eagle3Config(
        heads["safeailab"], max_draft_len=3, draft_len_schedule={2: 3, 4: 1}))
    assert sched.engine.draft_len(1) == 3 and sched.engine.draft_len(3) == 1
    assert sched.engine.draft_len(5) == 0
    assert token_ids(sched.generate(PROMPTS, GREEDY)) == plain
    conc = Eagle3Config(heads["safeailab"], max_draft_len=2, max_concurrency=4)
    assert conc.draft_len_schedule == {4: 2}
    gated = LLM(target, device=TEST_DEVICE, dtype="float32", speculative_config=Eagle3Config(
        heads["safeailab"], max_draft_len=3, acceptance_window=2,
        acceptance_length_threshold=5.0))
    gated.generate(PROMPTS[:2], GREEDY)                # random head: acceptance far below 6
    assert not gated.engine.gate.enabled
    before = gated.stats()["num_draft_tokens"]
    assert token_ids(gated.generate(PROMPTS, GREEDY)) == plain
    assert gated.stats()["num_draft_tokens"] == before
    assert_pool_full(gated)


def test_forced_acceptance_sets_tokens_per_step(pair):
    target, _, heads, _ = pair
    llm = LLM(target, device=TEST_DEVICE, dtype="float32", speculative_config=Eagle3Config(
        heads["safeailab"], max_draft_len=3, force_acceptance_length=2.5))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=60, ignore_eos=True))
    steps = sum(o.metrics.target_steps for o in outs) - len(outs)     # generation steps
    tokens = sum(len(o.outputs[0].token_ids) for o in outs) - len(outs)
    assert abs(tokens / steps - 2.5) < 0.3
    assert_pool_full(llm)


def test_metrics_are_consistent(pair):
    target, _, heads, _ = pair
    llm = spec_llm(target, heads["safeailab"], 3)
    outs = llm.generate(PROMPTS, GREEDY)
    stats = llm.stats()
    for o in outs:
        m = o.metrics
        assert m.num_generated_tokens == len(o.outputs[0].token_ids)
        assert m.num_accepted_draft_tokens <= m.num_draft_tokens
        assert m.acceptance_length == pytest.approx(len(o.outputs[0].token_ids) / m.target_steps)
        assert m.num_draft_tokens == 3 * (m.target_steps - 1)
    assert stats["num_draft_tokens"] == sum(o.metrics.num_draft_tokens for o in outs)
    assert len(stats["acceptance_rate_per_position"]) == 3
    assert all(0.0 <= r <= 1.0 for r in stats["acceptance_rate_per_position"])


def test_head_that_does_not_fit_fails_at_load(pair, tmp_path):
    target, _, _, _ = pair
    other = make_hf_model(tmp_path / "wide", "llama", hidden_size=96, num_layers=6)
    make_eagle3_head(tmp_path / "head", other, "safeailab")
    with pytest.raises(ValueError, match="hidden size"):
        spec_llm(target, str(tmp_path / "head"), 2)
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        spec_llm(target, target, 2)


def test_lower_precision_head_stays_lossless(pair):
    """A bf16 head over a float32 target: drafts change, output does not."""
    target, _, heads, plain = pair
    llm = LLM(target, device=TEST_DEVICE, dtype="float32", speculative_config=Eagle3Config(
        heads["safeailab"], max_draft_len=3, draft_dtype="bfloat16"))
    head = llm.engine.drafter.head
    assert head.fc.weight.dtype == torch.bfloat16
    assert head.layers[0].self_attn.k_cache.dtype == torch.bfloat16
    assert llm.engine.model.lm_head.weight.dtype == torch.float32
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
    assert_pool_full(llm)


def test_head_from_pytorch_model_bin(pair, tmp_path):
    """Published heads also ship pytorch_model.bin; it is read with weights_only=True."""
    from safetensors.torch import load_file
    target, _, heads, plain = pair
    shutil.copy(f"{heads['safeailab']}/config.json", tmp_path / "config.json")
    torch.save(load_file(f"{heads['safeailab']}/model.safetensors"),
               tmp_path / "pytorch_model.bin")
    runs = []
    for head in (heads["safeailab"], str(tmp_path)):
        llm = spec_llm(target, head, 3)
        outs = llm.generate(PROMPTS, GREEDY)
        runs.append((token_ids(outs), llm.stats()))
    assert runs[0] == runs[1]
    assert runs[1][0] == plain


def test_cli_generate_with_draft_prints_acceptance(pair):
    target, _, heads, plain = pair
    proc = subprocess.run(
        [sys.executable, "-m", "onespec", "generate", "--model", target, "--draft",
         heads["safeailab"], "--k", "3", "--prompt-ids", ",".join(map(str, PROMPTS[1])),
         "--max-tokens", "20", "--ignore-eos", "--device", "cpu", "--dtype", "float32"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(t) for t in plain[1]]
    assert "acceptance length" in proc.stderr and "drafts accepted" in proc.stderr
