"""A decoder layer after its attention (o_proj + residual, MLP, the next layer's qkv) on the
GPU, per layer of the 8B shape: the persistent kernel (triton_linear.layer_tail) against the
same work as one kernel per projection (what the engine runs with ONESPEC_PERSISTENT=0),
next to the HBM floor of its weights, in one run.

    python scripts/bench_layer_tail.py [--layers 8] [--rows 1,4]
        [--variants 5:16384:4:0,6:16384:4:8]  # stages:stage bytes:warps:L2 lines (TAIL_*)

Each figure is a CUDA graph of --layers chained layers (distinct weights, so nothing is
served from L2) replayed back to back, divided by the layers. With --timing the persistent
kernel also stamps the GPU's nanosecond timer at each phase boundary of every program; the
JSON then holds, per phase, its span (first program in to last program out, µs) and the
barrier after it (last program done to first program through), averaged over the layers
but the first. One JSON line per (rows, variant).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from onespec.bench_cli import copy_bandwidth  # noqa: E402
from onespec.layers import triton_linear as tlin  # noqa: E402

HIDDEN, Q_SIZE, INTER, QKV = 4096, 4096, 14336, 6144
PHASES = ("o_proj", "gate_up", "down", "qkv")


def make_layers(n: int, dtype) -> list[dict]:
    def w(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype) * shape[-1] ** -0.5
    return [dict(o=w(HIDDEN, Q_SIZE), gu=w(2 * INTER, HIDDEN), d=w(HIDDEN, INTER),
                 q=w(QKV, HIDDEN), n2=1 + 0.1 * w(HIDDEN), n3=1 + 0.1 * w(HIDDEN),
                 sync=torch.zeros(2, dtype=torch.int32, device="cuda")) for _ in range(n)]


def chain(layers, a, h, persistent: bool, times=None):
    """The layers' tails one after another (each layer's output is the next one's
    residual); returns the last output."""
    for i, p in enumerate(layers):
        if persistent:
            h, _ = tlin.layer_tail(a, p["o"], h, (p["n2"], 1e-5), p["gu"], None, p["d"], None,
                                   p["sync"], next_norm=(p["n3"], 1e-5),
                                   next_qkv=(p["q"], None),
                                   times=None if times is None else times[i])
        else:
            h2, pre = tlin.small_linear(a, p["o"], residual=h, norm_out=(p["n2"], 1e-5))
            act = tlin.small_linear(pre, p["gu"], gated=True)
            h, pre = tlin.small_linear(act, p["d"], residual=h2, norm_out=(p["n3"], 1e-5))
            tlin.small_linear(pre, p["q"])
    return h


def graph_us(fn, replays: int = 30) -> float:
    fn()                                            # compile and warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / replays


def phase_breakdown(times: torch.Tensor) -> dict:
    """times [layers, programs, 16] (ns stamps: 1 past the PDL wait, 2/4/6/8 phase done,
    3/5/7 through the barrier) -> per phase span and following barrier, µs, mean over the
    layers but the first."""
    t = times[1:].double() / 1e3
    begins, ends = (1, 3, 5, 7), (2, 4, 6, 8)
    out = {}
    for i, name in enumerate(PHASES):
        span = t[:, :, ends[i]].amax(1) - t[:, :, begins[i]].amin(1)
        out[f"{name}_us"] = round(span.mean().item(), 2)
        if i + 1 < len(PHASES):
            gap = t[:, :, begins[i + 1]].amin(1) - t[:, :, ends[i]].amax(1)
            out[f"barrier_after_{name}_us"] = round(gap.mean().item(), 2)
    out["wait_us"] = round((t[:, :, 1].amin(1) - t[:, :, 0].amin(1)).mean().item(), 2)
    out["total_us"] = round((t[:, :, 8].amax(1) - t[:, :, 0].amin(1)).mean().item(), 2)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rows", default="1,4")
    p.add_argument("--variants", default=f"{tlin.TAIL_STAGES}:{tlin.TAIL_STAGE_BYTES}:"
                                         f"{tlin.TAIL_WARPS}:{tlin.TAIL_PREFETCH}")
    p.add_argument("--timing", action="store_true")
    args = p.parse_args()
    dtype = torch.bfloat16
    layers = make_layers(args.layers, dtype)
    weight_bytes = sum(layers[0][k].numel() * 2 for k in ("o", "gu", "d", "q"))
    floor_us = 1e6 * weight_bytes / copy_bandwidth("cuda")
    for rows in (int(r) for r in args.rows.split(",")):
        a = torch.randn(rows, Q_SIZE, device="cuda", dtype=dtype)
        h = torch.randn(rows, HIDDEN, device="cuda", dtype=dtype)
        separate = graph_us(lambda: chain(layers, a, h, False)) / args.layers
        for variant in args.variants.split(","):
            (tlin.TAIL_STAGES, tlin.TAIL_STAGE_BYTES, tlin.TAIL_WARPS,
             tlin.TAIL_PREFETCH) = (int(x) for x in variant.split(":"))
            row = {"rows": rows, "variant": variant, "floor_us": round(floor_us, 2),
                   "separate_us": round(separate, 2),
                   "persistent_us": round(graph_us(lambda: chain(layers, a, h, True))
                                          / args.layers, 2)}
            if args.timing:
                times = torch.zeros(args.layers, 256, 16, dtype=torch.int64, device="cuda")
                for _ in range(3):
                    chain(layers, a, h, True, times)
                torch.cuda.synchronize()
                n = int((times[0, :, 0] > 0).sum())
                row.update(phase_breakdown(times[:, :n]))
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
