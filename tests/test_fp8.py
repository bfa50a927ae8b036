"""FP8 checkpoints and FP8 quantization at load.

Each published layout is written by the test from a tiny random float32 checkpoint
(block-scaled `weight_scale_inv` with quant_method "fp8"; compressed-tensors per channel
and per tensor; ModelOpt's hf_quant_config.json), with a second checkpoint holding the
same weights dequantized: greedy output of the FP8 one equals the dequantized one's token
for token (Llama, DeepSeek-V3 with MLA, experts and an MTP layer, Qwen3-MoE). Speculation
(EAGLE-3 with an FP8 head, MTP) on FP8 targets equals plain decoding of the same FP8
model. Bad scale shapes and unsupported schemes are refused by name."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TEST_DEVICE, assert_pool_full, make_eagle3_head, make_hf_model
from moe_utils import add_mtp_layers, make_deepseek_model, make_qwen3_moe_model
from onespec import LLM, Eagle3Config, MTPConfig, SamplingParams
from onespec.cli import build_llm, check_engine_args, generate_parser
from onespec.quant.fp8 import FP8, FP8Linear

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], list(range(20, 45))]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
E4M3_MAX = 448.0
BLOCK = (16, 32)      # a non-square block, with partial blocks at the edges of some weights


# ---- writing the published layouts -------------------------------------------------------

def quantizable(name: str, t: torch.Tensor) -> bool:
    """The weights published FP8 checkpoints quantize: every linear but the embedding,
    lm_head / the MTP vocabulary head and the MoE router."""
    return name.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in name and \
        not name.startswith("lm_head") and "shared_head.head" not in name and \
        not name.endswith("mlp.gate.weight")


def e4m3(w: torch.Tensor, scale_per_element: torch.Tensor) -> torch.Tensor:
    return (w / scale_per_element).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def block_quantized(w: torch.Tensor, block):
    bo, bi = block
    rows, cols = w.shape
    scale = torch.empty(-(-rows // bo), -(-cols // bi))
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            tile = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi]
            scale[r, c] = tile.abs().max() / E4M3_MAX
    per_element = scale.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    q = e4m3(w, per_element)
    return q, scale, q.float() * per_element


def channel_quantized(w: torch.Tensor):
    scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX                  # [out, 1]
    q = e4m3(w, scale)
    return q, scale, q.float() * scale


def tensor_quantized(w: torch.Tensor):
    scale = w.abs().max().reshape(1) / E4M3_MAX                           # [1]
    q = e4m3(w, scale)
    return q, scale, q.float() * scale


def write_fp8(src: str, dst: str, layout: str) -> str:
    """src's checkpoint in `layout` at dst, and its dequantized twin at dst + '-deq'."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quant, deq = {}, {}
    for name, t in tensors.items():
        if not quantizable(name, t):
            quant[name] = deq[name] = t
            continue
        base = name[:-len("weight")]
        if layout == "block":
            q, scale, d = block_quantized(t.float(), BLOCK)
            quant[base + "weight_scale_inv"] = scale
        elif layout == "compressed-channel":
            q, scale, d = channel_quantized(t.float())
            quant[base + "weight_scale"] = scale
            quant[base + "input_scale"] = torch.tensor([0.05])
        else:     # compressed-tensor, modelopt: one scale per tensor
            q, scale, d = tensor_quantized(t.float())
            quant[base + "weight_scale"] = scale if layout == "compressed-tensor" \
                else scale.reshape(())
            quant[base + "input_scale"] = torch.tensor(0.05)
        quant[name], deq[name] = q, d
    if layout == "modelopt":       # the KV-cache scales ModelOpt writes beside k/v_proj
        for name in list(quant):
            if name.endswith("self_attn.k_proj.weight"):
                quant[name[:-len("weight")] + "k_scale"] = torch.tensor(1.0)
    cfg = json.load(open(os.path.join(src, "config.json")))
    for out, weights in ((dst, quant), (dst + "-deq", deq)):
        os.makedirs(out, exist_ok=True)
        save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    if layout == "block":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": list(BLOCK)}
    elif layout.startswith("compressed"):
        channel = layout == "compressed-channel"
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                            "dynamic": False, "strategy": "channel" if channel else "tensor",
                            "group_size": None, "block_structure": None},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                      "dynamic": channel,
                                      "strategy": "token" if channel else "tensor"}}}}
    else:
        json.dump({"producer": {"name": "modelopt", "version": "0.19.0"},
                   "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                    "exclude_modules": ["lm_head"]}},
                  open(os.path.join(dst, "hf_quant_config.json"), "w"))
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


def greedy(path, **kw):
    llm = LLM(path, dtype="float32", device=TEST_DEVICE, **kw)
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert_pool_full(llm)
    return llm, outs


@pytest.fixture(scope="session")
def llama_src(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8-llama-src")
    hf = make_hf_model(path, "llama", num_layers=4)
    return str(path), hf


@pytest.fixture(scope="session")
def deepseek_fp8(tmp_path_factory):
    """A DeepSeek-V3 checkpoint (q LoRA, a dense layer then MoE, one MTP layer) in the
    block-scaled layout, as DeepSeek-V3/R1 ship theirs, and its dequantized twin."""
    src = tmp_path_factory.mktemp("fp8-ds-src")
    hf = make_deepseek_model(src, mtp_layers=1)
    add_mtp_layers(src, hf, 1)
    dst = str(tmp_path_factory.mktemp("fp8-ds") / "block")
    return write_fp8(str(src), dst, "block")


# ---- greedy output equals the dequantized model's ----------------------------------------

@pytest.mark.parametrize("layout", ["block", "compressed-channel", "compressed-tensor",
                                    "modelopt"])
def test_llama_layouts_match_their_dequantized_weights(llama_src, tmp_path, layout):
    path = write_fp8(llama_src[0], str(tmp_path / layout), layout)
    llm, outs = greedy(path)
    layer = llm.engine.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, FP8Linear) and qkv.weight.dtype == FP8        # stays FP8
    assert qkv.weight_scale.shape == ((-(-qkv.out_features // BLOCK[0]), 2)
                                      if layout == "block" else (qkv.out_features,))
    assert not isinstance(llm.engine.model.lm_head, FP8Linear)
    _, want = greedy(path + "-deq")
    assert outs == want


def test_deepseek_block_fp8_matches_and_mtp_is_lossless(deepseek_fp8):
    """MLA projections, shared and routed experts in block FP8 (kv_b_proj dequantized at
    load: its weight is read as W_UK / W_UV); the FP8 MTP layer drafts losslessly."""
    llm, outs = greedy(deepseek_fp8)
    model = llm.engine.model
    moe = model.model.layers[1].mlp
    assert moe.experts.gate_up_proj.dtype == FP8 and moe.experts.block == BLOCK
    assert moe.experts.gate_up_proj_scale.shape == (8, 64 // BLOCK[0], 64 // BLOCK[1])
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_a_proj, FP8Linear) and isinstance(attn.o_proj, FP8Linear)
    assert attn.kv_b_proj.weight.dtype == torch.float32
    _, want = greedy(deepseek_fp8 + "-deq")
    assert outs == want
    for k in (1, 2):
        spec, got = greedy(deepseek_fp8, speculative_config=MTPConfig(
            num_nextn_predict_layers=k))
        eh_proj = spec.engine.drafter.head.layers[0].eh_proj
        assert isinstance(eh_proj, FP8Linear)          # the checkpoint's own FP8 MTP layer
        assert got == outs and spec.stats()["num_draft_tokens"] > 0


def test_qwen3_moe_compressed_tensors_per_channel(tmp_path):
    src = tmp_path / "src"
    make_qwen3_moe_model(src)
    path = write_fp8(str(src), str(tmp_path / "ct"), "compressed-channel")
    llm, outs = greedy(path)
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.down_proj.dtype == FP8 and experts.down_proj_scale.shape == (8, 64)
    _, want = greedy(path + "-deq")
    assert outs == want


# ---- quantization="fp8" and draft_dtype="fp8" ------------------------------------------

def test_quantization_fp8_at_load_and_eagle3_fp8_head(llama_src, tmp_path):
    """quantization="fp8" makes every decoder linear FP8 per channel; an EAGLE-3 head with
    draft_dtype="fp8" over it drafts losslessly (greedy = plain decoding of the same FP8
    target), and the head's linears are FP8 too."""
    path, hf = llama_src
    llm, plain = greedy(path, quantization="fp8")
    model = llm.engine.model
    assert all(isinstance(getattr(layer.mlp, n), FP8Linear)
               for layer in model.model.layers for n in ("gate_up_proj", "down_proj"))
    assert model.model.layers[0].mlp.down_proj.weight_scale.shape == (64,)
    down = model.model.layers[0].mlp.down_proj
    w = hf.model.layers[0].mlp.down_proj.weight.detach()
    err = (down.dequantized(torch.float32) - w).abs().amax(dim=1)
    assert (err <= w.abs().amax(dim=1) / 16).all() and (err > 0).any()   # e4m3: 3 bits
    head = str(tmp_path / "head")
    make_eagle3_head(head, hf, "safeailab", draft_vocab_size=64, seed=3)
    spec, got = greedy(path, quantization="fp8", speculative_config=Eagle3Config(
        head, max_draft_len=3, draft_dtype="fp8"))
    drafter = spec.engine.drafter
    assert isinstance(drafter.head.fc, FP8Linear) and isinstance(drafter.head.lm_head, FP8Linear)
    assert drafter.dtype == torch.float32
    assert got == plain and spec.stats()["num_draft_tokens"] > 0
    # a head published in the block-FP8 layout loads FP8 and drafts the same tokens
    fp8_head = write_fp8(head, str(tmp_path / "fp8-head"), "block")
    spec, got = greedy(path, quantization="fp8", speculative_config=Eagle3Config(
        fp8_head, max_draft_len=3))
    assert isinstance(spec.engine.drafter.head.layers[0].self_attn.qkv_proj, FP8Linear)
    assert got == plain
    # the CLI's flags reach the same engine options
    parser = generate_parser()
    args = parser.parse_args([path, "--quantization", "fp8", "--draft", head, "--draft-dtype",
                              "fp8", "--prompt-ids", "1", "--device", "cpu", "--dtype",
                              "float32"])
    check_engine_args(parser, args)
    cli_llm = build_llm(args)
    assert cli_llm.engine.config.quantization == "fp8"
    assert cli_llm.engine.spec_config.draft_dtype == "fp8"
    assert [o.outputs[0].token_ids for o in cli_llm.generate(PROMPTS, GREEDY)] == plain


def test_mtp_draft_dtype_fp8_is_lossless(deepseek_fp8):
    """The dequantized twin's (float32) MTP layer quantized at load by draft_dtype="fp8"."""
    path = deepseek_fp8 + "-deq"
    _, plain = greedy(path)
    spec, got = greedy(path, speculative_config=MTPConfig(num_nextn_predict_layers=2,
                                                          draft_dtype="fp8"))
    layer = spec.engine.drafter.head.layers[0]
    assert isinstance(layer.eh_proj, FP8Linear) and layer.block.mlp.experts.quantized
    assert got == plain


# ---- errors ------------------------------------------------------------------------------

def _edit(path, dst, tensors=None, config=None):
    shutil.copytree(path, dst)
    if tensors:
        file = os.path.join(dst, "model.safetensors")
        weights = load_file(file)
        tensors(weights)
        save_file(weights, file)
    if config:
        file = os.path.join(dst, "config.json")
        cfg = json.load(open(file))
        config(cfg)
        json.dump(cfg, open(file, "w"))
    return str(dst)


def test_bad_scale_shapes_and_unsupported_schemes(llama_src, tmp_path):
    block = write_fp8(llama_src[0], str(tmp_path / "block"), "block")
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"

    def bad_block(w):
        w[name] = w[name][:, :2].contiguous()
    bad = _edit(block, tmp_path / "bad-block", tensors=bad_block)
    with pytest.raises(ValueError, match=rf"weight scale '{name}' has shape \(4, 2\), "
                                         r"expected \(4, 5\)"):
        LLM(bad, dtype="float32", device="cpu")
    channel = write_fp8(llama_src[0], str(tmp_path / "ch"), "compressed-channel")
    cname = "model.layers.0.self_attn.k_proj.weight_scale"

    def bad_channel(w):
        w[cname] = w[cname][:7]
    bad = _edit(channel, tmp_path / "bad-ch", tensors=bad_channel)
    with pytest.raises(ValueError, match=rf"weight scale '{cname}' has shape \(7, 1\), "
                                         r"expected \(32, 1\), \(32,\)"):
        LLM(bad, dtype="float32", device="cpu")

    def bad_input_scale(w):
        w["model.layers.0.mlp.up_proj.input_scale"] = torch.ones(3)
    bad = _edit(channel, tmp_path / "bad-in", tensors=bad_input_scale)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj.input_scale' has shape "
                                         r"\(3,\), expected one per-tensor value"):
        LLM(bad, dtype="float32", device="cpu")
    for edit, message in [
        (lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}),
         "quant_method 'awq' is not supported; onespec loads 'fp8'"),
        (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
            type="int"), "type='int', strategy='channel'.* is not supported"),
        (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
            strategy="group", group_size=128), "strategy='group'.* is not supported"),
        (lambda c: c.update(quantization_config={"quant_method": "modelopt",
                                                 "quant_algo": "NVFP4"}),
         "ModelOpt quant_algo 'NVFP4' is not supported"),
    ]:
        bad = _edit(channel, tmp_path / f"bad-{len(os.listdir(tmp_path))}", config=edit)
        with pytest.raises(ValueError, match=message):
            LLM(bad, dtype="float32", device="cpu")


