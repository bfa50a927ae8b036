"""Where the GPU time of one CUDA-graph decode step goes, phase by phase.

    python scripts/profile_graph_step.py [--batch 1] [--k 3] [--acceptance 3.0]
        [--variants preload=0,linear=6144:4096:0:16:256:4:5+attn=64:4:2:8]

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
  - one target layer's kernel sequence (name, start offset, duration in µs);
  - with --variants, first the step and replay times of each variant of the kernels' knobs
    (each captured afresh, the default measured again after them for the drift):
    preload=0|1 (attention reads older keys before its PDL wait),
    linear=N:K:gated:BLOCK_N:BLOCK_K:warps:stages[:preload tiles] (a GEMV's tiling),
    attn=BLOCK_N:warps:stages[:splits], fused_rope=0|1 (qkv GEMV with rotary and the KV
    write as its epilogue), release=N (a GEMV lets its successor launch N weight tiles
    before the end of its stream), early=0|1 (the qkv GEMV and the down projection
    before it let their successor launch right after their own wait), early=N:K:gated
    (that GEMV too), mlp=1 (gate_up and down as triton_mlp's persistent kernel instead of
    two small_linear kernels; mlp=0 the reverse), mlp.KEY=N (its CONFIG[KEY]),
    attn_idle=0|1 (attention's splits without keys leave before their wait),
    attn_merge=loop|unrolled (the last split loads the partials split by split, or all at
    once), max_rows=16|32 (the most rows a forward sends through the decode kernels; more
    go through cuBLAS with the row kernels); '+' joins
    knobs into one variant;
  - with --trace, the programs of each kernel of a layer from stamps they write themselves
    (start, end of the PDL wait, end of the main work, end; the programs' earliest, 10th
    percentile, median, 90th percentile and latest in µs from the layer's attention start,
    the median over layers 2-29; scripts/show_trace.py prints it compactly).
The markers add ~1-2 µs each; replay_marked_ms shows the total with them.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

from onespec import SamplingParams
from onespec.layers import linear as lin
from onespec.layers import triton_attention as ta
from onespec.layers import triton_linear as tlin
from onespec.layers import triton_mlp as tmlp
from onespec.bench_cli import build_llm, set_draft, write_model_dirs

MARK = "spin_kernel"


def mean_ms(fn, n: int = 100) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / n


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
    worker._accept = marked("accept", worker._accept)
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


def traced_layer(replay, replays: int = 5) -> list[list]:
    """layer_sequence of a few replays under the profiler (a variant's kernel timeline)."""
    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    return layer_sequence(kernels_of(prof), replays)


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


def apply_variant(spec: str):
    """Sets the knobs of one --variants entry; returns the function that restores them."""
    saved = (ta.PRELOAD, ta.SPLITS, ta.triton_paged_attention, dict(tlin.CONFIGS),
             tlin.FUSED_ROPE, tlin.RELEASE_TILES, set(tlin.RELEASE_AT_START),
             tlin.EARLY_RELEASE, tmlp.ENABLED, dict(tmlp.CONFIG), ta.IDLE_EXIT,
             ta.MERGE_UNROLLED, lin.MAX_FAST_ROWS)
    for knob in filter(None, spec.split("+")):
        name, _, value = knob.partition("=")
        if name == "preload":
            ta.PRELOAD = value == "1"
        elif name == "linear":
            n, k, gated, *cfg = (int(x) for x in value.split(":"))
            tlin.CONFIGS[(n, k, bool(gated))] = tuple(cfg)
        elif name == "fused_rope":
            tlin.FUSED_ROPE = value == "1"
        elif name == "release":
            tlin.RELEASE_TILES = int(value)
        elif name == "early" and value in ("0", "1"):
            tlin.EARLY_RELEASE = value == "1"
        elif name == "early":
            n, k, gated = (int(x) for x in value.split(":"))
            tlin.RELEASE_AT_START.add((n, k, bool(gated)))
        elif name == "attn":
            cfg = tuple(int(x) for x in value.split(":"))
            ta.SPLITS = cfg[3] if len(cfg) > 3 else ta.SPLITS
            ta.triton_paged_attention = functools.partial(saved[2], config=cfg[:3])
        elif name == "attn_idle" and value in ("0", "1"):
            ta.IDLE_EXIT = value == "1"
        elif name == "attn_merge" and value in ("loop", "unrolled"):
            ta.MERGE_UNROLLED = value == "unrolled"
        elif name == "mlp" and value in ("0", "1"):
            tmlp.ENABLED = value == "1"
        elif name.startswith("mlp.") and name[4:] in tmlp.CONFIG:
            tmlp.CONFIG[name[4:]] = int(value)
        elif name == "max_rows" and value in ("16", "32"):
            lin.MAX_FAST_ROWS = int(value)
        elif name != "default":
            raise SystemExit(f"unknown variant knob {knob!r}")

    def undo():
        ta.PRELOAD, ta.SPLITS, ta.triton_paged_attention = saved[:3]
        tlin.FUSED_ROPE, tlin.RELEASE_TILES = saved[4:6]
        tlin.RELEASE_AT_START.clear()
        tlin.RELEASE_AT_START.update(saved[6])
        tlin.EARLY_RELEASE, tmlp.ENABLED = saved[7:9]
        tmlp.CONFIG.clear()
        tmlp.CONFIG.update(saved[9])
        ta.IDLE_EXIT, ta.MERGE_UNROLLED, lin.MAX_FAST_ROWS = saved[10:13]
        tlin.CONFIGS.clear()
        tlin.CONFIGS.update(saved[3])
    return undo


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
    key = (graphs.bucket(args.batch), k, eng.runner.worker.force_acceptance_length)
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

    def stamped_layer(tag: str = "default") -> list[dict]:
        """program_trace of one replay of the graph captured afresh with stamps on (the raw
        stamps also saved to --trace-raw's folder)."""
        restart(False)
        tlin.TRACE = []
        graphs.graphs.clear()
        graphs.pool = torch.cuda.graph_pool_handle()
        while key not in graphs.graphs:
            eng.step()
        replay = graphs.standalone(key).replay
        replay()
        torch.cuda.synchronize()
        with torch.inference_mode():    # the engine made them there
            for _, buf in tlin.TRACE:      # keep only what the replay below writes
                buf.zero_()
        replay()
        torch.cuda.synchronize()
        launches = [(n, b.cpu()) for n, b in tlin.TRACE if b[:, 0].any()]
        tlin.TRACE = None
        if args.trace_raw:
            os.makedirs(args.trace_raw, exist_ok=True)
            torch.save(launches, os.path.join(
                args.trace_raw, f"{'plain' if k == 0 else 'spec'}_{tag}.pt".replace(":", "_")))
        graphs.graphs.clear()          # the next capture without stamps
        graphs.pool = torch.cuda.graph_pool_handle()
        return program_trace(launches)

    sweep = []
    for variant in args.variants + (["default"] if args.variants else []):
        undo = apply_variant(variant)
        restart(True)
        replay = graphs.standalone(key).replay
        sweep.append({"variant": variant, "step_ms": round(mean_ms(eng.step, 50), 3),
                      "replay_ms": round(mean_ms(replay, 100), 3),
                      "layer": traced_layer(replay)})
        if args.trace:
            sweep[-1]["trace"] = stamped_layer(variant)
        undo()
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
           "sweep": sweep,
           "replay_marked_ms": round(replay_marked_ms, 3),
           "kernels_per_step": len(kern) // replays - len(labels),
           "phases": phase_table(kern, labels, replays),
           "layer_kernels": layer_sequence(kern, replays)}
    if args.trace:
        out["trace"] = stamped_layer()
    for r in reqs:
        eng.abort(r.request_id)
    return out


