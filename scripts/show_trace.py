"""The stamped layers of `profile_graph_step.py --trace` output, one line a kernel:

    python scripts/show_trace.py FILE

programs' start (earliest..latest), end of their wait (earliest..latest), end of their main
work (earliest / median / latest) and the latest end, in µs from the layer's attention start.
"""
from __future__ import annotations

import json
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


if __name__ == "__main__":
    main(sys.argv[1])