def test_float8_weights_without_scales_and_option_errors(llama_src, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"

    def fp8_weight(w):
        w[name] = w[name].to(FP8)
    bad = _edit(llama_src[0], tmp_path / "bare", tensors=fp8_weight)
    with pytest.raises(ValueError, match=rf"'{name}' is stored as float8_e4m3fn, which "
                                         "onespec does not load here"):
        LLM(bad, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=r"quantization must be None or one of \('fp8',\)"):
        LLM(llama_src[0], quantization="int8")
    with pytest.raises(ValueError, match="draft_dtype must be 'auto' or 'fp8' for MTP"):
        MTPConfig(draft_dtype="bfloat16")
    with pytest.raises(ValueError, match="FP8 weights .* cannot be combined with "
                                         "tensor_parallel_size > 1"):
        LLM(llama_src[0], quantization="fp8", tensor_parallel_size=2)


# ---- the Triton FP8 GEMV (Triton's interpreter without a GPU) -------------------------------

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("block", [None, BLOCK, (128, 128)])
@pytest.mark.parametrize("rows,kind", [(1, "plain"), (5, "gated-bias"), (20, "residual"),
                                       (3, "prenormed")])
@torch.inference_mode()
def test_fp8_gemv_matches_the_dequantized_linear(block, rows, kind):
    """Per-channel and per-block scales (a block past the weight's edges: 128 x 128 on a
    [48, 80] weight), ragged K and N tiles, 16- and 32-row tiles, against F.linear
    with the dequantized weight."""
    pytest.importorskip("triton")
    from onespec.kernels.fp8_gemv import fp8_gemv
    from onespec.kernels.gemv import gemv_prenorm
    from onespec.quant.fp8 import dequantize, quantize
    torch.manual_seed(0)
    gated = "gated" in kind
    n, k = 40, 80          # (gate | up meets inside a block row of 16 and of 128)
    w = torch.randn(2 * n if gated else n, k, device=DEV) * k ** -0.5
    q, scale = quantize(w, block)
    bias = torch.randn(w.shape[0], device=DEV) if "bias" in kind else None
    x = torch.randn(rows, k, device=DEV)
    dense = dequantize(q, scale, block, torch.float32)
    kw = {}
    if kind == "residual":
        kw["residual"] = torch.randn(rows, n, device=DEV)
    if kind == "prenormed":      # rows whose RMSNorm a GEMV before began (kernels/gemv.py)
        h = torch.randn(rows, 64, device=DEV)
        norm_w = torch.rand(k, device=DEV) + 0.5
        h_out, x_in = gemv_prenorm(h, torch.randn(k, 64, device=DEV) * 0.1,
                                   torch.randn(rows, k, device=DEV), (norm_w, 1e-6))
        x = F_rms(h_out, norm_w)
        got = fp8_gemv(x_in, q, scale, block, bias)
    else:
        got = fp8_gemv(x, q, scale, block, bias, gated=gated, **kw)
    ref = torch.nn.functional.linear(x, dense, bias)
    if gated:
        gate, up = ref.chunk(2, -1)
        ref = torch.nn.functional.silu(gate) * up
    if "residual" in kw:
        ref = kw["residual"] + ref
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)


