"""The FP8 KV cache (`kv_cache_dtype="fp8"`): keys and values stored as e4m3 with one
float32 scale per layer for keys and one for values.

A value x is stored as q = e4m3(clamp(x * (1 / scale), ±448)) and read as q * scale, in
float32, then cast to the compute dtype. The PyTorch path (layers/ops.py) is the reference;
the Triton rotary + KV-write kernels (kernels/rope_kv.py) quantize with the same arithmetic
(the same bytes), and the paged attention kernel (kernels/attention.py) reads e4m3 tiles,
folding k_scale into its softmax scale and applying v_scale to its result.

Scales come from the target checkpoint where it has them, else 1.0 (as vLLM does). Keys of
published FP8-KV checkpoints, per attention module `P` (e.g. model.layers.0.self_attn):

    P.k_scale, P.v_scale                   compressed-tensors kv_cache_scheme, vLLM's form
    P.k_proj.k_scale, P.v_proj.v_scale     NVIDIA ModelOpt (kv_cache_quant_algo "FP8")
    P.k_proj.output_scale, ...v_proj...    older compressed-tensors exports
    P.kv_scale                             one scale for both (older FP8-KV exports)

Each is one positive finite value; they are read whatever kv_cache_dtype is and applied
only with kv_cache_dtype="fp8" (with "auto" the cache is in the model's dtype and needs
none). Draft layers (an EAGLE-3 head, an MTP layer) keep their KV in the same dtype, with
scale 1.0: head checkpoints carry no KV scales.
"""
from __future__ import annotations

import math

import torch

from onespec.quant.fp8 import FP8, FP8_MAX, linear_dtype

KV_CACHE_DTYPES = ("auto", "fp8")
# checkpoint key suffix -> which scales it sets ("k", "v" or both), and how many trailing
# name parts past the attention module it has
KV_SCALE_KEYS = {
    ".k_proj.k_scale": ("k", 2), ".v_proj.v_scale": ("v", 2),
    ".k_proj.output_scale": ("k", 2), ".v_proj.output_scale": ("v", 2),
    ".k_scale": ("k", 1), ".v_scale": ("v", 1), ".kv_scale": ("kv", 1),
}


def check_kv_cache_dtype(value) -> str:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} ('fp8': e4m3 with "
                         f"per-tensor scales), got {value!r}")
    return value


# ---- quantize / dequantize (the reference arithmetic) ----------------------------------
def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> e4m3: x * (1 / scale) in float32, clamped to ±448."""
    inv = torch.tensor(1.0 / scale, dtype=torch.float32).item()     # float32-rounded
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_kv(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 q -> q * scale (float32) in dtype."""
    return (q.float() * scale).to(dtype)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
             scale: float | None):
    """cache[slots] = x, quantized when the cache is e4m3 (through a byte view: PyTorch
    has no float8 index_copy_ on the CPU)."""
    if cache.dtype == FP8:
        cache.view(torch.uint8).index_copy_(0, slots, quantize_kv(x, scale).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, x)


def read_kv(cache: torch.Tensor, index: torch.Tensor, scale: float | None,
            dtype: torch.dtype) -> torch.Tensor:
    """cache[index], dequantized to dtype when the cache is e4m3."""
    rows = cache[index]
    return dequantize_kv(rows, scale, dtype) if cache.dtype == FP8 else rows


def raw(t: torch.Tensor) -> torch.Tensor:
    """A byte view of an e4m3 tensor (for moves PyTorch lacks for float8 on the CPU)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


# ---- per-layer configuration -----------------------------------------------------------
def cache_dtype(attn) -> torch.dtype:
    """The dtype of a layer's k_cache / v_cache: e4m3 under kv_cache_dtype="fp8", else
    its output projection's compute dtype."""
    return getattr(attn, "kv_cache_dtype", None) or linear_dtype(attn.o_proj)


def configure_kv_cache(attn_layers, kv_cache_dtype: str):
    """Sets each layer's cache dtype and (k_scale, v_scale) before the pool is sized and
    allocated: e4m3 and the checkpoint's scales (1.0 where it has none) for "fp8"."""
    check_kv_cache_dtype(kv_cache_dtype)
    for a in attn_layers:
        if kv_cache_dtype == "fp8":
            if hasattr(a, "allocate_cache"):
                raise ValueError(f"kv_cache_dtype='fp8' is not supported for "
                                 f"{type(a).__name__}'s own cache layout (MLA latents); "
                                 "use kv_cache_dtype='auto'")
            a.kv_cache_dtype = FP8
            a.kv_scales = getattr(a, "checkpoint_kv_scales", (1.0, 1.0))
        else:
            a.kv_cache_dtype, a.kv_scales = None, None


def kv_scales(attn) -> tuple[float, float] | None:
    """A layer's (k_scale, v_scale) under an FP8 cache, else None."""
    return getattr(attn, "kv_scales", None)


# ---- checkpoint scales -----------------------------------------------------------------
def split_kv_scale(name: str) -> tuple[str, str] | None:
    """'model.layers.0.self_attn.k_proj.k_scale' -> ('model.layers.0.self_attn', 'k');
    None for any other key."""
    for suffix, (which, parts) in KV_SCALE_KEYS.items():
        if name.endswith(suffix):
            return name.rsplit(".", parts)[0], which
    return None


def collect_kv_scales(weights, found: dict, what: str):
    """Passes (name, tensor) through but for KV-cache scale keys, which go into
    found[attention module name] = {"k": float, "v": float}; each must be one positive
    finite value."""
    for name, t in weights:
        split = split_kv_scale(name)
        if split is None:
            yield name, t
            continue
        if t.numel() != 1 or not t.is_floating_point():
            raise ValueError(f"{what}: KV-cache scale {name!r} has shape {tuple(t.shape)} and "
                             f"dtype {t.dtype}, expected one floating-point value")
        value = float(t.reshape(()).float())
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{what}: KV-cache scale {name!r} is {value}, expected a "
                             "positive finite value")
        prefix, which = split
        for w in ("k", "v") if which == "kv" else (which,):
            found.setdefault(prefix, {})[w] = value


def attach_kv_scales(model, found: dict, rename, what: str):
    """Gives each attention module named in `found` (checkpoint names, mapped through the
    loader's rename) checkpoint_kv_scales = (k, v); one of the two missing is 1.0."""
    modules = dict(model.named_modules())
    for prefix, scales in found.items():
        mapped = rename(prefix + ".o_proj.weight")
        module = modules.get(mapped.rsplit(".", 2)[0]) if mapped else None
        if module is None or not hasattr(module, "o_proj"):
            raise ValueError(f"{what}: KV-cache scales for {prefix!r}, which is not an "
                             "attention module of this model")
        module.checkpoint_kv_scales = (scales.get("k", 1.0), scales.get("v", 1.0))
