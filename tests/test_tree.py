"""Dynamic-tree EAGLE-3 in the engine: lossless greedy and seeded sampled decoding (batched,
chunked prefill, preemption, several targets), a top-1 tree equal to a chain step for step,
drafts equal to a from-scratch EAGLE-2 expansion, forced path lengths, metrics."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import (TEST_DEVICE, assert_pool_full, assert_schedule_keeps_output,
                      build_eagle_pair, make_eagle3_head, make_hf_model)
from draft_reference import HeadReference
from onespec import LLM, Eagle3Config, SamplingParams
from onespec.speculative.tree import depths_of

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 30, [40, 41],
           list(range(20, 45))]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 6-layer target, a random head for it (draft vocab 64 of 128), plain greedy outputs."""
    return build_eagle_pair(tmp_path_factory, 6, PROMPTS, GREEDY)


def tree_llm(target, head, depth=3, top_k=2, nodes=6, device=TEST_DEVICE, **kw):
    cfg = Eagle3Config(head, max_draft_len=depth, use_dynamic_tree=True,
                       dynamic_tree_max_topK=top_k, max_total_draft_tokens=nodes)
    return LLM(target, device=device, dtype="float32", speculative_config=cfg, **kw)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("engine_kw", [{}, {"max_num_tokens": 9},
                                       {"num_kv_blocks": 24, "block_size": 4,
                                        "max_model_len": 64}],
                         ids=["batch", "chunked", "preempt"])
def test_greedy_tree_lossless(pair, engine_kw):
    target, _, head, plain = pair
    llm = tree_llm(target, head, **engine_kw)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
    if "num_kv_blocks" in engine_kw:
        assert llm.stats()["num_preemptions"] > 0
    assert llm.stats()["num_draft_tokens"] > 0
    assert_pool_full(llm)


def plant_tree(rng: random.Random, truth: list[int], n: int, depth: int, vocab: int):
    """A random tree of n nodes whose accepted path (the nodes matching `truth`, the plain
    continuation) ends at a random node; returns (tokens, parents, drafts it accepts)."""
    parents, depths = [], [0]
    for i in range(n):
        p = rng.choice([r for r in range(i + 1) if depths[r] < depth])
        parents.append(p)
        depths.append(depths[p] + 1)
    end = rng.choice([r for r in range(n + 1) if depths[r] <= len(truth)])
    path = {end}
    while end:
        end = parents[end - 1]
        path.add(end)
    tokens = []
    for i, p in enumerate(parents, 1):
        d = depths[i] - 1
        if i in path:
            tokens.append(truth[d])
            continue
        taken = {t for t, q in zip(tokens, parents) if q == p}
        if p in path and d < len(truth):
            taken.add(truth[d])
        tokens.append(rng.choice([t for t in range(vocab) if t not in taken]))
    return tokens, parents, len(path) - 1


