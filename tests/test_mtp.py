"""MTP drafting on a DeepSeek-V3 target: greedy output equals plain output in both modes
(batched, chunked prefill, preemption), drafts equal a cache-free reference built from
transformers modules, configuration errors, the CLI flag."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import TEST_DEVICE, assert_drafts_match_reference, assert_pool_full
from moe_utils import add_mtp_layers, make_deepseek_model
from onespec import LLM, MTPConfig, SamplingParams

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 30, [40, 41],
           list(range(20, 45))]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
ENGINE_KW = {"batch": {}, "chunked": {"max_num_tokens": 9},
             "preempt": {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 64}}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 3-layer DeepSeek-V3 target with 2 MTP layers (own embedding and head), its
    transformers model, the MTP layers' reference modules, and plain greedy outputs."""
    path = tmp_path_factory.mktemp("ds-mtp")
    hf = make_deepseek_model(path, mtp_layers=2)
    refs = add_mtp_layers(path, hf, 2)
    plain = LLM(str(path), dtype="float32", device=TEST_DEVICE).generate(PROMPTS, GREEDY)
    return str(path), hf, refs, [o.outputs[0].token_ids for o in plain]


def mtp_llm(path, k, vanilla=False, device=TEST_DEVICE, **kw):
    return LLM(path, dtype="float32", device=device,
               speculative_config=MTPConfig(num_nextn_predict_layers=k,
                                            use_mtp_vanilla=vanilla), **kw)


@pytest.mark.parametrize("engine_kw", list(ENGINE_KW))
@pytest.mark.parametrize("mode,k", [("eagle", 1), ("eagle", 3), ("vanilla", 2)])
def test_greedy_lossless(target, mode, k, engine_kw):
    path, _, _, plain = target
    llm = mtp_llm(path, k, vanilla=mode == "vanilla", **ENGINE_KW[engine_kw])
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    if engine_kw == "preempt":
        assert llm.stats()["num_preemptions"] > 0
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0
    assert len(llm.engine.drafter.attention_layers) == (2 if mode == "vanilla" else 1)
    assert_pool_full(llm)


def test_sa_enhancer_over_mtp_drafts(target):
    """The suffix-automaton enhancer works on MTP drafts as on EAGLE-3's: same output."""
    path, _, _, plain = target
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, max_num_tokens=9,
              speculative_config=MTPConfig(num_nextn_predict_layers=3, use_sa_enhancer=True,
                                           sa_min_match_len=2))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.stats()
    assert 0 < stats["num_sa_accepted_draft_tokens"] <= stats["num_sa_draft_tokens"]
    assert_pool_full(llm)


@torch.no_grad()
def reference_drafts(hf, mtp, tokens: list[int], k: int):
    """MTP-Eagle drafts for a request whose committed tokens are `tokens`, recomputed
    without any cache from transformers modules (docs/DECODING.md, "MTP"): rows at positions 0..n-2
    carry (token p+1, target's final hidden p); step j adds a row (draft j, output of the
    row before). Also returns each step's top-2 logit margin (near-ties are float noise)."""
    embed = mtp.embed if mtp.embed is not None else hf.model.embed_tokens
    head = mtp.head if mtp.head is not None else hf.lm_head
    final = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]       # [n-1, H]

    def layer_input(ids, hidden):
        return mtp.eh_proj(torch.cat([mtp.enorm(embed(ids)), mtp.hnorm(hidden)], -1))

    xs = layer_input(torch.tensor(tokens[1:]), final)
    drafts, margins = [], []
    for _ in range(k):
        n = xs.shape[0]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = mtp.block(xs[None], attention_mask=mask, position_ids=pos,
                        position_embeddings=hf.model.rotary_emb(xs[None], pos))[0]
        last = mtp.shared_head_norm(out[-1:])
        top2 = head(last)[0].topk(2)
        drafts.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        xs = torch.cat([xs, layer_input(torch.tensor(drafts[-1:]), last)])
    return drafts, margins


def test_drafts_match_cache_free_reference(target):
    path, hf, refs, _ = target
    k = 3
    llm = mtp_llm(path, k, device="cpu", max_num_tokens=10)     # compared on the CPU
    assert_drafts_match_reference(llm, PROMPTS[:4], GREEDY,
                                  lambda ids: reference_drafts(hf, refs[0], ids, k), k)


def test_mtp_layers_come_from_the_checkpoint(target):
    path, _, refs, _ = target
    llm = mtp_llm(path, 2, vanilla=True)
    layers = llm.engine.drafter.head.layers
    for layer, ref in zip(layers, refs):
        torch.testing.assert_close(layer.eh_proj.weight.cpu(), ref.eh_proj.weight)
        torch.testing.assert_close(layer.embed_tokens.weight.cpu(), ref.embed.weight)
        torch.testing.assert_close(layer.block.mlp.experts.gate_up_proj[3, :32].cpu(),
                                   ref.block.mlp.experts.gate_up_proj[3, :32])
    # the MTP layers' latents are extra layers of the one pool
    assert all(a.latent_cache is not None for a in llm.engine.drafter.attention_layers)


