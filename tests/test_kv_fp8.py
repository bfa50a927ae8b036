"""The FP8 KV cache (kv_cache_dtype="fp8", quant/kv_fp8.py).

Greedy output over an e4m3 cache cannot equal a float cache's, so the tests check instead:
the Triton kernels (rotary + KV write, paged attention) agree with the PyTorch path over
e4m3 caches (in Triton's interpreter on the CPU); speculation (EAGLE-3 chains and dynamic
trees) over an FP8 cache equals plain decoding over an FP8 cache; the pool's tensors are
float8 and a block costs half a bfloat16 block; a checkpoint's k/v scales are read (every
published key form) and applied (a power-of-two scale shifts the stored values by exactly
that power); bad values are refused by name."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TEST_DEVICE, assert_pool_full, build_eagle_pair, make_hf_model
from moe_utils import make_deepseek_model
from onespec import LLM, Eagle3Config, EngineConfig, NGramConfig, SamplingParams
from onespec.cli import generate_parser
from onespec.engine.kv_cache import kv_bytes_per_block, target_attention_layers
from onespec.quant.fp8 import FP8
from onespec.quant.kv_fp8 import dequantize_kv, quantize_kv

try:
    import triton
    import triton.language as tl
    from onespec.kernels.rope_kv import _round_e4m3
except ImportError:             # the Triton tests skip
    triton = None

PROMPTS = [[5, 6, 7], list(range(20, 41))]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
FP8_KV = dict(device=TEST_DEVICE, dtype="float32", kv_cache_dtype="fp8")


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="session")
def kv_pair(tmp_path_factory):
    """A 4-layer target and a random EAGLE-3 head for it (from conftest)."""
    target, _, head, _ = build_eagle_pair(tmp_path_factory, 4, PROMPTS[:1], GREEDY)
    return target, head


@pytest.fixture(scope="session")
def plain_fp8(kv_pair):
    llm = LLM(kv_pair[0], **FP8_KV)
    outs = token_ids(llm.generate(PROMPTS, GREEDY))
    assert_pool_full(llm)
    return outs


# ---- (b) speculation over an FP8 cache is lossless against plain decoding over one --------

@pytest.mark.parametrize("drafter", ["eagle3", "tree", "ngram"])
def test_speculation_over_fp8_cache_equals_plain_fp8(kv_pair, plain_fp8, drafter):
    """EAGLE-3 chains (the head's KV e4m3 too), dynamic trees (their accepted paths moved
    within the e4m3 pool) and n-gram drafts (accepted here: the tiny target loops)."""
    target, head = kv_pair
    cfg = {"eagle3": lambda: Eagle3Config(head, max_draft_len=3),
           "tree": lambda: Eagle3Config(head, max_draft_len=3, use_dynamic_tree=True,
                                        dynamic_tree_max_topK=2, max_total_draft_tokens=6),
           "ngram": lambda: NGramConfig(max_draft_len=3)}[drafter]()
    llm = LLM(target, speculative_config=cfg, **FP8_KV)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == plain_fp8
    assert llm.stats()["num_draft_tokens"] > 0
    if drafter == "ngram":
        assert llm.stats()["num_accepted_draft_tokens"] > 0
    else:       # the head's KV is e4m3 too, scale 1.0 (head checkpoints carry none)
        for attn in llm.engine.drafter.attention_layers:
            assert attn.k_cache.dtype == FP8 and attn.kv_scales == (1.0, 1.0)
    assert_pool_full(llm)


# ---- (c) float8 tensors, half the bytes of a bfloat16 block ----------------------------

def test_pool_is_float8_and_a_block_costs_half(kv_pair):
    target = kv_pair[0]
    engines = {kv: LLM(target, device=TEST_DEVICE, dtype="bfloat16", kv_cache_dtype=kv,
                       max_model_len=64) for kv in ("auto", "fp8")}
    per_block = {}
    for kv, llm in engines.items():
        layers = target_attention_layers(llm.engine.model)
        dtype = torch.bfloat16 if kv == "auto" else FP8
        assert all(a.k_cache.dtype == a.v_cache.dtype == dtype for a in layers)
        per_block[kv] = kv_bytes_per_block(layers, llm.engine.config.block_size)
        pool = layers[0].kv_pool          # what was allocated: blocks + 1 scratch block
        assert pool.numel() * pool.element_size() == \
            per_block[kv] * (llm.engine.pool.num_blocks + 1)
    assert per_block["auto"] == 2 * per_block["fp8"]
    from onespec.engine.summary import summary_lines
    assert "e4m3 with per-layer k/v scales" in "\n".join(summary_lines(engines["fp8"].engine))
    assert "e4m3" not in "\n".join(summary_lines(engines["auto"].engine))
    # the same memory budget sizes twice the blocks (the pool's rule: budget // per block)
    budget = 1000 * per_block["auto"]
    assert budget // per_block["fp8"] == 2 * (budget // per_block["auto"])
    out = engines["fp8"].generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    assert_pool_full(engines["fp8"])


# ---- (d) checkpoint scales are read and applied -------------------------------------------

SCALE_FORMS = {   # layer -> the keys of one published form, and (k_scale, v_scale)
    0: ({"self_attn.k_scale": 0.5, "self_attn.v_scale": 4.0}, (0.5, 4.0)),     # compressed-t.
    1: ({"self_attn.k_proj.k_scale": 2.0, "self_attn.v_proj.v_scale": 0.25}, (2.0, 0.25)),
}


@pytest.fixture(scope="session")
def scaled_target(tmp_path_factory):
    """A 2-layer target and the same weights with KV scales (one key form per layer)."""
    src = str(tmp_path_factory.mktemp("kv-src"))
    make_hf_model(src, "llama", num_layers=2)
    dst = str(tmp_path_factory.mktemp("kv-scaled"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for layer, (keys, _) in SCALE_FORMS.items():
        for key, value in keys.items():
            tensors[f"model.layers.{layer}.{key}"] = torch.tensor(value)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return src, dst


@torch.inference_mode()
def test_checkpoint_scales_are_read_and_applied(scaled_target):
    src, dst = scaled_target
    prompt = list(range(10, 40))
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    caches = {}
    for name, path in (("unscaled", src), ("scaled", dst)):
        llm = LLM(path, max_model_len=64, enable_prefix_caching=False, **FP8_KV)
        llm.generate([prompt], one)
        layers = target_attention_layers(llm.engine.model)
        want = [SCALE_FORMS[i][1] if name == "scaled" else (1.0, 1.0) for i in range(2)]
        assert [a.kv_scales for a in layers] == want
        caches[name] = [(a.k_cache[:len(prompt)].clone(), a.v_cache[:len(prompt)].clone())
                        for a in layers]          # one request: blocks 0.., slots 0..
        assert_pool_full(llm)
    # layer 0's keys and values are the same in both (its input is the embedding): stored
    # as x / scale, which for a power of two is the unscaled code times 1 / scale exactly
    # (where both are normal e4m3 numbers, away from the subnormal range and the clamp)
    k_scale, v_scale = SCALE_FORMS[0][1]
    for got, ref, scale in zip(caches["scaled"][0], caches["unscaled"][0], (k_scale, v_scale)):
        ref = ref.float()
        normal = (ref.abs() >= 2 ** -6 * max(scale, 1.0) * 4) & (ref.abs() <= 448 * min(scale, 1))
        assert normal.float().mean() > 0.5
        assert torch.equal(got.float()[normal], ref[normal] / scale)
        assert not torch.equal(got.view(torch.uint8), ref.to(FP8).view(torch.uint8))
        # read back (x * scale) both give the same keys and values
        torch.testing.assert_close(dequantize_kv(got, scale, torch.float32)[normal],
                                   ref[normal])
    # "auto" keeps the model's dtype and ignores the scales; the checkpoint still loads
    llm = LLM(dst, device=TEST_DEVICE, dtype="float32", max_model_len=64)
    assert target_attention_layers(llm.engine.model)[0].k_cache.dtype == torch.float32
    assert llm.generate([prompt], one)[0].outputs[0].token_ids


def test_quantize_kv_rounds_scales_and_clamps():
    x = torch.tensor([1.0, -3.0, 1000.0, -1000.0, 0.0])
    q = quantize_kv(x, 0.5)
    assert q.dtype == FP8
    assert q.float().tolist() == [2.0, -6.0, 448.0, -448.0, 0.0]
    assert dequantize_kv(q, 0.5, torch.float32).tolist() == [1.0, -3.0, 224.0, -224.0, 0.0]


# ---- (e) bad values are refused by name ---------------------------------------------------

def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8'\)"):
        EngineConfig(model="m", kv_cache_dtype="fp16")
    with pytest.raises(SystemExit):
        generate_parser().parse_args(["m", "--prompt", "hi", "--kv-cache-dtype", "int8"])
    args = generate_parser().parse_args(["m", "--prompt", "hi", "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"


@pytest.mark.parametrize("value,match", [
    (torch.ones(2), r"KV-cache scale 'model.layers.0.self_attn.k_scale' has shape \(2,\)"),
    (torch.tensor(-1.0), r"KV-cache scale 'model.layers.0.self_attn.k_scale' is -1.0, "
                         "expected a positive finite value"),
    (torch.tensor(float("inf")), r"'model.layers.0.self_attn.k_scale' is inf")])
def test_bad_checkpoint_scale_is_refused(scaled_target, tmp_path, value, match):
    src = scaled_target[0]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = value
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        cfg = f.read()
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        f.write(cfg)
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), **FP8_KV)


def test_mla_target_refuses_fp8_cache(tmp_path):
    make_deepseek_model(tmp_path)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' cannot be combined with an "
                                         "MLA target"):
        LLM(str(tmp_path), **FP8_KV)


# ---- (a) the Triton kernels agree with the PyTorch path over e4m3 caches ----------------

@torch.inference_mode()
def test_triton_decoder_over_fp8_cache_matches_portable_path(tmp_path):
    """Whole forwards with the Triton backend over e4m3 caches with scales != 1 (rotary +
    quantized KV write, fused with the qkv GEMV for decode-sized rows; paged attention
    dequantizing its tiles) agree with the portable path's: an 18-row prefill chunk, a
    4-row verify and a decode row, each over the cache the others wrote. The stored bytes
    are the same but where float noise in the rotation crosses an e4m3 rounding
    boundary."""
    if triton is None:
        pytest.skip("needs triton")
    from onespec.engine.kv_cache import allocate_kv_cache
    from onespec.kernels.settings import KernelSettings
    from onespec.layers.attention import build_attention_metadata
    from onespec.layers.ops import TORCH_OPS, make_ops
    from onespec.models.registry import load_target
    from onespec.quant.kv_fp8 import configure_kv_cache
    device = "cuda" if torch.cuda.is_available() else "cpu"
    make_hf_model(tmp_path, "llama", num_layers=1)
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (23,), device=device)
    tables = torch.tensor([[2, 0, 3]], device=device)
    results, caches = {}, {}
    for backend in ("torch", "triton"):
        ops = make_ops(KernelSettings(triton=True)) if backend == "triton" else TORCH_OPS
        model = load_target(str(tmp_path), device, torch.float32, ops=ops)
        model.setup_rotary(128, device)
        layers = [layer.self_attn for layer in model.model.layers]
        layers[0].checkpoint_kv_scales = (0.25, 3.0)
        configure_kv_cache(layers, "fp8")
        allocate_kv_cache(layers, 4, 8, device)
        outs = []
        for lo, hi in ((0, 18), (18, 22), (22, 23)):
            pos = torch.arange(lo, hi, device=device)
            meta = build_attention_metadata(tables, hi - lo, pos, 8, hi, None, backend)
            hidden, _ = model(ids[lo:hi], pos, meta, capture=(0,))
            outs += [hidden, model.compute_logits(hidden)]
        results[backend] = outs
        caches[backend] = [c.view(torch.uint8).clone() for a in layers
                           for c in (a.k_cache, a.v_cache)]
        assert layers[0].k_cache.dtype == FP8
    for got, ref in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
    for got, ref in zip(caches["triton"], caches["torch"]):
        assert (got == ref).float().mean() > 0.99


def test_triton_e4m3_rounding_equals_torch():
    """The write kernels' rounding (rope_kv._round_e4m3, then the cast) gives PyTorch's
    e4m3 byte for every e4m3 value, every midpoint between two (ties to even) and its
    neighbours, subnormals, signed zeros and random values over the whole range."""
    if triton is None:
        pytest.skip("needs triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([values, mids, mids.nextafter(torch.tensor(1e9)),
                   mids.nextafter(torch.tensor(-1e9)), torch.tensor([-0.0]),
                   torch.randn(1000, generator=gen) * torch.logspace(-4, 2.6, 1000)])
    x = torch.cat([x.clamp(-448, 448), torch.zeros(4096 - x.numel())]).to(device)
    y = torch.empty(4096, dtype=FP8, device=device)
    _round_kernel[(1,)](x, y, 4096)
    assert torch.equal(y.view(torch.uint8), x.to(FP8).view(torch.uint8))


if triton is not None:
    @triton.jit
    def _round_kernel(X, Y, N: tl.constexpr):
        d = tl.arange(0, N)
        tl.store(Y + d, _round_e4m3(tl.load(X + d)).to(Y.dtype.element_ty))


@pytest.mark.parametrize("layout", ["decode", "verify", "prefill", "sinks+window"])
@torch.inference_mode()
def test_triton_attention_over_fp8_cache_matches_portable_path(layout):
    """The paged attention kernel over e4m3 caches with scales != 1 (k_scale folded into
    the softmax scale, v_scale applied to the result) against the portable path's
    dequantize-then-attend: decode rows (split keys), 4-row verifies, a prefill chunk
    with its packs, and gpt-oss's sinks with a layer window."""
    if triton is None:
        pytest.skip("needs triton")
    from onespec.kernels.settings import KernelSettings
    from onespec.layers.attention import build_attention_metadata
    from onespec.layers.ops import TORCH_OPS, make_ops
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 16, 8
    tables = torch.randperm(24, generator=gen).view(2, 12).to(device)
    scales = (0.25, 3.0)
    kc, vc = (quantize_kv(torch.randn(24 * bs, kv_heads, dim, generator=gen), s).to(device)
              for s in scales)
    q_lens, starts = {"decode": ([1, 1], [70, 9]), "verify": ([4, 4], [60, 3]),
                      "prefill": ([20, 1], [40, 90]), "sinks+window": ([1, 4], [80, 20])}[layout]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)]).to(device)
    q = torch.randn(len(positions), heads, dim, generator=gen).to(device)
    extras = dict(sinks=torch.randn(heads, generator=gen).to(device), window=16) \
        if layout == "sinks+window" else {}
    outs = []
    for backend, ops in (("torch", TORCH_OPS), ("triton", make_ops(KernelSettings(triton=True)))):
        meta = build_attention_metadata(tables, q_lens if layout == "prefill" else q_lens[0]
                                        if len(set(q_lens)) == 1 else q_lens, positions, bs,
                                        int(positions.max()) + 1, None, backend)
        outs.append(ops.cached_attention(q, kc, vc, meta, dim ** -0.5, kv_scales=scales,
                                         **extras))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
