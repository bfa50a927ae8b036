"""gpt-oss against Hugging Face transformers: greedy generation token for token (batched,
chunked prefill, preemption, a request many windows long), bf16 logits, attention sinks
and the sliding layers' windows, the clamped SwiGLU; EAGLE-3 heads in the published
gpt-oss layout are lossless; config errors name their field."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import TEST_DEVICE, assert_greedy_matches, assert_pool_full, hf_greedy
from gpt_oss_utils import WINDOW, make_gpt_oss_model, write_gpt_oss_eagle3_head
from onespec import LLM, SamplingParams
from onespec.combinations import UnsupportedCombination
from onespec.config import Eagle3Config
from onespec.layers.attention import build_attention_metadata, windowed_attention
from onespec.models.gpt_oss import GptOssConfig, clamped_swiglu
from test_deepseek import ENGINE_MODES, NEW_TOKENS, PROMPTS, make_prompts

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
LONG_PROMPT = make_prompts((100,), seed=5)[0]       # 12 windows of the sliding layers


@pytest.fixture(scope="session")
def gpt_oss(tmp_path_factory):
    """(path, float32 transformers model, greedy references for PROMPTS)."""
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = make_gpt_oss_model(path)
    return str(path), hf, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def test_config_reads_layer_types_and_windows(gpt_oss):
    path, hf, _ = gpt_oss
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64)
    model = llm.engine.model
    assert model.config.layer_types == tuple(hf.config.layer_types)
    assert model.sliding_windows == (WINDOW, None, WINDOW, None)
    assert model.config.sliding_window is None        # the metadata stays full-causal
    assert llm.engine.features >= {"a target with a sliding window"}


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_greedy_matches_transformers(gpt_oss, mode):
    path, _, refs = gpt_oss
    assert_greedy_matches(path, refs, PROMPTS, GREEDY, **ENGINE_MODES[mode])


def test_long_request_matches_transformers(gpt_oss):
    """A request 14 windows long, prefilled in chunks over blocks of 4: every sliding
    layer's window moves over many blocks (all of them stay allocated: the full layers
    read them)."""
    path, hf, _ = gpt_oss
    ref = hf_greedy(hf, LONG_PROMPT, NEW_TOKENS)
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, block_size=4, max_num_tokens=24,
              max_model_len=128)
    out = llm.generate([LONG_PROMPT], GREEDY)[0].outputs[0].token_ids
    assert out == ref
    assert_pool_full(llm)


@torch.no_grad()
def _prefill_logits(llm, prompt):
    n = len(prompt)
    dev = llm.engine.device
    llm.engine.pool.allocate(table := [], n)
    meta = build_attention_metadata(torch.tensor([table], device=dev), [n],
                                    torch.arange(n, device=dev), llm.engine.pool.block_size, n)
    hidden, _ = llm.engine.model(torch.tensor(prompt, device=dev), torch.arange(n, device=dev),
                                 meta)
    llm.engine.pool.free(table)
    return llm.engine.model.compute_logits(hidden).float().cpu()


@torch.no_grad()
def test_prefill_logits_match_transformers_and_sinks_and_windows_matter(gpt_oss):
    """The logits equal transformers' over a prompt 5 windows long; zeroing the sinks or
    widening the windows changes them (both are exercised)."""
    path, hf, _ = gpt_oss
    llm = LLM(path, dtype="float32", device="cpu")
    prompt = PROMPTS[-1]
    ref = hf(torch.tensor([prompt])).logits[0]
    ours = _prefill_logits(llm, prompt)
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-5
    attn = [layer.self_attn for layer in llm.engine.model.model.layers]
    sinks = [a.sinks.clone() for a in attn]
    for a in attn:
        a.sinks.zero_()
    assert (_prefill_logits(llm, prompt) - ref).abs().max() > 1e-3
    for a, s in zip(attn, sinks):
        a.sinks.copy_(s)
        a.window = None if a.window is None else 10 * WINDOW
    assert (_prefill_logits(llm, prompt) - ref).abs().max() > 1e-3


@torch.no_grad()
def test_bfloat16_logits_as_close_as_transformers_own(gpt_oss, tmp_path):
    """A bf16 checkpoint: computed in float32, greedy output equals transformers' token for
    token; computed in bf16, onespec's logits are about as far from the float32 reference
    as transformers' own bf16 run is (per row, the median of the largest error: a row whose
    routing flips under bf16 rounding is far off in either). Its eager attention rounds to
    bf16 more often, so token-for-token equality with it is not expected."""
    import transformers
    _, hf, _ = gpt_oss
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path)   # (hf stays float32)
    prompt = PROMPTS[-1]
    ref = hf(torch.tensor([prompt])).logits[0]
    hf_bf16 = transformers.GptOssForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    hf_err = (hf_bf16(torch.tensor([prompt])).logits[0].float() - ref).abs().amax(-1)
    ours = _prefill_logits(LLM(str(tmp_path), dtype="bfloat16", device="cpu"), prompt)
    err = (ours - ref).abs().amax(-1)
    assert err.median() <= 1.5 * hf_err.median()
    # the bf16 checkpoint computed in float32: token for token with transformers
    hf32 = transformers.GptOssForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    refs = [hf_greedy(hf32, p, NEW_TOKENS) for p in PROMPTS]
    outs = LLM(str(tmp_path), dtype="float32", device="cpu").generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs


@torch.no_grad()
def test_training_features_match_transformers(gpt_oss):
    """EAGLE-3 training's dense forward of the target (train/features.py) keeps the sinks
    and the sliding layers' windows: its captured residual streams and logits equal
    transformers' hidden states and logits."""
    from onespec.train.features import dense_forward
    path, hf, _ = gpt_oss
    model = LLM(path, dtype="float32", device="cpu").engine.model
    prompt = PROMPTS[-1]
    ids = torch.tensor([prompt])
    hidden, captured = dense_forward(model, ids, (0, 2))
    ref = hf(ids, output_hidden_states=True)
    h = hf.config.hidden_size
    for i, layer in enumerate((0, 2)):
        torch.testing.assert_close(captured[0, :, i * h:(i + 1) * h],
                                   ref.hidden_states[layer + 1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.compute_logits(hidden[0]), ref.logits[0], atol=1e-4,
                               rtol=1e-4)


def test_clamped_swiglu_worked_example():
    # columns: gate0, up0, gate1, up1 (interleaved)
    gate_up = torch.tensor([[10.0, -10.0, 1.0, 0.5]])
    out = clamped_swiglu(gate_up, alpha=1.702, limit=7.0)
    g0, u0 = 7.0, -7.0
    g1, u1 = 1.0, 0.5
    want = torch.tensor([[(u0 + 1) * g0 * torch.sigmoid(torch.tensor(1.702 * g0)),
                          (u1 + 1) * g1 * torch.sigmoid(torch.tensor(1.702 * g1))]])
    torch.testing.assert_close(out, want)


@pytest.fixture(scope="session")
def eagle_head(gpt_oss, tmp_path_factory):
    _, hf, _ = gpt_oss
    path = tmp_path_factory.mktemp("gpt_oss_eagle3")
    write_gpt_oss_eagle3_head(path, hf.config, aux_layer_ids=(1, 2, 3))
    return str(path)


@pytest.mark.parametrize("mode", ["batched", "chunked-prefill"])
def test_eagle3_greedy_equals_plain(gpt_oss, eagle_head, mode):
    path, _, refs = gpt_oss
    llm = LLM(path, dtype="float32", device=TEST_DEVICE,
              speculative_config=Eagle3Config(eagle_head, max_draft_len=3),
              **ENGINE_MODES[mode])
    assert llm.engine.drafter.capture_layers == (0, 1, 2)     # inputs-to ids 1, 2, 3
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0
    assert_pool_full(llm)


def test_eagle3_long_request_equals_plain(gpt_oss, eagle_head):
    path, hf, _ = gpt_oss
    ref = hf_greedy(hf, LONG_PROMPT, NEW_TOKENS)
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, block_size=4, max_model_len=128,
              speculative_config=Eagle3Config(eagle_head, max_draft_len=2))
    assert llm.generate([LONG_PROMPT], GREEDY)[0].outputs[0].token_ids == ref
    assert_pool_full(llm)