def test_configuration_errors(target, tiny_models):
    path, _, _, _ = target
    with pytest.raises(ValueError, match="num_nextn_predict_layers=2 MTP layers; 3 were"):
        mtp_llm(path, 3, vanilla=True)
    with pytest.raises(ValueError, match="needs a target with MTP layers"):
        mtp_llm(tiny_models["llama"][0], 1)
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be an integer"):
        MTPConfig(num_nextn_predict_layers=0)


def test_cli_generate_with_mtp(target):
    path, _, _, plain = target
    out = subprocess.run([sys.executable, "-m", "onespec", "generate", "--model", path,
                          "--mtp", "2", "--prompt-ids", ",".join(map(str, PROMPTS[1])),
                          "--max-tokens", "8", "--ignore-eos", "--device", "cpu",
                          "--dtype", "float32"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(t) for t in plain[1][:8]]
    assert "acceptance length" in out.stderr


@pytest.mark.parametrize("cut", ["max_tokens", "stop"])
def test_accepted_drafts_count_only_emitted_tokens(target, cut):
    """Forced acceptance emits 4 tokens a step; max_tokens=10 or a stop token cuts a run
    inside a step: target_steps + num_accepted_draft_tokens == generated tokens still."""
    path, _, _, _ = target
    llm = LLM(path, dtype="float32", device=TEST_DEVICE,
              speculative_config=MTPConfig(num_nextn_predict_layers=3,
                                           force_acceptance_length=4.0))
    free_run = [o.outputs[0].token_ids for o in
                llm.generate(PROMPTS, SamplingParams(max_tokens=13, ignore_eos=True))]
    assert all(len(run) == 13 for run in free_run)          # 1 + 4 + 4 + 4: no cuts
    if cut == "max_tokens":
        params = SamplingParams(max_tokens=10, ignore_eos=True)
    else:       # stop at a token first seen inside a step, not at its end
        params = [SamplingParams(max_tokens=13, ignore_eos=True, stop_token_ids=[
            t for i, t in enumerate(run) if i % 4 and t not in run[:i]][:1])
            for run in free_run]
    outs = llm.generate(PROMPTS, params)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    for o, n in zip(outs, lengths):
        m = o.metrics
        assert m.num_generated_tokens == n
        assert m.target_steps + m.num_accepted_draft_tokens == n
    assert any(n % 4 != 1 for n in lengths)                  # some run was cut in a step
    assert_pool_full(llm)


# ---- relaxed acceptance (docs/DECODING.md, "Acceptance") -----------------------------------
def _logits(rows):
    return torch.tensor(rows).log().unsqueeze(0)                    # [1, K+1, V]


RELAXED_PROBS = [[.5, .3, .1, .05, .05], [.1, .6, .2, .05, .05], [.4, .1, .35, .1, .05],
                 [.2, .2, .2, .2, .2]]


@pytest.mark.parametrize("drafts,topk,delta,accepted,num_relaxed", [
    ([1, 1, 3], 2, 0.3, [1, 1, 0], 1),     # 0.3 >= 0.5 - 0.3; top-1; 3 is not in the top 2
    ([1, 1, 2], 3, 0.35, [1, 1, 2, 0], 2),  # 0.35 >= 0.4 - 0.35 too; bonus = top-1 (0)
    ([1, 1, 3], 2, 0.1, [0], 0),           # 0.3 < 0.5 - 0.1: rejected at once
    ([1, 1, 3], 1, 0.9, [0], 0),           # topk 1 is strict whatever delta
    ([1, 1, 3], 2, 0.0, [0], 0),           # delta 0 is strict
])
def test_relaxed_accept_worked_examples(drafts, topk, delta, accepted, num_relaxed):
    from onespec.speculative.acceptance import relaxed_accept, strict_accept
    drafts, logits = torch.tensor([drafts]), _logits(RELAXED_PROBS)
    acc, n, relaxed = relaxed_accept(drafts, logits, torch.tensor([delta]), topk)
    relaxed = relaxed.sum(-1)
    assert n.tolist() == [len(accepted)] and acc[0, :n[0]].tolist() == accepted
    assert relaxed.tolist() == [num_relaxed]
    if topk == 1 or delta == 0.0:
        s_acc, s_n = strict_accept(drafts, logits.argmax(-1))
        assert s_n.tolist() == n.tolist() and s_acc[0, :s_n[0]].tolist() == accepted


def test_relaxed_accept_is_strict_outside_thinking():
    """delta 0 (outside the thinking phase) equals strict acceptance on random cases."""
    from onespec.speculative.acceptance import relaxed_accept, strict_accept
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4, 16, generator=g)
    drafts = torch.where(torch.rand(64, 3, generator=g) < 0.6, logits[:, :3].argmax(-1),
                         torch.randint(0, 16, (64, 3), generator=g))
    acc, n, relaxed = relaxed_accept(drafts, logits, torch.zeros(64), topk=4)
    s_acc, s_n = strict_accept(drafts, logits.argmax(-1))
    assert torch.equal(n, s_n) and not relaxed.any()
    for i in range(64):
        assert torch.equal(acc[i, :n[i]], s_acc[i, :n[i]])


