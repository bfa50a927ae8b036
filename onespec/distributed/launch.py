"""Tensor parallelism across machines: every rank started by a launcher (`torchrun`, or
anything that sets torch.distributed's environment), rather than spawned by rank 0.

torchrun runs the same command on every node (`onespec serve ... --tensor-parallel-size N`
or a script building `LLM(..., tensor_parallel_size=N)`) and sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT in each process. The ranks meet through that
store (torch.distributed's env:// rendezvous, which also reuses torchrun's own store) in
two process groups: the tensor-parallel group the layers use (NCCL on CUDA, gloo on the
CPU) and a gloo control group that carries each step's header from rank 0, as the pipes
of ranks.py do for spawned ranks. Rank 0 runs the engine and serves; the constructor on
every other rank builds its RankParts, runs rank 0's steps until rank 0 stops them, and
then ends the process (SystemExit(0)): it never returns an engine.

Failures: a rank that raises prints its traceback and exits 1; its peers' collectives
fail as its connections close, and torchrun stops the job's other processes. A rank whose
rank 0 ends between steps without telling it (a script that never closed its LLM, or a
rank 0 that died: its own exit status says so) exits 0; one that loses rank 0 inside a
step exits 1."""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from onespec.distributed import broadcast
from onespec.distributed.group import TensorParallel, WorkerFailure

STARTUP_TIMEOUT = datetime.timedelta(seconds=600)   # nodes loading their shards
# rank 0 may stay idle for as long as the server has no requests: the other ranks wait
# for its next step that long (a rank 0 that dies closes the connection: noticed at once)
IDLE_TIMEOUT = datetime.timedelta(days=365)
logger = logging.getLogger("onespec.distributed")
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int


def launched_env(size: int) -> LaunchEnv | None:
    """This process's place in a launcher's job for a tensor_parallel_size of `size`, or
    None when no launcher started several processes (rank 0 then spawns the others)."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1:
        return None
    missing = [v for v in ENV if not os.environ.get(v)]
    if missing:
        raise ValueError(f"a launcher set WORLD_SIZE={os.environ['WORLD_SIZE']} but not "
                         f"{', '.join(missing)}: start every rank with torchrun (or set "
                         f"all of {', '.join(ENV)})")
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"tensor_parallel_size={size} but the launcher started "
                         f"WORLD_SIZE={world} processes; start exactly {size} in all "
                         "(torchrun --nnodes M --nproc-per-node P with M * P = "
                         "tensor_parallel_size)")
    return LaunchEnv(int(os.environ["RANK"]), world, int(os.environ["LOCAL_RANK"]))


def local_device(device: torch.device, env: LaunchEnv) -> torch.device:
    """The rank's device: cuda:LOCAL_RANK on CUDA (one GPU per process on each node)."""
    if device.type != "cuda":
        return device
    if torch.cuda.device_count() <= env.local_rank:
        raise ValueError(f"rank {env.rank} has LOCAL_RANK={env.local_rank} but its node "
                         f"has {torch.cuda.device_count()} GPUs visible")
    return torch.device("cuda", env.local_rank)


class _Control:
    """The gloo group of every rank that carries rank 0's messages (pickled objects)."""

    def __init__(self, store, env: LaunchEnv):
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("onespec-control", store),
                                           env.rank, env.world_size, IDLE_TIMEOUT)

    def _broadcast(self, t: torch.Tensor):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()

    def send(self, obj):
        data = torch.frombuffer(bytearray(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)),
                                dtype=torch.uint8)
        self._broadcast(torch.tensor([data.numel()], dtype=torch.int64))
        self._broadcast(data)

    def receive(self):
        size = torch.zeros(1, dtype=torch.int64)
        self._broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._broadcast(data)
        return pickle.loads(data.numpy().tobytes())

    def barrier(self):
        t = torch.zeros(1)
        self.group.allreduce([t]).wait()


def _join(env: LaunchEnv, device: torch.device) -> tuple[TensorParallel, _Control]:
    store, _, _ = next(dist.rendezvous("env://", timeout=STARTUP_TIMEOUT))
    group = TensorParallel.join(env.rank, env.world_size,
                                dist.PrefixStore("onespec-tp", store), device)
    return group, _Control(store, env)


class LaunchedRanks:
    """Rank 0's handle on the launcher's other ranks, with RankGroup's interface (ranks.py)."""

    def __init__(self, env: LaunchEnv, device: torch.device):
        self.env = env
        self.failure: str | None = None
        self.stopped = False
        self.group, self.control = _join(env, device)

    def wait_ready(self):
        """Returns once every rank has built its parts (they meet in a barrier)."""
        try:
            self.control.barrier()
        except RuntimeError as e:
            self._fail(f"a tensor-parallel rank failed during start-up ({e}); see its output")

    def send_header(self, header: broadcast.Header):
        self.check()
        try:
            self.control.send(("step", header))
        except RuntimeError as e:
            self._fail(f"a tensor-parallel rank is gone ({e}); see its output")

    def check(self):
        if self.failure is not None:
            raise WorkerFailure(self.failure)

    def step_failed(self, error: Exception) -> WorkerFailure:
        if self.failure is None:
            self.failure = (f"a step failed on rank 0 ({type(error).__name__}: {error}); "
                            "a rank may have died: see the other ranks' output")
        return WorkerFailure(self.failure)

    def startup_failed(self, error: BaseException) -> WorkerFailure | None:
        if isinstance(error, (ValueError, OSError, KeyboardInterrupt)):
            return None          # rank 0's own error says it (every rank refuses alike)
        return WorkerFailure(f"start-up failed on rank 0 ({type(error).__name__}: {error}); "
                             "a rank may have died: see the other ranks' output")

    def _fail(self, message: str):
        self.failure = message
        raise WorkerFailure(message)

    def shutdown(self):
        """Tells the other ranks to stop (they exit); idempotent."""
        if self.stopped:
            return
        self.stopped = True
        if self.failure is None:
            try:
                self.control.send(("stop", None))
            except RuntimeError:       # a rank is gone already: the others' sends fail too
                pass


def follow(config, speculative_config, features: frozenset, env: LaunchEnv,
           device: torch.device):
    """Rank env.rank (not 0): joins, builds its parts, runs rank 0's steps until rank 0
    stops; then the process ends (SystemExit(0)), or on an error prints it and exits 1."""
    from onespec.engine.parts import RankParts     # (it imports this package)
    try:
        group, control = _join(env, device)
        parts = RankParts.build(config, speculative_config, group, features)
        control.barrier()
        while True:
            try:
                kind, header = control.receive()
            except RuntimeError:   # rank 0's process ended between steps without a word
                kind = "gone"      # (a script that never closed its LLM): nothing is lost
            if kind != "step":
                break
            parts.worker.step(broadcast.receive(group, header))
    except BaseException:      # noqa: BLE001 - said on this rank's output, then exit
        traceback.print_exc()
        print(f"onespec: tensor-parallel rank {env.rank} failed", file=sys.stderr)
        raise SystemExit(1) from None
    logger.info("tensor-parallel rank %d: rank 0 %s, exiting", env.rank,
                "stopped" if kind == "stop" else "is gone")
    raise SystemExit(0)
