"""CUDA graphs for hybrid targets' generation steps (engine/cuda_graph.py with
engine/state_pool.py) and hybrids on the Triton backend.

On the CPU: a bucket's slots input packed as the graph runner packs it, and a padded
bucket's forward and commit (the graph step's recurrent part, from device tensors only)
equal the eager step's for the real requests, leaving every other slot alone; the Triton
backend's forwards (Triton's interpreter) equal the portable path's. On a GPU: graphed and
eager hybrid steps agree in float32 with MTP and EAGLE-3 drafts (greedy tokens, and
every recurrent state after the run)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import assert_pool_full, make_eagle3_head
from hybrid_utils import add_mtp_weights, make_hybrid_model, make_nemotron_h_model
from onespec import LLM, Eagle3Config, MTPConfig, NGramConfig, SamplingParams
from onespec.engine.cuda_graph import fill_slots, graph_recurrent_batch
from onespec.layers.attention import build_attention_metadata
from onespec.speculative.shape import InputLayout

TWO_LAYERS = dict(num_layers=2, layer_types=["linear_attention", "full_attention"])
NEMOTRON_NO_MOE = dict(layers_block_type=["linear_attention", "mlp", "full_attention", "mlp",
                                          "linear_attention", "mlp"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{arch: (path, hf model)}: two-layer Qwen3-Next (DeltaNet, attention) and a
    Nemotron-H without MoE blocks (Mamba2, attention, MLP)."""
    q = tmp_path_factory.mktemp("qwen3-next-graphs")
    n = tmp_path_factory.mktemp("nemotron-h-graphs")
    return {"qwen3-next": (str(q), make_hybrid_model(q, "qwen3-next", **TWO_LAYERS)),
            "nemotron-h": (str(n), make_nemotron_h_model(n, **NEMOTRON_NO_MOE))}


def test_slots_input_layout():
    """The slots segment follows the chain sources (the offsets kernels/chain.py reads
    are unchanged); padding takes the scratch slot, a request without a slot is refused."""
    plain, hybrid = InputLayout(4, 3, 2, False, 5), InputLayout(4, 3, 2, False, 5, True)
    assert (hybrid.pos_at, hybrid.drafts_at, hybrid.tables_at, hybrid.src_at) == \
        (plain.pos_at, plain.drafts_at, plain.tables_at, plain.src_at)
    assert plain.views(np.zeros(plain.size))["slots"] is None
    assert hybrid.size == plain.size + 4 and hybrid.slots_at == plain.size
    buf = np.full(hybrid.size, -7, dtype=np.int64)

    class Req:          # what fill_slots reads of a Request
        def __init__(self, rid, slot):
            self.request_id, self.state_slot = rid, slot
    fill_slots(hybrid.views(buf)["slots"], [Req("a", 2), Req("b", 0)], 9)
    assert buf[hybrid.slots_at:].tolist() == [2, 0, 9, 9]
    assert (buf[:hybrid.slots_at] == -7).all()
    rb = graph_recurrent_batch(torch.from_numpy(buf[hybrid.slots_at:]), 3, 9)
    assert rb.fresh.tolist() == [False, False, True, True]
    assert (rb.num_ctx, rb.num_gen, rb.gen_rows) == (0, 4, 3)
    with pytest.raises(RuntimeError, match="request c holds no recurrent state slot"):
        fill_slots(hybrid.views(buf)["slots"], [Req("c", None)], 9)


def test_which_hybrids_run_eagerly(tiny, tmp_path):
    """Hybrid targets may replay CUDA graphs; Nemotron-H with MoE blocks (its ungated
    experts pick their rows on the host) is listed to run eagerly, one without is not."""
    from onespec import combinations as C
    assert C.graphs_allowed({C.HYBRID, C.MTP})
    assert not C.graphs_allowed({C.HYBRID, C.HOST_SYNCED_EXPERTS})
    make_nemotron_h_model(tmp_path)                     # with MoE blocks
    for path, synced in ((str(tmp_path), True), (tiny["nemotron-h"][0], False),
                         (tiny["qwen3-next"][0], False)):
        features = LLM(path, dtype="float32", device="cpu").engine.features
        assert C.HYBRID in features and (C.HOST_SYNCED_EXPERTS in features) == synced


def _states(pool) -> list[dict]:
    return [{n: t.clone() for n, t in layer.states.items()} for layer in pool.layers]


def _restore(pool, saved):
    for layer, s in zip(pool.layers, saved):
        for n, t in layer.states.items():
            t.copy_(s[n])


