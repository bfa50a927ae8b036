"""Models, bytes and bandwidth of `onespec bench decode`: the benchmark shapes (config.json
files for random weights), the copy bandwidth of the device, and the bytes one decode step
must move (the floor every measured step is compared with)."""
from __future__ import annotations

import gc
import json
import math
import os
import time

import torch

from onespec.bench.moe import MTP_SHAPES, is_moe, moe_step_bytes, mtp_target_config
from onespec.engine.kv_cache import target_attention_layers
from onespec.speculative.mtp import MTPDrafter

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# name -> (model label, target config.json, head layer shape + draft vocabulary)
SHAPES = {
    "llama3-8b": ("llama3-8b-shape",
                  dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
                  dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, draft_vocab_size=32000)),
    "tiny": ("tiny-shape",
             dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=1000),
             dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, draft_vocab_size=500)),
}
# gpt-oss shapes (EAGLE-3 heads as published for gpt-oss: one layer of 64 heads of 64,
# draft vocabulary 32,000): name -> (label, target config.json fields, head fields)
GPT_OSS_SHAPES = {
    "gpt-oss-20b": ("gpt-oss-20b-shape",
                    dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                         num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                         vocab_size=201088),
                    dict(hidden_size=2880, intermediate_size=17280, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=64, draft_vocab_size=32000)),
    "tiny-gpt-oss": ("tiny-gpt-oss-shape",
                     dict(hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                          num_local_experts=8, num_experts_per_tok=2, sliding_window=16,
                          vocab_size=1000),
                     dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, draft_vocab_size=500)),
}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
COMMON = dict(rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
              max_position_embeddings=131072, tie_word_embeddings=False)
COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}


# the shape `onespec bench` runs when none is given: the first that fits the device
DEFAULT_SHAPES = {"cuda": ("llama3-8b", "tiny"), "cpu": ("tiny",)}
FIT_MARGIN = 1.5          # free memory needed, in multiples of the target's weights


def llama_weight_bytes(shape: str, dtype: torch.dtype) -> int:
    """The weights of a SHAPES target (embedding, layers, lm_head), in bytes."""
    _, t, _ = SHAPES[shape]
    h, v, i = t["hidden_size"], t["vocab_size"], t["intermediate_size"]
    d = h // t["num_attention_heads"]
    attn = h * d * (2 * t["num_attention_heads"] + 2 * t["num_key_value_heads"])
    params = 2 * v * h + t["num_hidden_layers"] * (attn + 3 * h * i + 2 * h) + h
    return params * dtype.itemsize


def default_shape(device: str, dtype: torch.dtype) -> tuple[str, str]:
    """(shape, why): on a GPU the 8B shape where FIT_MARGIN times its weights are free,
    else tiny; on a CPU tiny (an 8B float32 model needs ~32 GB and minutes a step)."""
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info()
    else:
        from onespec.engine.memory import available_bytes
        free = available_bytes(torch.device("cpu"))
    for shape in DEFAULT_SHAPES[device]:
        need = FIT_MARGIN * llama_weight_bytes(shape, dtype)
        if need <= free:
            return shape, (f"--shape {shape}: the first default for {device} whose weights "
                           f"fit ({need / 2**30:.1f} of {free / 2**30:.1f} GiB free)")
    return DEFAULT_SHAPES[device][-1], f"--shape {DEFAULT_SHAPES[device][-1]}: the smallest"


def shape_label(shape: str) -> str:
    return (MTP_SHAPES.get(shape) or GPT_OSS_SHAPES.get(shape) or SHAPES[shape])[0]


def target_config(shape: str) -> dict:
    if shape in MTP_SHAPES:
        return mtp_target_config(shape)
    if shape in GPT_OSS_SHAPES:
        _, target, _ = GPT_OSS_SHAPES[shape]
        return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **target,
                "rope_theta": 150000.0, "rope_scaling": GPT_OSS_ROPE, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 131072, "tie_word_embeddings": False,
                "attention_bias": True, "swiglu_limit": 7.0, "bos_token_id": 1,
                "eos_token_id": 2}
    _, target, _ = SHAPES[shape]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **target, **COMMON,
            "head_dim": target["hidden_size"] // target["num_attention_heads"],
            "bos_token_id": 1, "eos_token_id": 2}


