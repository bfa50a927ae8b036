"""Tensor parallelism over torch.distributed (docs/ARCHITECTURE.md, "Tensor parallelism").

group.py: one rank's process group and its collectives; layers.py: Megatron-style sharded
layers and the checkpoint slicing that fills them; workers.py: the driver's worker
processes (start, per-step inputs, liveness, shutdown) and their follow loop.
"""
from onespec.distributed.group import TensorParallel, WorkerFailure

__all__ = ["TensorParallel", "WorkerFailure"]
