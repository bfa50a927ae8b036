"""MXFP4 checkpoints (OCP microscaling FP4, as gpt-oss ships its experts), dequantized at
load until kernels read the packed format.

Layout of a quantized weight W [..., rows, cols] (gpt-oss: each expert's [out, in]):

    W_blocks  uint8 [..., rows, cols / 32, 16]   two FP4 (e2m1) codes a byte, the low
                                                 nibble the even element, 32 a block
    W_scales  uint8 [..., rows, cols / 32]       one E8M0 scale a block: 2^(s - 127)
                                                 (s = 255 is NaN)

    W[..., r, 32 g + i] = E2M1[code i of block g of row r] * 2^(scales[..., r, g] - 127)

E2M1 codes 0..7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the same values negated.
gpt-oss's bf16 checkpoints store the experts transposed ([E, in, out]: x @ W), so the
decoded tensor is transposed on its last two dimensions under the plain key (`W`).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

BLOCK_SIZE = 32                  # values sharing one scale
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in dtype (exact
    in bfloat16 and float32: every value is a 2-bit-mantissa number times a power of 2)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[-1] != BLOCK_SIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)} do not match: blocks must be [..., G, 16] "
                         "for scales [..., G]")
    if blocks.dim() > 2 and blocks.shape[0] > 1:     # one expert at a time: bounded scratch
        return torch.stack([dequantize_mxfp4(b, s, dtype) for b, s in zip(blocks, scales)])
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)   # [..., G, 32]
    values = table[codes.long()]
    exponent = scales.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(values, exponent.unsqueeze(-1).float())
    out = out.masked_fill((scales == E8M0_NAN).unsqueeze(-1), float("nan"))
    return out.flatten(-2).to(dtype)


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) stream with every `W_blocks` / `W_scales` pair replaced
    by W (decoded, last two dimensions transposed: the bf16 checkpoints' layout) once both
    have come; other tensors pass through. A half without its pair is a ValueError."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        for suffix in (BLOCKS_SUFFIX, SCALES_SUFFIX):
            if name.endswith(suffix):
                base = name[:-len(suffix)]
                halves = pending.setdefault(base, {})
                halves[suffix] = tensor
                if len(halves) == 2:
                    del pending[base]
                    w = dequantize_mxfp4(halves[BLOCKS_SUFFIX], halves[SCALES_SUFFIX], dtype)
                    yield base, w.transpose(-1, -2).contiguous()
                break
        else:
            yield name, tensor
    for base, halves in pending.items():
        have = next(iter(halves))
        need = SCALES_SUFFIX if have == BLOCKS_SUFFIX else BLOCKS_SUFFIX
        raise ValueError(f"MXFP4 checkpoint: weight {base + have!r} has no {base + need!r}")
