"""The Triton kernels (onespec/kernels/) and the Triton backend (layers/triton_ops.py)
against their PyTorch references. Compiled on CUDA; without CUDA, conftest runs them in Triton's
interpreter, so a CPU run checks their indexing, masking and arithmetic as well."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_eagle3_head, make_hf_model

pytest.importorskip("triton")

from onespec.kernels import attention as ta  # noqa: E402
from onespec.kernels.gemv import gemv, gemv_argmax, gemv_prenorm  # noqa: E402
from onespec.kernels.rope_kv import (qkv_rope_and_cache, qkv_rope_fusable,  # noqa: E402
                                     rope_and_cache)
from onespec.kernels.rows import add_rms_norm, embed_norm_concat, rms_norm, silu_mul  # noqa: E402
from onespec.kernels.settings import KernelSettings  # noqa: E402
from onespec.layers.attention import build_attention_metadata  # noqa: E402
from onespec.layers.norm import RMSNorm  # noqa: E402
from onespec.layers.ops import TORCH_OPS, make_ops  # noqa: E402
from onespec.layers.rotary import RotaryEmbedding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
TRITON_OPS = make_ops(KernelSettings(triton=True))


def assert_same_bits(a, b):
    """Bit-identical on the GPU. In Triton's CPU interpreter a tile's dot product is numpy's
    matmul, whose BLAS may block (and so round) a tile by its row count: there the rows
    must agree to rounding instead (float32's, or one bfloat16 step after it)."""
    if DEV == "cuda":
        assert torch.equal(a, b)
    else:
        tol = 1e-5 if a.dtype == torch.float32 else 8e-3
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def ops_for(backend: str):
    return TRITON_OPS if backend == "triton" else TORCH_OPS


def torch_linear(lin, x, norm=None, gated=False, residual=None, out_dtype=None):
    """The PyTorch reference: (residual +) [silu(gate) * up of] lin(norm(x))."""
    y = lin(x if norm is None else norm(x))
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = residual + y
    return y if out_dtype is None else y.to(out_dtype)


def triton_linear(lin, x, norm=None, gated=False, residual=None, out_dtype=None):
    """The same through the Triton backend (decode GEMVs, or cuBLAS and row kernels)."""
    if norm is not None:
        x = TRITON_OPS.norm(norm, x)
    if gated:
        return TRITON_OPS.gated(lin, x)
    return TRITON_OPS.linear(lin, x, residual, out_dtype)


def linear_parts(k: int, n: int, gated: bool, bias: bool, dtype, seed: int = 0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, 2 * n if gated else n, bias=bias)
    nn.init.normal_(lin.weight, 0, k ** -0.5)
    if bias:
        nn.init.normal_(lin.bias, 0, 0.5)
    norm = RMSNorm(k, 1e-5)
    nn.init.uniform_(norm.weight, 0.5, 1.5)
    return lin.to(DEV, dtype), norm.to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 20, 40])
@pytest.mark.parametrize("kind", ["plain", "bias", "norm", "gated", "norm-gated-bias",
                                  "residual", "norm-fp32-out"])
@torch.inference_mode()
def test_linear_matches_torch(dtype, rows, kind):
    """Decode-sized rows (one GEMV kernel: 16-row tiles, and 20 rows in a 32-row tile) and
    40 rows (cuBLAS with the norm and SiLU * up as Triton row kernels) against the PyTorch
    path."""
    k, n = 600, 40          # K spans two tiles with a ragged end; N is not a tile multiple
    gated = "gated" in kind
    lin, norm = linear_parts(k, n, gated, "bias" in kind, dtype)
    x = torch.randn(rows, k, device=DEV).to(dtype)
    kw = {}
    if "norm" in kind:
        kw["norm"] = norm
    if "residual" in kind:
        kw["residual"] = torch.randn(rows, n, device=DEV).to(dtype)
    if "fp32-out" in kind:
        kw["out_dtype"] = torch.float32
    ref = torch_linear(lin, x, gated=gated, **kw)
    got = triton_linear(lin, x, gated=gated, **kw)
    assert got.shape == ref.shape == (rows, n) and got.dtype == ref.dtype
    tol = TOL[dtype]
    if DEV == "cpu" and dtype == torch.bfloat16 and rows > 32:
        tol *= 4        # the interpreter truncates the row kernels' float32 to bf16 (no RNE)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("pre", [2, 4])