@pytest.mark.parametrize("arch", ["qwen3-next", "nemotron-h"])
@torch.no_grad()
def test_padded_bucket_step_equals_eager(tiny, arch):
    """Two generation requests in a bucket of 4: the forward over the slots input (the
    padding on the scratch slot, from zeros) and the commit at accepted counts given as a
    device tensor equal the eager step's (ModelRunner's RecurrentBatch) for the real
    requests; the scratch slot takes the padding's commits, no other slot changes."""
    path, _ = tiny[arch]
    llm = LLM(path, dtype="float32", device="cpu", max_batch_size=4,     # K = 2: 3 rows
              speculative_config=NGramConfig(max_draft_len=2))
    eng, rows = llm.engine, 3
    pool, model = eng.states, eng.model
    reqs = [eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
            for p in ([5, 17, 33, 9, 60], [7, 8, 9])]
    eng.step()                                    # the prompts: states in their slots
    assert all(r.state_slot is not None and not r.in_context for r in reqs)
    used = {b for r in reqs for b in r.block_table}
    spare = max(set(range(eng.pool.num_blocks)) - used)
    lay = InputLayout(4, rows, rows - 1, False, 1, True)
    buf = np.zeros(lay.size, dtype=np.int64)
    fill_slots(lay.views(buf)["slots"], reqs, pool.scratch_slot)
    slots = torch.from_numpy(buf)[lay.slots_at:]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (4 * rows,), generator=gen)
    pos = torch.cat([torch.arange(rows) + (r.num_computed if i < 2 else 0)
                     for i, r in enumerate(reqs + reqs)])
    tables = torch.tensor([[r.block_table[0]] for r in reqs] + [[spare], [spare]])
    before = _states(pool)

    def run(n, rb, num_accepted):
        meta = build_attention_metadata(tables[:n], rows, pos[:n * rows], eng.pool.block_size,
                                        int(pos.max()) + 1)
        meta.recurrent = rb
        hidden, _ = model(ids[:n * rows], pos[:n * rows], meta)
        pool.commit(rb, torch.tensor(num_accepted) - 1)
        return hidden, _states(pool)

    padded, after_graph = run(4, graph_recurrent_batch(slots, rows, pool.scratch_slot),
                              [2, 3, 1, 1])
    _restore(pool, before)
    eager, after_eager = run(2, pool.batch([], reqs, rows - 1, "cpu"), [2, 3])
    torch.testing.assert_close(padded[:2 * rows], eager)
    real = [r.state_slot for r in reqs]
    for g, e, b in zip(after_graph, after_eager, before):
        for name in b:
            torch.testing.assert_close(g[name][real], e[name][real])
            assert not torch.equal(e[name][real], b[name][real])
            rest = [s for s in range(pool.num_slots) if s not in real]
            assert torch.equal(g[name][rest], b[name][rest])
            assert torch.equal(e[name][pool.scratch_slot], b[name][pool.scratch_slot])
    assert any(not torch.equal(g[n][pool.scratch_slot], b[n][pool.scratch_slot])
               for g, b in zip(after_graph, before) for n in b)
    for r in reqs:
        eng.abort(r.request_id)
    assert_pool_full(llm)
    assert pool.num_free == pool.num_slots


