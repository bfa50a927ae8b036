"""How much memory a device has left, and a clear error before allocating past it."""
from __future__ import annotations

import os

import torch

GIB = 1 << 30


def available_bytes(device: torch.device) -> int:
    """Free memory on device: CUDA's free bytes, or the host's MemAvailable (Linux; where
    /proc/meminfo is missing, the physical memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def require_bytes(num_bytes: int, device: torch.device, what: str):
    """A ValueError naming `what` when num_bytes more would not fit on device."""
    free = available_bytes(device)
    if num_bytes > free:
        raise ValueError(f"{what} needs {num_bytes / GIB:.2f} GiB, more than the "
                         f"{free / GIB:.2f} GiB free on {device}")