def test_dynamic_tree_refused(gpt_oss, eagle_head):
    path, _, _ = gpt_oss
    with pytest.raises(UnsupportedCombination, match="sliding window"):
        LLM(path, dtype="float32", device="cpu",
            speculative_config=Eagle3Config(eagle_head, max_draft_len=2, use_dynamic_tree=True))


def _config(path) -> dict:
    with open(f"{path}/config.json") as f:
        return json.load(f)


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=["sliding_attention"]), "layer_types"),
    (dict(layer_types=["sliding_attention", "local", "full_attention", "full_attention"]),
     "layer_types"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope type"),
    (dict(num_local_experts=0), "num_local_experts"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(swiglu_limit="7"), "swiglu_limit"),
])
def test_bad_config_names_field(gpt_oss, change, field):
    cfg = {**_config(gpt_oss[0]), **change}
    with pytest.raises(ValueError, match=field):
        GptOssConfig.from_hf(cfg)


def test_published_config_spellings(gpt_oss):
    """transformers 4.x spellings (rope_scaling + rope_theta, experts_per_token) and no
    layer_types (even layers slide) read the same."""
    cfg = _config(gpt_oss[0])
    new = GptOssConfig.from_hf(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    cfg["experts_per_token"] = cfg.pop("num_experts_per_tok")
    cfg.pop("layer_types")
    old = GptOssConfig.from_hf(cfg)
    assert old == new


def test_bench_floor_of_the_gpt_oss_20b_shape():
    """The decode floor's target bytes at batch 1, K = 0: the 4 of 32 experts one token
    reaches, attention, norms, the LM head and one embedding row: gpt-oss-20b's published
    3.6 B active parameters. Sliding layers read at most their 128-key window."""
    from onespec.bench.models import target_config, windowed_kv_bytes
    from onespec.bench.moe import moe_step_bytes
    from onespec.models.gpt_oss import GptOssForCausalLM
    from onespec.models.loader import HFConfig
    cfg = GptOssConfig.from_hf(HFConfig(target_config("gpt-oss-20b")))
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg).to(torch.bfloat16)
    target = moe_step_bytes(model, None, 1, 0, 0.0, 0, 0)["target"]
    assert 3.55e9 < target / 2 < 3.65e9
    for layer in model.model.layers:
        layer.self_attn.k_cache = torch.empty(0, 8, 64, dtype=torch.bfloat16, device="meta")
    per_token = 2 * 8 * 64 * 2                       # K and V, 8 heads of 64, bf16
    kv = windowed_kv_bytes([layer.self_attn for layer in model.model.layers], 1, 0, 4096.0)
    assert kv == 12 * per_token * 4096 + 12 * per_token * 128


