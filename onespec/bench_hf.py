"""The transformers baseline of `onespec bench`: `LlamaForCausalLM.generate` on a random-weight
model of the benchmark's shape, made on the device, timed per decode step."""
from __future__ import annotations

import time

import torch


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
