"""Do the decode GEMVs stream faster with TMA tensor-descriptor loads? (Hopper probe)

    python scripts/probe_tma_chain.py [--out probe.jsonl]

One "layer" here is the 8B shape's four GEMVs at one decode row, each reading the one
before's output as its x: o_proj (4096 x 4096), gate_up (2 x 14336 x 4096, SiLU * up),
down (4096 x 14336), qkv (6144 x 4096); 32 layers of distinct weights in one CUDA graph,
every kernel launched with PDL as the engine does (qkv and down release their successor at
their start). No norms, residuals or attention: only the weight streams and their
boundaries. Prints microseconds per layer for onespec's small_linear chain and for a TMA
GEMV (weight tiles through host-made tensor descriptors, the rest like small_linear: 16
padded rows, tl.dot, the first weight tile read before the PDL wait) at several tilings,
next to the layer's weight bytes at the copy rate and at the best pure-read rate measured
by scripts/probe_read_bandwidth.py.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from timing import graph_us, jsonl_emitter

SHAPES = {"o_proj": (4096, 4096, False), "gate_up": (14336, 4096, True),
          "down": (4096, 14336, False), "qkv": (6144, 4096, False)}
ORDER = ("o_proj", "gate_up", "down", "qkv")
EARLY = {"down", "qkv"}      # release their successor right after their wait, as the engine


@triton.jit
def _tma_gemv_kernel(X, w_desc, Y, M, N, K, stride_xm, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr,
                     EARLY: tl.constexpr):
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    m = tl.arange(0, 16)
    m_ok = m < M
    k = tl.arange(0, BLOCK_K)
    w = w_desc.load([n0, 0])
    wu = w
    if GATED:
        wu = w_desc.load([N + n0, 0])
    tl.extra.cuda.gdc_wait()
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
    acc = tl.dot(x, tl.trans(w))
    acc_up = acc
    if GATED:
        acc_up = tl.dot(x, tl.trans(wu))
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([n0, k0])
        x = tl.load(X + m[:, None] * stride_xm + k0 + k[None, :], mask=m_ok[:, None],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            wu = w_desc.load([N + n0, k0])
            acc_up = tl.dot(x, tl.trans(wu), acc_up)
    if not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    y = acc
    if GATED:
        y = acc * tl.sigmoid(acc) * acc_up
    n = n0 + tl.arange(0, BLOCK_N)
    tl.store(Y + m[:, None] * N + n[None, :], y.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & (n < N)[None, :])


@triton.jit
def _blocked_gemv_kernel(X, W, Y, M, N, K, stride_xm, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr,
                         EARLY: tl.constexpr, TMA: tl.constexpr):
    """The weight pre-tiled: tile (nb, kb) is BLOCK_N x BLOCK_K contiguous elements at
    ((nb * K / BLOCK_K) + kb) * BLOCK_N * BLOCK_K, so each program reads one contiguous
    stretch (with GATED the up rows' tiles follow all the gate rows' tiles). TMA: W is a
    tensor descriptor over the tiles as rows [tiles * BLOCK_N, BLOCK_K]."""
    pid = tl.program_id(0)
    kb_n = K // BLOCK_K
    m = tl.arange(0, 16)
    m_ok = m < M
    k = tl.arange(0, BLOCK_K)
    r = tl.arange(0, BLOCK_N)
    tile = (r[:, None] * BLOCK_K + k[None, :]).to(tl.int64)
    base = pid.to(tl.int64) * kb_n
    up = (N // BLOCK_N).to(tl.int64) * kb_n
    if TMA:
        w = W.load([(base * BLOCK_N).to(tl.int32), 0])
        wu = w
        if GATED:
            wu = W.load([((up + base) * BLOCK_N).to(tl.int32), 0])
    else:
        w = tl.load(W + base * BLOCK_N * BLOCK_K + tile)
        wu = w
        if GATED:
            wu = tl.load(W + (up + base) * BLOCK_N * BLOCK_K + tile)
    tl.extra.cuda.gdc_wait()
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None], other=0.0)
    acc = tl.dot(x, tl.trans(w))
    acc_up = acc
    if GATED:
        acc_up = tl.dot(x, tl.trans(wu))
    for kb in tl.range(1, kb_n, num_stages=STAGES):
        if TMA:
            w = W.load([((base + kb) * BLOCK_N).to(tl.int32), 0])
        else:
            w = tl.load(W + (base + kb) * BLOCK_N * BLOCK_K + tile)
        x = tl.load(X + m[:, None] * stride_xm + kb * BLOCK_K + k[None, :],
                    mask=m_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            if TMA:
                wu = W.load([((up + base + kb) * BLOCK_N).to(tl.int32), 0])
            else:
                wu = tl.load(W + (up + base + kb) * BLOCK_N * BLOCK_K + tile)
            acc_up = tl.dot(x, tl.trans(wu), acc_up)
    if not EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    y = acc
    if GATED:
        y = acc * tl.sigmoid(acc) * acc_up
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(Y + m[:, None] * N + n[None, :], y.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & (n < N)[None, :])


def blocked(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """[rows, K] -> tiles [rows / bn, K / bk, bn, bk], contiguous."""
    rows, k = w.shape
    return w.reshape(rows // bn, bn, k // bk, bk).permute(0, 2, 1, 3).contiguous()


def small_linear_chain(weights: list[dict], x0: torch.Tensor) -> torch.Tensor:
    """The chain through onespec's small_linear, PDL and early releases as in the engine."""
    from onespec.layers.triton_linear import small_linear
    x = x0
    for w in weights:
        for name in ORDER:
            x = small_linear(x, w[name], gated=SHAPES[name][2], early_release=name in EARLY)
            x = x[:, :4096] if name == "qkv" else x
    return x


