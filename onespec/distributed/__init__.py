"""Tensor parallelism over torch.distributed (docs/ARCHITECTURE.md, "Tensor parallelism").

group.py: one rank's process group and its collectives; layers.py: Megatron-style sharded
layers and the checkpoint slicing that fills them; ranks.py: rank 0's RankGroup of the
other ranks' processes (start, liveness, shutdown), its Rank0Driver and their follow loop;
broadcast.py: a step's inputs from rank 0 to the others (tensors by broadcast);
attention_dp.py: attention data parallelism (each rank attends for its own requests).
"""
from onespec.distributed.group import TensorParallel, WorkerFailure

__all__ = ["TensorParallel", "WorkerFailure"]