def program_trace(launches, first: int = 2, last: int = 30) -> list[dict]:
    """The kernels of one layer from the programs' stamps (triton_linear.TRACE), each
    stamp's earliest, 10th percentile, median, 90th percentile and latest program in us
    from the layer's attention start, the median over layers first..last-1."""
    launches.sort(key=lambda nb: int(nb[1][:, 0][nb[1][:, 0] > 0].min()))
    attn = [i for i, (n, _) in enumerate(launches) if n == "attention"]
    per_layer = []
    for lo, hi in zip(attn[first:last], attn[first + 1:last + 1]):
        t0 = int(launches[lo][1][:, 0][launches[lo][1][:, 0] > 0].min())
        rows = []
        for name, buf in launches[lo:hi + 1]:
            row = {"kernel": name, "programs": buf.shape[0],
                   "sms": int(buf[:, 4].unique().numel())}
            for col, what in enumerate(("start", "waited", "worked", "end")):
                # a program that leaves early (attention's splits without keys) stamps
                # only its start: the rest of its row is whatever the memory held
                ok = (buf[:, col] >= buf[:, 0]) & (buf[:, col] - buf[:, 0] < 10 ** 9)
                v = buf[:, col][ok & (buf[:, col] > 0)].double()
                if v.numel():
                    v = (v - t0) / 1e3
                    row[what] = torch.quantile(v, torch.tensor(
                        [0, .1, .5, .9, 1], dtype=v.dtype)).tolist()
            rows.append(row)
        per_layer.append(rows)
    if not per_layer:
        return []
    out = []
    for j, row in enumerate(per_layer[0]):
        agg = dict(row)
        for what in ("start", "waited", "worked", "end"):
            if what in row:
                vals = torch.tensor([layer[j][what] for layer in per_layer
                                     if what in layer[j]])
                agg[what] = [round(x, 2) for x in vals.median(0).values.tolist()]
        out.append(agg)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--acceptance", type=float, default=3.0)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--variants", default="",
                   help="comma-separated kernel variants to time first (see above)")
    p.add_argument("--modes", default="plain,spec", help="plain, spec or both")
    p.add_argument("--trace", action="store_true",
                   help="also each kernel's programs of one layer, from stamps they write "
                        "(triton_linear.TRACE): start, end of the wait, of the main work, end")
    p.add_argument("--trace-raw", default="",
                   help="with --trace: a folder for each traced replay's raw stamps "
                        "(torch.save of [(kernel, stamps [programs, 5])])")
    args = p.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
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
