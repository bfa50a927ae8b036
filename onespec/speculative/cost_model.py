"""Draft length chosen per step by a cost model (docs/DECODING.md, "Auto draft length").

Each step the policy picks K in {0 .. max_draft_len} maximising expected tokens per second:

    E[tokens | K] = 1 + sum_{i=1..K} prod_{j=1..i} a_j      (per generation request)
    K*            = argmax_K  E[tokens | K] / t(bucket, K)

a_j is the conditional acceptance rate of draft position j (accepted, given that the
drafts before it were), exponentially averaged over the steps the engine runs; t is the
step time of a batch-size bucket at draft length K, measured when the engine starts
(engine/calibrate.py) and refreshed with every generation step's observed time. The batch
size is the same for every K, so it cancels out of the argmax.

K = 0 is always a candidate. While K = 0 (or any K < max_draft_len) runs, the positions
past K are not observed, so their estimates would freeze; every `probe_every`-th choice
below max_draft_len therefore runs one draft more than the best K (a probe), which
observes the next position at a bounded cost (at most one step in `probe_every` at the
next-best length). That is how speculation switches itself back on after acceptance
recovers.
"""
from __future__ import annotations

from collections import Counter

DEFAULT_PRIOR = 0.5         # a_j before anything is observed
DEFAULT_ALPHA = 0.05        # EMA weight of one observed draft (batch-size aware, see observe)
MAX_STEP_WEIGHT = 0.5       # one step's share of an estimate, however large its batch
DEFAULT_TIME_ALPHA = 0.1    # EMA weight of one observed step time
DEFAULT_PROBE_EVERY = 32    # one probe (K + 1) per this many choices below max_draft_len
DEFAULT_HYSTERESIS = 0.02
PROBE_STEPS = 2             # steps a probe runs at K + 1 (see choose)   # keep the current K unless another is this much faster


def expected_tokens(rates: list[float], k: int) -> float:
    """1 + sum_{i<=k} prod_{j<=i} a_j: tokens one request emits per step at draft length k.

    rates [0.5, 0.5], k 2 -> 1 + 0.5 + 0.25 = 1.75."""
    total, run = 1.0, 1.0
    for a in rates[:k]:
        run *= a
        total += run
    return total


def bucket_for(buckets: list[int], batch_size: int) -> int:
    """The smallest bucket >= batch_size (the largest one above them all)."""
    return next((b for b in buckets if b >= batch_size), buckets[-1])


