"""The step-time table of the auto draft length (speculative/cost_model.py), measured on
this machine: timed generation steps of dummy requests through the engine's own step (CUDA
graphs and the overlap scheduler included), so the table holds what a step costs here and
not an estimate.

What is measured is what the configuration can reach: the batch-size buckets up to
max_batch_size, every K in 0..max_draft_len. Step time grows smoothly with the batch, so
the buckets measured are 1, each bucket at least MEASURE_RATIO times the last measured, and
max_batch_size; the ones between are interpolated linearly in the batch size. Each
measured bucket takes the Ks in turn for up to ROUNDS rounds, stopping after the round
that passes BUCKET_BUDGET_S (a large batch's step is long, and so less noisy).

The table is cached on disk (table_path), keyed by the model's and drafter's files, the
device, the dtype, the settings that change a step's cost and the code version, so a
second engine of the same configuration starts without measuring.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict

import torch
from tqdm.auto import tqdm

from onespec import __version__
from onespec.engine.cuda_graph import DEFAULT_BUCKETS
from onespec.sampling_params import SamplingParams
from onespec.speculative.cost_model import DraftLenPolicy

WARMUP_STEPS = 1          # untimed after each switch of K (its first step starts a chain)
TIMED_STEPS = 2           # timed steps per K and round
ROUNDS = 4                # rounds over every K at most: a load that comes and goes hits them alike
BUCKET_BUDGET_S = 1.5     # no round starts after a bucket has run this long
MEASURE_RATIO = 4         # measured buckets: 1, then each >= 4x the last, and the largest
PROMPT_LEN = 16
CALIBRATION_SEED = 1234   # dummy prompts' token ids
TABLE_FORMAT = 2          # bump when what is measured, or how, changes
CACHE_DIR_ENV = "ONESPEC_CACHE_DIR"
# settings that do not change what a step costs (left out of the cache key)
NOT_IN_KEY = {"model", "draft_model", "seed", "num_kv_blocks", "kv_cache_memory_fraction",
              "enable_prefix_caching", "acceptance_window", "acceptance_length_threshold",
              "max_num_tokens"}

logger = logging.getLogger("onespec.engine")


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes the table is keyed by: the CUDA-graph buckets up to max_batch_size."""
    return [b for b in DEFAULT_BUCKETS if b < max_batch_size] + [max_batch_size]


def measured_buckets(buckets: list[int]) -> list[int]:
    """The buckets timed: the first, each at least MEASURE_RATIO times the last one taken,
    and the last. [1, 2, 4, 8, 16, 24, 32, 48, 64] -> [1, 4, 16, 64]."""
    out = [buckets[0]]
    for b in buckets[1:-1]:
        if b >= MEASURE_RATIO * out[-1]:
            out.append(b)
    return out + [buckets[-1]] if buckets[-1] != out[-1] else out


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(engine) -> float:
    _sync(engine.device)
    t0 = time.perf_counter()
    engine.step()
    _sync(engine.device)
    return time.perf_counter() - t0


