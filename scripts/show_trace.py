"""The stamped layers of `profile_graph_step.py --trace` output, one line a kernel:

    python scripts/show_trace.py FILE
    python scripts/show_trace.py RAW.pt     (a file of `--trace-raw`: per-SM stream times)

programs' start (earliest..latest), end of their wait (earliest..latest), end of their main
work (earliest / median / latest) and the latest end, in µs from the layer's attention start.
"""
from __future__ import annotations

import collections
import json
import statistics
import sys

ROW = ("    {kernel:12s} start {s0:6.2f}..{s1:6.2f} waited {w0:6.2f}..{w1:6.2f} "
       "worked {k0:6.2f}/{k2:6.2f}/{k4:6.2f} end {e4:6.2f}")


def main(path: str):
    for line in open(path):
        d = json.loads(line)
        print(d["mode"], "replay", d["replay_ms"])
        final = {"variant": "final", "replay_ms": d["replay_ms"], "trace": d.get("trace", [])}
        for v in d["sweep"] + [final]:
            print(" ", v["variant"], v["replay_ms"])
            for r in v.get("trace", []):
                print(ROW.format(kernel=r["kernel"], s0=r["start"][0], s1=r["start"][4],
                                 w0=r["waited"][0], w1=r["waited"][4], k0=r["worked"][0],
                                 k2=r["worked"][2], k4=r["worked"][4], e4=r["end"][4]))


def per_sm(path: str, kinds=("o_proj", "gate_up", "down", "qkv"), first: int = 2,
           last: int = 29):
    """Each GEMV's programs' stream time (wait returned -> weights streamed), over layers
    first..last: the spread within one launch (median over layers), the spread of the
    per-SM means, and how well two halves of the layers agree on which SMs are slow
    (correlation of the per-SM means of even and odd layers)."""
    import torch
    launches = torch.load(path)
    launches.sort(key=lambda nb: int(nb[1][:, 0][nb[1][:, 0] > 0].min()))
    attn = [i for i, (n, _) in enumerate(launches) if n == "attention"]
    layers = [launches[lo + 1:hi] for lo, hi in zip(attn, attn[1:])][first:last]
    for j, kind in enumerate(kinds):
        by_sm = collections.defaultdict(list)
        spreads = []
        for layer in layers:
            buf = layer[j][1]
            us = (buf[:, 2] - buf[:, 1]).double() / 1e3
            spreads.append([us.min().item(), us.median().item(), us.max().item()])
            for sm, t in zip(buf[:, 4].tolist(), us.tolist()):
                by_sm[sm].append(t)
        means = sorted(statistics.mean(v) for v in by_sm.values())
        even = torch.tensor([statistics.mean(v[0::2]) for v in by_sm.values() if len(v) > 3])
        odd = torch.tensor([statistics.mean(v[1::2]) for v in by_sm.values() if len(v) > 3])
        corr = torch.corrcoef(torch.stack([even, odd]))[0, 1].item()
        lo, med, hi = torch.tensor(spreads).median(0).values.tolist()
        print(f"{kind:8s} one launch {lo:6.2f} / {med:6.2f} / {hi:6.2f} us; per-SM means "
              f"{means[0]:6.2f}..{means[-1]:6.2f} over {len(means)} SMs; even/odd layers "
              f"agree {corr:.2f}")


if __name__ == "__main__":
    (per_sm if sys.argv[1].endswith(".pt") else main)(sys.argv[1])