BEGIN, END = 7, 8
THINKING_PROMPTS = [[5, 6, 7], [9, 7, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 20 + [7],
                    [40, 41], [7] + list(range(20, 45))]


def relaxed_llm(path, topk, delta, end=None, **kw):
    return LLM(path, dtype="float32", device=TEST_DEVICE, speculative_config=MTPConfig(
        num_nextn_predict_layers=3, use_relaxed_acceptance_for_thinking=True,
        relaxed_topk=topk, relaxed_delta=delta, begin_thinking_phase_token=BEGIN,
        end_thinking_phase_token=end), **kw)


@pytest.fixture(scope="module")
def strict_outputs(target):
    path = target[0]
    return [o.outputs[0].token_ids for o in LLM(path, dtype="float32", device=TEST_DEVICE)
            .generate(THINKING_PROMPTS, GREEDY)]


@pytest.mark.parametrize("topk,delta,end", [(1, 1.0, None),     # topk 1: strict
                                            (32, 0.0, None),    # delta 0: strict
                                            (32, 1.0, BEGIN + 1000)])  # never thinking
def test_relaxed_engine_equals_strict(target, strict_outputs, topk, delta, end):
    path = target[0]
    if end is not None:      # the phase closes right after it opens, in every prompt
        prompts = [p + [END] for p in THINKING_PROMPTS]
        llm = relaxed_llm(path, topk, delta, end=END)
        want = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", device=TEST_DEVICE)
                .generate(prompts, GREEDY)]
    else:
        prompts, llm, want = THINKING_PROMPTS, relaxed_llm(path, topk, delta), strict_outputs
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.stats()["num_relaxed_accepted_tokens"] == 0
    assert_pool_full(llm)


def test_relaxed_acceptance_inside_thinking(target, strict_outputs):
    """Inside the phase drafts among the top 32 are accepted: more tokens per step, some
    emitted tokens differ from strict greedy; chunked prefill (the begin token in an early
    chunk), preemption and a prefix-cache hit (the begin token in a cached block) track
    the phase the same way."""
    path = target[0]
    runs = {}
    for name, kw in (("batch", {}), ("chunked", {"max_num_tokens": 5}),
                     ("preempt", ENGINE_KW["preempt"]), ("cached", {"block_size": 4})):
        llm = relaxed_llm(path, 32, 1.0, **kw)
        outs = llm.generate(THINKING_PROMPTS, GREEDY)
        if name == "cached":        # again: the begin tokens are in cached blocks now
            outs += llm.generate(THINKING_PROMPTS, GREEDY)
            assert outs[-1].num_cached_tokens > 0
        runs[name] = [o.outputs[0].token_ids for o in outs[-len(THINKING_PROMPTS):]]
        stats = llm.stats()
        assert stats["num_relaxed_accepted_tokens"] > 0
        assert sum(o.metrics.num_relaxed_accepted_tokens for o in outs) == \
            stats["num_relaxed_accepted_tokens"]
        for o in outs:
            m = o.metrics
            assert m.num_relaxed_accepted_tokens <= m.num_accepted_draft_tokens
            assert m.target_steps + m.num_accepted_draft_tokens == m.num_generated_tokens
        assert_pool_full(llm)
    assert runs["batch"] == runs["chunked"] == runs["preempt"] == runs["cached"]
    assert runs["batch"] != strict_outputs


def test_thinking_phase_walk():
    from onespec.engine.request import Request
    from onespec.speculative.thinking import ThinkingPhase
    phase = ThinkingPhase(BEGIN, END, 0.4)
    req = Request("r", [1, 2], GREEDY)
    phase.walk(req, [1, BEGIN, 3])
    assert req.features.thinking.delta == 0.4
    phase.walk(req, [END, 4, BEGIN, END])            # the last one wins
    assert req.features.thinking.delta == 0.0
    phase.walk(req, [BEGIN])
    phase.walk(req, [1, 2], restart=True)            # recomputed from the start
    assert req.features.thinking.delta == 0.0


# ---- benchmark shape ----------------------------------------------------------------------
def test_expected_experts_worked_example():
    from onespec.bench.moe import expected_experts
    assert expected_experts(64, 6, 1) == pytest.approx(6.0)        # batch 1: the active ones
    assert expected_experts(64, 6, 2) == pytest.approx(64 * (1 - (58 / 64) ** 2))
    assert expected_experts(64, 6, 10_000) == pytest.approx(64.0)  # large batches: all


def test_bench_mtp_shape_tiny_cpu(capsys):
    from onespec.bench.decode import main
    assert main(["decode", "--shape", "tiny-mla", "--device", "cpu", "--dtype", "float32",
                 "--batch-sizes", "1", "--ks", "0,2", "--acceptance", "max", "--gen-len", "4",
                 "--trials", "1", "--warmup-steps", "1", "--no-hf"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert [(r["k"], r["acceptance_length"]) for r in rows] == [(0, 1.0), (2, 3.0)]
    plain, mtp = rows
    assert all("error" not in r and r["model"] == "tiny-mla-shape" for r in rows)
    assert mtp["floor_ms"] > plain["floor_ms"] > 0 and mtp["speedup"] > 0