def _kernel_case(q_lens, starts, heads=4, kv_heads=2, head_dim=16, seed=0):
    """Caches of 4-slot blocks (shuffled), queries of requests with q_lens rows from
    positions starts, sink logits of either sign and size."""
    g = torch.Generator().manual_seed(seed)
    bs, width = 4, 96
    tables = torch.randperm(len(q_lens) * width, generator=g).view(-1, width)
    kc, vc = (torch.randn(tables.numel() * bs, kv_heads, head_dim, generator=g)
              for _ in range(2))
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)])
    q = torch.randn(len(positions), heads, head_dim, generator=g)
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])[:heads]
    return q, kc, vc, tables, positions, bs, sinks


@pytest.mark.parametrize("launch, window", [("decode-split", 40), ("verify", None),
                                            ("prefill-packs", 40)])
@torch.inference_mode()
def test_triton_attention_sinks_match_portable(launch, window):
    """The Triton paged attention kernel with sinks (Triton's interpreter on a CPU) equals
    windowed_attention: rows split over key tiles and merged (the sink counted once, by the
    split holding the first tile), verify rows sharing programs, a prefill pack; with and
    without a window."""
    pytest.importorskip("triton")
    from onespec.kernels import attention as ta
    q_lens, starts = {"decode-split": ([1, 1], [150, 2]),
                      "verify": ([4], [130]),
                      "prefill-packs": ([20], [0])}[launch]
    q, kc, vc, tables, positions, bs, sinks = _kernel_case(q_lens, starts)
    rpr = 4 if launch == "verify" else 0
    meta = build_attention_metadata(tables, q_lens, positions, bs, int(positions.max()) + 1,
                                    window)
    ref = windowed_attention(q, kc, vc, meta, 0.25, sinks, window)
    out = ta.paged_attention(q, kc, vc, tables, meta.token_req, positions, 0.25, bs, window,
                             rows_per_request=rpr, sinks=sinks, splits=4,
                             packs=lambda rows: ta.row_packs(q_lens, rows, q.device))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    no_sinks = windowed_attention(q, kc, vc, meta, 0.25, None, window)
    assert (no_sinks - out).abs().max() > 1e-2          # the sinks do change the output
    assert ta.counters_clear(q.device) or launch == "prefill-packs"


