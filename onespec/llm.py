"""LLM: the user-facing facade over the engine (vLLM-style)."""
from __future__ import annotations

import logging
import time
from typing import Sequence

from tqdm.auto import tqdm

from onespec.config import EngineConfig, SpeculativeConfig
from onespec.engine.engine import Engine
from onespec.engine.request import Request
from onespec.engine.summary import summary_lines
from onespec.outputs import CompletionOutput, RequestOutput
from onespec.sampling_params import SamplingParams
from onespec.serve.detokenize import IncrementalDetokenizer

logger = logging.getLogger("onespec.llm")


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
        start = time.perf_counter()
        self.engine = Engine(EngineConfig(model=model, **kwargs), speculative_config)
        try:
            self.engine.calibrate()          # the auto draft length's timings, if asked for
        except BaseException:
            self.engine.close()
            raise
        self.tokenizer = self.engine.tokenizer
        logger.info("engine ready in %.1f s", time.perf_counter() - start)
        for line in summary_lines(self.engine):
            logger.info("  %s", line)

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
        if any(sp.stop for sp in params) and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer and this model has none; use "
                             "stop_token_ids")
        reqs, detoks = [], {}
        try:
            for p, sp, salt in zip(prompts, params, salts):  # add_request may still reject
                reqs.append(self.engine.add_request(p, sp, cache_salt=salt))
                if sp.stop:
                    detoks[reqs[-1].request_id] = IncrementalDetokenizer(self.decode, sp.stop)
            with tqdm(total=len(reqs), desc="generating",     # None: off a terminal, none
                      disable=None if use_tqdm else True) as bar:
                while self.engine.has_unfinished():
                    advanced = self.engine.step()
                    for r in advanced:
                        if r.request_id in detoks:
                            self._look_for_stop(r, detoks[r.request_id])
                    bar.update(sum(r.is_finished for r in advanced))
        except BaseException:
            for r in reqs:
                self.engine.abort(r.request_id)
            raise
        return [self.to_output(r, p if isinstance(p, str) else None, detoks.get(r.request_id))
                for r, p in zip(reqs, prompts)]

    def _look_for_stop(self, req: Request, detok: IncrementalDetokenizer):
        """Feeds the request's new tokens to its detokenizer; at a stop string the request
        ends ("stop") and the engine frees it."""
        if detok.stopped:
            return
        detok.update(req.output_token_ids[len(detok.token_ids):], req.is_finished)
        if detok.stopped:
            self.engine.abort(req.request_id)
            req.finish_reason = "stop"

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def to_output(self, req: Request, prompt: str | None = None,
                  detok: IncrementalDetokenizer | None = None) -> RequestOutput:
        """detok: the request's stop-string detokenizer, whose text ends before the stop."""
        logprobs = self._decoded(req.logprobs)
        if detok is not None and detok.stopped:
            out = CompletionOutput(0, detok.text, list(detok.token_ids), req.finish_reason,
                                   logprobs and logprobs[:len(detok.token_ids)])
        else:
            out = CompletionOutput(0, self.decode(req.output_token_ids),
                                   list(req.output_token_ids), req.finish_reason, logprobs)
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
