"""`onespec bench [decode]`: decode-phase throughput of a random-weight target, plain and with
a one-model EAGLE-3 head at forced acceptance lengths, against a memory-bandwidth floor and
Hugging Face transformers `generate`, all in one run.

One JSON object per measured configuration goes to stdout; progress and a per-config
breakdown go to stderr. speedup (both places) = tok/s with the head / plain tok/s at the
same batch size. `bench/decode.py` runs the same code from a checkout.

The default matrix (4 batch sizes x K in 0,3,5 x 4 acceptance lengths, 3 trials each, and
transformers) takes minutes even with --shape tiny. A short run, in seconds on a CPU:
  onespec bench --shape tiny --device cpu --batch-sizes 1 --ks 3 --acceptance max \\
      --gen-len 16 --trials 1 --no-hf
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from onespec.engine.kv_cache import slots_per_step
from onespec.bench_moe import (MTP_SHAPES, hf_weight_bytes, is_moe, moe_step_bytes,
                               mtp_target_config)
from onespec.speculative.mtp import MTPDrafter

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# name -> (model label, target config.json, head layer shape + draft vocabulary)
SHAPES = {
    "llama3-8b": ("llama3-8b-shape",
                  dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
                  dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, draft_vocab_size=32000)),
    "tiny": ("tiny-shape",
             dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000),
             dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, draft_vocab_size=500)),
}
COMMON = dict(rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
              max_position_embeddings=131072, tie_word_embeddings=False)
MAX_ACCEPTANCE = "max"           # --acceptance item meaning K + 1 (every draft accepted)
COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}
MIN_STEP_TOKENS = 2048         # engine max_num_tokens (prefill chunk budget) at least


def shape_label(shape: str) -> str:
    return MTP_SHAPES[shape][0] if shape in MTP_SHAPES else SHAPES[shape][0]


def parse_args(argv):
    from onespec.cli import Parser
    p = Parser(prog="onespec bench", description=__doc__)
    p.add_argument("which", nargs="?", default="decode", choices=["decode"],
                   help="the benchmark")
    p.add_argument("--batch-sizes", default="1,8,32,64", help="concurrent requests")
    p.add_argument("--ks", default="0,3,5", help="draft lengths; 0 (plain) always runs")
    p.add_argument("--acceptance", default="1.0,2.0,3.0,max",
                   help="forced tokens per step; 'max' = K+1")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--gen-len", type=int, default=128,
                   help="tokens per request in the timed decode phase")
    p.add_argument("--warmup-steps", type=int, default=5, help="untimed steps first")
    p.add_argument("--trials", type=int, default=3,
                   help="timed runs of --gen-len tokens per onespec configuration; step_ms "
                        "is their median (each run's in step_ms_trials); transformers: one")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES) + sorted(MTP_SHAPES),
                   help="MLA + MoE shapes (%s) draft with their MTP layer" % ", ".join(MTP_SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cuda", "cpu"], help="where to run")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers generate on the same shape")
    p.add_argument("--hf-runs", default="static:1,dynamic:32",
                   help="transformers runs as cache:batch (cache = static | dynamic)")
    p.add_argument("--overlap-scheduler", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each graphed step before the previous one is read (engine)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    args.ks = sorted({0} | {int(k) for k in args.ks.split(",")})
    args.acceptance = [a.strip() for a in args.acceptance.split(",")]
    args.hf_runs = [(c, int(b)) for c, b in (r.split(":") for r in args.hf_runs.split(","))]
    if min(args.batch_sizes) < 1 or min(args.ks) < 0 or args.gen_len < 1 \
            or args.prompt_len < 1 or args.warmup_steps < 0 or args.trials < 1:
        p.error("batch sizes, --gen-len, --prompt-len and --trials must be >= 1; "
                "K, warm-up >= 0")
    bad = [c for c, _ in args.hf_runs if c not in ("static", "dynamic")]
    if bad:
        p.error(f"--hf-runs caches must be static or dynamic, got {bad}")
    return args


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


# ---- models and bandwidth ------------------------------------------------------------------
def target_config(shape: str) -> dict:
    if shape in MTP_SHAPES:
        return mtp_target_config(shape)
    _, target, _ = SHAPES[shape]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **target, **COMMON,
            "head_dim": target["hidden_size"] // target["num_attention_heads"],
            "bos_token_id": 1, "eos_token_id": 2}


def write_model_dirs(shape: str, root: str) -> tuple[str, str]:
    """config.json files for load_format='dummy': the target and a SafeAILab-style head
    (None for the MTP shapes: their drafter is the target's own MTP layer)."""
    if shape in MTP_SHAPES:
        path = os.path.join(root, "target")
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(target_config(shape), f, indent=2)
        return path, None
    _, target, head = SHAPES[shape]
    head_cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **head,
                "num_hidden_layers": 1, "vocab_size": target["vocab_size"],
                "target_hidden_size": target["hidden_size"], **COMMON}
    dirs = []
    for name, cfg in (("target", target_config(shape)), ("head", head_cfg)):
        path = os.path.join(root, name)
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        dirs.append(path)
    return dirs[0], dirs[1]


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, reps: int = 10, trials: int = 5) -> float:
    """Bytes/s of a large device-to-device copy_ (bytes read + written), best of `trials`."""
    n = COPY_BYTES[device]
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(trials):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds / reps)
    del src, dst
    return 2 * n / best


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def kv_bytes_per_token(attn_layers) -> int:
    return sum(a.cache_bytes_per_token() if hasattr(a, "cache_bytes_per_token") else
               2 * a.num_kv_heads * a.head_dim * a.k_cache.element_size() for a in attn_layers)


