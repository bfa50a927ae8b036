"""What every kernel launch needs: the interpreter check, the GPU's generation and shared
memory, and programmatic dependent launch (PDL).

Under PDL (Hopper and newer, compiled Triton) a kernel may start while its predecessor
finishes, and waits for it (gdc_wait) before reading anything the predecessor wrote.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Triton's own switch: kernels run in its interpreter (the CPU test suite)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A small kernel's start under PDL: wait for the predecessor, then let the successor
    launch (it only waits, so it takes no SM time this kernel needs)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def hopper(device: torch.device) -> bool:
    """Compiled Triton on Hopper or newer (PDL, 227 KB of shared memory per block)."""
    return device.type == "cuda" and not INTERPRETED and \
        torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def block_smem(device: torch.device) -> int:
    """Shared memory one block may use (sm_90: 227 KB; an SM holds 1 KB more per block)."""
    if device.type != "cuda" or INTERPRETED:
        return 232448
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return props["max_shared_mem"]


def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with PDL."""
    return hopper(device)


def pdl_launch(pdl: bool) -> dict:
    """The launch keywords of a kernel launched with (or without) PDL."""
    return {"launch_pdl": True} if pdl else {}


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along its last dimension (rows may keep any stride)."""
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit
def dot_t(a, b, IEEE: tl.constexpr):
    """a [M, K] . b^T ([N, K]) in float32: IEEE float32 products for float32 inputs or in
    Triton's interpreter (whose bf16 dot is wrong), else the tensor cores'."""
    if IEEE:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    return tl.dot(a, tl.trans(b))
