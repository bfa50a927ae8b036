"""The MoE targets' Triton kernels (kernels/moe.py, kernels/mla.py) and the DeepSeek-V3 and
Qwen3-MoE forwards on the Triton backend, against the portable path. Compiled on CUDA;
without CUDA, conftest runs them in Triton's interpreter."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_utils import add_mtp_layers, make_deepseek_model, make_qwen3_moe_model

pytest.importorskip("triton")

from onespec.kernels.mla import SPLIT_ROWS, mla_attention, mla_rope_and_cache  # noqa: E402
from onespec.kernels.moe import grouped_experts, sort_pairs  # noqa: E402
from onespec.kernels.moe_route import route_and_sort  # noqa: E402
from onespec.layers.attention import build_attention_metadata  # noqa: E402
from onespec.models.moe import Experts, Router  # noqa: E402
from test_triton_kernels import DEV, TOL, ops_for  # noqa: E402


def make_experts(num_experts: int, hidden: int, inter: int, dtype, seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    experts = Experts(num_experts, hidden, inter)
    nn.init.normal_(experts.gate_up_proj, 0, hidden ** -0.5)
    nn.init.normal_(experts.down_proj, 0, inter ** -0.5)
    return experts.to(DEV, dtype)


def route(tokens: int, num_experts: int, top_k: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    return ids.to(DEV), torch.rand(tokens, top_k, generator=g).to(DEV)


def test_sort_pairs_groups_pairs_by_expert():
    ids = torch.tensor([[3, 0], [0, 2], [3, 1]], device=DEV)
    r = sort_pairs(ids, torch.arange(6.0, device=DEV).view(3, 2), 5)
    assert r.slots.tolist() == [1, 2, 5, 3, 0, 4]      # expert 0: pairs 1, 2; 1: 5; ...
    assert r.pair_token.tolist() == [0, 1, 2, 1, 0, 2]
    assert r.pair_weight.tolist() == [1.0, 2.0, 5.0, 3.0, 0.0, 4.0]
    assert r.offsets.tolist() == [0, 2, 3, 4, 6, 6]


ROUTERS = {
    "deepseek-grouped": (Router(3, sigmoid=True, norm_topk_prob=True, num_groups=4,
                                topk_groups=2, scaling=2.5), 16),
    "deepseek-flat": (Router(6, sigmoid=True, norm_topk_prob=False, scaling=1.0), 64),
    "deepseek-one-expert-groups": (Router(2, sigmoid=True, norm_topk_prob=True, num_groups=8,
                                          topk_groups=3), 8),
    "qwen3-softmax": (Router(2, sigmoid=False, norm_topk_prob=True), 8),
    "qwen3-softmax-unnormed": (Router(4, sigmoid=False, norm_topk_prob=False), 32),
}


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_fused_routing_matches_pytorch(name, tokens):
    """One program's routing and counting sort equal Router.route then sort_pairs (the
    chosen experts in order, their weights, and the sorted pairs)."""
    router, num_experts = ROUTERS[name]
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, num_experts, generator=g).to(DEV)
    bias = (0.3 * torch.randn(num_experts, generator=g)).to(DEV)
    weights, ids = router.route(logits, bias)
    ref = sort_pairs(ids, weights, num_experts)
    got = route_and_sort(logits, router.top_k, sigmoid=router.sigmoid, bias=bias,
                         num_groups=router.num_groups, topk_groups=router.topk_groups,
                         norm_topk_prob=router.norm_topk_prob, scaling=router.scaling)
    assert torch.equal(got.ids.long(), ids)
    for field in ("slots", "pair_token", "offsets"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), field
    torch.testing.assert_close(got.weights, weights.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.pair_weight, ref.pair_weight, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tokens", [5, 70])       # fused routing; PyTorch routing + sort
@torch.inference_mode()
def test_triton_backend_routes_and_runs_experts_as_the_portable_path(tokens):
    router, num_experts = ROUTERS["deepseek-grouped"]
    experts = make_experts(num_experts, 64, 32, torch.float32)
    x = torch.randn(tokens, 64, device=DEV)
    logits = torch.randn(tokens, num_experts, device=DEV)
    bias = torch.randn(num_experts, device=DEV)
    got = ops_for("triton").routed_experts(experts, x, logits, router, bias)
    ref = ops_for("torch").routed_experts(experts, x, logits, router, bias)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("experts,top_k,groups,kept", [
    (12, 2, 1, 1),          # not a power of two
    (8, 5, 4, 2),           # 5 experts asked of the 4 in the groups kept
])
def test_fused_routing_rejects_shapes_outside_it(experts, top_k, groups, kept):
    with pytest.raises(ValueError, match="outside the fused routing"):
        route_and_sort(torch.zeros(2, experts, device=DEV), top_k, sigmoid=True,
                       bias=torch.zeros(experts, device=DEV), num_groups=groups,
                       topk_groups=kept)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,num_experts,top_k,hidden,inter", [
    (1, 8, 2, 64, 32),           # a decode row
    (5, 8, 3, 96, 40),           # widths that are not tile multiples
    (40, 6, 2, 64, 80),          # several 16-pair tiles per expert
])
@torch.inference_mode()
def test_grouped_experts_match_portable_path(dtype, tokens, num_experts, top_k, hidden, inter):
    experts = make_experts(num_experts, hidden, inter, dtype)
    x = torch.randn(tokens, hidden, device=DEV).to(dtype)
    ids, weights = route(tokens, num_experts, top_k)
    got = grouped_experts(x, experts.gate_up_proj, experts.down_proj,
                          sort_pairs(ids, weights, num_experts))
    ref = experts.portable(x, ids, weights)
    assert got.dtype == x.dtype and got.shape == x.shape
    # bfloat16: the portable path rounds gate, up and their product; the kernel does not
    tol = TOL[dtype] * (2 if dtype == torch.bfloat16 else 1)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)
    # a residual joins in the same kernel, rounded as `residual + sum` is
    residual = torch.randn(tokens, hidden, device=DEV).to(dtype)
    with_res = grouped_experts(x, experts.gate_up_proj, experts.down_proj,
                               sort_pairs(ids, weights, num_experts), residual)
    if dtype == torch.float32 or DEV == "cuda":
        assert torch.equal(with_res, residual + got)
    else:     # the interpreter truncates to bfloat16 (no round to nearest): one unit apart
        torch.testing.assert_close(with_res, residual + got, atol=1e-2, rtol=2 ** -7)


@torch.inference_mode()
def test_grouped_experts_read_only_routed_experts():
    """Experts no pair chose are never read: NaN weights there leave the result finite."""
    experts = make_experts(8, 64, 32, torch.float32)
    x = torch.randn(3, 64, device=DEV)
    ids = torch.tensor([[1, 4], [4, 6], [6, 1]], device=DEV)
    weights = torch.rand(3, 2, device=DEV)
    ref = experts.portable(x, ids, weights)
    for e in (0, 2, 3, 5, 7):
        experts.gate_up_proj[e] = float("nan")
        experts.down_proj[e] = float("nan")
    got = grouped_experts(x, experts.gate_up_proj, experts.down_proj,
                          sort_pairs(ids, weights, 8))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_grouped_experts_rows_do_not_depend_on_the_batch():
    experts = make_experts(8, 64, 32, torch.float32)
    x = torch.randn(9, 64, device=DEV)
    ids, weights = route(9, 8, 2)
    full = grouped_experts(x, experts.gate_up_proj, experts.down_proj,
                           sort_pairs(ids, weights, 8))
    alone = grouped_experts(x[4:5], experts.gate_up_proj, experts.down_proj,
                            sort_pairs(ids[4:5], weights[4:5], 8))
    torch.testing.assert_close(alone, full[4:5], atol=1e-6, rtol=1e-6)


def test_grouped_experts_reject_mismatched_shapes():
    experts = make_experts(4, 64, 32, torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_experts(torch.randn(2, 48, device=DEV), experts.gate_up_proj,
                        experts.down_proj, sort_pairs(*route(2, 4, 2), 4))


def latent_reference(q, cache, tables, req, positions, rank, scale, block_size):
    """Row by row: softmax(scale q . latents[0..pos]) over the latents' first rank dims."""
    outs = []
    for i in range(q.shape[0]):
        n = torch.arange(int(positions[i]) + 1, device=q.device)
        latents = cache[tables[req[i], n // block_size] * block_size + n % block_size].float()
        probs = (scale * q[i].float() @ latents.T).softmax(-1)           # [heads, n]
        outs.append(probs @ latents[:, :rank])
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,rank,rope,lens", [
    (4, 32, 16, [5]),                        # a decode row: split keys, one tile
    (20, 64, 16, [70, 1, 33]),               # two head groups, many tiles across splits
    (4, 32, 16, [600, 40]),                  # more tiles than splits: a split takes several
    (4, 24, 8, [9] * (SPLIT_ROWS + 3)),      # unsplit launch; widths not powers of two
])
@torch.inference_mode()
def test_mla_kernel_matches_reference(dtype, heads, rank, rope, lens):
    block_size, batch = 4, len(lens)
    g = torch.Generator().manual_seed(0)
    nb = max(lens) // block_size + 1
    tables = torch.randperm(batch * nb + 3, generator=g)[:batch * nb].view(batch, nb).to(DEV)
    cache = torch.randn(batch * nb * block_size + 12, rank + rope, generator=g).to(DEV, dtype)
    q = torch.randn(batch, heads, rank + rope, generator=g).to(DEV, dtype)
    req = torch.arange(batch, device=DEV)
    positions = torch.tensor(lens, device=DEV) - 1
    got = mla_attention(q, cache, tables, req, positions, rank, 0.15, block_size)
    ref = latent_reference(q, cache, tables, req, positions, rank, 0.15, block_size)
    torch.testing.assert_close(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    # the last split of each row merged and left its ticket at zero for the next launch
    from onespec.kernels.attention import counters_clear
    assert batch > SPLIT_ROWS or counters_clear(q.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave,heads,rope", [(True, 4, 16), (False, 20, 12)])
@torch.inference_mode()
def test_mla_rope_and_cache_matches_portable_path(dtype, interleave, heads, rope):
    """The latents written (RMSNorm of c, rotated k_pe) and the absorbed queries equal
    MLARotary + RMSNorm + concatenation (YaRN-scaled cos/sin; rope halves of 6 pairs are
    padded in the kernel)."""
    from onespec.layers.norm import RMSNorm
    from onespec.models.deepseek_v3 import MLARotary
    rows, nope, rank = 5, 8, 24
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    rotary = MLARotary(rope, 64, 10000.0, scaling, interleave, DEV)
    norm = RMSNorm(rank, 1e-6).to(DEV, dtype)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, nope + rope, generator=g).to(DEV, dtype)
    q_lat = torch.randn(rows, heads, rank, generator=g).to(DEV, dtype)
    ckv = torch.randn(rows, rank + rope, generator=g).to(DEV, dtype)
    positions = torch.tensor([0, 3, 17, 40, 63], device=DEV)
    slots = torch.tensor([6, 0, 2, 9, 4], device=DEV)
    cache = torch.zeros(10, rank + rope, device=DEV, dtype=dtype)
    query = mla_rope_and_cache(q, q_lat, ckv, (norm.weight, norm.eps), rotary.cos_sin,
                               positions, slots, cache, interleave)
    q_pe, k_pe = rotary(positions, q[..., nope:], ckv[:, None, rank:])
    want_cache = torch.zeros_like(cache)
    want_cache[slots] = torch.cat([norm(ckv[:, :rank]), k_pe[:, 0]], -1)
    tol = TOL[dtype] / 2
    torch.testing.assert_close(cache.float(), want_cache.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(query.float(), torch.cat([q_lat, q_pe], -1).float(), atol=tol,
                               rtol=tol)


def test_mla_kernel_rejects_mismatched_cache():
    with pytest.raises(ValueError, match="do not fit"):
        mla_attention(torch.zeros(1, 4, 48, device=DEV), torch.zeros(8, 40, device=DEV),
                      torch.zeros(1, 2, dtype=torch.int64, device=DEV),
                      torch.zeros(1, dtype=torch.int64, device=DEV),
                      torch.zeros(1, dtype=torch.int64, device=DEV), 32, 0.1, 4)


def backend_forwards(path, backend: str, chunks, tables, ids):
    """The target at `path` on `backend`: hidden states, logits and greedy tokens of each
    chunk (lo, hi) of ids in turn, each over the cache the chunks before it wrote."""
    from onespec.engine.kv_cache import allocate_kv_cache
    from onespec.models.registry import load_target
    model = load_target(str(path), DEV, torch.float32, ops=ops_for(backend))
    for layer in model.model.layers:
        assert (getattr(layer.self_attn, "_fused_a", None) is not None) == \
            (backend == "triton" and hasattr(layer.self_attn, "fuse_projections"))
    model.setup_rotary(128, DEV)
    allocate_kv_cache([layer.self_attn for layer in model.model.layers], 9, 8, DEV)
    outs = []
    for lo, hi in chunks:
        pos = torch.arange(lo, hi, device=DEV)
        meta = build_attention_metadata(tables, hi - lo, pos, 8, hi, None, backend)
        hidden, _ = model(ids[lo:hi], pos, meta)
        outs += [hidden, model.compute_logits(hidden), model.greedy_tokens(hidden)]
    return outs


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3-no-qlora", "qwen3-moe"])
@torch.inference_mode()
def test_moe_target_on_triton_matches_portable_path(tmp_path, family):
    """Whole forwards with the Triton backend (fused MLA rotary + latent write and absorbed
    MLA over the paged latents, or the Triton paged attention; fused routing, grouped
    experts, GEMV dense and shared experts) equal the portable path: a 34-row prefill chunk
    (cuBLAS linears, unsplit MLA), a 4-row verify and one decode row (GEMVs, split MLA),
    each over the cache the chunks before wrote. The Triton backend's MLA takes x's two
    projections (q or q_a, and kv_a) as one fused linear."""
    if family.startswith("deepseek-v3"):             # a dense layer, then MoE
        no_lora = dict(q_lora_rank=None) if family.endswith("no-qlora") else {}
        make_deepseek_model(tmp_path, num_layers=2, **no_lora)
    else:
        make_qwen3_moe_model(tmp_path, num_hidden_layers=2, mlp_only_layers=[1])
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (39,), device=DEV)
    tables = torch.tensor([[2, 0, 3, 1, 6, 4, 7, 5, 8]], device=DEV)
    chunks = ((0, 34), (34, 38), (38, 39))
    got = backend_forwards(tmp_path, "triton", chunks, tables, ids)
    ref = backend_forwards(tmp_path, "torch", chunks, tables, ids)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_mtp_drafter_on_triton_matches_portable_path(tmp_path):
    """The MTP layer's passes with the Triton backend (its decoder block, lm_head logits
    and fused argmax) equal the portable path: a 4-row step 0 and a one-row later step
    over the MTP layer's KV the first one wrote."""
    from onespec.engine.kv_cache import allocate_kv_cache
    from onespec.models.mtp import load_mtp_head
    from onespec.models.registry import load_target
    from onespec.speculative.mtp import MTPDrafter
    hf = make_deepseek_model(tmp_path, mtp_layers=1)
    add_mtp_layers(tmp_path, hf, 1)
    torch.manual_seed(0)
    hidden = torch.randn(4, 64, device=DEV)
    ids = torch.randint(3, 128, (5,), device=DEV)
    tables = torch.tensor([[1, 0]], device=DEV)
    results = {}
    for backend in ("torch", "triton"):
        target = load_target(str(tmp_path), DEV, torch.float32, ops=ops_for(backend))
        drafter = MTPDrafter(load_mtp_head(str(tmp_path), target, 1, DEV, torch.float32),
                             target)
        drafter.head.setup_rotary(64, DEV)
        allocate_kv_cache(drafter.attention_layers, 2, 8, DEV)
        outs = []
        for lo, hi, h in ((0, 4, hidden), (4, 5, None)):
            pos = torch.arange(3 + lo, 3 + hi, device=DEV)
            meta = build_attention_metadata(tables, hi - lo, pos, 8, 3 + hi, None, backend)
            h = drafter.forward(ids[lo:hi], pos, outs[-3][-1:] if h is None else h, meta)
            outs += [h, drafter.compute_logits(h), drafter.greedy_target_ids(h)]
        results[backend] = outs
    for got, ref in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
