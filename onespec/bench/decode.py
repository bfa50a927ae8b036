"""`onespec bench [decode]`: decode-phase throughput of a random-weight target, plain and with
a one-model EAGLE-3 head at forced acceptance (lengths, or per-position rates), at fixed
draft lengths and with the auto draft length, against a memory-bandwidth floor and Hugging
Face transformers `generate`, all in one run.

One JSON object per measured configuration goes to stdout; progress and a per-config
breakdown go to stderr. speedup (both places) = tok/s with the head / plain tok/s at the
same batch size. `bench/decode.py` runs the same code from a checkout.

The default matrix (4 batch sizes x K in 0,3,5 x 4 acceptance lengths, 3 trials each, and
transformers) takes minutes even with --shape tiny. A short run, in seconds on a CPU:
  onespec bench --shape tiny --device cpu --batch-sizes 1 --ks 3 --acceptance max \\
      --gen-len 16 --trials 1 --no-hf

FP8 weights (the floor counts their bytes): `--quantization fp8` quantizes the target per
output channel (LLM(quantization="fp8")), `fp8-block` gives it DeepSeek-V3's layout
(e4m3 per 128 x 128 block, experts and attention too), `--draft-dtype fp8` the head's:
  onespec bench --shape deepseek-v2-lite --quantization fp8-block --ks 0,1 --no-hf

Plain, every K and auto at the bundled pair's measured acceptance curve, plotted:
  onespec bench --ks 0,1,2,3,4,5,auto --acceptance-rates 0.70,0.57,0.45,0.38,0.31 \\
      --no-hf --plot auto.png
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from onespec.bench.hf import run_hf
from onespec.bench.models import (GPT_OSS_SHAPES, SHAPES, copy_bandwidth, default_shape,
                                  release_memory, shape_label, step_floor_parts, sync,
                                  target_config,
                                  write_model_dirs)
from onespec.bench.moe import MTP_SHAPES
from onespec.config import AUTO_DRAFT_LEN
from onespec.speculative.cost_model import expected_tokens
from onespec.speculative.shape import ChainShape, TreeShape

MAX_ACCEPTANCE = "max"           # --acceptance item meaning K + 1 (every draft accepted)
# --quantization -> the target's quantization_config (None: LLM(quantization=...) instead)
QUANTIZATIONS = {"fp8": None,
                 "fp8-block": {"quant_method": "fp8", "fmt": "e4m3",
                               "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}
MIN_STEP_TOKENS = 2048         # engine max_num_tokens (prefill chunk budget) at least
AUTO_MAX_DRAFT_LEN = 5         # auto's max_draft_len when --ks names no K > 0
AUTO_WARMUP_STEPS = 32         # untimed steps before timing auto (its estimates settle)


def parse_args(argv):
    from onespec.cli import Parser
    p = Parser(prog="onespec bench", description=__doc__)
    p.add_argument("which", nargs="?", default="decode", choices=["decode"],
                   help="the benchmark")
    p.add_argument("--batch-sizes", default="1,8,32,64", help="concurrent requests")
    p.add_argument("--ks", default="0,3,5",
                   help="draft lengths, and 'auto' (the cost model picks K per step, up to "
                        "the largest K listed); 0 (plain) always runs")
    p.add_argument("--acceptance", default="1.0,2.0,3.0,max",
                   help="forced tokens per step; 'max' = K+1")
    p.add_argument("--acceptance-rates", default=None,
                   help="forced conditional acceptance rate of each draft position, e.g. "
                        "0.70,0.57,0.45,0.38,0.31 (replaces --acceptance)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="plot tok/s against batch size (needs matplotlib: onespec[plot])")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--gen-len", type=int, default=128,
                   help="tokens per request in the timed decode phase")
    p.add_argument("--warmup-steps", type=int, default=5, help="untimed steps first")
    p.add_argument("--trials", type=int, default=3,
                   help="timed runs of --gen-len tokens per onespec configuration; step_ms "
                        "is their median (each run's in step_ms_trials); transformers: one")
    p.add_argument("--shape", default=None,
                   choices=sorted(SHAPES) + sorted(GPT_OSS_SHAPES) + sorted(MTP_SHAPES),
                   help="MLA + MoE and hybrid shapes (%s) draft with their MTP layer, gpt-oss "
                        "shapes (%s) with an EAGLE-3 head; default: llama3-8b on a GPU where "
                        "its weights fit, else tiny"
                        % (", ".join(MTP_SHAPES), ", ".join(GPT_OSS_SHAPES)))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cuda", "cpu"], help="where to run")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--quantization", default=None, choices=sorted(QUANTIZATIONS),
                   help="target weights: fp8 = e4m3 per output channel, fp8-block = e4m3 "
                        "per 128 x 128 block (an FP8 checkpoint's layout, experts included)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: the KV cache in e4m3 (scale 1.0: random weights); the floor "
                        "counts its one byte a value")
    p.add_argument("--draft-dtype", default="auto",
                   choices=["auto", "bfloat16", "float16", "float32", "fp8"],
                   help="the head's weights (MTP: auto or fp8); fp8: e4m3 per output channel")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers generate on the same shape")
    p.add_argument("--hf-runs", default="static:1,dynamic:32",
                   help="transformers runs as cache:batch (cache = static | dynamic)")
    p.add_argument("--trees", default="",
                   help="dynamic trees DEPTHxTOPKxNODES, comma-separated (e.g. 6x4x32): rows "
                        "at each --acceptance value up to DEPTH+1 (the forced path length)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="the engine's attention backend (auto: triton on CUDA, where steps "
                        "replay CUDA graphs, trees included; torch on the CPU)")
    p.add_argument("--overlap-scheduler", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each graphed step before the previous one is read (engine)")
    p.add_argument("--sa-enhancer", type=int, default=None, metavar="N",
                   help="speculative engines with the suffix-automaton enhancer (min match N): "
                        "its host cost, and graph steps no longer chained")
    p.add_argument("--mtp-index-share", action=argparse.BooleanOptionalAction, default=True,
                   help="sparse-attention MTP shapes (deepseek-v3.2): draft steps after the "
                        "first reuse its indexer selection (off: each step selects anew)")
    p.add_argument("--parallel-drafting", type=int, default=None, metavar="LAYERS",
                   help="speculative engines draft with a random P-EAGLE head of LAYERS layers "
                        "(one head forward a step, trained depth = the largest K)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    try:
        args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
        ks = [k.strip() for k in args.ks.split(",")]
        args.auto = AUTO_DRAFT_LEN in ks
        args.ks = sorted({0} | {int(k) for k in ks if k != AUTO_DRAFT_LEN})
        args.acceptance_rates = None if args.acceptance_rates is None else \
            tuple(float(a) for a in args.acceptance_rates.split(","))
    except ValueError as e:
        p.error(f"--batch-sizes, --ks (integers or 'auto') and --acceptance-rates: {e}")
    args.acceptance = [a.strip() for a in args.acceptance.split(",")]
    args.hf_runs = [(c, int(b)) for c, b in (r.split(":") for r in args.hf_runs.split(","))]
    try:
        args.trees = [tuple(int(x) for x in t.split("x")) for t in args.trees.split(",") if t]
    except ValueError:
        p.error(f"--trees must be DEPTHxTOPKxNODES items, got {args.trees!r}")
    if any(len(t) != 3 for t in args.trees):
        p.error(f"--trees must be DEPTHxTOPKxNODES items, got {args.trees!r}")
    if min(args.batch_sizes) < 1 or min(args.ks) < 0 or args.gen_len < 1 \
            or args.prompt_len < 1 or args.warmup_steps < 0 or args.trials < 1:
        p.error("batch sizes, --gen-len, --prompt-len and --trials must be >= 1; "
                "K, warm-up >= 0")
    rates = args.acceptance_rates
    if rates is not None and (len(rates) < auto_max_draft_len(args.ks)
                              or not all(0.0 <= a <= 1.0 for a in rates)):
        p.error(f"--acceptance-rates needs one rate in [0, 1] per draft position up to "
                f"K = {auto_max_draft_len(args.ks)}, got {args.acceptance_rates}")
    if args.parallel_drafting is not None and args.parallel_drafting < 1:
        p.error(f"--parallel-drafting (head layers) must be >= 1, got {args.parallel_drafting}")
    bad = [c for c, _ in args.hf_runs if c not in ("static", "dynamic")]
    if bad:
        p.error(f"--hf-runs caches must be static or dynamic, got {bad}")
    if args.plot:
        from onespec.bench.plot import check_matplotlib
        check_matplotlib(p.error)
    return args


def auto_max_draft_len(ks: list[int]) -> int:
    return max(ks) or AUTO_MAX_DRAFT_LEN


def spec_configs(ks: list[int], acceptance: list[str]) -> list[tuple[int, float]]:
    """(K, forced acceptance) pairs to run with a head: a in [1, K+1], duplicates dropped.
    [3], ['1.0', '3.0', 'max'] -> [(3, 1.0), (3, 3.0), (3, 4.0)]."""
    out = []
    for k in ks:
        if k == 0:
            continue
        values = [float(k + 1) if a == MAX_ACCEPTANCE else float(a) for a in acceptance]
        out += [(k, a) for a in sorted(set(values)) if 1.0 <= a <= k + 1]
    return out


# ---- onespec -------------------------------------------------------------------------------
@dataclass
class Draft:
    """What one measured configuration drafts: K (or "auto") and the forced acceptance,
    as tokens per step or as per-position rates."""
    k: int | str
    acceptance: float | None           # forced tokens per step (None: auto at rates)
    rates: tuple[float, ...] | None = None

    @property
    def tokens_per_step(self) -> float:
        """For the step count and the request budget: E[tokens] (auto: assume 1)."""
        if self.k == AUTO_DRAFT_LEN:
            return self.acceptance or 1.0
        return self.acceptance if self.rates is None else expected_tokens(self.rates, self.k)


def draft_configs(args) -> tuple[list[Draft], list[Draft]]:
    """(the fixed-K drafts, the auto drafts) that --ks, --acceptance and
    --acceptance-rates ask for."""
    rates, k_auto = args.acceptance_rates, auto_max_draft_len(args.ks)
    if rates is not None:
        fixed = [Draft(k, expected_tokens(rates, k), rates) for k in args.ks if k]
        auto = [Draft(AUTO_DRAFT_LEN, None, rates)]
    else:
        fixed = [Draft(k, a) for k, a in spec_configs(args.ks, args.acceptance)]
        auto = [Draft(AUTO_DRAFT_LEN, a) for _, a in spec_configs([k_auto], args.acceptance)]
    return fixed, auto if args.auto else []


@dataclass
class Measurement:
    step_ms: float             # median of the trials
    step_ms_trials: list[float]
    acceptance_length: float
    kv_tokens: float           # keys read per target layer per step, summed over the batch
    num_steps: int
    k_histogram: dict[int, int] = field(default_factory=dict)   # timed steps at each K


def build_llm(target_dir, head_dir, k_max: int, args, max_tokens: int, auto: bool = False,
              tree=None):
    """tree: (depth, top-k, nodes) of a dynamic tree of depth k_max, or None (chains)."""
    from onespec import LLM, Eagle3Config, MTPConfig
    max_model_len = args.prompt_len + max_tokens + 2 * k_max + 2
    block_size = 16
    shape = TreeShape(*tree) if tree else ChainShape()
    blocks_per_seq = -(-(max_model_len + shape.gen_slots(k_max)) // block_size)
    batch = max(args.batch_sizes)
    rates = None if tree else getattr(args, "acceptance_rates", None)
    forced = dict(force_acceptance_length=None if rates else 1.0, force_acceptance_rates=rates,
                  draft_len_schedule=AUTO_DRAFT_LEN if auto else None)
    spec = None
    sa = getattr(args, "sa_enhancer", None)
    sa = dict(use_sa_enhancer=True, sa_min_match_len=sa) if sa else {}
    draft = dict(draft_dtype=getattr(args, "draft_dtype", "auto"))
    if k_max and head_dir is None:
        spec = MTPConfig(num_nextn_predict_layers=k_max, **forced, **sa, **draft,
                         use_index_share=getattr(args, "mtp_index_share", True))
    elif k_max:
        trees = dict(use_dynamic_tree=True, dynamic_tree_max_topK=tree[1],
                     max_total_draft_tokens=tree[2]) if tree else {}
        parallel = dict(parallel_drafting=True) if getattr(args, "parallel_drafting", None) \
            else {}
        spec = Eagle3Config(head_dir, max_draft_len=k_max, **forced, **sa, **trees, **draft,
                            **parallel)
    quantization = "fp8" if getattr(args, "quantization", None) == "fp8" else None
    return LLM(target_dir, speculative_config=spec, load_format="dummy", dtype=args.dtype,
               quantization=quantization,
               kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
               device=args.device, max_batch_size=batch, max_model_len=max_model_len,
               max_num_tokens=max(MIN_STEP_TOKENS, batch * shape.verify_rows(k_max)),
               block_size=block_size, num_kv_blocks=batch * blocks_per_seq + 1, seed=args.seed,
               attention_backend=getattr(args, "attention_backend", "auto"),
               overlap_scheduler=getattr(args, "overlap_scheduler", True))


def set_draft(engine, k: int | str, acceptance: float | None, rates=None):
    """Runs every following step with draft length k (or the engine's auto policy) and
    forced acceptance on an engine built with max_draft_len >= k (one engine serves every K)."""
    if k != AUTO_DRAFT_LEN:
        engine.set_draft_len(k)
    if engine.drafter is not None:
        engine.set_forced_acceptance(None if rates else acceptance, rates)


def num_timed_steps(gen_len: int, acceptance: float) -> int:
    return max(1, math.ceil(gen_len / acceptance))


def request_budget(args, k: int, acceptance: float) -> int:
    """max_tokens that no request reaches before timing ends: at most K+1 tokens a step over
    the prefill steps (which may already decode early requests), warm-up and every trial's
    timed steps."""
    prefill_steps = -(-max(args.batch_sizes) * args.prompt_len // MIN_STEP_TOKENS) + 1
    steps = prefill_steps + max(args.warmup_steps, AUTO_WARMUP_STEPS) + \
        args.trials * num_timed_steps(args.gen_len, acceptance)
    return 2 + steps * (k + 1)


def measure_decode(llm, batch: int, draft: Draft, args, **sampling) -> Measurement:
    """Prefill (untimed), warm-up steps, then `trials` runs of timed decode steps with no
    prefill chunk in them; every request stays running throughout. Requests are aborted at
    the end. `sampling`: further SamplingParams fields of every request."""
    from onespec import SamplingParams
    eng = llm.engine
    set_draft(eng, draft.k, draft.acceptance, draft.rates)
    auto = draft.k == AUTO_DRAFT_LEN
    gen = torch.Generator().manual_seed(args.seed + batch)
    vocab = eng.model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=gen).tolist()
    k_max = eng.max_draft_len if auto else draft.k
    sp = SamplingParams(max_tokens=request_budget(args, k_max, draft.tokens_per_step),
                        ignore_eos=True, **sampling)
    reqs = [eng.add_request(p, sp) for p in prompts]
    try:
        while any(r.in_context for r in reqs):
            eng.step()
        for _ in range(max(args.warmup_steps, AUTO_WARMUP_STEPS) if auto else args.warmup_steps):
            eng.step()
        steps = num_timed_steps(args.gen_len, draft.tokens_per_step)
        tokens0 = sum(r.metrics.num_generated_tokens for r in reqs)
        target0 = sum(r.metrics.target_steps for r in reqs)
        ks0 = dict(eng.stats.steps_by_k)
        context = 0
        trials = []
        for _ in range(args.trials):
            sync(args.device)
            t0 = time.perf_counter()
            for _ in range(steps):
                context += sum(r.num_computed for r in reqs)
                eng.step()
            sync(args.device)
            trials.append(1e3 * (time.perf_counter() - t0) / steps)
        timed = steps * args.trials
        tokens = sum(r.metrics.num_generated_tokens for r in reqs) - tokens0
        target_steps = sum(r.metrics.target_steps for r in reqs) - target0
        if any(r.is_finished for r in reqs) or target_steps != batch * timed:
            raise RuntimeError("not every request decoded in every timed step")
    finally:
        for r in reqs:
            eng.abort(r.request_id)
    hist = {k: n - ks0.get(k, 0) for k, n in eng.stats.steps_by_k.items() if n > ks0.get(k, 0)}
    mean_k = sum(k * n for k, n in hist.items()) / max(1, sum(hist.values()))
    return Measurement(statistics.median(trials), trials, tokens / target_steps,
                       context / timed + batch * (mean_k + 1), timed, hist)


def onespec_row(llm, batch, draft: Draft, m: Measurement, bandwidth: float
                ) -> tuple[dict, dict]:
    """The JSON row; a K-weighted floor for auto (each K's bytes times its share of steps)."""
    eng = llm.engine
    shares = {k: n / sum(m.k_histogram.values()) for k, n in m.k_histogram.items()} \
        if draft.k == AUTO_DRAFT_LEN else {draft.k: 1.0}
    mean_k = sum(k * w for k, w in shares.items())
    context = m.kv_tokens - batch * (mean_k + 1)
    parts = {"target": 0.0, "head": 0.0, "kv": 0.0, "state": 0.0}
    for k, w in shares.items():
        for name, b in step_floor_parts(eng, batch, k, context + batch * (k + 1)).items():
            parts[name] += w * b
    floor_ms = 1e3 * sum(parts.values()) / bandwidth
    tok_s = batch * m.acceptance_length / m.step_ms * 1e3
    row = {"k": draft.k, "forced_acceptance_length": draft.acceptance,
           "acceptance_length": m.acceptance_length, "tok_s": tok_s, "step_ms": m.step_ms,
           "step_ms_trials": m.step_ms_trials,
           "floor_ms": floor_ms, "hbm_fraction": floor_ms / m.step_ms,
           "baseline": "onespec-plain", "engine": "onespec",
           "overlap_scheduler": eng.config.overlap_scheduler,
           "sa_enhancer": eng.spec_config.sa_min_match_len
           if getattr(eng.spec_config, "use_sa_enhancer", False) else None,
           "context_len": context / batch}
    if draft.rates is not None:
        row["forced_acceptance_rates"] = list(draft.rates[:eng.max_draft_len])
    if draft.k == AUTO_DRAFT_LEN:
        row["k_histogram"] = {str(k): n for k, n in sorted(m.k_histogram.items())}
        row["mean_k"] = mean_k
    if eng.tree is not None:            # a tree's K is its depth; it verifies `nodes` drafts
        row.update(tree=f"{eng.tree.depth}x{eng.tree.top_k}x{eng.tree.num_nodes}",
                   nodes=eng.tree.num_nodes)
    return row, {name: 1e3 * b / bandwidth for name, b in parts.items()}


# ---- the run -------------------------------------------------------------------------------
def _significant(x, digits: int = 5):
    if isinstance(x, list):
        return [_significant(v, digits) for v in x]
    return float(f"{x:.{digits}g}") if isinstance(x, float) else x


def make_emitter(args, model_label: str, device_name: str, rows: list | None = None):
    """emit(row): one JSON line to stdout (and --out); `rows` collects what was emitted."""
    head = {"bench": args.which, "model": model_label, "weights": "random", "dtype": args.dtype,
            "quantization": getattr(args, "quantization", None),
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
            "draft_dtype": getattr(args, "draft_dtype", "auto")}
    shape = getattr(args, "shape", None)
    if shape is not None and "index_n_heads" in target_config(shape):   # the A/B's arm
        head["mtp_index_share"] = getattr(args, "mtp_index_share", True)
    if getattr(args, "parallel_drafting", None):
        head["parallel_drafting_layers"] = args.parallel_drafting

    def emit(row: dict):
        row = {k: _significant(v) for k, v in {**head, **row, "device": device_name}.items()}
        if rows is not None:
            rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return emit


def run_onespec_configs(llm, configs, args, bandwidth, emit, plain, hf_best):
    """Measures each (batch, Draft); plain (K=0) results fill `plain` {batch: row}."""
    for batch, d in tqdm(configs, desc=f"onespec K<={llm.engine.max_draft_len}",
                         file=sys.stderr, disable=None):
        try:
            m = measure_decode(llm, batch, d, args)
            row, floors = onespec_row(llm, batch, d, m, bandwidth)
        except Exception as e:                      # noqa: BLE001 - reported, not fatal
            emit({"batch": batch, "k": d.k, "forced_acceptance_length": d.acceptance,
                  "engine": "onespec", "error": repr(e)})
            release_memory(args.device)
            continue
        base = plain.get(batch)
        row["speedup"] = 1.0 if d.k == 0 else (row["tok_s"] / base["tok_s"] if base else None)
        if batch in hf_best:
            row["speedup_vs_hf"] = row["tok_s"] / hf_best[batch]
        emit({"batch": batch, **row})
        if d.k == 0:
            plain[batch] = row
        elif base:
            a = f"{d.acceptance:g}" if d.acceptance is not None else f"{m.acceptance_length:.2f}"
            tqdm.write(f"[b={batch} K={d.k} a={a}] speedup "
                       f"{row['speedup']:.2f}x (tok/s vs plain); step {m.step_ms:.2f} ms vs "
                       f"plain {base['step_ms']:.2f} ms; floor {row['floor_ms']:.2f} ms = target "
                       f"{floors['target']:.2f} + head {floors['head']:.2f} + kv "
                       f"{floors['kv']:.2f} + state {floors['state']:.2f}", file=sys.stderr)


def run_onespec(args, bandwidth: float, emit, hf_best: dict[int, float]):
    """Plain engine over every batch size first, then one engine with the head for every
    fixed K, then one with draft_len_schedule='auto' (its step-time table measured when it
    starts, as in serving)."""
    plain: dict[int, dict] = {}
    fixed, auto = draft_configs(args)
    with tempfile.TemporaryDirectory(prefix="onespec-bench-") as root:
        target_dir, head_dir = write_model_dirs(args.shape, root, args.parallel_drafting,
                                                auto_max_draft_len(args.ks))
        declare_quantization(target_dir, args.quantization)

        def per_batch(drafts):
            return [(b, d) for b in args.batch_sizes for d in drafts]
        phases = [(0, False, per_batch([Draft(0, 1.0)]), None)]
        if fixed:
            phases.append((max(d.k for d in fixed), False, per_batch(fixed), None))
        if auto:
            phases.append((auto_max_draft_len(args.ks), True, per_batch(auto), None))
        for tree in args.trees if head_dir else []:     # one engine per tree shape
            phases.append((tree[0], False, per_batch(
                [Draft(k, a) for k, a in spec_configs([tree[0]], args.acceptance)]), tree))
        for k_max, is_auto, configs, tree in phases:
            budget = max(request_budget(args, k_max, d.tokens_per_step) for _, d in configs)
            try:
                llm = build_llm(target_dir, head_dir, k_max, args, budget, auto=is_auto,
                                tree=tree)
            except Exception as e:                  # noqa: BLE001 - reported, not fatal
                emit({"engine": "onespec", "k": AUTO_DRAFT_LEN if is_auto else k_max,
                      "error": repr(e)})
                continue
            run_onespec_configs(llm, configs, args, bandwidth, emit, plain, hf_best)
            del llm
            release_memory(args.device)


def declare_quantization(target_dir: str, quantization: str | None):
    """Writes --quantization's quantization_config (if it has one) into the target's
    config.json: random weights then load in that FP8 layout."""
    declared = QUANTIZATIONS.get(quantization) if quantization else None
    if declared is None:
        return
    file = os.path.join(target_dir, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = declared
    with open(file, "w") as f:
        json.dump(cfg, f, indent=2)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("onespec bench: error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    if args.shape is None:
        args.shape, why = default_shape(args.device, getattr(torch, args.dtype))
        print(f"[{why}]", file=sys.stderr)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    label = shape_label(args.shape)
    rows: list[dict] = []
    emit = make_emitter(args, label, device_name, rows)
    start = time.perf_counter()
    bandwidth = copy_bandwidth(args.device)
    print(f"[{label} on {device_name}, {args.dtype}] copy bandwidth {bandwidth / 1e9:.1f} GB/s",
          file=sys.stderr)
    hf_best = run_hf(args, bandwidth, emit) if args.hf else {}
    run_onespec(args, bandwidth, emit, hf_best)
    if args.plot:
        from onespec.bench.plot import plot_throughput
        plot_throughput(rows, args.plot, f"{label} on {device_name}, {args.dtype}")
        print(f"[plot written to {args.plot}]", file=sys.stderr)
    print(f"[bench done in {time.perf_counter() - start:.1f} s]", file=sys.stderr)
    failed = [row for row in rows if "error" in row]
    if failed:
        print(f"onespec bench: error: {len(failed)} of {len(rows)} configurations failed "
              f"(their JSON lines carry \"error\"); the first: {failed[0]['error']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

