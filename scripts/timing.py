"""GPU timing and JSON-lines output shared by the measurement scripts (bench/ and the
engine time themselves)."""
from __future__ import annotations

import json
import sys
import time

import torch


def mean_ms(fn, n: int = 100) -> float:
    """Mean wall time of n back-to-back calls of fn, in ms (the GPU synchronised around)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / n


def jsonl_emitter(path: str | None):
    """emit(**row): one JSON line to `path` (stdout when empty), flushed at once."""
    out = open(path, "w") if path else sys.stdout

    def emit(**row):
        out.write(json.dumps(row) + "\n")
        out.flush()
    return emit


def best_us(run, reps: int = 20, trials: int = 3, per: int = 1) -> float:
    """Microseconds per call of `run` (which makes `per` calls), timed `reps` times in a row
    between CUDA events; the best of `trials` such rounds."""
    best = float("inf")
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        best = min(best, 1e3 * start.elapsed_time(end) / reps / per)
    return best


def graph_us(fn, per: int = 1, reps: int = 20, trials: int = 3, warmup: int = 3) -> float:
    """best_us of replaying a CUDA graph of fn (run once on a side stream first, so that
    lazy initialisation and compilation stay out of the graph), per call of the `per` that
    fn makes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup):
        graph.replay()
    return best_us(graph.replay, reps, trials, per)
