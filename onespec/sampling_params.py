"""Per-request sampling parameters (names follow vLLM / TensorRT-LLM)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from onespec.structured.params import StructuredOutputsParams

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
# Temperatures below this are greedy: logits / T would leave float32's range.
MIN_TEMPERATURE = 1e-5
# Above this the distribution is uniform to float32 precision anyway.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 10.0
MAX_LOGIT_BIAS = 1024              # logit_bias entries per request
MAX_LOGPROBS = 20                  # top log-probabilities returned per token


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value, low: int, what: str = ""):
    """value must be an int (not a bool) in [low, 2**63): what int64 tensors can hold."""
    if not (_is_int(value) and low <= value <= INT64_MAX):
        low_text = "-2**63" if low == INT64_MIN else str(low)
        raise ValueError(f"{name} must be an integer >= {low_text} and < 2**63{what}, "
                         f"got {value!r}")


@dataclass
class SamplingParams:
    """How one request samples.

    max_tokens       integer in [1, 2**63 - 1]
    temperature      number in [0, 100]; 0 = greedy, and so is any temperature below 1e-5
                     (it is stored as 0.0): logits / T would overflow float32
    top_k            integer in [0, 2**63 - 1]; 0 or -1 = off
    top_p            number in (0, 1]; 1 = off
    seed             None, or an integer in [-2**63, 2**63 - 1]: the request's random draws
                     are a function of (seed, position of the token drawn) only, so its
                     output does not depend on the batch, chunking or preemption
    stop_token_ids   integers in [0, 2**63 - 1] (the engine also checks them against the
                     vocabulary)
    stop             None, a string or a list of non-empty strings: LLM.generate ends the
                     output before the first of them ("stop"), as the server does
                     (serve/detokenize.py); the token ids are those generated up to the
                     step that completed it
    structured_outputs  None, or a StructuredOutputsParams: the output follows its JSON
                     schema, regex, choice or grammar and ends ("stop") when it is complete
    Logit processors (layers/processors.py), applied to the target's logits in this order
    before temperature, top-k and top-p:
    logit_bias       {token id: bias in [-100, 100]}, added to the logits (at most 1024)
    min_tokens       integer >= 0: end-of-sequence and stop_token_ids are not emitted
                     before this many output tokens
    repetition_penalty  number in (0, 10]; 1 = off: logits of tokens in the prompt or the
                     output so far are divided by it where positive, multiplied where not
    frequency_penalty, presence_penalty  numbers in [-2, 2]; 0 = off: OpenAI's penalties,
                     subtracted per occurrence in the output / once per token in it
    logprobs         None, or an integer in [0, 20]: with each output token, its
                     log-probability, rank and the `logprobs` likeliest tokens' (the target's
                     raw distribution: before processors, temperature, top-k and top-p)
    prompt_logprobs  None, or an integer in [0, 20]: the same for each prompt token after
                     the first (such a request does not read the prefix cache)
    Booleans are not integers here, and strings are not numbers.
    """
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        _check_int("max_tokens", self.max_tokens, 1)
        t = self.temperature
        if not (_is_number(t) and math.isfinite(t) and 0.0 <= t <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] "
                             f"(0 = greedy), got {t!r}")
        self.temperature = 0.0 if t < MIN_TEMPERATURE else float(t)
        if self.top_k == -1:
            self.top_k = 0
        _check_int("top_k", self.top_k, 0, what=" (0 or -1 = off)")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        self.top_p = float(self.top_p)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN)
        if isinstance(self.stop_token_ids, (str, bytes)) or \
                not hasattr(self.stop_token_ids or [], "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of integers, "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            if not (_is_int(t) and 0 <= t <= INT64_MAX):
                raise ValueError(f"stop_token_ids must be integers >= 0 and < 2**63, "
                                 f"got {t!r}")
        # what the scheduler tests each emitted token against (a list scan per token would
        # let one request with a huge list slow every other)
        self.stop_token_set = frozenset(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not (isinstance(self.stop, (list, tuple)) and all(
                isinstance(s, str) and s for s in self.stop)):
            raise ValueError(f"stop must be a string or a list of non-empty strings, "
                             f"got {self.stop!r}")
        self.stop = list(self.stop or [])
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise ValueError("structured_outputs must be None or a StructuredOutputsParams, "
                             f"got {type(self.structured_outputs).__name__}")
        self._check_processors()

    def _check_processors(self):
        r = self.repetition_penalty
        if not (_is_number(r) and 0.0 < r <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty must be a number in (0, "
                             f"{MAX_REPETITION_PENALTY:g}] (1 = off), got {r!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not (_is_number(v) and -2.0 <= v <= 2.0):
                raise ValueError(f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")
            setattr(self, name, float(v))
        self.repetition_penalty = float(r)
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} "
                                 "{token id: bias} entries")
            for t, b in bias.items():
                if not (_is_int(t) and 0 <= t <= INT64_MAX):
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {t!r}")
                if not (_is_number(b) and -100.0 <= b <= 100.0):
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], "
                                     f"got {b!r} for token {t}")
            self.logit_bias = {t: float(b) for t, b in bias.items()} or None
        _check_int("min_tokens", self.min_tokens, 0)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (_is_int(v) and 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], "
                                 f"got {v!r}")

    @property
    def needs_logits(self) -> bool:
        """Whether its rows need the full logits (processors, log-probabilities): such
        requests decode eagerly, outside CUDA graphs."""
        return self.has_processors or self.logprobs is not None or \
            self.prompt_logprobs is not None

    @property
    def has_processors(self) -> bool:
        """Whether any logit processor is on (such requests decode eagerly)."""
        return bool(self.repetition_penalty != 1.0 or self.frequency_penalty or
                    self.presence_penalty or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