def _forwards(path, ops, chunks, tables, ids):
    """The target at `path` built with `ops`: hidden states, logits and greedy tokens of
    each chunk (lo, hi) of ids in turn, each over the cache the chunks before it wrote."""
    from onespec.engine.kv_cache import allocate_kv_cache
    from onespec.models.registry import load_target
    model = load_target(str(path), "cpu", torch.float32, ops=ops)
    model.setup_rotary(128, "cpu")
    allocate_kv_cache([layer.self_attn for layer in model.model.layers], 12, 4, "cpu")
    backend = "torch" if type(ops).__name__ == "TorchOps" else "triton"
    outs = []
    for lo, hi in chunks:
        pos = torch.arange(lo, hi)
        meta = build_attention_metadata(tables, hi - lo, pos, 4, hi, None, backend)
        hidden, _ = model(ids[lo:hi], pos, meta)
        outs += [hidden, model.compute_logits(hidden), model.greedy_tokens(hidden)]
    return outs


@torch.inference_mode()
def test_triton_backend_matches_portable_path(tmp_path):
    """Whole forwards on the Triton backend (Triton's interpreter on a CPU: fused rotary +
    KV write from the YaRN table, paged attention with sinks and the sliding layer's
    window, fused routing, grouped experts with biases and the clamped SwiGLU, GEMVs)
    equal the portable path: a 36-row prefill chunk (cuBLAS linears, prefill packs) and a
    4-row verify (GEMVs, split attention) over the cache the chunk before wrote (5
    windows of the sliding layer)."""
    pytest.importorskip("triton")
    from onespec.kernels.settings import KernelSettings
    from onespec.layers.ops import TORCH_OPS, make_ops
    make_gpt_oss_model(tmp_path, num_layers=2)
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (40,))
    tables = torch.tensor([[2, 0, 3, 1, 6, 4, 7, 5, 8, 11, 9, 10]])
    chunks = ((0, 36), (36, 40))
    got = _forwards(tmp_path, make_ops(KernelSettings(triton=True)), chunks, tables, ids)
    ref = _forwards(tmp_path, TORCH_OPS, chunks, tables, ids)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)



needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_llm(path, dtype="float32", graphs=True, head=None, **kw):
    llm = LLM(path, device="cuda", dtype=dtype, cuda_graphs=graphs, max_batch_size=8,
              speculative_config=Eagle3Config(head, max_draft_len=3) if head else None, **kw)
    assert llm.engine.kernel_settings.triton, "gpt-oss did not take the Triton backend"
    return llm


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_cuda_triton_greedy_matches_transformers(gpt_oss, mode, graphs):
    """GPU only: the Triton backend (sinks and windows in the paged kernel, grouped
    experts with biases and the clamped SwiGLU), eager and in CUDA graphs, equals
    transformers in float32, batched, chunked and preempted."""
    path, _, refs = gpt_oss
    llm = _cuda_llm(path, graphs=graphs, **ENGINE_MODES[mode])
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert_pool_full(llm)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_eagle3_in_graphs_equals_plain(gpt_oss, eagle_head, dtype):
    """GPU only: greedy EAGLE-3 (K = 3) in CUDA graphs equals plain decoding of the same
    engine settings token for token, in float32 and in bf16 (each verify row's attention
    and experts equal a decode row's), over a request many windows long too."""
    path, _, _ = gpt_oss
    prompts = PROMPTS + [LONG_PROMPT]
    plain = _cuda_llm(path, dtype).generate(prompts, GREEDY)
    llm = _cuda_llm(path, dtype, head=eagle_head)
    spec = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.stats()["num_draft_tokens"] > 0
    assert_pool_full(llm)
