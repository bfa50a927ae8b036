"""The persistent MLP kernel (triton_mlp.fused_mlp) against small_linear's gate_up + down.

    python scripts/probe_fused_mlp.py [--layers 32] [--variants default,ba=32,...]
                                      [--trace] [--out f.jsonl]

First checks, at 1, 4 and 16 rows of the 8B shape, that fused_mlp gives bit for bit what
small_linear's two kernels give (output, the next norm's rows and sums), also on a repeated
launch (the counters zeroed by the last program). Then times a chain of 32 layers in one
CUDA graph, each o_proj (residual + next norm) -> MLP -> qkv (PDL as in the engine; no
attention), with the MLP as the two kernels and as fused_mlp in each variant: 'default'
or triton_mlp.CONFIG keys joined by '+' (e.g. ba=32+stages_a=4). With --trace, also each
variant's per-program phase times (the kernel's stamps). One JSON line per result.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from timing import graph_us


def parse_variant(variant: str) -> dict:
    """'default' or triton_mlp.CONFIG keys, e.g. 'ba=32+stages_a=3' -> a config."""
    from onespec.layers.triton_mlp import CONFIG
    cfg = dict(CONFIG)
    for knob in filter(None, variant.split("+")):
        if knob != "default":
            key, _, value = knob.partition("=")
            if key not in CONFIG:
                raise SystemExit(f"unknown triton_mlp.CONFIG key {key!r}")
            cfg[key] = int(value)
    return cfg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--variants", default="default,sync=0,rr=0+sync=0,ba=32+stages_a=3,"
                    "ba=32+stages_a=3+sync=0,stages_a=6")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    from onespec.layers import triton_linear as tl_
    from onespec.layers.triton_linear import small_linear
    from onespec.layers.triton_mlp import fused_mlp, plan, _sm_count

    out = open(args.out, "a") if args.out else None

    def emit(**row):
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")

    dev = torch.device("cuda")
    hid, inter, qkv_n = 4096, 14336, 6144
    emit(kind="plan", sms=_sm_count(dev), plan=plan(hid, inter, _sm_count(dev)))
    torch.manual_seed(0)

    def weights():
        return {"o": torch.randn(hid, hid, device=dev, dtype=torch.bfloat16) * 0.02,
                "gu": torch.randn(2 * inter, hid, device=dev, dtype=torch.bfloat16) * 0.02,
                "d": torch.randn(hid, inter, device=dev, dtype=torch.bfloat16) * 0.02,
                "qkv": torch.randn(qkv_n, hid, device=dev, dtype=torch.bfloat16) * 0.02,
                "n2": 1 + 0.1 * torch.randn(hid, device=dev, dtype=torch.bfloat16),
                "n3": 1 + 0.1 * torch.randn(hid, device=dev, dtype=torch.bfloat16)}

    w0 = weights()
    ok_all = True
    for rows in (1, 4, 16):
        a = torch.randn(rows, hid, device=dev, dtype=torch.bfloat16)
        h = torch.randn(rows, hid, device=dev, dtype=torch.bfloat16)
        h2, pre = small_linear(a, w0["o"], residual=h, norm_out=(w0["n2"], 1e-5))
        act = small_linear(pre, w0["gu"], gated=True)
        y_ref, n_ref = small_linear(act, w0["d"], residual=h2, norm_out=(w0["n3"], 1e-5))
        for variant in args.variants.split(","):
            cfg = parse_variant(variant)
            if not cfg["sync"]:           # no waits: a timing diagnostic, wrong results
                continue
            for launch in range(2):
                y, nxt = fused_mlp(pre, w0["gu"], w0["d"], h2, norm_out=(w0["n3"], 1e-5),
                                   config=cfg)
                torch.cuda.synchronize()
                same = (torch.equal(y, y_ref) and torch.equal(nxt.x, n_ref.x) and
                        torch.equal(nxt.ss, n_ref.ss))
                ok_all &= same
                emit(kind="check", rows=rows, variant=variant, launch=launch, bit_equal=same,
                     max_abs=float((y.float() - y_ref.float()).abs().max()),
                     ss_max_rel=float(((nxt.ss - n_ref.ss).abs() /
                                       n_ref.ss.abs().clamp_min(1e-6)).max()))
    if not ok_all:
        emit(kind="warning", msg="fused_mlp differs from small_linear's two kernels")

    layers = [weights() for _ in range(args.layers)]
    a0 = torch.randn(1, hid, device=dev, dtype=torch.bfloat16)
    h0 = torch.randn(1, hid, device=dev, dtype=torch.bfloat16)
    gb = args.layers * sum(w.numel() * 2 for w in w0.values()) / 1e9

    def chain(mlp):
        def run():
            a, h = a0, h0
            for w in layers:
                h, pre = small_linear(a, w["o"], residual=h, norm_out=(w["n2"], 1e-5))
                h, pre = mlp(pre, w, h)
                a = small_linear(pre, w["qkv"], early_release=True)[:, :hid]
            return h
        return run

    def two(pre, w, h):
        act = small_linear(pre, w["gu"], gated=True)
        return small_linear(act, w["d"], residual=h, norm_out=(w["n3"], 1e-5),
                            early_release=True)

    def fused(cfg):
        return lambda pre, w, h: fused_mlp(pre, w["gu"], w["d"], h,
                                           norm_out=(w["n3"], 1e-5), config=cfg)

    base = graph_us(chain(two)) / args.layers
    emit(kind="chain", mlp="small_linear x2", us_per_layer=round(base, 2),
         gb_per_layer=round(gb / args.layers, 4))
    for variant in args.variants.split(","):
        cfg = parse_variant(variant)
        us = graph_us(chain(fused(cfg))) / args.layers
        emit(kind="chain", mlp="fused", variant=variant, us_per_layer=round(us, 2),
             vs_two=round(us - base, 2))
        if args.trace:
            tl_.TRACE = []
            stream = torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                with torch.cuda.graph(graph):
                    chain(fused(cfg))()
            tl_.TRACE, trace = None, tl_.TRACE
            graph.replay()
            torch.cuda.synchronize()
            mlps = [buf.cpu() for name, buf in trace if name == "fused_mlp"]
            for li in (2, args.layers // 2):
                s = mlps[li].double()
                t0 = s[:, 0].min()
                q = lambda v: [round(float(v.min()), 2), round(float(v.median()), 2),
                               round(float(v.max()), 2)]
                emit(kind="trace", variant=variant, layer=li,
                     wait_us=q((s[:, 1] - t0) / 1e3), a_end_us=q((s[:, 2] - t0) / 1e3),
                     end_us=q((s[:, 3] - t0) / 1e3))
    emit(kind="done", checks_bit_equal=ok_all)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
