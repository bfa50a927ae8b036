"""The transformers baseline of `onespec bench`: `LlamaForCausalLM.generate` on a random-weight
model of the benchmark's shape, made on the device, timed per decode step."""
from __future__ import annotations

import sys
import time

import torch
from tqdm.auto import tqdm

from onespec.bench.models import release_memory, target_config
from onespec.bench.moe import hf_weight_bytes


def build_hf_model(config: dict, device: str, dtype: torch.dtype):
    """The transformers model of config.json's architecture (LlamaForCausalLM by default)
    from its fields, random init, never stopping on EOS (random weights would end some rows
    early)."""
    import transformers
    arch = (config.get("architectures") or ["LlamaForCausalLM"])[0]
    cfg = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    cfg.update(bos_token_id=None, eos_token_id=None, pad_token_id=0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf_config = transformers.AutoConfig.for_model(config.get("model_type", "llama"), **cfg)
            model = getattr(transformers, arch)(hf_config)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = None
    return model.eval()


def generate_step_times(model, input_ids, max_new_tokens: int, cache: str) -> list[float]:
    """Host timestamps (device synced) each time generate processes logits: the first after
    prefill, each later one after one decode forward. input_ids [B, P]."""
    import transformers

    class StepTimer(transformers.LogitsProcessor):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, ids, scores):
            if scores.is_cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    timer = StepTimer()
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                   max_new_tokens=max_new_tokens, pad_token_id=0,
                   logits_processor=transformers.LogitsProcessorList([timer]), **extra)
    return timer.times


def time_decode(model, input_ids, num_steps: int, cache: str) -> tuple[float, int, float]:
    """(mean ms per decode step, steps timed, warm-up seconds). A static cache compiles on
    its first call, so the warm-up uses the same lengths as the timed call (no recompile)."""
    new_tokens = num_steps + 1
    start = time.perf_counter()
    generate_step_times(model, input_ids, new_tokens if cache == "static" else 4, cache)
    warmup_s = time.perf_counter() - start
    times = generate_step_times(model, input_ids, new_tokens, cache)
    steps = len(times) - 1
    return 1e3 * (times[-1] - times[0]) / steps, steps, warmup_s


def hf_row(model, cache: str, batch: int, args, bandwidth: float) -> dict:
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
