"""LLM: the user-facing facade over the engine (vLLM-style)."""
from __future__ import annotations

from typing import Sequence

from tqdm.auto import tqdm

from onespec.config import EngineConfig, SpeculativeConfig
from onespec.engine.engine import Engine
from onespec.engine.request import Request
from onespec.outputs import CompletionOutput, RequestOutput
from onespec.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, speculative_config: SpeculativeConfig | dict | None = None,
                 **kwargs):
        """speculative_config: Eagle3Config, MTPConfig, NGramConfig, or vLLM's dictionary
        ({"method": "eagle3" | "mtp" | "ngram", "model": PATH, "num_speculative_tokens": K,
        ...}); kwargs: EngineConfig's fields."""
        unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown LLM arguments {sorted(unknown)}; allowed: "
                            f"{sorted(set(EngineConfig.__dataclass_fields__) - {'model'})}")
        self.engine = Engine(EngineConfig(model=model, **kwargs), speculative_config)
        try:
            self.engine.calibrate()          # the auto draft length's timings, if asked for
        except BaseException:
            self.engine.close()
            raise
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                 = None, use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts, salts = zip(*map(unpack_prompt, prompts)) if prompts else ((), ())
        params = sampling_params if isinstance(sampling_params, (list, tuple)) \
            else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        for p in prompts:          # validate every prompt before any request is queued
            self.engine.tokenize(p)
        reqs = []
        try:
            for p, sp, salt in zip(prompts, params, salts):  # add_request may still reject
                reqs.append(self.engine.add_request(p, sp, cache_salt=salt))
            with tqdm(total=len(reqs), desc="generating",     # None: off a terminal, none
                      disable=None if use_tqdm else True) as bar:
                while self.engine.has_unfinished():
                    done = sum(r.is_finished for r in self.engine.step())
                    bar.update(done)
        except BaseException:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        return [self.to_output(r, p if isinstance(p, str) else None)
                for r, p in zip(reqs, prompts)]

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def to_output(self, req: Request, prompt: str | None = None) -> RequestOutput:
        out = CompletionOutput(0, self.decode(req.output_token_ids), list(req.output_token_ids),
                               req.finish_reason, self._decoded(req.logprobs))
        prompt_logprobs = None if req.prompt_logprobs is None else \
            [None, *self._decoded(req.prompt_logprobs)]
        return RequestOutput(req.request_id, prompt, list(req.prompt_token_ids), [out],
                             req.is_finished, req.metrics, prompt_logprobs)

    def _decoded(self, entries: list[dict] | None) -> list[dict] | None:
        """Log-probability entries with each token's text filled in (with a tokenizer)."""
        if entries is None or self.tokenizer is None:
            return entries
        for entry in entries:
            for token, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([token])
        return entries

    def stats(self) -> dict:
        """The aggregate counters (SpecStats) and the scheduler's preemptions so far."""
        return {**self.engine.stats.as_dict(), "num_preemptions": self.engine.num_preemptions}

    def close(self):
        """Stops the engine's tensor-parallel workers, if any (also at exit); idempotent."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc):
        self.close()


def unpack_prompt(prompt) -> tuple:
    """(text or token ids, cache_salt) of a prompt: a string, a list of token ids, or, as
    vLLM takes them, {"prompt": text} or {"prompt_token_ids": ids} with an optional
    "cache_salt" (the prefix-cache namespace of the request)."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict holds exactly one of 'prompt' and 'prompt_token_ids', "
                         f"and optionally 'cache_salt'; got keys {sorted(prompt)}")
    return prompt.get("prompt", prompt.get("prompt_token_ids")), prompt.get("cache_salt")
