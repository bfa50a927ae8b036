"""MXFP4 checkpoints (gpt-oss's experts) decoded at load: the E2M1 codes and E8M0 scales
worked by hand, a gpt-oss checkpoint written in the exact MXFP4 layout by the test's own
quantizer loads to the weights it encodes and generates what the dequantized bf16
checkpoint generates, token for token; other schemes and broken pairs are clear errors."""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_pool_full
from gpt_oss_utils import make_gpt_oss_model
from onespec import LLM, SamplingParams
from onespec.quant.mxfp4 import dequantize_mxfp4, dequantized_weights
from test_deepseek import PROMPTS

MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor):
    """w [..., cols] (cols a multiple of 32) -> (blocks uint8 [..., G, 16], scales uint8
    [..., G], the values they encode [..., cols] float32): per block of 32 the scale
    2^(floor(log2 amax) - 2) (6 = 1.5 * 2^2 is E2M1's largest), each value rounded to the
    nearest E2M1 magnitude, its sign in bit 3, the even element in the low nibble."""
    x = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = x.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-30))) - 2,
                      torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = x / torch.exp2(exp).unsqueeze(-1)
    idx = (scaled.abs().unsqueeze(-1) - MAGNITUDES).abs().argmin(-1)
    code = (idx + 8 * (scaled < 0)).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    values = MAGNITUDES[idx] * torch.where(scaled < 0, -1.0, 1.0) * torch.exp2(exp).unsqueeze(-1)
    return blocks, (exp + 127).to(torch.uint8), values.reshape(w.shape)


def test_e2m1_codes_and_e8m0_scales_worked_example():
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
             -4.0, -6.0]
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes[0::2] | (codes[1::2] << 4)).view(1, 8).repeat(1, 2).view(1, 16)
    out = dequantize_mxfp4(blocks, torch.tensor([127], dtype=torch.uint8), torch.float32)
    assert out.tolist() == table + table                     # 2^0; low nibble first
    byte = torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8)
    out = dequantize_mxfp4(byte, torch.tensor([129], dtype=torch.uint8), torch.float32)
    assert out[:2].tolist() == [0.5 * 4, 1.0 * 4]             # 2^(129 - 127)
    out = dequantize_mxfp4(byte, torch.tensor([120], dtype=torch.uint8), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out[1].item() == math.ldexp(1.0, -7)
    out = dequantize_mxfp4(byte, torch.tensor([255], dtype=torch.uint8), torch.float32)
    assert out.isnan().all()                                     # E8M0's NaN


def test_quantizer_round_trip():
    w = torch.randn(3, 5, 64) * 3
    blocks, scales, values = quantize_mxfp4(w)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), values)
    assert (values - w).abs().max() <= w.abs().max() / 4 + 1e-6   # one E2M1 step at most


def test_bad_blocks_and_pairs():
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8),
                         torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, dtype=torch.uint8))
    stream = [("a.gate_up_proj_blocks", torch.zeros(1, 2, 1, 16, dtype=torch.uint8)),
              ("a.gate_up_proj_bias", torch.zeros(1, 2))]
    with pytest.raises(ValueError, match="has no 'a.gate_up_proj_scales'"):
        list(dequantized_weights(stream, torch.float32))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(MXFP4 dir, dequantized bf16 dir): a bf16 gpt-oss checkpoint whose experts are
    quantized by quantize_mxfp4, and the same checkpoint holding the values they encode."""
    src = tmp_path_factory.mktemp("gpt_oss_bf16")
    make_gpt_oss_model(src, dtype=torch.bfloat16, num_layers=2)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    quantized, dequantized = dict(tensors), dict(tensors)
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # stored [E, in, out]; MXFP4 blocks run along `in` of each [out, in] row
            blocks, scales, values = quantize_mxfp4(t.transpose(1, 2))
            del quantized[name]
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            dequantized[name] = values.transpose(1, 2).to(torch.bfloat16).contiguous()
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    out = []
    for kind, state in (("mxfp4", quantized), ("dequantized", dequantized)):
        path = tmp_path_factory.mktemp(kind)
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        c = dict(cfg)
        if kind == "mxfp4":
            c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router",
                "model.embed_tokens", "lm_head"]}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(c, f)
        out.append(str(path))
    return tuple(out)


def test_mxfp4_checkpoint_generates_as_the_dequantized_one(checkpoints):
    mxfp4, reference = checkpoints
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    a = LLM(mxfp4, dtype="bfloat16", device="cpu")
    b = LLM(reference, dtype="bfloat16", device="cpu")
    for (name, p), (_, q) in zip(a.engine.model.named_parameters(),
                                 b.engine.model.named_parameters()):
        assert torch.equal(p, q), name
    outs = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] for llm in (a, b)]
    assert outs[0] == outs[1]
    assert len({tuple(t) for t in outs[0]}) > 1
    assert_pool_full(a)


def test_other_quantization_scheme_refused(checkpoints, tmp_path):
    mxfp4, _ = checkpoints
    with open(os.path.join(mxfp4, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    shutil.copy(os.path.join(mxfp4, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="'gptq' is not supported; onespec loads .*'mxfp4'"):
        LLM(str(tmp_path), dtype="float32", device="cpu")
