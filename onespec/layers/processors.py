"""Logit processors: repetition, frequency and presence penalties, logit_bias and
min_tokens, applied to the target's logits of each row before temperature, top-k and top-p.

Lossless under speculation: a verify row j of a request (its j-th draft's position) is
processed with the history that plain decoding would have there, the output so far plus
the request's drafts 0..j-1 (if those are accepted, row j is exactly plain decoding's next
row; if not, row j is never used). So greedy speculative output equals greedy plain output
with the same processors, and rejection sampling compares the drafts with the processed
target distribution. Drafts themselves are proposed from unprocessed logits: that costs
acceptance only. The rules, in the order applied (vLLM's and transformers' order: biases
first, then penalties; SamplingParams names the ranges):

  logit_bias:             l[t] += bias[t]
  min_tokens m:           while the output has fewer than m tokens, end-of-sequence and
                          stop_token_ids get l = -inf
  repetition_penalty r:   for tokens in the prompt or output, l = l / r if l > 0 else l * r
  frequency f, presence p: for tokens in the output with count c, l = l - c * f - p
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from onespec.sampling_params import SamplingParams


@dataclass
class RowHistory:
    """What one logit row's processors read: its request's params, prompt, and output as
    plain decoding would have it at that row (drafts before the row included)."""
    params: SamplingParams
    prompt: list[int]
    output: list[int]


@dataclass
class RowProcessors:
    """The processed rows of a step's logit rows [R] (context chunks' last rows, then K+1
    per generation request) and what each reads."""
    index: torch.Tensor                # [M] int64 rows, on the device
    histories: list[RowHistory]        # [M]
    stop_ids: tuple[int, ...]          # end-of-sequence ids (min_tokens holds them back)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:    # [M, V] -> [M, V] float32
        out = logits.float().clone()
        for m, h in enumerate(self.histories):
            process_row(out[m], h, self.stop_ids)
        return out


def process_row(row: torch.Tensor, h: RowHistory, stop_ids: tuple[int, ...]):
    """Applies h's processors to one row of logits [V] in place."""
    sp, dev, vocab = h.params, row.device, row.shape[0]
    if sp.logit_bias:
        ids = torch.tensor(list(sp.logit_bias), device=dev)
        row[ids] += torch.tensor(list(sp.logit_bias.values()), device=dev, dtype=row.dtype)
    if len(h.output) < sp.min_tokens:
        held = [t for t in (*(() if sp.ignore_eos else stop_ids), *sp.stop_token_ids)
                if t < vocab]
        if held:
            row[torch.tensor(held, device=dev)] = float("-inf")
    if sp.repetition_penalty != 1.0 and (h.prompt or h.output):
        seen = torch.tensor(sorted(set(h.prompt) | set(h.output)), device=dev)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty,
                                vals * sp.repetition_penalty)
    if (sp.frequency_penalty or sp.presence_penalty) and h.output:
        tokens, counts = torch.unique(torch.tensor(h.output, device=dev), return_counts=True)
        row[tokens] -= counts.to(row.dtype) * sp.frequency_penalty + sp.presence_penalty


def build_row_processors(histories: list[RowHistory | None], stop_ids: tuple[int, ...],
                         device) -> RowProcessors | None:
    """histories [R]: a row's history if its request has processors, else None. None when
    no row has any (the common case costs nothing)."""
    rows = [i for i, h in enumerate(histories) if h is not None]
    if not rows:
        return None
    return RowProcessors(torch.tensor(rows, dtype=torch.int64, device=device),
                         [histories[i] for i in rows], stop_ids)
