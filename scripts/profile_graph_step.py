"""Where the GPU time of one CUDA-graph decode step goes, phase by phase.

    python scripts/profile_graph_step.py [--batch 1] [--k 3] [--acceptance 3.0]

For plain decode and for K drafts at a forced acceptance length (random-weight 8B shape, as in
bench/decode.py), prints one JSON line per mode:
  - step_ms (engine.step, host included), replay_ms (the captured graph replayed back to
    back) and host_ms (their difference: scheduling, input copies, the device-to-host copy);
  - phases: the graph is captured once more with a tiny marker kernel after each phase
    (target forward, target lm_head + argmax, acceptance, draft fc, each draft pass, each
    draft lm_head + argmax) and replayed under torch.profiler; each phase's time is the
    span between its markers (so PDL overlap inside a phase counts once), with its kernel
    count;
  - step_gaps: the GPU's idle time between kernels and copies over ten engine steps;
  - one target layer's kernel sequence (name, start offset, duration in µs).
The markers add ~1-2 µs each; replay_marked_ms shows the total with them.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import mean_ms  # noqa: E402

from onespec import SamplingParams  # noqa: E402
from onespec.bench.decode import build_llm, set_draft  # noqa: E402
from onespec.bench.models import write_model_dirs  # noqa: E402

MARK = "spin_kernel"


def install_markers(worker, labels: list[str]):
    """After each phase of SpecWorker.step, launch a marker kernel and note the phase name."""
    def marked(name, fn):
        def call(*a, **kw):
            out = fn(*a, **kw)
            labels.append(name)
            torch.cuda._sleep(1)
            return out
        return call

    step = worker.step

    def reset_then_step(*a, **kw):
        labels.clear()
        return step(*a, **kw)
    worker.step = reset_then_step
    t = worker.target
    t.forward = marked("target forward", t.forward)
    t.greedy_tokens = marked("target lm_head+argmax", t.greedy_tokens)
    worker.acceptor.accept = marked("accept", worker.acceptor.accept)
    if worker.drafter is not None:
        d = worker.drafter
        d.initial_hidden = marked("draft fc", d.initial_hidden)
        d.forward = marked("draft pass", d.forward)
        worker._pick = marked("draft lm_head+argmax", worker._pick)


def kernels_of(prof) -> list[tuple[str, float, float]]:
    out = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()
           and "memset" not in e.name.lower()]
    return sorted(out, key=lambda x: x[1])


def phase_table(kern, labels, replays: int) -> list[dict]:
    per = len(kern) // replays
    rows: dict[int, dict] = {}
    for r in range(replays):
        ks = kern[r * per:(r + 1) * per]
        marks = [i for i, (n, _, _) in enumerate(ks) if MARK in n]
        prev_end, prev_i = ks[0][1], -1
        for j, i in enumerate(marks):
            span = ks[i][1] - prev_end
            row = rows.setdefault(j, {"phase": labels[j] if j < len(labels) else "?",
                                      "us": 0.0, "kernels": i - prev_i - 1})
            row["us"] += span / replays
            prev_end, prev_i = ks[i][2], i
        tail = rows.setdefault(len(marks), {"phase": "outputs", "us": 0.0,
                                            "kernels": per - prev_i - 1})
        tail["us"] += (ks[-1][2] - prev_end) / replays
    return [{**r, "us": round(r["us"], 1)} for _, r in sorted(rows.items())]


def step_gaps(eng, steps: int = 10, min_us: float = 1.0) -> dict:
    """The GPU's idle time while the engine steps (overlap scheduler as configured): every
    kernel and copy of `steps` engine steps in time order; gaps of at least min_us between
    one's end and the next one's start, per step, summed by (before, after) names."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    ev = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                 if e.device_type.name == "CUDA"), key=lambda x: x[1])
    pairs: dict[str, float] = {}
    idle, end = 0.0, ev[0][2]
    for (name0, _, _), (name1, start, stop) in zip(ev, ev[1:]):
        gap = start - end
        if gap >= min_us:
            idle += gap
            key = f"{name0[:32]} -> {name1[:32]}"
            pairs[key] = pairs.get(key, 0.0) + gap
        end = max(end, stop)
    top = sorted(pairs.items(), key=lambda kv: -kv[1])[:8]
    return {"span_ms": round((end - ev[0][1]) / 1e3 / steps, 3),
            "idle_us": round(idle / steps, 1),
            "top_gaps_us": [[k, round(v / steps, 1)] for k, v in top]}


def layer_sequence(kern, replays: int, layer: int = 5) -> list[list]:
    per = len(kern) // replays
    ks = kern[:per]
    attn = [i for i, (n, _, _) in enumerate(ks) if "attention" in n]
    if len(attn) <= layer + 1:
        return []
    lo, hi = attn[layer], attn[layer + 1]
    t0 = ks[lo][1]
    return [[n[:40], round(s - t0, 1), round(e - s, 1)] for n, s, e in ks[lo:hi + 1]]