class DraftLenPolicy:
    """Chooses K per step from acceptance estimates and a step-time table.

    step_times: {(bucket, K): seconds} for every bucket and every K in 0..max_draft_len.
    """

    def __init__(self, max_draft_len: int, step_times: dict[tuple[int, int], float],
                 prior: float = DEFAULT_PRIOR, alpha: float = DEFAULT_ALPHA,
                 time_alpha: float = DEFAULT_TIME_ALPHA, probe_every: int = DEFAULT_PROBE_EVERY,
                 hysteresis: float = DEFAULT_HYSTERESIS):
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {prior!r}")
        for name, v in (("alpha", alpha), ("time_alpha", time_alpha)):
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v!r}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every!r}")
        self.max_draft_len = max_draft_len
        self.buckets = sorted({b for b, _ in step_times})
        missing = [(b, k) for b in self.buckets for k in range(max_draft_len + 1)
                   if (b, k) not in step_times]
        if not self.buckets or missing:
            raise ValueError(f"step_times needs every K in 0..{max_draft_len} for each bucket; "
                             f"missing {missing[:4]}")
        self.step_times = dict(step_times)
        self.rates = [prior] * max_draft_len            # a_j, j = 1..max_draft_len
        self.alpha, self.time_alpha = alpha, time_alpha
        self.probe_every, self.hysteresis = probe_every, hysteresis
        self.chosen: Counter[int] = Counter()           # K per choice (probes included)
        self.num_probes = 0
        self._current = max_draft_len
        self._since_probe = 0
        self._probe_steps_left = 0
        self._last_k = -1                               # K of the last observed step

    # ---- choice --------------------------------------------------------------------------
    def bucket_times(self, bucket: int) -> list[float]:
        """The bucket's step times for K = 0..max_draft_len made non-decreasing in K (more
        drafts never make a step cheaper, so a dip is measurement noise): neighbours out of
        order are replaced by their mean (isotonic regression, pool adjacent violators)."""
        blocks: list[list[float]] = []        # [sum, count] of each pooled run of Ks
        for k in range(self.max_draft_len + 1):
            blocks.append([self.step_times[(bucket, k)], 1])
            while len(blocks) > 1 and \
                    blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        return [total / count for total, count in blocks for _ in range(count)]

    def tokens_per_second(self, bucket: int, k: int) -> float:
        return expected_tokens(self.rates, k) / self.bucket_times(bucket)[k]

    def best(self, batch_size: int) -> int:
        """The K with the highest expected tokens per second (no probing); the current K
        stays unless another beats it by more than the hysteresis margin."""
        times = self.bucket_times(bucket_for(self.buckets, batch_size))
        speed = [expected_tokens(self.rates, k) / t for k, t in enumerate(times)]
        top = max(range(len(speed)), key=speed.__getitem__)
        if speed[top] <= speed[self._current] * (1.0 + self.hysteresis):
            top = self._current
        return top

    def choose(self, batch_size: int) -> int:
        """K for the next step: the best one, or one more than it on a probe step. A probe
        is PROBE_STEPS steps long: drafts are made by the step before the one that
        verifies them, so the first step at K + 1 makes the extra draft and the second
        verifies it."""
        k = self._current = self.best(batch_size)
        if k < self.max_draft_len:
            if self._probe_steps_left:
                self._probe_steps_left -= 1
                k += 1
            else:
                self._since_probe += 1
                if self._since_probe >= self.probe_every:
                    self._since_probe = 0
                    self._probe_steps_left = PROBE_STEPS - 1
                    self.num_probes += 1
                    k += 1
        self.chosen[k] += 1
        return k

    # ---- observation ---------------------------------------------------------------------
    def observe_acceptance(self, drafted: list[tuple[int, int]]):
        """drafted: (tokens emitted 1..K+1, real drafts d) per generation request that had
        drafts this step. d < K when K grew since the drafts were made (the rest is padding,
        always rejected, so not an observation).

        Position j is tried by the requests with a real draft j whose first j - 1 drafts
        were accepted, and accepted by those that also kept draft j; its rate moves towards this batch's
        ratio with weight 1 - (1 - alpha)^(tries), so a batch of n requests counts as n
        single observations, but at most MAX_STEP_WEIGHT (one step's binomial noise must
        not decide alone)."""
        for j in range(max((d for _, d in drafted), default=0)):
            tried = sum(1 for n, d in drafted if n - 1 >= j and d > j)
            if not tried:
                break
            kept = sum(1 for n, d in drafted if n - 1 > j and d > j)
            w = min(MAX_STEP_WEIGHT, 1.0 - (1.0 - self.alpha) ** tried)
            self.rates[j] += w * (kept / tried - self.rates[j])

    def observe_step_time(self, batch_size: int, k: int, seconds: float):
        """A generation step's wall time rescales its bucket's row of the table: the row
        moves by the factor that takes the step's own entry a time_alpha of the way to
        the observation. What changes while the engine runs (the machine's load, the
        context length) changes every K's step alike, so the row keeps the relative costs
        measured at start-up (in interleaved rounds) and follows the level; moving one
        entry alone would let a load change make the K in use look cheaper or dearer than
        the others. The first step after a change of K is skipped: it cannot overlap the
        step before it (CUDA graphs chain only steps of one K), so it is dearer than the
        steady state."""
        bucket = bucket_for(self.buckets, batch_size)
        switched, self._last_k = k != self._last_k, k
        if (bucket, k) not in self.step_times or seconds <= 0 or switched:
            return
        factor = 1.0 + self.time_alpha * (seconds / self.step_times[(bucket, k)] - 1.0)
        for j in range(self.max_draft_len + 1):
            self.step_times[(bucket, j)] *= factor

    def as_dict(self) -> dict:
        """What llm.stats() and /metrics show: the table (ms), the estimates, the choices."""
        return {
            "acceptance_rate_estimates": [round(a, 4) for a in self.rates],
            "step_ms": {f"{b}x{k}": round(1e3 * t, 4)
                        for (b, k), t in sorted(self.step_times.items())},
            "chosen_k": {k: self.chosen[k] for k in range(self.max_draft_len + 1)},
            "num_probes": self.num_probes,
        }