def F_rms(h, weight, eps=1e-6):
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


@torch.inference_mode()
def test_triton_backend_chains_fp8_linears_like_the_portable_path():
    """A decoder layer's chain of linears through both backends, FP8 where a checkpoint has
    it: a dense GEMV that begins the next RMSNorm (a Prenormed), the FP8 gate_up that
    finishes it, the FP8 down projection adding the residual (and its norm), an FP8 draft
    lm_head's greedy ids with a vocabulary map, and 40 rows (dequantized, then cuBLAS)."""
    pytest.importorskip("triton")
    from torch import nn
    from onespec.kernels.settings import KernelSettings
    from onespec.layers.norm import RMSNorm
    from onespec.layers.ops import TORCH_OPS, make_ops
    triton_ops = make_ops(KernelSettings(triton=True))
    torch.manual_seed(0)
    h_size, inter, vocab = 64, 96, 80
    o_proj = nn.Linear(h_size, h_size, bias=False)
    gate_up = FP8Linear.quantized(nn.Linear(h_size, 2 * inter, bias=False), BLOCK)
    down = FP8Linear.quantized(nn.Linear(inter, h_size, bias=False))
    lm_head = FP8Linear.quantized(nn.Linear(h_size, vocab, bias=False), BLOCK)
    norms = [RMSNorm(h_size, 1e-6) for _ in range(2)]
    for norm in norms:
        nn.init.uniform_(norm.weight, 0.5, 1.5)
    offsets = torch.randint(0, 40, (vocab,))
    for m in (o_proj, gate_up, down, lm_head, *norms):
        m.to(DEV)
    for rows in (3, 40):
        x, residual = torch.randn(rows, h_size, device=DEV), torch.randn(rows, h_size, device=DEV)
        results = []
        for ops in (TORCH_OPS, triton_ops):
            h, xn = ops.add_norm(o_proj, x, residual, norms[0])
            act = ops.gated(gate_up, xn)
            h2, x2 = ops.add_full_norm(down, act, h, norms[1])
            results.append([h, act, h2, x2, ops.logits(lm_head, h2, norms[1]),
                            ops.greedy(lm_head, h2, norms[1], offsets=offsets)])
        for ref, got in zip(*results):
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block", [None, BLOCK])
@pytest.mark.parametrize("tokens", [1, 20])
@torch.inference_mode()
def test_fp8_grouped_experts_match_the_portable_path(block, tokens):
    """The grouped GEMM over FP8 experts (per-row or per-block scales; 16-pair tiles once
    and twice) against Experts.portable, which dequantizes the experts it gathers."""
    pytest.importorskip("triton")
    from onespec.kernels.moe import grouped_experts, sort_pairs
    from onespec.models.moe import Experts
    from onespec.quant.fp8 import quantize_experts
    torch.manual_seed(0)
    num_experts, hidden, inter, top_k = 6, 64, 48, 2
    experts = Experts(num_experts, hidden, inter)
    torch.nn.init.normal_(experts.gate_up_proj, 0, hidden ** -0.5)
    torch.nn.init.normal_(experts.down_proj, 0, inter ** -0.5)
    quantize_experts(experts, block)
    experts.to(DEV)
    assert experts.quantized and experts.down_proj.dtype == FP8
    x = torch.randn(tokens, hidden, device=DEV)
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)]).to(DEV)
    weights = torch.rand(tokens, top_k, device=DEV)
    got = grouped_experts(x, experts.gate_up_proj, experts.down_proj,
                          sort_pairs(ids, weights, num_experts), None,
                          (experts.gate_up_proj_scale, experts.down_proj_scale), block)
    torch.testing.assert_close(got, experts.portable(x, ids, weights), atol=1e-4, rtol=1e-4)