@pytest.mark.parametrize("arch", ["qwen3-next", "nemotron-h"])
@torch.inference_mode()
def test_triton_backend_matches_portable_path(tiny, arch):
    """A hybrid's forwards with the Triton backend (its attention kernel, the decode GEMVs
    of its linears; Triton's interpreter here) equal the portable path's: a 12-row prompt
    chunk, then a 4-row verify over it, each state committed; hidden states, logits,
    greedy tokens and the committed states."""
    from onespec.engine.kv_cache import allocate_kv_cache
    from onespec.engine.state_pool import RecurrentBatch, StatePool
    from onespec.models.registry import load_target
    from test_triton_kernels import DEV, ops_for
    path, _ = tiny[arch]
    ids = torch.randint(3, 128, (16,), generator=torch.Generator().manual_seed(2)).to(DEV)
    tables = torch.tensor([[1, 0, 3]], device=DEV)
    results = {}
    for backend in ("torch", "triton"):
        model = load_target(path, DEV, torch.float32, ops=ops_for(backend))
        model.setup_rotary(64, DEV)
        allocate_kv_cache(model.attention_layers(), 4, 8, DEV)
        pool = StatePool(model.recurrent_layers(), 2, 4, torch.float32, DEV)
        outs = []
        for lo, hi, ctx in ((0, 12, 1), (12, 16, 0)):
            pos = torch.arange(lo, hi, device=DEV)
            meta = build_attention_metadata(tables, hi - lo, pos, 8, hi, None, backend)
            meta.recurrent = RecurrentBatch(torch.tensor([1], device=DEV),
                                            torch.tensor([lo == 0], device=DEV), [hi - lo],
                                            ctx, hi - lo)
            hidden, _ = model(ids[lo:hi], pos, meta)
            pool.commit(meta.recurrent, torch.tensor([1] if not ctx else [], device=DEV,
                                                     dtype=torch.int64))
            outs += [hidden, model.compute_logits(hidden), model.greedy_tokens(hidden)]
        outs += [t[1] for layer in pool.layers for t in layer.states.values()]
        results[backend] = outs
    for got, ref in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# ---- on a GPU -------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPTS = [[5, 17, 33, 9, 60, 3, 44], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 90, 91],
           [100, 3], [21, 22, 23, 24, 25]]


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    """{name: (path, spec config or None)}: Qwen3-Next with its MTP module and with an
    EAGLE-3 head, Nemotron-H (no MoE blocks) with an EAGLE-3 head, and plain."""
    qpath = tmp_path_factory.mktemp("qwen3-next-mtp")
    hf = make_hybrid_model(qpath, "qwen3-next", num_layers=4, embed_scale=4.0)
    add_mtp_weights(str(qpath), hf)
    qhead = tmp_path_factory.mktemp("qwen3-next-head")
    make_eagle3_head(qhead, hf)
    npath = tmp_path_factory.mktemp("nemotron-h")
    nhf = make_nemotron_h_model(npath, embed_scale=4.0, **NEMOTRON_NO_MOE)
    nhead = tmp_path_factory.mktemp("nemotron-h-head")
    make_eagle3_head(nhead, nhf)
    return {"qwen3-next-mtp": (str(qpath), lambda: MTPConfig(num_nextn_predict_layers=3)),
            "qwen3-next-eagle3": (str(qpath), lambda: Eagle3Config(str(qhead), max_draft_len=3)),
            "qwen3-next-plain": (str(qpath), lambda: None),
            "nemotron-h-eagle3": (str(npath), lambda: Eagle3Config(str(nhead),
                                                                   max_draft_len=3)),
            "nemotron-h-plain": (str(npath), lambda: None)}


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", ["qwen3-next-mtp", "qwen3-next-eagle3", "qwen3-next-plain",
                                  "nemotron-h-eagle3", "nemotron-h-plain"])
def test_hybrid_cuda_graphs_agree_with_eager(gpu_models, name, overlap):
    """Graphed hybrid steps (bucket 4 of 3 requests: padded; the overlap scheduler's
    chained steps too) emit the eager steps' greedy tokens in float32; without overlap
    (no step in flight between steps), every recurrent state a request's slot holds after
    a step equals the eager run's at the same position."""
    path, spec = gpu_models[name]
    sp = [SamplingParams(max_tokens=20 + 4 * i, ignore_eos=True) for i in range(3)]
    runs = []
    for graphs in (False, True):
        llm = LLM(path, device="cuda", dtype="float32", cuda_graphs=graphs, max_batch_size=4,
                  speculative_config=spec(), overlap_scheduler=overlap and graphs)
        eng = llm.engine
        assert (eng.runner.graphs is not None) == graphs
        reqs = [eng.add_request(p, s) for p, s in zip(PROMPTS[:3], sp)]
        seen = {}
        while eng.has_unfinished():
            eng.step()
            r = reqs[2]
            if not overlap and not r.is_finished and not r.in_context and \
                    r.state_slot is not None:
                seen[r.num_computed] = [{n: t[r.state_slot].clone() for n, t in
                                         layer.states.items()} for layer in eng.states.layers]
        runs.append(([r.output_token_ids for r in reqs], seen))
        if graphs:
            assert eng.runner.graphs.num_replays > 0
            if overlap:
                assert eng.runner.graphs.num_chained > 0
        assert_pool_full(llm)
        assert eng.states.num_free == eng.states.num_slots
    assert runs[0][0] == runs[1][0]
    common = set(runs[0][1]) & set(runs[1][1])
    assert common or overlap
    for at in common:
        for got, ref in zip(runs[1][1][at], runs[0][1][at]):
            for n in ref:
                torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-5)


@cuda
@pytest.mark.cuda
def test_nemotron_h_with_moe_runs_eagerly(tmp_path):
    """Nemotron-H's ungated experts pick their rows on the host: with MoE blocks its
    steps stay eager (combinations.py RUNS_EAGERLY), on the Triton backend."""
    make_nemotron_h_model(tmp_path)
    llm = LLM(str(tmp_path), device="cuda", dtype="float32")
    assert llm.engine.runner.graphs is None and llm.engine.kernel_settings.triton