def torch_chain(weights: list[dict], x0: torch.Tensor) -> torch.Tensor:
    """The chain in float32 through PyTorch, each GEMV's output rounded to x0's dtype as
    the kernels store it; qkv's first 4096 columns go on."""
    x = x0.float()
    for w in weights:
        for name in ORDER:
            y = x @ w[name].float().T
            if SHAPES[name][2]:
                g, u = y.chunk(2, -1)
                y = torch.nn.functional.silu(g) * u
            x = y.to(x0.dtype).float()
            x = x[:, :4096] if name == "qkv" else x
    return x


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--read-gbps", type=float, default=4630.0)
    p.add_argument("--out", default="")
    p.add_argument("--tma-sweep", action="store_true",
                   help="also the TMA GEMV on the usual layout at several tilings")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_tma_chain.py needs CUDA")
    from triton.tools.tensor_descriptor import TensorDescriptor
    from onespec.bench_cli import copy_bandwidth
    emit = jsonl_emitter(args.out)

    copy = copy_bandwidth("cuda") / 1e9
    dt = torch.bfloat16
    weights = [{name: torch.randn((2 if g else 1) * n, k, device="cuda", dtype=dt) * k ** -0.5
                for name, (n, k, g) in SHAPES.items()} for _ in range(args.layers)]
    layer_bytes = sum(w.numel() * 2 for w in weights[0].values())
    emit(kernel="floor", copy_gbps=round(copy, 1), layer_mb=round(layer_bytes / 1e6, 1),
         us_at_copy=round(layer_bytes / copy / 1e3, 2),
         us_at_read=round(layer_bytes / args.read_gbps / 1e3, 2))
    x0 = torch.randn(1, 4096, device="cuda", dtype=dt)

    emit(kernel="small_linear",
         us_per_layer=round(graph_us(lambda: small_linear_chain(weights, x0)) / args.layers, 2))

    outs = {name: torch.empty(1, SHAPES[name][0], device="cuda", dtype=dt) for name in ORDER}

    def chain(per_layer: list[dict], launch):
        """run(layers=None): the chain over per_layer's weights (descriptors, tiles), each
        GEMV launched by launch(name, x, its weight, its output)."""
        def run(layers=None):
            x = x0
            for d in per_layer[:layers]:
                for name in ORDER:
                    launch(name, x, d[name], outs[name])
                    x = outs[name][:, :4096] if name == "qkv" else outs[name]
            return x
        return run

    def tma_chain(cfg: dict):
        def launch(name, x, desc, y):
            n, k, g = SHAPES[name]
            bn, bk, stages, warps = cfg[name]
            _tma_gemv_kernel[(triton.cdiv(n, bn),)](
                x, desc, y, 1, n, k, x.stride(0), BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                GATED=g, EARLY=name in EARLY, num_warps=warps, launch_pdl=True)
        return chain([{name: TensorDescriptor.from_tensor(w[name], list(cfg[name][:2]))
                       for name in ORDER} for w in weights], launch)

    def blocked_chain(cfg: dict, tma: bool):
        tiles = [{name: blocked(w[name], cfg[name][0], cfg[name][1]) for name in ORDER}
                 for w in weights]
        if tma:
            tiles = [{name: TensorDescriptor.from_tensor(t.view(-1, cfg[name][1]),
                                                         list(cfg[name][:2]))
                      for name, t in layer.items()} for layer in tiles]

        def launch(name, x, w, y):
            n, k, g = SHAPES[name]
            bn, bk, stages, warps = cfg[name]
            _blocked_gemv_kernel[(n // bn,)](
                x, w, y, 1, n, k, x.stride(0), BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                GATED=g, EARLY=name in EARLY, TMA=tma, num_warps=warps, launch_pdl=True)
        return chain(tiles, launch)

    def check_and_time(kind, cfg, run):
        try:
            got = run(1)
            x = torch_chain(weights[:1], x0)
            ok = ((got.float() - x).norm() / x.norm()).item() < 2e-2
            us = graph_us(run) / args.layers
        except Exception as e:
            emit(kernel=kind, cfg=cfg, error=str(e)[:300])
            return
        emit(kernel=kind, cfg=cfg, us_per_layer=round(us, 2), matches_torch=ok)

    sl = {"o_proj": (32, 256, 8, 4), "gate_up": (64, 128, 3, 4), "down": (32, 256, 5, 4),
          "qkv": (32, 256, 5, 4)}
    for cfg in [sl, {**sl, "o_proj": (32, 256, 5, 4)}, {**sl, "down": (32, 256, 6, 4)},
                {**sl, "gate_up": (64, 128, 4, 4)}, {**sl, "gate_up": (64, 256, 3, 4)},
                {**sl, "down": (32, 512, 4, 4)}, {**sl, "qkv": (32, 512, 4, 4)}]:
        check_and_time("blocked", cfg, blocked_chain(cfg, False))
    for cfg in [{"o_proj": (32, 256, 4, 4), "gate_up": (64, 128, 3, 4),
                 "down": (32, 256, 4, 4), "qkv": (32, 256, 4, 4)},
                {"o_proj": (32, 256, 6, 4), "gate_up": (64, 128, 4, 4),
                 "down": (32, 256, 6, 4), "qkv": (32, 256, 6, 4)}]:
        check_and_time("blocked_tma", cfg, blocked_chain(cfg, True))
    if not args.tma_sweep:
        return

    base = {"o_proj": (32, 256, 4, 4), "gate_up": (64, 128, 3, 4), "down": (32, 256, 4, 4),
            "qkv": (32, 256, 4, 4)}
    sweeps = {"o_proj": [(32, 256, 3, 4), (32, 256, 6, 4), (16, 256, 4, 4), (32, 128, 6, 4),
                         (16, 512, 3, 4)],
              "gate_up": [(64, 128, 2, 4), (64, 128, 4, 4), (32, 128, 4, 4), (32, 256, 3, 4),
                          (64, 64, 6, 4), (64, 128, 3, 8)],
              "down": [(32, 256, 3, 4), (32, 256, 6, 4), (16, 256, 4, 4), (16, 512, 3, 4),
                       (32, 128, 6, 4), (32, 512, 3, 4)],
              "qkv": [(32, 256, 3, 4), (32, 256, 6, 4), (16, 256, 4, 4), (16, 512, 3, 4),
                      (32, 128, 6, 4)]}
    variants = [dict(base)] + [{**base, name: c} for name, cs in sweeps.items() for c in cs]
    for cfg in variants:
        check_and_time("tma", cfg, tma_chain(cfg))

if __name__ == "__main__":
    main()