def test_bench_floor_counts_fp8_bytes(tmp_path):
    """`onespec bench --quantization fp8-block` on an MLA + MoE shape: random weights in
    DeepSeek-V3's layout (block-FP8 experts and attention, an FP8 MTP layer), and a step
    floor that counts their bytes: below the unquantized engine's."""
    from onespec.bench.decode import declare_quantization, parse_args
    from onespec.bench.models import step_floor_parts, write_model_dirs
    args = parse_args(["--shape", "tiny-mla", "--quantization", "fp8-block",
                       "--draft-dtype", "fp8"])
    assert args.quantization == "fp8-block"
    floors = {}
    for quant in (None, "fp8-block"):
        target, _ = write_model_dirs("tiny-mla", str(tmp_path / str(quant)))
        declare_quantization(target, quant)
        llm = LLM(target, load_format="dummy", device="cpu", dtype="bfloat16",
                  speculative_config=MTPConfig(num_nextn_predict_layers=1))
        engine = llm.engine
        floors[quant] = sum(step_floor_parts(engine, 1, 1, 0.0).values())
        layer = engine.model.model.layers[1]
        mtp = engine.drafter.head.layers[0].block
        assert (layer.mlp.experts.block == (128, 128)) == (quant is not None)
        assert isinstance(layer.self_attn.o_proj, FP8Linear) == (quant is not None)
        assert mtp.mlp.experts.quantized == (quant is not None)
        llm.close()
    assert floors["fp8-block"] < 0.75 * floors[None]        # bf16 weights -> 1-byte e4m3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("which", ["llama-eagle3", "deepseek-mtp"])
