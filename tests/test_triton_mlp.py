"""The persistent MLP kernel (layers/triton_mlp.py): its work plan on any machine, the
kernel itself on a Hopper GPU (its programs wait on each other, which Triton's interpreter,
running them one after another, cannot do)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from onespec.layers import triton_linear as tlin  # noqa: E402
from onespec.layers import triton_mlp  # noqa: E402
from onespec.layers.triton_linear import Prenormed, small_linear  # noqa: E402
from onespec.layers.triton_mlp import BB, CONFIG, fused_mlp, fused_mlp_supported, plan  # noqa: E402

BA = CONFIG["ba"]

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90+) GPU")


def deal(hidden, inter, sms):
    """The kernel's dealing, in Python: {program: [(round, tile), ...]}."""
    programs, g0, s0, c0, s1, c1, c2, nob_last = plan(hidden, inter, sms)
    assert programs <= sms
    out = {}
    for p in range(programs):
        rank = (p - g0 if p >= g0 else programs - g0 + p) if nob_last else p
        n = c0 if rank < s0 else c1 if rank < s0 + s1 else c2
        out[p] = [(j, programs * min(j, c2) + (s0 + s1) * min(max(j - c2, 0), c1 - c2)
                   + s0 * max(j - c1, 0) + rank) for j in range(n)]
    return g0, out


@pytest.mark.parametrize("hidden,inter,sms", [(4096, 14336, 132), (4096, 14336, 128),
                                                   (512, 1536, 132), (2048, 8192, 78),
                                                   (1024, 2816, 32), (4096, 1536, 132)])
