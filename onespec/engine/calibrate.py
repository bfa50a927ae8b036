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

WARMUP_STEPS = 2          # untimed (the first may capture a graph or compile kernels)
TIMED_STEPS = 3           # the table keeps their median
PROMPT_LEN = 16
CALIBRATION_SEED = 1234   # dummy prompts' token ids


def batch_buckets(max_batch_size: int) -> list[int]:
    """The batch sizes the table is keyed by: the CUDA-graph buckets up to max_batch_size."""
    return [b for b in DEFAULT_BUCKETS if b < max_batch_size] + [max_batch_size]


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(engine, batch_size: int, k: int) -> float | None:
    """Median seconds of an engine step of `batch_size` generation requests at draft length
    k; None if the pool could not hold them all at once. The requests are aborted after."""
    prompt_len = min(PROMPT_LEN, engine.max_model_len // 4)
    steps = WARMUP_STEPS + TIMED_STEPS
    budget = max(1, min(steps * (k + 1) + 1, engine.max_model_len - prompt_len - 2 * k - 2))
    gen = torch.Generator().manual_seed(CALIBRATION_SEED + batch_size)
    prompts = torch.randint(0, engine.model.config.vocab_size, (batch_size, prompt_len),
                            generator=gen).tolist()
    sp = SamplingParams(max_tokens=budget, ignore_eos=True)
    engine.draft_len_fn = lambda num_requests: k
    reqs = [engine.add_request(p, sp, request_id=f"calibration-{batch_size}-{k}-{i}")
            for i, p in enumerate(prompts)]
    times = []
    try:
        while any(r.in_context for r in reqs) and not any(r.is_finished for r in reqs):
            engine.step()
        for i in range(steps):
            if engine.num_running() < batch_size or any(r.is_finished for r in reqs):
                break
            _sync(engine.device)
            t0 = time.perf_counter()
            engine.step()
            _sync(engine.device)
            if i >= WARMUP_STEPS:
                times.append(time.perf_counter() - t0)
    finally:
        for r in reqs:
            engine.abort(r.request_id)
    return statistics.median(times) if len(times) == TIMED_STEPS else None


def measure_step_times(engine, buckets: list[int], max_draft_len: int
                       ) -> dict[tuple[int, int], float]:
    """{(bucket, K): seconds} for every bucket whose requests fit the pool together, and
    every K in 0..max_draft_len. A bucket whose requests do not fit takes the row of the
    nearest measured bucket below it; observed steps correct it if such batches run."""
    table: dict[tuple[int, int], float] = {}
    todo = [(b, k) for b in buckets for k in range(max_draft_len + 1)]
    for b, k in tqdm(todo, desc="measuring step times (auto draft length)", leave=False):
        t = time_steps(engine, b, k)
        if t is not None:
            table[(b, k)] = t
    fitted = sorted({b for b, _ in table})
    if not fitted:
        raise ValueError("draft_len_schedule='auto' could not time a single request's step: "
                         "the KV pool is too small (raise num_kv_blocks or lower max_model_len)")
    for b in buckets:
        if b not in fitted:
            below = max((f for f in fitted if f < b), default=fitted[0])
            for k in range(max_draft_len + 1):
                table[(b, k)] = table[(below, k)]
    return table


def build_policy(engine) -> DraftLenPolicy:
    """Measures the table on `engine` (its draft_len_fn is left to the caller to set)."""
    buckets = batch_buckets(engine.config.max_batch_size)
    return DraftLenPolicy(engine.max_draft_len,
                          measure_step_times(engine, buckets, engine.max_draft_len))