CUDA_TRITON = pytest.param(
    {"device": "cuda", "attention_backend": "triton", "cuda_graphs": False}, id="triton-cuda",
    marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("engine_kw", [{}, {"max_num_tokens": 12},
                                       {"num_kv_blocks": 24, "block_size": 4,
                                        "max_model_len": 64}, CUDA_TRITON],
                         ids=["batch", "chunked", "preempt", "triton-cuda"])
def test_planted_trees_accept_their_paths(pair, engine_kw):
    """Each step verifies a planted tree whose matching path (of random length, at random
    rows) is known: exactly that path is accepted, the output equals plain decoding (so the
    path's KV was moved where later steps read it), and the next tree drafted from the
    moved hidden rows equals the from-scratch expansion."""
    target, hf, head, plain = pair
    depth, top_k, nodes = 4, 2, 10
    # (on CUDA: the Triton kernels, tree rows rotated at their depth inside the fused
    # rotary + cache kernels; eager steps, so the planted trees are the ones verified)
    llm = tree_llm(target, head, depth, top_k, nodes, **{"device": "cpu", **engine_kw})
    eng = llm.engine
    ref_hf = hf if eng.device.type == "cpu" else copy.deepcopy(hf).to(eng.device)
    rng = random.Random(0)
    reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
    lengths, checked = set(), 0
    while eng.has_unfinished():
        planned = {}       # request id -> (drafts its path accepts, outputs before)
        for r, want in zip(reqs, plain):
            if r in eng.scheduler.running and not r.in_context:
                truth = want[len(r.output_token_ids):][:depth]
                r.draft_tokens, r.draft_parents, n = plant_tree(rng, truth, nodes, depth, 128)
                planned[r.request_id] = n, len(r.output_token_ids)
        for r in eng.step():
            if r.request_id in planned and not r.is_finished:
                n, before = planned[r.request_id]
                assert len(r.output_token_ids) - before == n + 1
                lengths.add(n)
                if checked < 12:
                    ref = HeadReference(ref_hf, eng.drafter.head,
                                        eng.drafter.capture_layers, r.token_ids)
                    want, margin = ref.tree(depth, top_k, nodes)
                    if margin > 1e-3:
                        assert node_paths(r.draft_tokens, r.draft_parents) == want
                        checked += 1
    assert token_ids([llm.to_output(r) for r in reqs]) == plain
    assert lengths == set(range(depth + 1)) and checked >= 12
    check_metrics(llm.stats(), [r.metrics for r in reqs], nodes)
    if "num_kv_blocks" in engine_kw:
        assert eng.scheduler.num_preemptions > 0
    assert_pool_full(llm)


def check_metrics(st: dict, metrics, nodes: int):
    """Every node counts as a verified draft; the path-length counts and the acceptance per
    depth agree with the accepted drafts."""
    counts = st["accepted_path_length_counts"]
    assert st["num_draft_tokens"] == nodes * sum(counts)
    # (emitted drafts only: max_tokens may cut a request's last accepted path)
    assert 0 < st["num_accepted_draft_tokens"] <= sum(j * c for j, c in enumerate(counts))
    rates = st["acceptance_rate_per_position"]                   # acceptance per depth
    assert rates == [sum(counts[j + 1:]) / sum(counts) for j in range(len(rates))]
    for m in metrics:
        assert m.target_steps + m.num_accepted_draft_tokens == m.num_generated_tokens


@pytest.mark.parametrize("depth,top_k,nodes", [(1, 3, 3), (4, 3, 30), (2, 4, 20)])
def test_tree_shapes_lossless(pair, depth, top_k, nodes):
    target, _, head, plain = pair
    llm = tree_llm(target, head, depth, top_k, nodes)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
    assert_pool_full(llm)


def test_tree_steps_between_plain_steps(pair):
    """K alternates between the tree's depth and 0 (a schedule or the gate): a tree step
    after a plain one verifies padding, and the output stays plain decoding's."""
    target, _, head, plain = pair
    llm = tree_llm(target, head)
    assert_schedule_keeps_output(llm, [3, 3, 0, 3, 0, 0], PROMPTS, GREEDY, plain)


def test_top1_tree_is_a_chain_step_for_step(pair):
    """A tree of top-k 1 and depth K drafts, verifies and accepts exactly as a K-chain."""
    target, _, head, plain = pair
    tree = tree_llm(target, head, depth=3, top_k=1, nodes=3)
    chain = LLM(target, device=TEST_DEVICE, dtype="float32",
                speculative_config=Eagle3Config(head, max_draft_len=3))
    runs = []
    for llm in (tree, chain):
        eng = llm.engine
        reqs = [eng.add_request(p, GREEDY) for p in PROMPTS]
        trace = []
        while eng.has_unfinished():
            eng.step()
            trace.append([(len(r.output_token_ids), list(r.draft_tokens)) for r in reqs])
        runs.append((trace, [vars(r.metrics) for r in reqs], [r.output_token_ids for r in reqs]))
        assert_pool_full(llm)
    assert runs[0] == runs[1]
    assert runs[0][2] == plain


def test_tree_drafts_match_from_scratch_expansion(pair):
    """After every step each running request's tree equals an EAGLE-2 expansion recomputed
    without any cache from transformers' hidden states (docs/DECODING.md, "dynamic trees"),
    except where near-equal scores let float noise choose."""
    target, hf, head, _ = pair
    depth, top_k, nodes = 3, 2, 5
    llm = tree_llm(target, head, depth, top_k, nodes, device="cpu", max_num_tokens=12)
    eng = llm.engine
    drafter = eng.drafter
    reqs = [eng.add_request(p, GREEDY) for p in PROMPTS[:4]]
    checked = 0
    while eng.has_unfinished():
        for req in eng.step():
            if req.is_finished or not req.draft_tokens:
                continue
            ref = HeadReference(hf, drafter.head, drafter.capture_layers, req.token_ids)
            want, margin = ref.tree(depth, top_k, nodes)
            if margin < 1e-3:
                continue
            assert node_paths(req.draft_tokens, req.draft_parents) == want
            checked += 1
    assert checked >= 20
    assert all(r.is_finished for r in reqs)
    assert_pool_full(llm)


def node_paths(tokens, parents) -> set[tuple[int, ...]]:
    """Each node of a tree as the tuple of tokens from the root to it."""
    paths = [()]
    for t, p in zip(tokens, parents):
        paths.append(paths[p] + (t,))
    return set(paths[1:])


def test_seeded_sampled_tree_equals_plain(pair):
    """Sampled rows accept by exact match on the tree; a seeded request's draws depend only
    on (seed, position), so its output equals plain decoding's, mixed with greedy ones."""
    target, _, head, plain = pair
    params = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, top_k=20,
                             seed=7 + i) for i in range(3)] + [GREEDY, GREEDY]
    want = LLM(target, device=TEST_DEVICE, dtype="float32").generate(PROMPTS, params)
    llm = tree_llm(target, head, depth=3, top_k=3, nodes=9)
    got = llm.generate(PROMPTS, params)
    assert token_ids(got) == token_ids(want)
    assert token_ids(got)[3:] == plain[3:]
    assert_pool_full(llm)


