"""Rotary position embeddings, with the rope_scaling kinds Llama-family checkpoints use."""
from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(cfg: dict) -> tuple[float, dict]:
    """(theta, scaling) from a config dict written by transformers 4.x or 5.x."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    merged["rope_type"] = kind
    return check_rope(theta, merged, getattr(cfg, "source", "config.json")), merged


# rope fields that must be finite numbers (and `factor` a positive one) when present
ROPE_NUMBER_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast",
                      "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def check_rope(theta, scaling: dict, source: str) -> float:
    """theta as a float, after a ValueError naming the field for a theta or scaling value
    that is not a (positive) finite number."""
    def is_number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if not (is_number(theta) and theta > 0):
        raise ValueError(f"{source}: field 'rope_theta' must be a positive finite number, "
                         f"got {theta!r}")
    for name in ROPE_NUMBER_FIELDS:
        v = scaling.get(name)
        if v is not None and not (is_number(v) and (v > 0 or name != "factor")):
            want = "a positive finite number" if name == "factor" else "a finite number"
            raise ValueError(f"{source}: rope field {name!r} must be {want}, got {v!r}")
    orig = scaling.get("original_max_position_embeddings")
    if orig is not None and not (isinstance(orig, int) and not isinstance(orig, bool)
                                 and orig >= 1):
        raise ValueError(f"{source}: rope field 'original_max_position_embeddings' must be "
                         f"a positive integer, got {orig!r}")
    return float(theta)


def inv_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq.float()


class RotaryEmbedding:
    """Precomputed cos/sin table; applied to q, k of shape [T, heads, head_dim] (neox layout)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict, device):
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                                    # [P, D/2]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1).to(device)  # [P, D]
        self.max_positions = max_positions
        half = head_dim // 2
        self.fused_ok = head_dim % 2 == 0 and half & (half - 1) == 0   # Triton: 2^n halves

    def __call__(self, positions, q, k):
        """q [T, Hq, D], k [T, Hk, D] -> rotated (q, k), in one pass over both."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        x = torch.cat([q, k], dim=1)
        x1, x2 = (x if x.dtype == torch.float32 else x.float()).chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(q.dtype)
        return out.split([q.shape[1], k.shape[1]], dim=1)
