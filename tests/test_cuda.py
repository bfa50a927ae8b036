"""CUDA-only checks (skip cleanly without a GPU): the Triton attention backend against the
portable one, and lossless greedy speculation on the GPU in float32."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_pool_full, hf_greedy, make_eagle3_head, make_hf_model

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [3] * 30, [40, 41],
           list(range(20, 45))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (6, 2, 24)])
@pytest.mark.parametrize("window", [None, 5])
def test_triton_matches_torch_backend(dtype, heads, kv_heads, head_dim, window):
    from onespec.kernels.settings import KernelSettings
    from onespec.layers.attention import build_attention_metadata
    from onespec.layers.ops import make_ops
    torch.manual_seed(0)
    dev, bs, num_blocks = "cuda", 4, 64
    # three requests: a prefill chunk of 7 rows at 10.., a 4-row verify at 20.., one row at 3
    q_lens, starts = [7, 4, 1], [10, 20, 3]
    tables = torch.randperm(num_blocks, device=dev)[:3 * 8].view(3, 8)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)]).to(dev)
    outs = []
    for backend in ("torch", "triton"):
        gen = torch.Generator(device=dev).manual_seed(1)
        kc = torch.randn(num_blocks * bs, kv_heads, head_dim, device=dev, generator=gen).to(dtype)
        vc = torch.randn(num_blocks * bs, kv_heads, head_dim, device=dev, generator=gen).to(dtype)
        t = len(positions)
        q = torch.randn(t, heads, head_dim, device=dev, generator=gen).to(dtype)
        k = torch.randn(t, kv_heads, head_dim, device=dev, generator=gen).to(dtype)
        v = torch.randn(t, kv_heads, head_dim, device=dev, generator=gen).to(dtype)
        meta = build_attention_metadata(tables, q_lens, positions, bs, int(positions.max()) + 1,
                                        window, backend)
        ops = make_ops(KernelSettings(triton=backend == "triton"))
        outs.append(ops.paged_attention(q, k, v, kc, vc, meta, head_dim ** -0.5).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tdir = tmp_path_factory.mktemp("target")
    hf = make_hf_model(tdir, "llama", num_layers=6)
    hdir = tmp_path_factory.mktemp("head")
    make_eagle3_head(hdir, hf, "safeailab", draft_vocab_size=64, seed=3)
    return str(tdir), hf, str(hdir)


def test_plain_matches_transformers_on_cuda(pair):
    from onespec import LLM, SamplingParams
    target, hf, _ = pair
    llm = LLM(target, device="cuda", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 16) for p in PROMPTS]
    assert_pool_full(llm)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("kw", [{}, {"max_num_tokens": 9},
                                {"num_kv_blocks": 20, "block_size": 4, "max_model_len": 64}],
                         ids=["batch", "chunked", "preempt"])
def test_greedy_lossless_on_cuda(pair, k, kw):
    from onespec import LLM, Eagle3Config, SamplingParams
    target, _, head = pair
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = LLM(target, device="cuda", dtype="float32", **kw).generate(PROMPTS, sp)
    llm = LLM(target, device="cuda", dtype="float32",
              speculative_config=Eagle3Config(head, max_draft_len=k), **kw)
    outs = llm.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.stats()["num_draft_tokens"] > 0
    assert_pool_full(llm)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kw", [{}, {"max_num_tokens": 12},
                                {"num_kv_blocks": 24, "block_size": 4, "max_model_len": 64}],
                         ids=["batch", "chunked", "preempt"])
def test_tree_on_triton_equals_plain(pair, graphs, kw):
    """Dynamic trees on the Triton backend (the default on CUDA): tree-masked verify and
    draft passes in the Triton attention kernel, eagerly and from CUDA graphs captured per
    (bucket, tree), the overlap scheduler chaining tree steps (their nodes and parents
    taken from the step before on the device); greedy output equals plain decoding
    (float32) and the pool is whole."""
    from onespec import LLM, Eagle3Config, SamplingParams
    target, _, head = pair
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    chains = not kw                           # one batch throughout: steps chain
    kw = dict(kw, max_batch_size=8)           # graph buckets 1, 2, 4, 8
    plain = LLM(target, device="cuda", dtype="float32", **kw).generate(PROMPTS, sp)
    cfg = Eagle3Config(head, max_draft_len=4, use_dynamic_tree=True, dynamic_tree_max_topK=3,
                       max_total_draft_tokens=10)
    llm = LLM(target, device="cuda", dtype="float32", speculative_config=cfg,
              cuda_graphs=graphs, **kw)
    assert llm.engine.kernel_settings.triton
    outs = llm.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.stats()["num_draft_tokens"] > 0
    runner = llm.engine.runner.graphs
    assert (runner is not None and runner.num_replays > 0) == graphs
    if graphs and chains:
        assert runner.num_chained > 0
    assert_pool_full(llm)


def test_tree_graphs_forced_acceptance_match_eager(pair):
    """Forced accepted path lengths (the bench's tree rows) from CUDA graphs: the same
    tokens and accepted counts as eager tree steps, over buckets with padding rows."""
    from onespec import LLM, Eagle3Config, SamplingParams
    target, _, head = pair
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        cfg = Eagle3Config(head, max_draft_len=4, use_dynamic_tree=True,
                           dynamic_tree_max_topK=2, max_total_draft_tokens=8,
                           force_acceptance_length=3.0)
        llm = LLM(target, device="cuda", dtype="float32", speculative_config=cfg,
                  cuda_graphs=graphs, max_batch_size=8)
        outs = llm.generate(PROMPTS[:3], sp)
        runs.append(([o.outputs[0].token_ids for o in outs], llm.stats()["num_accepted_draft_tokens"]))
        assert_pool_full(llm)
    assert runs[0] == runs[1]
    assert runs[0][1] > 0


def test_tensor_parallel_layers_on_triton_in_cuda_graphs(pair):
    """A tensor-parallel engine of one NCCL rank: the sharded layers (row-parallel
    linears all-reducing, the vocabulary-parallel embedding and LM head) through the
    Triton backend, with the collectives captured in CUDA graphs and the overlap scheduler
    chaining them; greedy EAGLE-3 output equals plain decoding (float32)."""
    from onespec import Eagle3Config, LLM, SamplingParams
    from onespec.config import EngineConfig
    from onespec.distributed.group import TensorParallel, rendezvous_store
    from onespec.distributed.layers import ParallelLMHead, RowParallelLinear
    from onespec.engine.engine import Engine
    target, _, head = pair
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = LLM(target, device="cuda", dtype="float32").generate(PROMPTS, sp)
    group = TensorParallel.join(0, 1, rendezvous_store(1), torch.device("cuda", 0))
    eng = Engine(EngineConfig(model=target, device="cuda", dtype="float32", max_batch_size=8),
                 Eagle3Config(head, max_draft_len=3), parallel=group)
    assert type(eng.ops).__name__ == "TensorParallelTritonOps"
    assert isinstance(eng.model.lm_head, ParallelLMHead)
    assert isinstance(eng.model.model.layers[0].self_attn.o_proj, RowParallelLinear)
    reqs = [eng.add_request(p, sp) for p in PROMPTS]
    while eng.has_unfinished():
        eng.step()
    assert [r.output_token_ids for r in reqs] == [o.outputs[0].token_ids for o in plain]
    graphs = eng.runner.graphs
    assert graphs.num_replays > 0 and graphs.num_chained > 0
    assert eng.stats.as_dict()["num_accepted_draft_tokens"] > 0
    assert eng.pool.num_free_blocks == eng.pool.num_blocks


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("num_prompts", [3, 5])          # buckets 4 and 8: padded rows
def test_cuda_graphs_agree_with_eager(pair, k, num_prompts):
    from onespec import LLM, Eagle3Config, SamplingParams
    target, hf, head = pair
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    spec = Eagle3Config(head, max_draft_len=k) if k else None
    runs = []
    for graphs in (False, True):
        llm = LLM(target, device="cuda", dtype="float32", cuda_graphs=graphs,
                  max_batch_size=8, speculative_config=spec)
        assert (llm.engine.runner.graphs is not None) == graphs
        outs = llm.generate(PROMPTS[:num_prompts], sp)
        runs.append(([o.outputs[0].token_ids for o in outs], [vars(o.metrics) for o in outs]))
        assert_pool_full(llm)
        if graphs:
            assert llm.engine.runner.graphs.graphs, "no graph was captured"
    assert runs[0] == runs[1]
    assert runs[1][0] == [hf_greedy(hf, p, 24) for p in PROMPTS[:num_prompts]]


@pytest.mark.parametrize("k", [0, 3])
def test_capture_warm_up_in_threads(pair, k, monkeypatch):
    """The buckets warmed up side by side before capture (compiling in threads) give the
    same greedy tokens as warming them up one by one, and leave attention's ticket
    counters zero."""
    from onespec import LLM, Eagle3Config, SamplingParams
    from onespec.engine import cuda_graph
    from onespec.kernels import attention as ta
    target, hf, head = pair
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    spec = Eagle3Config(head, max_draft_len=k) if k else None
    runs = []
    real = cuda_graph.CudaGraphRunner._step
    for threads in (1, 4):
        monkeypatch.setattr(cuda_graph, "COMPILE_THREADS", threads)
        warmed = []
        monkeypatch.setattr(cuda_graph.CudaGraphRunner, "_step",
                            lambda self, b, k, buf=None: (warmed.append(buf is not None),
                                                          real(self, b, k, buf))[1])
        llm = LLM(target, device="cuda", dtype="float32", max_batch_size=8,
                  speculative_config=spec)
        buckets = llm.engine.runner.graphs.buckets
        # threads: one warm-up per bucket on its own buffers, then the capture loop's two
        assert warmed.count(True) == (len(buckets) if threads > 1 else 0)
        assert warmed.count(False) == 2 * len(buckets)
        assert ta.counters_clear(torch.device("cuda", 0))
        outs = llm.generate(PROMPTS, sp)
        runs.append([o.outputs[0].token_ids for o in outs])
        assert llm.engine.runner.graphs.num_replays > 0
        assert_pool_full(llm)
    assert runs[0] == runs[1] == [hf_greedy(hf, p, 24) for p in PROMPTS]


def test_cuda_graphs_forced_acceptance(pair):
    from onespec import LLM, Eagle3Config, SamplingParams
    target, _, head = pair
    llm = LLM(target, device="cuda", dtype="float32", max_batch_size=8,
              speculative_config=Eagle3Config(head, max_draft_len=3,
                                              force_acceptance_length=3.0))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    for o in outs:
        assert o.metrics.acceptance_length > 2.5
    assert_pool_full(llm)


def _overlap_llm(target, head, k: int, overlap: bool):
    from onespec import LLM, Eagle3Config
    spec = Eagle3Config(head, max_draft_len=k) if k else None
    return LLM(target, device="cuda", dtype="float32", max_batch_size=8,
               speculative_config=spec, overlap_scheduler=overlap)


@pytest.mark.parametrize("k", [0, 3])
def test_overlap_scheduler_matches_sync_steps(pair, k):
    """Steps launched before the previous one is read give the same tokens, finish reasons
    and metrics as synchronous steps, with requests stopping mid-chain on a stop token
    (known only on the device) and at different max_tokens."""
    from onespec import SamplingParams
    target, hf, head = pair
    full = [hf_greedy(hf, p, 30) for p in PROMPTS]
    # each request stops at the first occurrence of the token at its (7 + 3i)-th output
    params = [SamplingParams(max_tokens=30 - 2 * i, stop_token_ids=[out[7 + 3 * i]],
                             ignore_eos=True) for i, out in enumerate(full)]
    runs = []
    for overlap in (False, True):
        llm = _overlap_llm(target, head, k, overlap)
        outs = llm.generate(PROMPTS, params)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason, vars(o.metrics))
                     for o in outs])
        assert_pool_full(llm)
        chained = llm.engine.runner.graphs.num_chained
        assert (chained > 0) == overlap, chained
    assert runs[0] == runs[1]
    for (tokens, reason, _), out, sp in zip(runs[1], full, params):
        assert reason == "stop" and tokens == out[:out.index(sp.stop_token_ids[0]) + 1]


@pytest.mark.parametrize("k", [0, 3])
def test_overlap_scheduler_abort_in_flight(pair, k):
    """Aborting a request while a step holding it is in flight frees its blocks at once,
    drops its row of that step, and leaves the other requests' outputs unchanged."""
    from onespec import SamplingParams
    target, hf, head = pair
    llm = _overlap_llm(target, head, k, True)
    eng = llm.engine
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    reqs = [eng.add_request(p, sp) for p in PROMPTS[:3]]
    while eng.runner.graphs.num_chained < 2:
        eng.step()
    assert eng._inflight is not None
    eng.abort(reqs[1].request_id)
    assert reqs[1].finish_reason == "abort" and not reqs[1].block_table
    n_out = len(reqs[1].output_token_ids)
    while eng.has_unfinished():
        eng.step()
    assert len(reqs[1].output_token_ids) == n_out          # the dropped row added nothing
    for r in (reqs[0], reqs[2]):
        assert r.output_token_ids == hf_greedy(hf, r.prompt_token_ids, 24)
    assert_pool_full(llm)
    # a new request after the in-flight step of aborted rows still decodes from scratch
    again = llm.generate([PROMPTS[4]], sp)[0].outputs[0].token_ids
    assert again == hf_greedy(hf, PROMPTS[4], 24)
    assert_pool_full(llm)


# ---- prefix caching and long contexts ---------------------------------------------------
@pytest.mark.parametrize("k", [0, 3])
def test_prefix_cache_hits_match_uncached_on_cuda(pair, k):
    """With the Triton backend, CUDA graphs and the overlap scheduler, prompts reusing
    blocks that prefill chunks and graphed decode/verify steps wrote give the uncached
    engine's greedy tokens; the pool is whole again."""
    from onespec import LLM, Eagle3Config, SamplingParams
    target, _, head = pair
    shared = list(range(20, 60))
    prompts = [shared + [i, i + 1, i + 2] for i in (3, 70, 90)] + [shared[:32] + [5] * 9]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)

    def build(cached: bool):
        return LLM(target, device="cuda", dtype="float32", enable_prefix_caching=cached,
                   speculative_config=Eagle3Config(head, max_draft_len=k) if k else None)
    want = [o.outputs[0].token_ids for o in build(False).generate(prompts, sp)]
    llm = build(True)
    outs = llm.generate(prompts[:1], sp) + llm.generate(prompts[1:], sp)
    assert [o.outputs[0].token_ids for o in outs] == want
    # the last prompt leaves the shared tokens after two blocks: with a head, the second
    # block's KV depends on the token after it, so only the first is reused
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 16 if k else 32]
    again = llm.generate(prompts[0] + want[0], sp)[0]          # blocks of graphed steps
    assert again.num_cached_tokens == 64
    assert again.outputs[0].token_ids == \
        build(False).generate(prompts[0] + want[0], sp)[0].outputs[0].token_ids
    assert_pool_full(llm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,rows", [(8, 4), (16, 4), (2, 4), (8, 1)])
@torch.inference_mode()
def test_long_context_attention_split_matches_unsplit(dtype, batch, rows):
    """8B attention shape at 3,000-6,000 positions: decode and verify launches, split over
    keys as the SM count says, equal the unsplit launch and the portable attention."""
    from onespec.kernels import attention as ta
    from onespec.kernels.settings import KernelSettings
    from onespec.layers.attention import build_attention_metadata
    from onespec.layers.ops import make_ops
    gen = torch.Generator(device="cuda").manual_seed(0)
    bs, heads, kv_heads, d = 16, 32, 8, 128
    per = 6016 // bs
    tables = torch.randperm(batch * per, device="cuda", generator=gen).view(batch, per)
    kc, vc = (torch.randn(batch * per * bs, kv_heads, d, device="cuda", generator=gen)
              .to(dtype) for _ in range(2))
    starts = torch.randint(3000, 6000, (batch,), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(s, s + rows) for s in starts.tolist()]).cuda()
    q = torch.randn(len(positions), heads, d, device="cuda", generator=gen).to(dtype)
    meta = build_attention_metadata(tables, rows, positions, bs, int(positions.max()) + 1)
    want = make_ops(KernelSettings()).cached_attention(q, kc, vc, meta, d ** -0.5).float()
    req = torch.arange(batch, device="cuda").repeat_interleave(rows)
    outs = [ta.paged_attention(q, kc, vc, tables, req, positions, d ** -0.5, bs,
                               rows_per_request=rows, split_programs=programs).float()
            for programs in (None, 0)]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for got in outs:
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert ta.counters_clear(q.device)