def time_bucket(engine, batch_size: int, max_draft_len: int, rounds: int = ROUNDS,
                budget_s: float = BUCKET_BUDGET_S, bar=None) -> dict[int, float] | None:
    """{K: median seconds of an engine step of `batch_size` generation requests} for K in
    0..max_draft_len, the Ks taken in turn for up to `rounds` rounds (none started after
    `budget_s` seconds); None if the pool or max_model_len cannot hold the requests
    throughout. The requests are aborted after."""
    ks = range(max_draft_len + 1)
    per_round = sum((k + 1) * (WARMUP_STEPS + TIMED_STEPS) for k in ks)
    prompt_len = min(PROMPT_LEN, engine.max_model_len // 4)
    room = engine.max_model_len - prompt_len - 2 * max_draft_len - 2
    rounds = min(rounds, room // per_round)
    if rounds < 1:
        return None
    gen = torch.Generator().manual_seed(CALIBRATION_SEED + batch_size)
    prompts = torch.randint(0, engine.model.config.vocab_size, (batch_size, prompt_len),
                            generator=gen).tolist()
    sp = SamplingParams(max_tokens=rounds * per_round + 1, ignore_eos=True)
    reqs = [engine.add_request(p, sp, request_id=f"calibration-{batch_size}-{i}")
            for i, p in enumerate(prompts)]
    samples: dict[int, list[float]] = {k: [] for k in ks}
    engine.set_draft_len(max_draft_len)     # the prefill steps
    try:
        while any(r.in_context for r in reqs) and not any(r.is_finished for r in reqs):
            engine.step()
        start = time.perf_counter()
        for i in range(rounds):
            if i and time.perf_counter() - start > budget_s:
                break
            for k in ks:
                engine.set_draft_len(k)
                for j in range(WARMUP_STEPS + TIMED_STEPS):
                    if engine.num_running() < batch_size or any(r.is_finished for r in reqs):
                        return None
                    seconds = _timed_step(engine)
                    if j >= WARMUP_STEPS:
                        samples[k].append(seconds)
            if bar is not None:
                bar.update(1)
    finally:
        for r in reqs:
            engine.abort(r.request_id)
    return {k: statistics.median(v) for k, v in samples.items()}


def interpolate(table: dict[tuple[int, int], float], buckets: list[int], max_draft_len: int
                ) -> dict[tuple[int, int], float]:
    """Fills every bucket from the measured ones: linear in the batch size between the two
    around it; below the first or above the last measured, that one's row."""
    measured = sorted({b for b, _ in table})
    out = dict(table)
    for b in buckets:
        if b in measured:
            continue
        lo = max((m for m in measured if m < b), default=measured[0])
        hi = min((m for m in measured if m > b), default=measured[-1])
        w = 0.0 if hi == lo else (b - lo) / (hi - lo)
        for k in range(max_draft_len + 1):
            out[(b, k)] = (1 - w) * table[(lo, k)] + w * table[(hi, k)]
    return out


def measure_step_times(engine, buckets: list[int], max_draft_len: int
                       ) -> dict[tuple[int, int], float]:
    """{(bucket, K): seconds} for every bucket and every K in 0..max_draft_len: the buckets
    of measured_buckets(buckets) whose requests fit the pool together are timed, the rest
    interpolated (interpolate)."""
    table: dict[tuple[int, int], float] = {}
    timed = measured_buckets(buckets)
    with tqdm(total=len(timed) * ROUNDS, desc="measuring step times (auto draft length)",
              leave=False, disable=None) as bar:        # None: shown on a terminal only
        time_bucket(engine, timed[0], max_draft_len, rounds=1)   # warm-up: first calls
        for b in timed:
            times = time_bucket(engine, b, max_draft_len, bar=bar)
            table.update({(b, k): t for k, t in (times or {}).items()})
            bar.n = bar.total * (timed.index(b) + 1) // len(timed)   # rounds cut short
            bar.refresh()
    engine.step()    # collects a step still in flight for aborted dummies (overlap), if any
    if not table:
        raise ValueError("draft_len_schedule='auto' could not time a single request's step: "
                         "the KV pool or max_model_len is too small for its dummy requests")
    return interpolate(table, buckets, max_draft_len)


# ---- the on-disk cache ---------------------------------------------------------------------
def cache_dir() -> str:
    """$ONESPEC_CACHE_DIR, else $XDG_CACHE_HOME/onespec, else ~/.cache/onespec."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "onespec")


def _files_fingerprint(path: str) -> list:
    """(name, size, mtime) of a model directory's config and weight files."""
    path = os.path.realpath(path)
    names = sorted(n for n in os.listdir(path)
                   if n == "config.json" or n.endswith((".safetensors", ".bin")))
    stats = [(n, os.stat(os.path.join(path, n))) for n in names]
    return [path] + [(n, s.st_size, s.st_mtime_ns) for n, s in stats]


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"


def _settings(obj) -> dict:
    return {k: v for k, v in sorted(asdict(obj).items()) if k not in NOT_IN_KEY}


def table_key(engine, buckets: list[int]) -> dict:
    """What the table depends on (a JSON-able dict)."""
    sc = engine.spec_config
    return {
        "format": TABLE_FORMAT, "onespec": __version__, "torch": torch.__version__,
        "model": _files_fingerprint(engine.config.model),
        "draft_model": _files_fingerprint(sc.draft_model) if hasattr(sc, "draft_model")
        else None,
        "device": _device_name(engine.device), "dtype": str(engine.dtype),
        "engine": _settings(engine.config), "speculative": [type(sc).__name__, _settings(sc)],
        "max_model_len": engine.max_model_len, "buckets": buckets,
    }


def table_path(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode())
    return os.path.join(cache_dir(), "draft_len", digest.hexdigest()[:32] + ".json")


def load_table(path: str, key: dict) -> dict[tuple[int, int], float] | None:
    """The cached table at path if it was stored under this key, else None."""
    try:
        with open(path) as f:
            stored = json.load(f)
        if stored["key"] != json.loads(json.dumps(key, default=str)):
            return None
        return {(int(b), int(k)): float(t) for b, k, t in stored["step_times"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_table(path: str, key: dict, table: dict[tuple[int, int], float]):
    """Writes the table atomically; a cache that cannot be written is only logged."""
    body = {"key": key, "step_times": [[b, k, t] for (b, k), t in sorted(table.items())]}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f, default=str)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the auto draft length's step times at %s: %s",
                       path, e)


def step_time_table(engine, buckets: list[int], max_draft_len: int
                    ) -> dict[tuple[int, int], float]:
    """The table from the cache, or measured on `engine` (and cached)."""
    key = table_key(engine, buckets)
    path = table_path(key)
    table = load_table(path, key)
    if table is not None:
        logger.info("auto draft length: step times read from %s", path)
        return table
    timed = measured_buckets(buckets)
    logger.info("auto draft length: measuring step times of batch sizes %s x K 0..%d "
                "(the other buckets interpolated; cached in %s)", timed, max_draft_len, path)
    if not sys.stderr.isatty() and not logger.isEnabledFor(logging.INFO):
        print(f"onespec: measuring step times for the auto draft length (batch sizes "
              f"{timed} x K 0..{max_draft_len}); the table is cached in {path}",
              file=sys.stderr, flush=True)
    start = time.perf_counter()
    table = measure_step_times(engine, buckets, max_draft_len)
    logger.info("auto draft length: measured in %.1f s", time.perf_counter() - start)
    save_table(path, key, table)
    return table


def build_policy(engine) -> DraftLenPolicy:
    """Measures the table on `engine` (Engine.calibrate installs the policy)."""
    buckets = batch_buckets(engine.config.max_batch_size)
    return DraftLenPolicy(engine.max_draft_len,
                          step_time_table(engine, buckets, engine.max_draft_len))