def test_fp8_on_triton_in_cuda_graphs_matches_the_portable_path(llama_src, deepseek_fp8,
                                                                tmp_path, which):
    """On a GPU: FP8 targets and drafters on the Triton backend (FP8 GEMV, FP8 grouped
    experts) with CUDA graphs give the portable path's greedy tokens (float32), and
    speculation stays lossless there."""
    if which == "llama-eagle3":
        path = write_fp8(llama_src[0], str(tmp_path / "block"), "block")
        head = str(tmp_path / "head")
        make_eagle3_head(head, llama_src[1], "safeailab", draft_vocab_size=64, seed=3)
        spec = Eagle3Config(head, max_draft_len=3, draft_dtype="fp8")
    else:
        path, spec = deepseek_fp8, MTPConfig(num_nextn_predict_layers=2)
    runs = {}
    for backend in ("torch", "triton"):
        for drafting in (None, spec):
            llm = LLM(path, device="cuda", dtype="float32", attention_backend=backend,
                      speculative_config=drafting, max_batch_size=8)
            outs = llm.generate(PROMPTS, GREEDY)
            assert_pool_full(llm)
            runs[backend, drafting is not None] = [o.outputs[0].token_ids for o in outs]
            llm.close()
    assert len({str(v) for v in runs.values()}) == 1, runs


@pytest.mark.parametrize("block,gated", [(None, True), ((128, 128), False)])
@torch.inference_mode()
def test_fp8_gemv_in_bfloat16(block, gated):
    """bf16 rows (the GPU's tensor-core dots over e4m3 tiles widened to bf16) within bf16
    tolerance of F.linear with the dequantized weight, 16- and 32-row tiles."""
    pytest.importorskip("triton")
    from onespec.kernels.fp8_gemv import fp8_gemv
    from onespec.quant.fp8 import dequantize, quantize
    torch.manual_seed(0)
    n, k = 96, 256
    q, scale = quantize(torch.randn(2 * n if gated else n, k, device=DEV) * k ** -0.5, block)
    dense = dequantize(q, scale, block, torch.bfloat16)
    for rows in (2, 24):
        x = torch.randn(rows, k, device=DEV).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), dense.float())
        if gated:
            gate, up = ref.chunk(2, -1)
            ref = torch.nn.functional.silu(gate) * up
        got = fp8_gemv(x, q, scale, block, gated=gated)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