def write_model_dirs(shape: str, root: str, parallel_layers: int | None = None,
                     parallel_depth: int = 1) -> tuple[str, str]:
    """config.json files for load_format='dummy': the target and a SafeAILab-style head
    (None for the MTP shapes: their drafter is the target's own MTP layer); with
    parallel_layers, a P-EAGLE head of that many layers, trained to parallel_depth."""
    if shape in MTP_SHAPES:
        path = os.path.join(root, "target")
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(target_config(shape), f, indent=2)
        return path, None
    _, target, head = GPT_OSS_SHAPES.get(shape) or SHAPES[shape]
    head_cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **head,
                "num_hidden_layers": 1, "vocab_size": target["vocab_size"],
                "target_hidden_size": target["hidden_size"], **COMMON}
    if parallel_layers:
        head_cfg |= {"num_hidden_layers": parallel_layers, "ptd_token_id": 0,
                     "num_depths": parallel_depth}
    dirs = []
    for name, cfg in (("target", target_config(shape)), ("head", head_cfg)):
        path = os.path.join(root, name)
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        dirs.append(path)
    return dirs[0], dirs[1]


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, reps: int = 10, trials: int = 5) -> float:
    """Bytes/s of a large device-to-device copy_ (bytes read + written), best of `trials`."""
    n = COPY_BYTES[device]
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(trials):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                dst.copy_(src)
            seconds = time.perf_counter() - t0
        best = min(best, seconds / reps)
    del src, dst
    return 2 * n / best


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def kv_bytes_per_token(attn_layers) -> int:
    return sum(a.cache_bytes_per_token() if hasattr(a, "cache_bytes_per_token") else
               2 * a.num_kv_heads * a.head_dim * a.k_cache.element_size() for a in attn_layers)


def step_bytes(model, head, batch: int, k: int, kv_tokens: float,
               target_kv_per_token: int, head_kv_per_token: int) -> dict[str, float]:
    """Bytes one decode step must move. Target: every weight once but the embedding table
    (one row per input token), plus its KV of `kv_tokens` keys summed over the batch. Head
    (K > 0): fc once, its layer, norm and lm_head once per draft pass (K passes: step 0 and
    K-1 single-token steps), its KV per pass."""
    embed = model.model.embed_tokens.weight
    rows = batch * (k + 1) * embed.shape[1] * embed.element_size()
    weights = _nbytes(p for p in model.parameters() if p is not embed)
    if model.lm_head.weight is embed:          # tied: the table is read whole as the lm_head
        weights += _nbytes([embed])
    out = {"target": weights + rows, "head": 0.0, "kv": kv_tokens * target_kv_per_token,
           "state": 0.0}
    if head is not None and k > 0:
        per_pass = _nbytes(p for n, p in head.named_parameters() if not n.startswith("fc."))
        out["head"] = _nbytes(head.fc.parameters()) + k * per_pass
        out["kv"] += k * kv_tokens * head_kv_per_token
    return out


def release_memory(device: str):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def windowed_kv_bytes(attn_layers, batch: int, k: int, kv_tokens: float) -> float:
    """KV bytes the target's layers read for `kv_tokens` keys summed over the batch: a
    sliding layer (`window` set) reads at most window + k keys a request."""
    out = 0.0
    for a in attn_layers:
        window = getattr(a, "window", None)
        keys = kv_tokens if window is None else min(kv_tokens, batch * (window + k))
        out += keys * kv_bytes_per_token([a])
    return out


def step_floor_parts(engine, batch: int, k: int, kv_tokens: float) -> dict[str, float]:
    """step_bytes (or moe_step_bytes) of `engine` at draft length k: {target, head, kv};
    an MoE target with an EAGLE-3 head counts its experts as moe_step_bytes does and its
    head as step_bytes does."""
    head = engine.drafter.head if engine.drafter is not None else None
    layers = target_attention_layers(engine.model)
    target_kv = kv_bytes_per_token(layers)
    head_kv = kv_bytes_per_token(engine.drafter.attention_layers) if head is not None else 0
    if isinstance(engine.drafter, MTPDrafter):
        return moe_step_bytes(engine.model, engine.drafter, batch, k, kv_tokens, target_kv,
                              head_kv)
    out = step_bytes(engine.model, head, batch, k, kv_tokens, target_kv, head_kv)
    if is_moe(engine.model):
        out["target"] = moe_step_bytes(engine.model, None, batch, k, kv_tokens, target_kv,
                                       0)["target"]
    if any(getattr(a, "window", None) is not None for a in layers):
        out["kv"] += windowed_kv_bytes(layers, batch, k, kv_tokens) - kv_tokens * target_kv
    return out
