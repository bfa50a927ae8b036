"""The Triton decode / verify recurrences of hybrid targets (kernels/recurrent.py) against
the portable scans (layers/recurrent.py): K+1 rows per request in one launch, every row's
state, initial states read from pool slots (zeros where fresh). Compiled on CUDA, run in
Triton's interpreter otherwise (conftest)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from onespec.kernels.recurrent import gated_delta_verify, mamba2_verify  # noqa: E402
from onespec.layers.recurrent import gated_delta_scan, mamba2_scan  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_gated_delta_verify_matches_scan(dtype):
    g = torch.Generator().manual_seed(0)
    b, length, hk, hv, dk, dv = 2, 3, 1, 2, 16, 24      # Dv not a power of two: masked
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k = rnd(b, length, hk, dk).to(dtype), rnd(b, length, hk, dk).to(dtype)
    v = rnd(b, length, hv, dv).to(dtype)
    decay, beta = -torch.rand(b, length, hv, generator=g), torch.rand(b, length, hv, generator=g)
    pool = rnd(6, hv, dk, dv)
    slots, fresh = torch.tensor([4, 0]), torch.tensor([False, True])
    o, snap = gated_delta_verify(*(t.to(DEV) for t in (q, k, v, decay, beta, pool, slots,
                                                       fresh)))
    init = torch.where(fresh[:, None, None, None], 0, pool[slots])
    ro, rs = gated_delta_scan(q, k, v, decay, beta, init, keep_all=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o.cpu().float(), ro.to(dtype).float(), rtol=tol, atol=tol)
    torch.testing.assert_close(snap.cpu(), rs, rtol=1e-5, atol=1e-5)
    _, last = gated_delta_verify(*(t.to(DEV) for t in (q, k, v, decay, beta, pool, slots,
                                                       fresh)), keep_all=False)
    torch.testing.assert_close(last.cpu(), rs[:, -1], rtol=1e-5, atol=1e-5)


def test_mamba2_verify_matches_scan():
    g = torch.Generator().manual_seed(1)
    b, length, h, groups, p, n = 2, 4, 4, 2, 12, 16
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, bb, cc = rnd(b, length, h, p), rnd(b, length, groups, n), rnd(b, length, groups, n)
    dt = torch.rand(b, length, h, generator=g)
    a, d = -torch.rand(h, generator=g) * 2, rnd(h)
    pool = rnd(5, h, p, n)
    slots, fresh = torch.tensor([3, 1]), torch.tensor([False, True])
    y, snap = mamba2_verify(*(t.to(DEV) for t in (x, dt, a, bb, cc, d, pool, slots, fresh)))
    init = torch.where(fresh[:, None, None, None], 0, pool[slots])
    ry, rs = mamba2_scan(x, dt, a, bb, cc, d, init, keep_all=True)
    torch.testing.assert_close(y.cpu(), ry, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(snap.cpu(), rs, rtol=1e-5, atol=1e-5)
    _, last = mamba2_verify(*(t.to(DEV) for t in (x, dt, a, bb, cc, d, pool, slots, fresh)),
                            keep_all=False)                 # a prompt chunk's launch
    torch.testing.assert_close(last.cpu(), rs[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["nemotron-h"])     # (DeltaNet's: on a GPU, test_hybrid)
def test_engine_verify_through_kernels(tmp_path, monkeypatch, arch):
    """An engine whose recurrent layers run through the Triton launches (prompt chunks,
    chunked, and verify rows): greedy n-gram speculation equals plain decoding on the
    portable path."""
    from conftest import assert_pool_full
    from hybrid_utils import make_hybrid_model, make_nemotron_h_model
    from onespec import LLM, NGramConfig, SamplingParams
    from onespec.models.nemotron_h import Mamba2Mixer
    from onespec.models.qwen3_next import GatedDeltaNet
    # one recurrent layer and one attention layer: the interpreter is slow
    if arch == "nemotron-h":
        make_nemotron_h_model(tmp_path, vocab_size=24, embed_scale=10.0,
                              layers_block_type=["linear_attention", "full_attention"])
    else:
        make_hybrid_model(tmp_path, arch, num_layers=2, vocab_size=24, embed_scale=10.0,
                          layer_types=["linear_attention", "full_attention"],
                          linear_num_key_heads=1, linear_num_value_heads=2)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 5, 5, 5]]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = LLM(str(tmp_path), dtype="float32", device=DEV).generate(prompts, sp)
    for cls in (GatedDeltaNet, Mamba2Mixer):
        monkeypatch.setattr(cls, "verify_kernel", True)
        monkeypatch.setattr(cls, "prefill_chunk", 0)    # prompt chunks through the launch too
    llm = LLM(str(tmp_path), dtype="float32", device=DEV, max_num_tokens=5,
              speculative_config=NGramConfig(max_draft_len=2))
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.stats()["num_accepted_draft_tokens"] > 0
    assert_pool_full(llm)