def test_forced_path_lengths(pair):
    target, _, head, _ = pair
    cfg = Eagle3Config(head, max_draft_len=3, use_dynamic_tree=True, dynamic_tree_max_topK=1,
                       max_total_draft_tokens=3, force_acceptance_length=2.5)
    llm = LLM(target, device=TEST_DEVICE, dtype="float32", speculative_config=cfg)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=60, ignore_eos=True))
    st = llm.stats()
    assert 2.2 < st["acceptance_length"] < 2.8
    counts = st["accepted_path_length_counts"]
    assert counts[0] == counts[3] == 0 and counts[1] and counts[2]   # 2 or 3 tokens a step
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    assert_pool_full(llm)


def test_tree_drafts_are_valid_trees(pair):
    target, _, head, _ = pair
    llm = tree_llm(target, head, depth=4, top_k=3, nodes=12)
    eng = llm.engine
    req = eng.add_request(PROMPTS[1], GREEDY)
    for _ in range(4):
        eng.step()
        assert len(req.draft_tokens) == len(req.draft_parents) == 12
        assert max(depths_of(req.draft_parents)) <= 4
        assert all(p <= i for i, p in enumerate(req.draft_parents))
        siblings = {}
        for t, p in zip(req.draft_tokens, req.draft_parents):
            assert t not in siblings.setdefault(p, set())        # distinct children
            siblings[p].add(t)
    eng.abort(req.request_id)
    assert_pool_full(llm)


@pytest.fixture(scope="module")
def other_targets(tmp_path_factory):
    from moe_utils import make_deepseek_model, make_qwen3_moe_model
    out = {}
    makers = {"qwen3": lambda p: make_hf_model(p, "qwen3", num_layers=4),
              "qwen3-moe": make_qwen3_moe_model, "deepseek-v3": make_deepseek_model}
    for name, make in makers.items():
        tdir = tmp_path_factory.mktemp(name)
        hf = make(tdir)
        head = str(tmp_path_factory.mktemp(name + "-head"))
        make_eagle3_head(head, hf, "safeailab", aux_layer_ids=[1, 2, 3], seed=5)
        out[name] = (str(tdir), head)
    return out


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe", "deepseek-v3"])
def test_other_targets_lossless(other_targets, name):
    target, head = other_targets[name]
    prompts = PROMPTS[:3]
    plain = LLM(target, device=TEST_DEVICE, dtype="float32").generate(prompts, GREEDY)
    llm = tree_llm(target, head, depth=3, top_k=2, nodes=6, max_num_tokens=16)
    assert token_ids(llm.generate(prompts, GREEDY)) == token_ids(plain)
    assert_pool_full(llm)


def test_unsupported_combinations_fail_clearly(pair, other_targets):
    target, _, head, _ = pair
    with pytest.raises(ValueError, match="max_num_tokens"):
        tree_llm(target, head, depth=3, top_k=4, nodes=20, max_num_tokens=16)
    with pytest.raises(ValueError, match="attention_backend='triton' needs a CUDA device"):
        tree_llm(target, head, attention_backend="triton", device="cpu")
    # MLA's Triton kernel has no tree masks (on any device: refused before loading)
    with pytest.raises(ValueError, match="use_dynamic_tree=True cannot be combined with attention_backend='triton' on a target without tree masks"):
        tree_llm(*other_targets["deepseek-v3"], attention_backend="triton")
    from onespec.structured.params import StructuredOutputsParams
    llm = tree_llm(target, head)
    with pytest.raises(ValueError, match="use_dynamic_tree=True cannot be combined with "
                                         "structured_outputs"):
        llm.engine.add_request([5, 6], SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="[0-9]+")))
    assert_pool_full(llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tree_on_cuda_float32_equals_plain(pair, backend):
    """On the GPU (float32, portable or Triton attention) a tree equals plain greedy
    decoding (computed on the CPU)."""
    target, _, head, plain = pair
    llm = tree_llm(target, head, depth=6, top_k=4, nodes=32, device="cuda",
                   attention_backend=backend)
    assert llm.engine.kernel_settings.triton == (backend == "triton")
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain
    assert_pool_full(llm)


def test_cli_tree_options(pair, capsys):
    from onespec.cli import build_llm, check_engine_args, generate_parser, main
    from onespec.speculative.shape import TreeShape
    target, _, head, plain = pair
    parser = generate_parser()
    args = parser.parse_args(["--model", target, "--draft", head, "--k", "3", "--tree-topk", "2",
                              "--tree-nodes", "6", "--prompt-ids", "1", "--device", "cpu",
                              "--dtype", "float32"])
    check_engine_args(parser, args)
    llm = build_llm(args)
    assert llm.engine.tree == TreeShape(3, 2, 6)
    assert token_ids(llm.generate([PROMPTS[1]], GREEDY)) == [plain[1]]
    for argv, message in [(["--tree-topk", "2"], "need --draft"),
                          (["--draft", head, "--tree-nodes", "6"], "needs --tree-topk")]:
        with pytest.raises(SystemExit):
            main(["generate", "--model", target, "--prompt-ids", "1", *argv])
        assert message in capsys.readouterr().err