def host_breakdown(eng, key, steps: int = 30) -> dict:
    """Host time per step in the engine's parts (runner.collect waits for the GPU); inside
    runner.launch: filling the inputs and the replay call (the graph launch); `gpu`, the
    graph's span on the GPU between events recorded around the replay; `gap` = step - gpu,
    the time the GPU waits for the host (about 0 when the overlap scheduler launches each
    step before the one in flight is read)."""
    spent: dict[str, float] = {}
    graphs = eng.runner.graphs

    def timed(name, fn):
        def call(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
            return out
        return call

    events = []

    class TimedGraph:
        def __init__(self, graph):
            self.graph = graph

        def replay(self):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            e0.record()
            self.graph.replay()
            e1.record()
            spent["launch"] = spent.get("launch", 0.0) + time.perf_counter() - t
            events.append((e0, e1))

    parts = [(eng.scheduler, "schedule"), (eng.scheduler, "postprocess"),
             (eng.runner, "launch"), (eng.runner, "collect"), (eng.stats, "record_step"),
             (graphs, "_fill_inputs")]
    for obj, name in parts:
        setattr(obj, name, timed(name, getattr(obj, name)))
    graph = graphs.graphs[key]
    graphs.graphs[key] = TimedGraph(graph)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    spent["step"] = time.perf_counter() - t
    graphs.graphs[key] = graph
    for obj, name in parts:
        delattr(obj, name)
    torch.cuda.synchronize()
    res = {n: round(1e3 * v / steps, 3) for n, v in spent.items()}
    res["gpu"] = round(sum(a.elapsed_time(b) for a, b in events) / len(events), 3)
    res["gap"] = round(res["step"] - res["gpu"], 3)
    return res


def run_mode(target_dir, head_dir, args, k: int, acceptance: float) -> dict:
    ns = SimpleNamespace(prompt_len=args.prompt_len, batch_sizes=[args.batch],
                         dtype="bfloat16", device="cuda", seed=0)
    llm = build_llm(target_dir, head_dir if k else None, k, ns, 4096)
    eng = llm.engine
    set_draft(eng, k, acceptance)
    vocab = eng.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=g).tolist()
    graphs = eng.runner.graphs
    key = (graphs.bucket(args.batch), k, eng.runner.worker.forced_key)
    reqs: list = []

    def restart(recapture: bool):
        """Fresh requests at the prompt length (every figure at the same context), the
        graph captured again if asked, a few warm-up steps."""
        for r in reqs:
            eng.abort(r.request_id)
        reqs[:] = [eng.add_request(p, SamplingParams(max_tokens=4000, ignore_eos=True))
                   for p in prompts]
        if recapture:     # into a fresh pool (re-capturing into a released one asserts)
            graphs.graphs.clear()
            graphs.pool = torch.cuda.graph_pool_handle()
        for _ in range(4):
            eng.step()
        for _ in range(64):     # a large batch's prefill takes more steps
            if not any(r.in_context for r in reqs) and key in graphs.graphs:
                break
            eng.step()

    restart(True)
    host = host_breakdown(eng, key)
    restart(False)
    gaps = step_gaps(eng)
    restart(False)
    step_ms = mean_ms(eng.step, 50)
    replay_ms = mean_ms(graphs.standalone(key).replay, 100)
    restart(False)
    # capture again with phase markers
    labels: list[str] = []
    install_markers(eng.runner.worker, labels)
    graphs.graphs.clear()
    while key not in graphs.graphs:     # the step in flight first, then a fresh launch
        eng.step()
    graph = graphs.graphs[key]
    replay_marked_ms = mean_ms(graphs.standalone(key).replay, 50)
    replays = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kern = kernels_of(prof)
    out = {"mode": "plain" if k == 0 else f"K={k} a={acceptance:g}", "batch": args.batch,
           "step_ms": round(step_ms, 3), "replay_ms": round(replay_ms, 3),
           "host_ms": round(step_ms - replay_ms, 3), "host_parts_ms": host,
           "step_gaps": gaps,
           "replay_marked_ms": round(replay_marked_ms, 3),
           "kernels_per_step": len(kern) // replays - len(labels),
           "phases": phase_table(kern, labels, replays),
           "layer_kernels": layer_sequence(kern, replays)}
    for r in reqs:
        eng.abort(r.request_id)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--acceptance", type=float, default=3.0)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--modes", default="plain,spec", help="plain, spec or both")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_graph_step.py needs CUDA")
    root = tempfile.mkdtemp()
    target_dir, head_dir = write_model_dirs(args.shape, root)
    modes = [m for m in ((0, 1.0), (args.k, args.acceptance))
             if ("plain" if m[0] == 0 else "spec") in args.modes.split(",")]
    for k, a in modes:
        print(json.dumps(run_mode(target_dir, head_dir, args, k, a)), flush=True)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