@pytest.mark.parametrize("gated", [False, True])
@torch.inference_mode()
def test_gemv_preloading_several_tiles(pre, gated):
    """PRE weight tiles loaded before the wait for the previous kernel, ragged K included
    (600 = 4 tiles of 128 + 88; PRE = 8 preloads all of K, so the loop never runs)."""
    lin, norm = linear_parts(600, 40, gated, True, torch.float32)
    x = torch.randn(3, 600, device=DEV)
    ref = torch_linear(lin, x, norm=norm, gated=gated)
    for p in (pre, 2 * pre):
        got = gemv(rms_norm(x, norm.weight, norm.eps), lin.weight, lin.bias, gated=gated,
                   tiling=(16, 128, 4, 2, p))
        torch.testing.assert_close(got, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])
    with pytest.raises(ValueError, match="preload tiles must be 0 or a power of two"):
        gemv(x, lin.weight, tiling=(16, 64, 4, 2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@torch.inference_mode()
def test_gemv_without_preload_is_bit_identical(dtype, gated):
    """PRE = 0 (wait first, every tile in the pipelined loop) adds the same tiles in the
    same order as one preloaded tile: equal bits, with the residual epilogue (and the next
    norm begun, ungated)."""
    lin, norm = linear_parts(600, 40, gated, False, dtype)

    def run(x, res, p):
        if gated:
            return gemv(x, lin.weight, gated=True, residual=res, tiling=(16, 128, 4, 2, p)), None
        return gemv_prenorm(x, lin.weight, res, (norm.weight, norm.eps),
                            tiling=(16, 128, 4, 2, p))
    for rows in (1, 5):
        x = torch.randn(rows, 600, device=DEV).to(dtype)
        res = torch.randn(rows, 40, device=DEV).to(dtype)
        outs = [run(x, res, p) for p in (0, 1)]
        assert torch.equal(outs[0][0], outs[1][0])
        if not gated:
            assert torch.equal(outs[0][1].x, outs[1][1].x)
            assert torch.equal(outs[0][1].ss, outs[1][1].ss)
        ref = torch_linear(lin, x, gated=gated, residual=res)
        torch.testing.assert_close(outs[0][0].float(), ref.float(), atol=TOL[dtype],
                                   rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_gemv_rows_do_not_depend_on_the_batch(dtype):
    """Each row gets bit-identical results alone or among 2..32 rows: a verify row and the
    plain decode row of the same input agree exactly. On the GPU a row's tensor-core dots
    add the same terms in the same order in a 16- or a 32-row tile; Triton's interpreter
    computes the tile's dot with numpy, whose summation order follows the tile's height,
    so there rows in 32-row tiles are compared among themselves."""
    lin, norm = linear_parts(256, 48, True, False, dtype)
    x = torch.randn(32, 256, device=DEV).to(dtype)

    def run(rows):
        return gemv(rms_norm(x[rows], norm.weight, 1e-6), lin.weight, gated=True)
    alone = torch.cat([run(slice(i, i + 1)) for i in range(32)])
    tall = run(slice(0, 32))                     # a 32-row tile
    assert_same_bits(run(slice(0, 20)), tall[:20])
    assert_same_bits(run(slice(12, 32)), tall[12:])
    for m in (2, 4, 16):
        assert_same_bits(run(slice(0, m)), alone[:m])
    if DEV == "cuda":
        assert_same_bits(tall, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7])
@torch.inference_mode()
def test_rms_norm_split_across_two_linears(dtype, rows):
    """o_proj + residual leaving the next RMSNorm half done (rows * weight, partial sums of
    squares), and gate_up finishing it, equal norm -> gate_up on the residual stream."""
    o_proj, _ = linear_parts(96, 300, False, False, dtype, seed=1)     # 300: ragged tiles
    gate_up, norm = linear_parts(300, 40, True, True, dtype, seed=2)
    a = torch.randn(rows, 96, device=DEV).to(dtype)
    h = torch.randn(rows, 300, device=DEV).to(dtype)
    # reference in float32 from the same (rounded) values: this path rounds less than the
    # bf16 PyTorch one, so it is compared with what both approximate
    o32, g32, n32 = (copy.deepcopy(mod).float() for mod in (o_proj, gate_up, norm))
    ref_h = torch_linear(o32, a.float(), residual=h.float())
    ref = torch_linear(g32, ref_h.to(dtype).float(), norm=n32, gated=True)
    got_h, pre = gemv_prenorm(a, o_proj.weight, h, (norm.weight, norm.eps),
                              tiling=(32, 64, 4, 2))
    got = gemv(pre, gate_up.weight, gate_up.bias, gated=True)
    assert pre.ss.shape == (rows, 10)                  # one partial sum per producer program
    tol = TOL[dtype]
    torch.testing.assert_close(got_h.float(), ref_h.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("norm", [False, True])
@torch.inference_mode()
def test_gemv_argmax_matches_torch(dtype, rows, norm):
    """Greedy tokens straight from the GEMV (per-tile argmax + a reduction, no logits
    written) equal argmax over the logits the same kernel writes, and the PyTorch path's
    (in bf16, whose logits differ by rounding: a token within rounding of its maximum)."""
    lin, rms = linear_parts(200, 300, False, False, dtype)    # 300: 10 tiles, ragged end
    x = torch.randn(rows, 200, device=DEV).to(dtype)
    rms = rms if norm else None
    got = TRITON_OPS.greedy(lin, x, rms)
    assert got.shape == (rows,) and got.dtype == torch.int64
    logits = TRITON_OPS.logits(lin, x, rms)
    assert torch.equal(got, logits.argmax(-1))
    offsets = torch.randint(0, 1000, (300,), device=DEV)          # a draft->target map
    assert torch.equal(TRITON_OPS.greedy(lin, x, rms, offsets), got + offsets[got])
    ref = TORCH_OPS.logits(lin, x, rms)
    if dtype == torch.float32:
        assert torch.equal(got, ref.argmax(-1))
    else:
        best = ref.max(-1).values
        assert (ref.gather(1, got[:, None])[:, 0] >= best - 0.05 * best.abs()).all()


@torch.inference_mode()
def test_gemv_argmax_takes_the_first_of_equal_maxima():
    """As torch.argmax: ties go to the lowest column, within a tile and across tiles."""
    w = torch.randn(300, 64, device=DEV) * 0.01
    x = torch.ones(2, 64, device=DEV)
    w[[40, 45]] = 1.0                        # row 0's maxima: one tile (32 columns each)
    w[[290, 70, 250]] = 0.0                  # row 1: keep its own maxima below
    w[70, :32] = 2.0
    w[250, :32] = 2.0                        # row 1's maxima: tiles 2 and 7
    x[1, 32:] = 0.0
    x[0, :32] = 0.0
    w[[40, 45], :32] = 0.0
    tokens = gemv_argmax(x, w, tiling=(32, 64, 4, 2))
    assert tokens.tolist() == [40, 70]
    assert torch.equal(tokens, (x @ w.T).argmax(-1))


def test_gemv_rejects_bad_shapes():
    w = torch.zeros(8, 32, device=DEV)
    with pytest.raises(ValueError, match="equal K"):
        gemv(torch.zeros(1, 16, device=DEV), w)
    with pytest.raises(ValueError, match="at most 32 rows"):
        gemv(torch.zeros(33, 32, device=DEV), w)
    with pytest.raises(ValueError, match="at most 32 rows"):
        gemv_prenorm(torch.zeros(33, 32, device=DEV), w, torch.zeros(33, 8, device=DEV),
                     (torch.ones(8, device=DEV), 1e-6))
    with pytest.raises(ValueError, match="equal K"):
        gemv_argmax(torch.zeros(1, 16, device=DEV), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [600, 5000])
@torch.inference_mode()
def test_row_kernels_match_torch(dtype, k):
    """The row kernels around cuBLAS linears: residual add + RMSNorm (the sum rounded
    exactly as `residual + y`; K = 5000 spans two 4096-wide blocks) and SiLU * up."""
    torch.manual_seed(0)
    y, res = (torch.randn(19, k, device=DEV).to(dtype) for _ in range(2))
    norm = RMSNorm(k, 1e-5).to(DEV, dtype)
    nn.init.uniform_(norm.weight, 0.5, 1.5)
    h, xn = add_rms_norm(y, res, norm.weight, norm.eps)
    h_ref = res + y
    xn_ref = norm(h_ref)
    assert h.dtype == xn.dtype == dtype
    tol = TOL[dtype]
    if dtype == torch.float32 or DEV == "cuda":    # the interpreter truncates to bf16
        assert torch.equal(h, h_ref)
    torch.testing.assert_close(h.float(), h_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(xn.float(), xn_ref.float(), atol=tol, rtol=tol)
    gu = torch.randn(19, 2 * k, device=DEV).to(dtype) * 4
    act = silu_mul(gu)
    gate, up = gu.chunk(2, -1)
    torch.testing.assert_close(act.float(), (F.silu(gate) * up).float(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match=r"must be \[rows, 2 \* N\]"):
        silu_mul(gu[:, 1:])
    with pytest.raises(ValueError, match="must be the same"):
        add_rms_norm(y, res[:, 1:], norm.weight, norm.eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_embed_norm_concat_matches_torch(dtype):
    """An EAGLE-3 layer's input in one kernel: the embedding rows (gathered, cast from the
    table's dtype) and the hidden rows, each RMS-normalised, side by side."""
    torch.manual_seed(0)
    table = torch.randn(50, 96, device=DEV)                  # float32, as a target's may be
    hidden = torch.randn(3, 96, device=DEV).to(dtype)
    ids = torch.tensor([7, 0, 49], device=DEV)
    e_norm, h_norm = RMSNorm(96, 1e-5).to(DEV, dtype), RMSNorm(96, 1e-6).to(DEV, dtype)
    nn.init.uniform_(e_norm.weight, 0.5, 1.5)
    nn.init.uniform_(h_norm.weight, 0.5, 1.5)
    got = embed_norm_concat(ids, table, hidden, (e_norm.weight, e_norm.eps),
                            (h_norm.weight, h_norm.eps))
    ref = torch.cat([e_norm(table[ids].to(dtype)), h_norm(hidden)], -1)
    assert got.shape == (3, 192) and got.dtype == dtype
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,qk_norm,tree", [(16, False, False), (16, True, False),
                                                   (128, False, False), (16, False, True),
                                                   (64, True, True)])
@torch.inference_mode()
def test_rope_and_cache_matches_torch(dtype, head_dim, qk_norm, tree):
    """q rotated, k rotated and v written to their rows' cache slots; `tree`: rows rotate
    at their own rotary positions (a dynamic tree's: prefix length + depth) while they are
    cached at their block positions."""
    heads, kv_heads, t, slots = 4, 2, 5, 64
    torch.manual_seed(0)
    rotary = RotaryEmbedding(head_dim, 100, 10000.0, {"rope_type": "default"}, DEV)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=DEV).to(dtype)
    positions = torch.tensor([0, 7, 8, 9, 63], device=DEV)
    # rows of two requests, blocks of 8 slots: the kernel looks the slots up itself
    tables = torch.tensor([[0, 6, 2, 5, 1, 7, 4, 3], [4, 5, 6, 7, 0, 1, 3, 2]], device=DEV)
    token_req = torch.tensor([0, 1, 1, 1, 0], device=DEV)
    slot_mapping = torch.tensor([0, 39, 40, 41, 31], device=DEV)      # block * 8 + pos % 8
    q_norm, k_norm = RMSNorm(head_dim).to(DEV, dtype), RMSNorm(head_dim).to(DEV, dtype)
    nn.init.uniform_(q_norm.weight, 0.5, 1.5)
    nn.init.uniform_(k_norm.weight, 0.5, 1.5)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim)
    if qk_norm:
        q, k = q_norm(q), k_norm(k)
    rot = torch.tensor([0, 7, 8, 8, 62], device=DEV) if tree else positions
    q_ref, k_ref = rotary(rot, q, k)
    caches = [torch.randn(slots, kv_heads, head_dim, device=DEV).to(dtype) for _ in range(2)]
    kc_ref, vc_ref = caches[0].clone(), caches[1].clone()
    kc_ref[slot_mapping] = k_ref
    vc_ref[slot_mapping] = v.view(t, kv_heads, head_dim)
    norms = (q_norm.weight, k_norm.weight, q_norm.eps) if qk_norm else ()
    q_got = rope_and_cache(qkv, positions, rotary.cos_sin, tables, token_req, 8, caches[0],
                           caches[1], heads, kv_heads, *norms,
                           rotary_positions=rot if tree else None)
    tol = TOL[dtype]
    torch.testing.assert_close(q_got.float(), q_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(caches[0].float(), kc_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(caches[1], vc_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rows,norm,bias", [(16, 5, "prenormed", True),
                                                     (128, 1, "prenormed", False),
                                                     (64, 16, "weight", False),
                                                     (32, 20, "prenormed", False),
                                                     (128, 3, None, True)])
@torch.inference_mode()
def test_qkv_rope_and_cache_equals_its_two_kernels(dtype, head_dim, rows, norm, bias):
    """The qkv GEMV with rotary and the KV write as its epilogue gives exactly what
    gemv followed by rope_and_cache gives: q, and the cache rows it writes (and no
    others)."""
    heads, kv_heads, hidden, slots = 4, 2, 96, 128
    lin, norm_mod = linear_parts(hidden, (heads + 2 * kv_heads) * head_dim, False, bias,
                                 dtype, seed=5)
    rotary = RotaryEmbedding(head_dim, 200, 10000.0, {"rope_type": "default"}, DEV)
    x = torch.randn(rows, hidden, device=DEV).to(dtype)
    h = torch.randn(rows, hidden, device=DEV).to(dtype)
    if norm == "prenormed":       # the norm begun by a residual GEMV before (as in a layer)
        res, _ = linear_parts(hidden, hidden, False, False, dtype, seed=6)
        _, x = gemv_prenorm(x, res.weight, h, (norm_mod.weight, 1e-5))
    elif norm == "weight":        # the norm as its own row kernel first
        x = rms_norm(x, norm_mod.weight, 1e-5)
    # 8 blocks of 8 a request; no two rows share a position (so no cache slot is written
    # twice, in an order that may differ between the two ways)
    positions = torch.randperm(64, device=DEV)[:rows]
    tables = torch.randperm(slots // 8, device=DEV).view(2, -1)
    token_req = torch.randint(0, 2, (rows,), device=DEV)
    assert qkv_rope_fusable(x, lin.weight, head_dim, False)
    assert not qkv_rope_fusable(x, lin.weight, head_dim, True)      # q/k norm: whole heads
    outs = []
    for fused in (False, True):
        caches = [torch.randn(slots, kv_heads, head_dim, device=DEV,
                              generator=torch.Generator(DEV).manual_seed(c)).to(dtype)
                  for c in range(2)]
        args = (positions, rotary.cos_sin, tables, token_req, 8, *caches, heads, kv_heads)
        if fused:
            q = qkv_rope_and_cache(x, lin.weight, lin.bias, *args)
        else:
            q = rope_and_cache(gemv(x, lin.weight, lin.bias), *args)
        outs.append((q, *caches))
    for got, ref in zip(outs[1], outs[0]):
        assert_same_bits(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_qkv_rope_and_cache_rotates_tree_rows_at_their_depth(dtype):
    """A dynamic tree's verify block through the fused qkv kernel: rows cached at their
    block positions P + i, rotated at P + depth; the same q and cache as the qkv GEMV then
    rope_and_cache with those rotary positions, and not what rotating at the cache
    positions gives."""
    heads, kv_heads, hidden, head_dim, slots = 4, 2, 96, 32, 128
    lin, _ = linear_parts(hidden, (heads + 2 * kv_heads) * head_dim, False, True, dtype,
                          seed=7)
    rotary = RotaryEmbedding(head_dim, 200, 10000.0, {"rope_type": "default"}, DEV)
    x = torch.randn(7, hidden, device=DEV).to(dtype)
    positions = torch.arange(40, 47, device=DEV)                     # root + 6 nodes at P=40
    depths = torch.tensor([0, 1, 1, 2, 2, 3, 1], device=DEV)
    tables = torch.randperm(slots // 8, device=DEV).view(1, -1)
    token_req = torch.zeros(7, dtype=torch.int64, device=DEV)
    outs = []
    for fused, rot in ((False, 40 + depths), (True, 40 + depths), (True, None)):
        caches = [torch.randn(slots, kv_heads, head_dim, device=DEV,
                              generator=torch.Generator(DEV).manual_seed(c)).to(dtype)
                  for c in range(2)]
        args = (positions, rotary.cos_sin, tables, token_req, 8, *caches, heads, kv_heads)
        if fused:
            q = qkv_rope_and_cache(x, lin.weight, lin.bias, *args, rotary_positions=rot)
        else:
            q = rope_and_cache(gemv(x, lin.weight, lin.bias), *args, rotary_positions=rot)
        outs.append((q, *caches))
    for got, ref in zip(outs[1], outs[0]):
        assert_same_bits(got, ref)
    assert not torch.equal(outs[2][0], outs[1][0])        # rotated at the cache positions


def _attention_case(dtype, heads, kv_heads, head_dim, q_lens, starts, seed=0):
    """Caches of 4-slot blocks, queries of requests with q_lens rows at positions starts.."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    bs, width = 4, 320
    tables = torch.randperm(len(q_lens) * width, device=DEV, generator=gen).view(-1, width)
    slots = tables.numel() * bs
    kc, vc = (torch.randn(slots, kv_heads, head_dim, device=DEV, generator=gen).to(dtype)
              for _ in range(2))
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens)]).to(DEV)
    q = torch.randn(len(positions), heads, head_dim, device=DEV, generator=gen).to(dtype)
    return q, kc, vc, tables, positions, bs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (6, 2, 24)])
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("batch", ["mixed", "verify", "verify-wide", "verify-6"])
@torch.inference_mode()
def test_split_attention_matches_torch(dtype, heads, kv_heads, head_dim, window, batch):
    """Decode-sized launches split each row's keys over up to 32 programs and merge them
    in the last one: equal to the portable attention, from a few keys (most splits idle)
    to 1,200 (19 float32 tiles of 64 keys), with and without a sliding window. 'verify': 4-row
    requests share programs (one read of each key tile); 'verify-wide': 20 rows, packed,
    split too (10 programs would leave SMs idle); 'verify-6': 24 rows, 6-row requests
    packed into a 16-row tile (2 query heads a kv head) and split 16 ways, or unpacked
    (3) and split 4 ways."""
    q_lens, starts = {"mixed": ([1, 4, 1], [1200, 700, 2]),
                      "verify": ([4] * 3, [1200, 700, 2]),
                      "verify-wide": ([4] * 5, [1200, 700, 2, 64, 333]),
                      "verify-6": ([6] * 4, [1200, 700, 2, 333])}[batch]
    q, kc, vc, tables, positions, bs = _attention_case(dtype, heads, kv_heads, head_dim,
                                                      q_lens, starts)
    rpr = 6 if batch == "verify-6" else 4
    outs = []
    for backend in ("torch", "triton"):
        meta = build_attention_metadata(tables, rpr if "verify" in batch else q_lens, positions,
                                        bs, int(positions.max()) + 1, window, backend)
        outs.append(ops_for(backend).cached_attention(q, kc, vc, meta, head_dim ** -0.5)
                    .float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@torch.inference_mode()
def test_split_attention_rows_do_not_depend_on_the_batch():
    """A verify row and the same row decoded alone get bit-identical attention (so greedy
    speculation matches plain decoding exactly), batched, and packed with its request's
    other verify rows; the ticket counters end at zero."""
    q, kc, vc, tables, positions, bs = _attention_case(torch.float32, 4, 2, 32, [4, 1],
                                                      [900, 60])
    req = torch.tensor([0, 0, 0, 0, 1], device=DEV)
    together = ta.paged_attention(q, kc, vc, tables, req, positions, 0.2, bs)
    packed = ta.paged_attention(q[:4], kc, vc, tables, req[:4], positions[:4], 0.2, bs,
                                rows_per_request=4)
    assert_same_bits(packed, together[:4])
    for i in range(5):
        for rows_per_request in (0, 1):     # 1: older keys read before the PDL wait
            alone = ta.paged_attention(q[i:i + 1], kc, vc, tables, req[i:i + 1],
                                       positions[i:i + 1], 0.2, bs,
                                       rows_per_request=rows_per_request)
            assert_same_bits(alone, together[i:i + 1])
    assert ta.counters_clear(q.device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_verify_rows_packed_in_a_32_row_tile_match_unpacked(dtype):
    """A launch without splits packs a 6-row request with 3 query heads a kv head (18 tile
    rows) into one 32-row tile, reading each key tile once, or, in 16-row tiles, into two
    programs of 3 rows (the largest divisor that fits): the same results as one program
    per row. In bf16 on the GPU bit-identical: each row's tensor-core dots add the same
    terms in the same order in either tile height. float32's dots (FMA, 'ieee') and
    Triton's interpreter (numpy) sum in an order that follows the tile's layout."""
    q, kc, vc, tables, positions, bs = _attention_case(dtype, 6, 2, 24, [6] * 3,
                                                      [900, 60, 301])
    req = torch.arange(3, device=DEV).repeat_interleave(6)
    outs = {tile: ta.paged_attention(q, kc, vc, tables, req, positions, 0.2, bs,
                                     rows_per_request=rpr, pack_tile_rows=tile,
                                     split_programs=0, config=ta.ROWS_CONFIG)
            for tile, rpr in ((16, 6), (32, 6), (0, 0))}       # 0: one program per row
    tol = TOL[dtype] / 2
    for tile in (16, 32):
        if DEV == "cuda" and dtype == torch.bfloat16:
            assert torch.equal(outs[tile], outs[0])
        torch.testing.assert_close(outs[tile].float(), outs[0].float(), atol=tol, rtol=tol)


def test_pack_takes_the_largest_divisor_that_fits():
    """Rows of a request one program takes: all of them where they fit the tile; else the
    largest divisor of the request's rows that fits (a 32-node tree's 33 verify rows with
    4 query heads a kv head: 3 a program in 32-row tiles); 1 where no divisor but 1 fits."""
    assert ta.rows_per_program(6, 3, 32) == 6
    assert ta.rows_per_program(6, 3, 16) == 3
    assert ta.rows_per_program(33, 4, 32) == 3
    assert ta.rows_per_program(33, 4, 16) == 3
    assert ta.rows_per_program(7, 4, 16) == 1
    assert ta.rows_per_program(4, 8, 16) == 2
    assert ta.rows_per_program(1, 4, 32) == 1
    assert ta.rows_per_program(5, 32, 16) == 1          # a group wider than the tile: one row


def test_row_packs_cut_each_request_latest_first():
    """Prefill packs: each request's consecutive rows in packs of up to `rows` (a request's
    latest rows first, ragged ends kept), never across requests; none without a request
    of more than MAX_SPLIT_ROWS rows (decode and verify steps keep their own launches)."""
    assert ta.row_packs([40, 1, 4, 17], 16, "cpu").tolist() == [
        [32, 8], [16, 16], [0, 16], [40, 1], [41, 4], [61, 1], [45, 16]]
    assert ta.row_packs([16, 4, 1], 16, "cpu") is None
    assert ta.row_packs([], 16, "cpu") is None
    assert ta.prefill_pack_rows(4, 128, torch.bfloat16) == 32
    assert ta.prefill_pack_rows(3, 32, torch.bfloat16) == 32
    assert ta.prefill_pack_rows(4, 128, torch.float32) == 16
    assert ta.prefill_pack_rows(8, 256, torch.bfloat16) == 8
    assert ta.prefill_pack_rows(256, 128, torch.bfloat16) == 1


@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,window", [
    (torch.float32, 4, 2, 32, None), (torch.bfloat16, 4, 2, 32, 300),
    (torch.float32, 6, 2, 24, 300), (torch.bfloat16, 6, 2, 24, None)])
@torch.inference_mode()
def test_prefill_row_packs_match_torch_and_unpacked(dtype, heads, kv_heads, head_dim, window):
    """A step mixing prefill chunks (a new 70-row prompt, a 37-row chunk at positions
    500.., whose packs end ragged) with a decode row and a 4-row verify: each program takes
    a pack of one request's rows and reads each key tile once for them. Equal to the
    portable attention, and to one program a row (bit-identical on the GPU in bfloat16,
    where each row's dots add the same terms in the same order in any tile height)."""
    q_lens, starts = [70, 1, 37, 4], [0, 600, 500, 333]
    q, kc, vc, tables, positions, bs = _attention_case(dtype, heads, kv_heads, head_dim,
                                                      q_lens, starts)
    outs = []
    for backend in ("torch", "triton"):
        meta = build_attention_metadata(tables, q_lens, positions, bs,
                                        int(positions.max()) + 1, window, backend)
        outs.append(ops_for(backend).cached_attention(q, kc, vc, meta, head_dim ** -0.5))
    rows = ta.prefill_pack_rows(heads // kv_heads, head_dim, dtype)
    assert rows in (16, 32, 64)
    assert meta.row_packs(rows).shape[0] == sum(-(-n // rows) for n in q_lens)
    unpacked = ta.paged_attention(q, kc, vc, tables, meta.token_req, positions,
                                  head_dim ** -0.5, bs, window, config=ta.PREFILL_CONFIG
                                  if ta.wide_tiles(head_dim, dtype) else (32, 4, 2))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)
    if DEV == "cuda" and dtype == torch.bfloat16:
        assert torch.equal(outs[1], unpacked)
    torch.testing.assert_close(outs[1].float(), unpacked.float(), atol=tol / 2, rtol=tol / 2)


def _random_parents(batch: int, nodes: int, seed: int, padded: int = -1) -> torch.Tensor:
    """[batch, nodes] parents of random trees (node i + 1 under a row in 0 .. i); request
    `padded` gets the engine's padding tree (every node under the root)."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.stack([torch.randint(0, i + 1, (), generator=gen)
                                        for i in range(nodes)]) for _ in range(batch)])
    if 0 <= padded < batch:
        parents[padded] = 0
    return parents.to(DEV)


def _tree_attention(q, kc, vc, tables, q_lens, positions, bs, req_index, base, ancestors,
                    **launch):
    """The portable path's tree-masked attention (mask_tree_block over its dense mask) and
    the Triton kernel's (the same call over the Triton metadata), as float32."""
    from onespec.speculative.tree import mask_tree_block
    outs = []
    for backend in ("torch", "triton"):
        meta = build_attention_metadata(tables, q_lens, positions, bs,
                                        int(positions.max()) + 1, None, backend)
        meta = mask_tree_block(meta, req_index, base, ancestors)
        if backend == "torch" or not launch:
            out = ops_for(backend).cached_attention(q, kc, vc, meta, 0.2)
        else:
            out = ta.paged_attention(q, kc, vc, tables, meta.token_req, positions, 0.2, bs,
                                     rows_per_request=meta.rows_per_request,
                                     tree_mask=meta.tree_mask, tree_base=meta.tree_base,
                                     **launch)
        outs.append(out.float())
    return outs


TREE_CASES = ["mixed", "verify-split", "verify-wide", "verify-unsplit"]


# every case in float32 on one head shape; the other (head_dim 24, three query heads a KV
# head) on the mixed and wide cases in float32 and on the split one in bfloat16 (the same
# masks, a looser tolerance), since each case costs seconds in Triton's interpreter
@pytest.mark.parametrize("dtype,heads,kv_heads,head_dim,case", [
    *[(torch.float32, 4, 2, 32, case) for case in TREE_CASES],
    *[(torch.float32, 6, 2, 24, case) for case in ("mixed", "verify-wide", "verify-partial")],
    (torch.bfloat16, 6, 2, 24, "verify-split")])
@torch.inference_mode()
def test_tree_verify_attention_matches_torch(dtype, heads, kv_heads, head_dim, case):
    """A tree verify (rows [t_last, n1 .. nN] of a request at cache positions P .. P + N,
    each seeing the prefix and its own ancestors in the block): the Triton kernel with the
    rows' ancestor masks equals the portable path's masked attention, for random trees
    and the engine's padding tree (every node under the root), at prefixes of 2 .. 1,200
    keys. 'mixed': prefill chunks before the tree requests (rows per request unknown, a
    split launch of 16 rows); 'verify-split': 3 requests of N = 4, packed and split 16
    ways; 'verify-wide': 5 requests of N = 7 (40 rows), packed and split (few programs);
    'verify-unsplit': the same never split (one program walks every key tile);
    'verify-partial': 2 requests of N = 14, whose 15 rows x 3 query heads overflow the
    32-row tile: 5 rows a program, unsplit (as a 32-node tree's 33 rows, 3 a program)."""
    nodes, batch, ctx = {"mixed": (5, 2, [3, 1]), "verify-split": (4, 3, []),
                         "verify-wide": (7, 5, []), "verify-unsplit": (7, 5, []),
                         "verify-partial": (14, 2, [])}[case]
    starts = [1200, 2, 700, 64, 333][:batch]
    ctx_starts = [40, 5][:len(ctx)]
    q_lens = ctx + [nodes + 1] * batch
    q, kc, vc, tables, positions, bs = _attention_case(dtype, heads, kv_heads, head_dim,
                                                      q_lens, ctx_starts + starts, seed=3)
    parents = _random_parents(batch, nodes, seed=len(case), padded=1)
    from onespec.speculative.tree import ancestor_matrix
    ancestors = ancestor_matrix(parents, nodes)
    req_index = torch.arange(len(ctx), len(q_lens), device=DEV)
    base = torch.tensor(starts, device=DEV)
    launch = {"split_programs": 0} if case in ("verify-unsplit", "verify-partial") else {}
    want, got = _tree_attention(q, kc, vc, tables, q_lens if ctx else nodes + 1, positions,
                                bs, req_index, base, ancestors, **launch)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert ta.counters_clear(q.device)
    # the mask matters: the rows with a sibling before them differ from causal attention
    plain = TRITON_OPS.cached_attention(q, kc, vc, build_attention_metadata(
        tables, q_lens, positions, bs, 0, None, "triton"), 0.2).float()
    assert not torch.allclose(plain, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k,depth", [(2, 3), (4, 4)])
@torch.inference_mode()
def test_tree_draft_pass_attention_matches_torch(dtype, top_k, depth):
    """A tree draft pass at depth d: k frontier rows a request at draft positions
    Q + 1 + (d - 1)·k .. Q + d·k, each seeing the draft KV up to the root Q and its own
    ancestors' entries in the block from Q + 1: the Triton kernel equals the portable
    path's masked attention (4 requests, so a split launch of 8 or 16 rows)."""
    batch, width = 4, (depth - 1) * top_k
    roots = [900, 3, 250, 40]
    d = depth - 1                                  # the last pass: the fullest block
    starts = [r + 1 + (d - 1) * top_k for r in roots]
    q, kc, vc, tables, positions, bs = _attention_case(dtype, 4, 2, 32, [top_k] * batch,
                                                      starts, seed=5)
    gen = torch.Generator().manual_seed(top_k)
    ancestors = torch.zeros(batch, top_k, width, dtype=torch.bool)
    own = torch.arange(top_k)
    for level in range(1, d + 1):             # each frontier row: one entry a depth
        pick = own if level == d else torch.randint(0, top_k, (batch, top_k), generator=gen)
        ancestors[torch.arange(batch)[:, None], own, (level - 1) * top_k + pick] = True
    base = torch.tensor(roots, device=DEV) + 1
    want, got = _tree_attention(q, kc, vc, tables, top_k, positions, bs,
                                torch.arange(batch, device=DEV), base, ancestors.to(DEV))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_num_splits_worked_examples():
    """8B shape (8 kv heads, 4 query heads each) on 132 SMs: decode-sized launches split
    32 ways at batch 1, 16 at batch 2, fewer where their programs would pass two an SM
    (batch 8: 4 ways, 16: 2); a K = 3 verify of one request (4 rows x 4 heads merged) at
    most 16 ways, so its last split's merge holds 256 rows; of 8 requests (32 rows, 64
    packed programs) 4 ways, of 16 requests 2 ways, of 32 not at all; plain decode of 32
    rows and prefill never."""
    programs = 2 * 132
    assert ta.SPLITS == 32 and ta.MERGE_SPLIT_ROWS == 256
    assert ta.num_splits(1, 1, 8, 32, programs, 4) == 32
    assert ta.num_splits(2, 1, 16, 32, programs, 4) == 16
    assert ta.num_splits(4, 4, 8, 32, programs, 16) == 16
    assert ta.num_splits(4, 4, 8, 32, 0, 16) == 16
    assert ta.num_splits(8, 1, 64, 32, programs, 4) == 4
    assert ta.num_splits(16, 1, 128, 32, programs, 4) == 2
    assert ta.num_splits(8, 1, 64, 16, 0) == 16                     # (tests: as before)
    assert ta.num_splits(32, 4, 8 * 8, 32, programs, 16) == 4
    assert ta.num_splits(64, 4, 16 * 8, 16, programs) == 2
    assert ta.num_splits(128, 4, 32 * 8, 16, programs) == 1
    assert ta.num_splits(32, 1, 32 * 8, 16, programs) == 1
    assert ta.num_splits(32, 0, 32 * 8, 16, programs) == 1
    assert ta.num_splits(32, 4, 8 * 8, 16, 0) == 1                  # turned off


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_many_verify_rows_split_long_contexts(dtype):
    """8 requests of 4 verify rows (32 rows, more than a decode-sized launch) at up to
    1,200 positions: split 4 ways (5 key tiles a split) when few programs would run, they
    equal the unsplit launch and the portable attention; the ticket counters end at 0."""
    starts = [1200, 700, 2, 64, 333, 1000, 5, 900]
    q, kc, vc, tables, positions, bs = _attention_case(dtype, 4, 2, 32, [4] * 8, starts)
    meta = build_attention_metadata(tables, 4, positions, bs, int(positions.max()) + 1,
                                    None, "torch")
    want = ops_for("torch").cached_attention(q, kc, vc, meta, 0.2).float()
    req = torch.arange(8, device=DEV).repeat_interleave(4)
    assert ta.num_splits(32, 4, 8 * 2, ta.SPLITS, 64) == 4
    outs = [ta.paged_attention(q, kc, vc, tables, req, positions, 0.2, bs,
                               rows_per_request=4, split_programs=programs).float()
            for programs in (64, 0)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got in outs:
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert ta.counters_clear(q.device)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@torch.inference_mode()
def test_triton_decoder_matches_portable_path(tmp_path, arch):
    """Whole forwards with the Triton backend (norms split across the linears around them,
    SiLU/residual epilogues, rotary and cache writes, paged attention) equal the portable
    path: a 40-row prefill chunk (cuBLAS linears), a 20-row chunk (decode path, 32-row
    tiles), a 4-row verify step and a single decode row (decode path, 16-row tiles), each
    over the cache the previous ones wrote. qwen3's head_dim 24 takes the PyTorch q/k-norm
    and rotary inside the Triton path."""
    from onespec.engine.kv_cache import allocate_kv_cache
    from onespec.models.registry import load_target
    make_hf_model(tmp_path, arch, num_layers=2)
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (65,), device=DEV)
    tables = torch.tensor([[2, 0, 3, 1, 6, 4, 7, 5, 8]], device=DEV)
    results = {}
    for backend in ("torch", "triton"):
        model = load_target(str(tmp_path), DEV, torch.float32, ops=ops_for(backend))
        model.setup_rotary(128, DEV)
        torch.manual_seed(1)
        for name, p in model.named_parameters():     # HF initialises norm weights to 1
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        allocate_kv_cache([layer.self_attn for layer in model.model.layers], 9, 8, DEV)
        outs = []
        for lo, hi in ((0, 40), (40, 60), (60, 64), (64, 65)):
            pos = torch.arange(lo, hi, device=DEV)
            meta = build_attention_metadata(tables, hi - lo, pos, 8, hi, None, backend)
            hidden, captured = model(ids[lo:hi], pos, meta, capture=(0,))
            outs += [hidden, captured, model.compute_logits(hidden),
                     model.greedy_tokens(hidden)]
        results[backend] = outs
    for got, ref in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("norm_before_residual,num_layers", [(False, 1), (True, 2)])
@torch.inference_mode()
def test_triton_eagle3_drafter_matches_portable_path(tmp_path, norm_before_residual,
                                                     num_layers):
    """The draft head's passes with the Triton backend (fc, both input norms written into
    one concatenation, fused layers, norm + draft lm_head) equal the portable path: a
    4-row step 0 and a single-row later step over the draft KV the first one wrote."""
    from onespec.engine.kv_cache import allocate_kv_cache
    from onespec.models.eagle3_io import load_eagle3_head
    from onespec.models.registry import load_target
    from onespec.speculative.eagle3 import Eagle3Drafter
    hf = make_hf_model(tmp_path / "target", "llama", num_layers=4)
    make_eagle3_head(tmp_path / "head", hf, draft_vocab_size=64, num_layers=num_layers,
                     norm_before_residual=norm_before_residual)
    torch.manual_seed(0)
    captured = torch.randn(4, 3 * 64, device=DEV)
    ids = torch.randint(3, 128, (5,), device=DEV)
    tables = torch.tensor([[1, 0]], device=DEV)
    results = {}
    for backend in ("torch", "triton"):
        ops = ops_for(backend)
        target = load_target(str(tmp_path / "target"), DEV, torch.float32, ops=ops)
        head = load_eagle3_head(str(tmp_path / "head"), target.config, 3, DEV, torch.float32,
                                ops=ops)
        head.setup_rotary(64, DEV)
        torch.manual_seed(1)
        for name, p in head.named_parameters():      # so the split norms are seen
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        drafter = Eagle3Drafter(head, target, (1, 2, 3))
        allocate_kv_cache(drafter.attention_layers, 2, 8, DEV)
        pos = torch.arange(3, 7, device=DEV)
        meta = build_attention_metadata(tables, 4, pos, 8, 7, None, backend)
        h = drafter.forward(ids[:4], pos, drafter.initial_hidden(captured, None), meta)
        outs = [h, drafter.compute_logits(h), drafter.greedy_target_ids(h)]
        pos = torch.tensor([7], device=DEV)
        meta = build_attention_metadata(tables, 1, pos, 8, 8, None, backend)
        h = drafter.forward(ids[4:], pos, h[-1:], meta)
        results[backend] = outs + [h, drafter.compute_logits(h), drafter.greedy_target_ids(h)]
    for got, ref in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_kernels_compile_for_hopper_without_a_gpu():
    """scripts/compile_kernels.py builds every kernel for sm_90 through Triton's CUDA backend
    (no GPU needed): the PDL instructions are in the code and the shared memory fits an
    H100/H200 block — what the interpreter cannot check."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "compile_kernels.py")],
                          capture_output=True, text=True, env=env, cwd=root, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(rows) == 46
    for row in rows:
        assert row["fits"] and row["shared_bytes"] <= 232448, row
        # gdc_wait + launch_dependents (the MoE targets' kernels follow PyTorch operations)
        no_pdl = row["kernel"].startswith(("mla", "moe"))
        assert row["pdl_instructions"] == (0 if no_pdl else 2), row
    by_name = {row["kernel"]: row for row in rows}
    # attention with known rows per request reads its inputs and older keys before the wait
    assert by_name["attention bf16 decode (split keys, 1 row per request)"][
        "global_loads_before_wait"] > 0
    assert by_name["attention bf16 prefill"]["global_loads_before_wait"] == 0
    # ... over an e4m3 cache too (kv_cache_dtype="fp8")
    assert by_name["attention bf16 decode over an e4m3 cache (split keys, 4-row verify "
                   "packs)"]["global_loads_before_wait"] > 0
    # the fused qkv reads positions, slots and cos/sin before the wait
    qkv = by_name["qkv + rotary + KV write (prenormed)"]
    assert qkv["global_loads_before_wait"] > 8
    # the qkv GEMV and the down projection before it release their successor right after
    # their wait (no load between the two); the other GEMVs only after their weight stream
    early = by_name["gemv prenorm, early release (down before qkv)"]
    for row in (qkv, early):
        assert row["global_loads_before_release"] == row["global_loads_before_wait"], row
    # ... and a qkv program fits beside a down program on one SM (228 KB, 1 KB reserved
    # per block), where the early release places it
    assert early["shared_bytes"] + qkv["shared_bytes"] + 2048 <= 228 * 1024
    late = by_name["gemv prenorm"]
    assert late["global_loads_before_release"] > late["global_loads_before_wait"], late


@torch.inference_mode()
def test_triton_tree_step_matches_portable_path(tmp_path):
    """A tree step's forwards through the Triton backend equal the portable path: a target
    forward of a prefill chunk beside a tree verify (7 rows at cache positions 20 .. 26,
    rotated at 20 + depth, each seeing the prefix and its ancestors), and the draft head's
    tree expansion (draft_tree: two passes of 2 frontier rows a request, each seeing the
    draft KV to its root and its ancestors' entries) giving the same tree and draft KV."""
    from onespec.engine.kv_cache import allocate_kv_cache
    from onespec.models.eagle3_io import load_eagle3_head
    from onespec.models.registry import load_target
    from onespec.speculative.eagle3 import Eagle3Drafter
    from onespec.speculative.shape import TreeShape
    from onespec.speculative.tree import ancestor_matrix, depths_of, mask_tree_block
    from onespec.speculative.tree_draft import draft_tree
    hf = make_hf_model(tmp_path / "target", "llama", num_layers=4)
    make_eagle3_head(tmp_path / "head", hf, draft_vocab_size=64, num_layers=1)
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (37,), device=DEV)
    tables = torch.tensor([[0, 1, 6, 7], [2, 3, 4, 5]], device=DEV)
    parents = [0, 0, 1, 1, 3, 2]
    cache_pos = torch.cat([torch.arange(0, 10), torch.arange(20, 27)]).to(DEV)
    rotary = torch.cat([torch.arange(0, 10), 20 + torch.tensor(depths_of(parents))]).to(DEV)
    ancestors = ancestor_matrix(torch.tensor([parents], device=DEV), 3)
    shape = TreeShape(3, 2, 4)
    results = {}
    for backend in ("torch", "triton"):
        ops = ops_for(backend)
        target = load_target(str(tmp_path / "target"), DEV, torch.float32, ops=ops)
        target.setup_rotary(64, DEV)
        head = load_eagle3_head(str(tmp_path / "head"), target.config, 3, DEV, torch.float32,
                                ops=ops)
        head.setup_rotary(64, DEV)
        drafter = Eagle3Drafter(head, target, (1, 2, 3))
        allocate_kv_cache([layer.self_attn for layer in target.model.layers], 8, 8, DEV)
        allocate_kv_cache(drafter.attention_layers, 8, 8, DEV)
        # request 1's prefix 0 .. 19, then request 0's chunk beside request 1's tree verify
        pos = torch.arange(20, device=DEV)
        meta = build_attention_metadata(tables[1:], 20, pos, 8, 20, None, backend)
        target(ids[:20], pos, meta)
        meta = build_attention_metadata(tables, [10, 7], cache_pos, 8, 27, None, backend)
        meta = mask_tree_block(meta, torch.tensor([1], device=DEV),
                               torch.tensor([20], device=DEV), ancestors)
        hidden, captured = target(ids[20:], rotary, meta, capture=(1, 2, 3))
        outs = [hidden, captured]
        # draft KV to the roots at positions 9 and 5, then the tree expansion after them
        pos = torch.cat([torch.arange(10), torch.arange(6)]).to(DEV)
        meta = build_attention_metadata(tables, [10, 6], pos, 8, 10, None, backend)
        h = drafter.forward(ids[:16], pos, drafter.initial_hidden(captured[:16], None), meta)
        roots = h[torch.tensor([9, 15], device=DEV)]
        tree = draft_tree(drafter, roots, torch.tensor([9, 5], device=DEV), tables, shape, 8,
                          16, backend)
        layer = drafter.attention_layers[0]
        results[backend] = outs + [h, *tree, layer.k_cache.clone(), layer.v_cache.clone()]
    for got, ref in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