@pytest.mark.parametrize("drafts", ["sa-enhancer", "ngram"])
def test_host_drafts_in_graph_steps(pair, drafts):
    """The suffix-automaton enhancer and the n-gram drafter with CUDA graphs: the same tokens
    as plain decoding, graph steps replayed. N-gram steps never chain (their drafts are set
    after a step is read); with the enhancer, steps chain while the automaton matches
    nothing and run serially while it proposes, and its drafts are still accepted."""
    from onespec import LLM, Eagle3Config, NGramConfig, SamplingParams
    target, hf, head = pair
    prompts = PROMPTS + [[7, 8, 9, 10] * 6]
    spec = Eagle3Config(head, max_draft_len=3, use_sa_enhancer=True, sa_min_match_len=2) \
        if drafts == "sa-enhancer" else NGramConfig(max_draft_len=3)
    llm = LLM(target, device="cuda", dtype="float32", max_batch_size=8, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 30) for p in prompts]
    graphs = llm.engine.runner.graphs
    assert graphs.num_replays > 0
    assert (graphs.num_chained > 0) == (drafts == "sa-enhancer"), graphs.num_chained
    st = llm.stats()
    assert st["num_accepted_draft_tokens"] > 0
    if drafts == "sa-enhancer":
        assert st["num_sa_accepted_draft_tokens"] > 0
    assert_pool_full(llm)