def step_bytes(model, head, batch: int, k: int, kv_tokens: float,
               target_kv_per_token: int, head_kv_per_token: int) -> dict[str, float]:
    """Bytes one decode step must move. Target: every weight once but the embedding table
    (one row per input token), plus its KV of `kv_tokens` keys summed over the batch. Head
    (K > 0): fc once, its layer, norm and lm_head once per draft pass (K passes: step 0 and
    K-1 single-token steps), its KV per pass."""
    embed = model.model.embed_tokens.weight
    rows = batch * (k + 1) * embed.shape[1] * embed.element_size()
    weights = _nbytes(p for p in model.parameters() if p is not embed)
    if model.lm_head.weight is embed:          # tied: the table is read whole as the lm_head
        weights += _nbytes([embed])
    out = {"target": weights + rows, "head": 0.0, "kv": kv_tokens * target_kv_per_token}
    if head is not None and k > 0:
        per_pass = _nbytes(p for n, p in head.named_parameters() if not n.startswith("fc."))
        out["head"] = _nbytes(head.fc.parameters()) + k * per_pass
        out["kv"] += k * kv_tokens * head_kv_per_token
    return out


def release_memory(device: str):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---- onespec -------------------------------------------------------------------------------
@dataclass
class Measurement:
    step_ms: float             # median of the trials
    step_ms_trials: list[float]
    acceptance_length: float
    kv_tokens: float           # keys read per target layer per step, summed over the batch
    num_steps: int


