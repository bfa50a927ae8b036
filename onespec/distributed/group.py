"""One rank's view of the tensor-parallel group: its rank, its device, and the collectives
the sharded layers need, on a torch.distributed process group of its own (NCCL on CUDA,
gloo on the CPU) rather than the process-wide default group, so a process may hold more
than one tensor-parallel engine (one after another in tests, or side by side)."""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# A collective waits this long for a rank that is alive but stuck; a rank that died is
# noticed at once (its connections close), and the driver checks liveness every step.
COLLECTIVE_TIMEOUT_S = 60
_TIMEOUT = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died or raised: the engine cannot step any more."""


def rendezvous_store(world_size: int) -> dist.TCPStore:
    """The driver's store on a free port of 127.0.0.1 (its .port goes to the workers)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=_TIMEOUT)


@dataclass
class TensorParallel:
    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup = field(repr=False)
    # enable_attention_dp: attention whole on every rank, each attending for its own
    # requests (attention_dp.py); set by engine/parts.py before the model is built
    attention_dp: bool = False

    @classmethod
    def join(cls, rank: int, world_size: int, store_or_port, device: torch.device
             ) -> "TensorParallel":
        """Joins the group: rank 0 passes its rendezvous store, the others its port."""
        store = store_or_port if isinstance(store_or_port, dist.Store) else \
            dist.TCPStore("127.0.0.1", store_or_port, world_size, is_master=False,
                          timeout=_TIMEOUT)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = _TIMEOUT
            group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            group = dist.ProcessGroupGloo(store, rank, world_size, _TIMEOUT)
        return cls(rank, world_size, device, group)

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduces t over the ranks, in place (every rank ends with the same bytes)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.group.allreduce([t], opts).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's t stacked in rank order: [world_size, *t.shape]."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self.group.allgather([parts], [t]).wait()
        return torch.stack(parts)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's t into every rank's t (same shape and dtype, contiguous), in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()
        return t

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. KV blocks each GPU has room for)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())

    def shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `total` (divisible by world_size)."""
        size = total // self.world_size
        return self.rank * size, (self.rank + 1) * size