def test_sa_enhancer_chains_only_without_a_match(pair):
    """Requests whose automaton never matches (sa_min_match_len above anything the short
    outputs repeat) chain most decode steps; one whose prompt repeats
    runs serially while the automaton proposes. Both decode as plain decoding does, one at
    a time and together, and the drafts the automaton counts are ones the steps verified
    (never more than the verified drafts)."""
    from onespec import LLM, Eagle3Config, SamplingParams
    target, hf, head = pair
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    for min_match, prompts in ((64, PROMPTS[:2]), (2, [[7, 8, 9, 10] * 6])):
        llm = LLM(target, device="cuda", dtype="float32", max_batch_size=8,
                  speculative_config=Eagle3Config(head, max_draft_len=3, use_sa_enhancer=True,
                                                   sa_min_match_len=min_match))
        outs = llm.generate(prompts, sp)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]
        graphs, st = llm.engine.runner.graphs, llm.stats()
        if min_match == 64:
            assert st["num_sa_draft_tokens"] == 0
            assert 2 * graphs.num_chained > graphs.num_replays, vars(graphs)
        else:
            assert 0 < st["num_sa_accepted_draft_tokens"] <= st["num_sa_draft_tokens"]
            assert st["num_sa_draft_tokens"] <= st["num_draft_tokens"]
        assert_pool_full(llm)