def build_llm(target_dir, head_dir, k_max: int, args, max_tokens: int):
    from onespec import LLM, Eagle3Config, MTPConfig
    max_model_len = args.prompt_len + max_tokens + 2 * k_max + 2
    block_size = 16
    blocks_per_seq = -(-(max_model_len + slots_per_step(k_max)) // block_size)
    batch = max(args.batch_sizes)
    spec = None
    if k_max and head_dir is None:
        spec = MTPConfig(num_nextn_predict_layers=k_max, force_acceptance_length=1.0)
    elif k_max:
        spec = Eagle3Config(head_dir, max_draft_len=k_max, force_acceptance_length=1.0)
    return LLM(target_dir, speculative_config=spec, load_format="dummy", dtype=args.dtype,
               device=args.device, max_batch_size=batch, max_model_len=max_model_len,
               max_num_tokens=max(MIN_STEP_TOKENS, batch * (k_max + 1)), block_size=block_size,
               num_kv_blocks=batch * blocks_per_seq + 1, seed=args.seed,
               overlap_scheduler=getattr(args, "overlap_scheduler", True))


def set_draft(engine, k: int, acceptance: float):
    """Runs every following step with draft length k and forced acceptance on an engine
    built with max_draft_len >= k (one engine serves every K)."""
    engine.draft_len_fn = lambda num_requests: k
    if engine.drafter is not None:
        engine.runner.worker.force_acceptance_length = acceptance


def num_timed_steps(gen_len: int, acceptance: float) -> int:
    return max(1, math.ceil(gen_len / acceptance))


def request_budget(args, k: int, acceptance: float) -> int:
    """max_tokens that no request reaches before timing ends: at most K+1 tokens a step over
    the prefill steps (which may already decode early requests), warm-up and every trial's
    timed steps."""
    prefill_steps = -(-max(args.batch_sizes) * args.prompt_len // MIN_STEP_TOKENS) + 1
    steps = prefill_steps + args.warmup_steps + \
        args.trials * num_timed_steps(args.gen_len, acceptance)
    return 2 + steps * (k + 1)


def measure_decode(llm, batch: int, k: int, acceptance: float, args,
                   **sampling) -> Measurement:
    """Prefill (untimed), warm-up steps, then `trials` runs of timed decode steps with no
    prefill chunk in them; every request stays running throughout. Requests are aborted at
    the end. `sampling`: further SamplingParams fields of every request."""
    from onespec import SamplingParams
    eng = llm.engine
    set_draft(eng, k, acceptance)
    gen = torch.Generator().manual_seed(args.seed + batch)
    vocab = eng.model.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=gen).tolist()
    sp = SamplingParams(max_tokens=request_budget(args, k, acceptance), ignore_eos=True,
                        **sampling)
    reqs = [eng.add_request(p, sp) for p in prompts]
    try:
        while any(r.in_context for r in reqs):
            eng.step()
        for _ in range(args.warmup_steps):
            eng.step()
        steps = num_timed_steps(args.gen_len, acceptance)
        tokens0 = sum(r.metrics.num_generated_tokens for r in reqs)
        target0 = sum(r.metrics.target_steps for r in reqs)
        kv_tokens = 0
        trials = []
        for _ in range(args.trials):
            sync(args.device)
            t0 = time.perf_counter()
            for _ in range(steps):
                kv_tokens += sum(r.num_computed for r in reqs) + batch * (k + 1)
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
    return Measurement(statistics.median(trials), trials, tokens / target_steps,
                       kv_tokens / timed, timed)


def onespec_row(llm, batch, k, acceptance, m: Measurement, bandwidth: float) -> tuple[dict, dict]:
    eng = llm.engine
    head = eng.drafter.head if eng.drafter is not None else None
    target_kv = kv_bytes_per_token([layer.self_attn for layer in eng.model.model.layers])
    head_kv = kv_bytes_per_token(eng.drafter.attention_layers) if head is not None else 0
    if isinstance(eng.drafter, MTPDrafter) or is_moe(eng.model):
        parts = moe_step_bytes(eng.model, eng.drafter, batch, k, m.kv_tokens, target_kv,
                               head_kv)
    else:
        parts = step_bytes(eng.model, head, batch, k, m.kv_tokens, target_kv, head_kv)
    floor_ms = 1e3 * sum(parts.values()) / bandwidth
    tok_s = batch * m.acceptance_length / m.step_ms * 1e3
    row = {"k": k, "forced_acceptance_length": acceptance,
           "acceptance_length": m.acceptance_length, "tok_s": tok_s, "step_ms": m.step_ms,
           "step_ms_trials": m.step_ms_trials,
           "floor_ms": floor_ms, "hbm_fraction": floor_ms / m.step_ms,
           "baseline": "onespec-plain", "engine": "onespec",
           "overlap_scheduler": eng.config.overlap_scheduler,
           "context_len": m.kv_tokens / batch}
    return row, {name: 1e3 * b / bandwidth for name, b in parts.items()}


# ---- transformers baseline -----------------------------------------------------------------
def hf_row(model, cache: str, batch: int, args, bandwidth: float) -> dict:
    from onespec.bench_hf import time_decode
    gen = torch.Generator().manual_seed(args.seed + batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=gen)
    step_ms, steps, warmup_s = time_decode(model, ids.to(args.device), args.gen_len, cache)
    c = model.config
    itemsize = next(model.parameters()).element_size()
    kv_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * itemsize
    if getattr(c, "kv_lora_rank", None):         # MLA: transformers caches the latent
        kv_per_token = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * itemsize
    kv_tokens = batch * (args.prompt_len + (steps + 1) / 2)      # keys read, mean over steps
    embed = model.model.embed_tokens.weight
    weights = hf_weight_bytes(model, batch) + batch * embed.shape[1] * embed.element_size()
    floor_ms = 1e3 * (weights + kv_tokens * kv_per_token) / bandwidth
    return {"k": 0, "forced_acceptance_length": 1.0, "acceptance_length": 1.0,
            "tok_s": batch / step_ms * 1e3, "step_ms": step_ms, "floor_ms": floor_ms,
            "hbm_fraction": floor_ms / step_ms, "baseline": "hf-transformers", "speedup": 1.0,
            "engine": "hf-transformers", "cache": cache, "context_len": kv_tokens / batch,
            "warmup_s": warmup_s}


def run_hf(args, bandwidth: float, emit) -> dict[int, float]:
    """Times every --hf-runs entry; returns the best transformers tok/s per batch."""
    best: dict[int, float] = {}
    try:
        from onespec.bench_hf import build_hf_model
        model = build_hf_model(target_config(args.shape), args.device, getattr(torch, args.dtype))
    except Exception as e:                          # noqa: BLE001 - reported, not fatal
        emit({"engine": "hf-transformers", "baseline": "hf-transformers", "error": repr(e)})
        return best
    for cache, batch in tqdm(args.hf_runs, desc="transformers generate", file=sys.stderr,
                             disable=None):
        try:
            row = hf_row(model, cache, batch, args, bandwidth)
            best[batch] = max(best.get(batch, 0.0), row["tok_s"])
            emit({"batch": batch, **row})
        except Exception as e:                      # noqa: BLE001 - reported, not fatal
            emit({"batch": batch, "engine": "hf-transformers", "baseline": "hf-transformers",
                  "cache": cache, "error": repr(e)})
    del model
    try:
        torch._dynamo.reset()                       # compiled graphs hold the weights
    except Exception:                               # noqa: BLE001
        pass
    release_memory(args.device)
    return best


# ---- the run -------------------------------------------------------------------------------
def _significant(x, digits: int = 5):
    if isinstance(x, list):
        return [_significant(v, digits) for v in x]
    return float(f"{x:.{digits}g}") if isinstance(x, float) else x


def make_emitter(args, model_label: str, device_name: str):
    head = {"bench": args.which, "model": model_label, "weights": "random", "dtype": args.dtype}

    def emit(row: dict):
        line = json.dumps({k: _significant(v) for k, v in
                           {**head, **row, "device": device_name}.items()})
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    return emit


def run_onespec_configs(llm, configs, args, bandwidth, emit, plain, hf_best):
    """Measures each (batch, K, a); plain (K=0) results fill `plain` {batch: row}."""
    for batch, k, a in tqdm(configs, desc=f"onespec K<={max(c[1] for c in configs)}",
                            file=sys.stderr, disable=None):
        try:
            m = measure_decode(llm, batch, k, a, args)
            row, floors = onespec_row(llm, batch, k, a, m, bandwidth)
        except Exception as e:                      # noqa: BLE001 - reported, not fatal
            emit({"batch": batch, "k": k, "forced_acceptance_length": a,
                  "engine": "onespec", "error": repr(e)})
            release_memory(args.device)
            continue
        base = plain.get(batch)
        row["speedup"] = 1.0 if k == 0 else (row["tok_s"] / base["tok_s"] if base else None)
        if batch in hf_best:
            row["speedup_vs_hf"] = row["tok_s"] / hf_best[batch]
        emit({"batch": batch, **row})
        if k == 0:
            plain[batch] = row
        elif base:
            tqdm.write(f"[b={batch} K={k} a={a:g}] speedup {row['speedup']:.2f}x (tok/s vs "
                       f"plain); step {m.step_ms:.2f} ms vs plain {base['step_ms']:.2f} ms; "
                       f"floor {row['floor_ms']:.2f} ms = target {floors['target']:.2f} + head "
                       f"{floors['head']:.2f} + kv {floors['kv']:.2f}", file=sys.stderr)


def run_onespec(args, bandwidth: float, emit, hf_best: dict[int, float]):
    """Plain engine over every batch size first, then one engine with the head for all K."""
    plain: dict[int, dict] = {}
    spec = spec_configs(args.ks, args.acceptance)
    with tempfile.TemporaryDirectory(prefix="onespec-bench-") as root:
        target_dir, head_dir = write_model_dirs(args.shape, root)
        phases = [(0, [(b, 0, 1.0) for b in args.batch_sizes])]
        if spec:
            phases.append((max(k for k, _ in spec),
                           [(b, k, a) for b in args.batch_sizes for k, a in spec]))
        for k_max, configs in phases:
            budget = max(request_budget(args, k, a) for _, k, a in configs)
            try:
                llm = build_llm(target_dir, head_dir, k_max, args, budget)
            except Exception as e:                  # noqa: BLE001 - reported, not fatal
                emit({"engine": "onespec", "k": k_max, "error": repr(e)})
                continue
            run_onespec_configs(llm, configs, args, bandwidth, emit, plain, hf_best)
            del llm
            release_memory(args.device)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("onespec bench: error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    label = shape_label(args.shape)
    emit = make_emitter(args, label, device_name)
    start = time.perf_counter()
    bandwidth = copy_bandwidth(args.device)
    print(f"[{label} on {device_name}, {args.dtype}] copy bandwidth {bandwidth / 1e9:.1f} GB/s",
          file=sys.stderr)
    hf_best = run_hf(args, bandwidth, emit) if args.hf else {}
    run_onespec(args, bandwidth, emit, hf_best)
    print(f"[bench done in {time.perf_counter() - start:.1f} s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
