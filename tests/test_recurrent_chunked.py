"""Chunked prefill of the recurrences (layers/recurrent.py gated_delta_chunked,
mamba2_chunked): equal to the token-by-token scans to float32 rounding (blocks that do and
do not divide the length, grouped heads, a carried initial state), the DeltaNet form equal
to transformers' chunked rule, and engines whose prompt chunks run in several blocks equal
to transformers token for token, leaving the state the row-by-row walk leaves."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy
from hybrid_utils import make_hybrid_model, make_nemotron_h_model
from onespec import LLM, SamplingParams
from onespec.layers.recurrent import (gated_delta_chunked, gated_delta_scan, mamba2_chunked,
                                      mamba2_scan)
from onespec.models.nemotron_h import Mamba2Mixer
from onespec.models.qwen3_next import GatedDeltaNet
from test_hybrid import assert_states_free, layer_states


def _delta_inputs(seed: int, b=2, length=13, hk=2, hv=4, dk=16, dv=12):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (rnd(b, length, hk, dk), rnd(b, length, hk, dk), rnd(b, length, hv, dv),
            -torch.rand(b, length, hv, generator=g) * 2, torch.rand(b, length, hv, generator=g),
            rnd(b, hv, dk, dv))


@pytest.mark.parametrize("chunk", [1, 4, 5, 64])
def test_gated_delta_chunked_matches_scan(chunk):
    q, k, v, g, beta, state = _delta_inputs(0)
    ref_o, ref_s = gated_delta_scan(q, k, v, g, beta, state)
    o, s = gated_delta_chunked(q, k, v, g, beta, state, chunk)
    torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=1e-5)


def test_gated_delta_chunked_matches_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import \
        torch_chunk_gated_delta_rule
    q, k, v, g, beta, state = _delta_inputs(1, length=21)
    ref_o, ref_s = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=8,
                                                initial_state=state.clone(),
                                                output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    o, s = gated_delta_chunked(q, k, v, g, beta, state, 8)
    torch.testing.assert_close(o, ref_o.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, ref_s.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 4, 6, 64])
def test_mamba2_chunked_matches_scan(chunk):
    g = torch.Generator().manual_seed(2)
    b, length, h, groups, p, n = 2, 14, 4, 2, 8, 16
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, bb, cc = rnd(b, length, h, p), rnd(b, length, groups, n), rnd(b, length, groups, n)
    dt, a, d = torch.rand(b, length, h, generator=g), -torch.rand(h, generator=g) * 2, rnd(h)
    state = rnd(b, h, p, n)
    ref_y, ref_s = mamba2_scan(x, dt, a, bb, cc, d, state)
    y, s = mamba2_chunked(x, dt, a, bb, cc, d, state, chunk)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=1e-5)


LONG = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 90, 91, 5, 17, 33, 9, 60, 3, 44, 100, 3]


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    out = {}
    for arch in ("qwen3-next", "nemotron-h"):
        path = tmp_path_factory.mktemp(arch + "-chunked")
        hf = make_nemotron_h_model(path) if arch == "nemotron-h" else \
            make_hybrid_model(path, arch)
        out[arch] = (str(path), hf)
    return out


def _prefill_states(path, prompt):
    """Every recurrent layer's state after the prompt (one step), and the top logprobs."""
    llm = LLM(path, dtype="float32", device="cpu")
    eng = llm.engine
    req = eng.add_request(prompt, SamplingParams(max_tokens=3, logprobs=5, ignore_eos=True))
    eng.step()
    states, logprobs = layer_states(eng, req.state_slot), req.logprobs[0]
    eng.abort(req.request_id)
    assert_states_free(llm)
    return states, logprobs


@torch.no_grad()
@pytest.mark.parametrize("arch", ["qwen3-next", "nemotron-h"])
def test_engine_chunked_prefill_matches_transformers(hybrids, arch, monkeypatch):
    """Prompt chunks in blocks of 4 rows (several blocks, the last partial): greedy tokens
    equal transformers' (whole prompt in one step, and engine chunks of 7 carrying the
    state), prefill logprobs equal its logits, the states equal the row-by-row walk's."""
    path, hf = hybrids[arch]
    layer_cls = Mamba2Mixer if arch == "nemotron-h" else GatedDeltaNet
    monkeypatch.setattr(layer_cls, "prefill_chunk", 0)
    walked, _ = _prefill_states(path, LONG)
    monkeypatch.setattr(layer_cls, "prefill_chunk", 4)
    chunked, logprobs = _prefill_states(path, LONG)
    for got, ref in zip(chunked, walked):
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5)
    ref = hf(torch.tensor([LONG])).logits[0, -1].log_softmax(-1).topk(5)
    for tok, lp in zip(ref.indices.tolist(), ref.values.tolist()):
        assert abs(logprobs[tok].logprob - lp) < 1e-4
    prompts = [LONG, LONG[5:]]
    want = [hf_greedy(hf, p, 6) for p in prompts]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    for kw in (dict(), dict(max_num_tokens=7)):
        llm = LLM(path, dtype="float32", device="cpu", **kw)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
        assert_states_free(llm)