def test_plan_deals_every_tile_once_and_balances_bytes(hidden, inter, sms):
    g0, dealt = deal(hidden, inter, sms)
    programs = len(dealt)
    assert g0 == programs - hidden // BB
    tiles = sorted(dealt.values(), key=len)
    flat = [x for d in dealt.values() for x in d]
    assert sorted(t for _, t in flat) == list(range(inter // BA))    # each tile once
    # a later round holds later activation columns than every earlier round
    last = {}
    for j, t in flat:
        last[j] = max(last.get(j, -1), t)
    assert all(t > last[j - 1] for j, t in flat if j)
    tile_b, block_b = 4 * BA * hidden, 2 * BB * inter
    loads = [len(d) * tile_b + (block_b if p >= g0 else 0) for p, d in dealt.items()]
    # no program streams more than the mean over all SMs plus one tile (or one down block)
    assert max(loads) <= max(sum(loads) / sms + tile_b, block_b) and len(tiles[-1]) > 0
    if hidden == 4096 and inter == 14336 and sms == 132:    # the 8B shape on an H200
        assert programs == 132 and max(loads) == 7 * tile_b + block_b


def test_plan_needs_a_program_per_down_block():
    assert plan(8192, 28672, 132) is None         # 256 row blocks of 32 for 132 SMs


def test_not_supported_off_hopper(monkeypatch):
    monkeypatch.setattr(triton_mlp, "ENABLED", True)
    lin = torch.nn.Linear(512, 3072, bias=False).to(torch.bfloat16)
    down = torch.nn.Linear(1536, 512, bias=False).to(torch.bfloat16)
    assert not fused_mlp_supported(torch.zeros(1, 512, dtype=torch.bfloat16), lin, down)


def test_fused_mlp_rejects_bad_shapes():
    """Checked before anything is launched (so on any machine)."""
    w_gu, w_d = torch.zeros(3072, 512), torch.zeros(512, 1536)

    def pre(rows):
        return Prenormed(torch.zeros(rows, 512), torch.ones(rows, 16), 1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        fused_mlp(pre(2), w_gu[:-256], w_d, torch.zeros(2, 512))
    with pytest.raises(ValueError, match="at most 16 rows"):
        fused_mlp(pre(18), w_gu, w_d, torch.zeros(18, 512))
    with pytest.raises(ValueError, match="multiples of 256"):
        fused_mlp(pre(2), torch.zeros(2 * 1000, 512), torch.zeros(512, 1000),
                  torch.zeros(2, 512))


def _parts(hidden, inter, rows, dtype, seed=0):
    torch.manual_seed(seed)
    dev = "cuda"
    w_o = torch.randn(hidden, hidden, device=dev).to(dtype) * hidden ** -0.5
    w_gu = torch.randn(2 * inter, hidden, device=dev).to(dtype) * hidden ** -0.5
    w_d = torch.randn(hidden, inter, device=dev).to(dtype) * inter ** -0.5
    n2 = (1 + 0.2 * torch.randn(hidden, device=dev)).to(dtype)
    n3 = (1 + 0.2 * torch.randn(hidden, device=dev)).to(dtype)
    a = torch.randn(rows, hidden, device=dev).to(dtype)
    h = torch.randn(rows, hidden, device=dev).to(dtype)
    h2, pre = small_linear(a, w_o, residual=h, norm_out=(n2, 1e-5))
    return pre, h2, w_gu, w_d, n3


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("cfg", [{}, {"early": False, "bands": 2, "stages_a": 3},
                                 {"flat": False, "bands": 3}])
def test_fused_mlp_equals_two_kernels(dtype, rows, cfg):
    pre, h, w_gu, w_d, n3 = _parts(512, 1536, rows, dtype)
    act = small_linear(pre, w_gu, gated=True)
    # down in the fused kernel's BB-row tiles, so the next norm's partial sums of squares
    # come from the same row bands (the default tiling's are 16 rows: twice as many)
    y_ref, nxt_ref = small_linear(act, w_d, residual=h, norm_out=(n3, 1e-5),
                                  config=(triton_mlp.BB, triton_mlp.BLOCK_K, 4, 3))
    for _ in range(3):          # the counters are zeroed for the next launch
        y, nxt = fused_mlp(pre, w_gu, w_d, h, norm_out=(n3, 1e-5), config=cfg)
        assert torch.equal(y, y_ref) and torch.equal(nxt.x, nxt_ref.x)
        assert torch.equal(nxt.ss, nxt_ref.ss)
    assert torch.equal(fused_mlp(pre, w_gu, w_d, h, config=cfg), y_ref)
    assert int(triton_mlp._SYNC[y.device].abs().sum()) == 0


@needs_hopper
def test_fused_mlp_matches_torch_and_rows_are_independent():
    pre, h, w_gu, w_d, _ = _parts(1024, 2816 // 256 * 256, 7, torch.bfloat16, seed=1)
    y = fused_mlp(pre, w_gu, w_d, h)
    x = (pre.x.float() * torch.rsqrt(pre.ss.sum(1, keepdim=True) / pre.x.shape[1] + pre.eps))
    gate, up = (x @ w_gu.float().T).chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate) * up) @ w_d.float().T + h.float()
    torch.testing.assert_close(y.float(), ref, atol=3e-2, rtol=3e-2)
    one = fused_mlp(Prenormed(pre.x[3:4], pre.ss[3:4], pre.eps), w_gu, w_d, h[3:4])
    assert torch.equal(one[0], y[3])


@needs_hopper
def test_fused_mlp_in_a_cuda_graph():
    pre, h, w_gu, w_d, n3 = _parts(512, 1536, 2, torch.bfloat16)
    layers = [(w_gu, w_d), (w_gu * 0.5, w_d), (w_gu, w_d * 2)]

    def run():
        x, y = pre, h
        for gu, d in layers:
            y, x = fused_mlp(x, gu, d, y, norm_out=(n3, 1e-5))
        return y
    eager = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@needs_hopper
def test_engine_bf16_fused_mlp_same_tokens(tmp_path):
    """A bf16 model whose MLP the kernel takes: the same greedy tokens with and without it,
    plain and speculative (the kernel's results equal the two GEMVs', bit for bit)."""
    from conftest import make_eagle3_head, make_hf_model

    from onespec import LLM, Eagle3Config, SamplingParams
    hf = make_hf_model(tmp_path / "t", "llama", num_layers=6, hidden_size=512,
                       intermediate_size=1536, num_attention_heads=4, num_key_value_heads=2)
    make_eagle3_head(tmp_path / "h", hf, "safeailab", draft_vocab_size=64, seed=3)
    prompts = [[5, 6, 7], list(range(20, 45)), [3] * 12]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    runs, launches, saved = [], [], triton_mlp.ENABLED
    for enabled in (True, False):
        triton_mlp.ENABLED = enabled
        tlin.TRACE = []           # every Triton launch, by kernel name
        try:
            for spec in (None, Eagle3Config(str(tmp_path / "h"), max_draft_len=3)):
                llm = LLM(str(tmp_path / "t"), device="cuda", dtype="bfloat16",
                          speculative_config=spec)
                runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
        finally:
            triton_mlp.ENABLED = saved
            launches.append(sum(name == "fused_mlp" for name, _ in tlin.TRACE))
            tlin.TRACE = None
    assert launches[0] > 0 and launches[1] == 0
    assert runs[0] == runs[1] == runs[2] == runs[3]
