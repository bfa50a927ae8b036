"""The step-time table of the auto draft length (speculative/cost_model.py), measured on
this machine when the engine starts: a few timed generation steps of dummy requests for
every batch-size bucket and every K in 0..max_draft_len, through the engine's own step
(CUDA graphs and the overlap scheduler included), so the table holds what a step costs
here and not an estimate."""
from __future__ import annotations

import statistics
import time

import torch
from tqdm.auto import tqdm

from onespec.engine.cuda_graph import DEFAULT_BUCKETS
from onespec.sampling_params import SamplingParams
from onespec.speculative.cost_model import DraftLenPolicy

WARMUP_STEPS = 1          # untimed after each switch of K (its first step starts a chain)
TIMED_STEPS = 4           # timed steps per K and round
ROUNDS = 4                # rounds over every K: a load that comes and goes hits them alike
PROMPT_LEN = 16
CALIBRATION_SEED = 1234   # dummy prompts' token ids


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes the table is keyed by: the CUDA-graph buckets up to max_batch_size."""
    return [b for b in DEFAULT_BUCKETS if b < max_batch_size] + [max_batch_size]


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_step(engine) -> float:
    _sync(engine.device)
    t0 = time.perf_counter()
    engine.step()
    _sync(engine.device)
    return time.perf_counter() - t0


def time_bucket(engine, batch_size: int, max_draft_len: int, rounds: int = ROUNDS, bar=None
                ) -> dict[int, float] | None:
    """{K: median seconds of an engine step of `batch_size` generation requests} for K in
    0..max_draft_len, the Ks taken in turn for `rounds` rounds; None if the pool or
    max_model_len cannot hold the requests throughout. The requests are aborted after."""
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
        for _ in range(rounds):
            for k in ks:
                engine.set_draft_len(k)
                for i in range(WARMUP_STEPS + TIMED_STEPS):
                    if engine.num_running() < batch_size or any(r.is_finished for r in reqs):
                        return None
                    seconds = _timed_step(engine)
                    if i >= WARMUP_STEPS:
                        samples[k].append(seconds)
                if bar is not None:
                    bar.update(1)
    finally:
        for r in reqs:
            engine.abort(r.request_id)
    return {k: statistics.median(v) for k, v in samples.items()}


def measure_step_times(engine, buckets: list[int], max_draft_len: int
                       ) -> dict[tuple[int, int], float]:
    """{(bucket, K): seconds} for every bucket whose requests fit the pool together, and
    every K in 0..max_draft_len. A bucket whose requests do not fit takes the row of the
    nearest measured bucket below it; observed steps correct it if such batches run."""
    table: dict[tuple[int, int], float] = {}
    total = len(buckets) * ROUNDS * (max_draft_len + 1)
    with tqdm(total=total, desc="measuring step times (auto draft length)", leave=False,
              disable=None) as bar:              # None: shown on a terminal only
        time_bucket(engine, buckets[0], max_draft_len, rounds=1)   # warm-up: first calls
        for b in buckets:
            times = time_bucket(engine, b, max_draft_len, bar=bar)
            table.update({(b, k): t for k, t in (times or {}).items()})
    engine.step()    # collects a step still in flight for aborted dummies (overlap), if any
    fitted = sorted({b for b, _ in table})
    if not fitted:
        raise ValueError("draft_len_schedule='auto' could not time a single request's step: "
                         "the KV pool or max_model_len is too small for its dummy requests")
    for b in buckets:
        if b not in fitted:
            below = max((f for f in fitted if f < b), default=fitted[0])
            for k in range(max_draft_len + 1):
                table[(b, k)] = table[(below, k)]
    return table


def build_policy(engine) -> DraftLenPolicy:
    """Measures the table on `engine` (Engine.calibrate installs it)."""
    buckets = batch_buckets(engine.config.max_batch_size)
    return DraftLenPolicy(engine.max_draft_len,
                          measure_step_times(engine, buckets, engine.max_draft_len))
