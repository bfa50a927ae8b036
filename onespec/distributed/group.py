"""One rank's view of the tensor-parallel group: its rank, its device, and the three
collectives the sharded layers need, on torch.distributed's default process group (NCCL
on CUDA, gloo on the CPU). One tensor-parallel engine per process."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective waits this long for a rank that is alive but stuck; a rank that died is
# noticed at once (its connections close), and the driver checks liveness every step.
COLLECTIVE_TIMEOUT_S = 60


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died or raised: the engine cannot step any more."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def init(cls, rank: int, world_size: int, port: int, device: torch.device
             ) -> "TensorParallel":
        """Joins the group (rank 0 hosts the rendezvous on 127.0.0.1:port)."""
        if dist.is_initialized():
            raise ValueError("this process already belongs to a torch.distributed group: "
                             "one tensor-parallel engine per process (close the other first)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        return cls(rank, world_size, device)

    @staticmethod
    def destroy():
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums t over the ranks, in place (every rank ends with the same bytes)."""
        dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's t stacked in rank order: [world_size, *t.shape]."""
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.stack(parts)

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. KV blocks each GPU has room for)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `total` (divisible by world_size)."""
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size
