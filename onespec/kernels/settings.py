"""The kernels' settings, fixed once when the engine is built (no globals, no environment)."""
from __future__ import annotations

from dataclasses import dataclass

# Rows up to which a forward takes the decode GEMV kernels (padded to a 16- or 32-row
# tile); larger batches run their linears through cuBLAS with Triton row kernels around.
MAX_ROWS = 32


@dataclass(frozen=True)
class KernelSettings:
    """triton: the fused Triton kernels (CUDA) instead of the portable PyTorch operations.
    pdl: launch them with programmatic dependent launch where the GPU has it (Hopper and
    newer): each kernel starts while its predecessor finishes."""
    triton: bool = False
    pdl: bool = True
