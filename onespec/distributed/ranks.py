"""Rank 0's side of tensor parallelism: ranks 1..N-1 as processes it starts and stops.

Rank 0 (the caller's process) runs the engine: it schedules, and before each step it sends
every other rank that step's StepInputs: a small header of host values over the rank's
pipe, the tensors by broadcast (broadcast.py). Then every rank runs the same
SpecWorker.step on its shards, the collectives inside keeping them in lockstep, and only
rank 0's results are read. The other ranks build only what they run (engine/parts.py:
their shards, KV cache tensors and SpecWorker), no scheduler or tokenizer. A rank that
dies or raises becomes a WorkerFailure in the caller: its pipe and its process are
watched every step, and the collectives of a step whose peer died fail as soon as the
connection closes (or after COLLECTIVE_TIMEOUT_S if a rank hangs). The ranks ignore
Ctrl-C (rank 0 stops them) and exit when rank 0's end of their pipe closes, so none
outlives it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import traceback
import weakref

import torch

from onespec.distributed import broadcast, launch
from onespec.distributed.attention_dp import check_attention_dp
from onespec.distributed.group import TensorParallel, WorkerFailure, rendezvous_store
from onespec.distributed.layers import check_tensor_parallel
from onespec.models.loader import read_config
from onespec.models.registry import resolve_device

STARTUP_TIMEOUT_S = 600      # loading a large checkpoint shard
STOP_TIMEOUT_S = 5


def dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def start_ranks(config, speculative_config, features: frozenset
                ) -> "RankGroup | launch.LaunchedRanks | None":
    """The other ranks of a tensor-parallel engine (None for one rank), after checking
    that the checkpoint and devices allow the split. features: the configuration's
    (combinations.py), which each rank checks again once its target is loaded. Under a
    launcher (torchrun: launch.py) the ranks exist already: on rank 0 this joins them, on
    any other rank it runs rank 0's steps and then ends the process."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    if config.enable_attention_dp:
        check_attention_dp(read_config(config.model), size)
    check_tensor_parallel(read_config(config.model), size, config.enable_attention_dp)
    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is not None:
        raise ValueError(f"device={config.device!r}: with tensor_parallel_size > 1 "
                         "rank r runs on cuda:r (cuda:LOCAL_RANK under torchrun); pass "
                         "device='cuda'")
    env = launch.launched_env(size)
    if env is not None:         # torchrun started every rank: rank 0 drives, others follow
        device = launch.local_device(device, env)
        if env.rank != 0:
            launch.follow(config, speculative_config, features, env, device)  # exits
        return launch.LaunchedRanks(env, device)
    if device.type == "cuda":
        if torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs, "
                             f"{torch.cuda.device_count()} visible")
    return RankGroup(config, speculative_config, features, device)


class RankGroup:
    """Ranks 1..N-1 of one engine, started in __init__ (spawned; they load their shards)."""

    def __init__(self, config, speculative_config, features: frozenset, device: torch.device):
        size = config.tensor_parallel_size
        self.store = store = rendezvous_store(size)   # kept: NCCL meets through it lazily
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self.failure: str | None = None
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, name=f"onespec-tp-rank{rank}", daemon=True,
                               args=(rank, size, store.port, config, speculative_config,
                                     features, child))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        try:
            self.group = TensorParallel.join(0, size, store, rank_device(device, 0))
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self):
        """Returns once every rank has built its parts; a WorkerFailure if one failed."""
        for rank, conn in enumerate(self.conns, 1):
            if not conn.poll(STARTUP_TIMEOUT_S):
                self._fail(f"rank {rank} did not start within {STARTUP_TIMEOUT_S} s")
            report = self._reported(rank, conn)
            if report:
                self._fail(report)

    def send_header(self, header: broadcast.Header):
        """Sends one step's header to every other rank (after checking they are alive);
        its tensors follow by broadcast (broadcast.send)."""
        self.check()
        data = dumps(("step", header))
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(self._died(rank))

    def check(self):
        """A WorkerFailure if a rank has died or reported an error (or one did before)."""
        if self.failure is not None:
            raise WorkerFailure(self.failure)
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            report = self._reported(rank, conn) if conn.poll() else None
            if report:
                self._fail(report)
            if not proc.is_alive():
                self._fail(self._died(rank))

    def step_failed(self, error: Exception) -> WorkerFailure:
        """The WorkerFailure for rank 0's step raising `error` (ranks are out of step now):
        the failing rank's own report when there is one."""
        if self.failure is None:
            self.failure = self._failed_rank() or \
                f"rank 0 failed: {type(error).__name__}: {error}"
        return WorkerFailure(self.failure)

    def startup_failed(self, error: BaseException) -> WorkerFailure | None:
        """A WorkerFailure with the report of the rank behind rank 0's start-up `error`
        (e.g. a collective whose peer ran out of memory), or None: rank 0's own error says
        it (a bad setting is refused alike on every rank)."""
        if isinstance(error, (ValueError, OSError, KeyboardInterrupt)):
            return None
        report = self.failure or self._failed_rank()
        return WorkerFailure(report) if report else None

    def _failed_rank(self) -> str | None:
        """The report of the first rank that reported an error or died (within 0.5 s)."""
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), 1):
            report = self._reported(rank, conn) if conn.poll(0.5) else \
                None if proc.is_alive() else self._died(rank)
            if report:
                return report
        return None

    def _reported(self, rank: int, conn) -> str | None:
        """What rank's pipe says: its error, its death (closed), or None (it is ready)."""
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return self._died(rank)
        return None if kind == "ready" else f"tensor-parallel rank {rank} raised:\n{text}"

    def _died(self, rank: int) -> str:
        proc = self.procs[rank - 1]
        proc.join(1.0)
        return (f"tensor-parallel rank {rank} (pid {proc.pid}) died "
                f"(exit code {proc.exitcode})")

    def _fail(self, message: str):
        self.failure = message
        raise WorkerFailure(message)

    def shutdown(self):
        """Stops every rank and leaves the group (also run when the object is collected
        or the interpreter exits); idempotent."""
        self._finalizer()


def _stop(procs, conns):
    """Asks each rank to stop, then terminates, then kills it; leaves the group."""
    for conn in conns:
        try:
            conn.send_bytes(dumps(("stop", None)))
        except OSError:
            pass
    for proc in procs:
        proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.terminate()
            proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


class Rank0Driver:
    """Rank 0's SpecWorker, driving the others: each step's inputs go to them first; a
    step that raises is a WorkerFailure (the ranks' collectives are out of step after it)."""

    def __init__(self, worker, ranks: RankGroup):
        self.worker, self.ranks = worker, ranks

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def step(self, inputs):
        header, buffers = broadcast.pack(inputs)
        self.ranks.send_header(header)
        try:
            broadcast.send(self.ranks.group, buffers)
            return self.worker.step(inputs)
        except Exception as e:
            raise self.ranks.step_failed(e) from e
        except BaseException:       # Ctrl-C inside a step: the other ranks are mid-step
            self.ranks.failure = "a step was interrupted on rank 0 (ranks out of step)"
            raise


def rank_main(rank: int, size: int, port: int, config, speculative_config, features,
              conn):
    """Rank `rank`: joins the group, builds its parts, then runs rank 0's steps."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # rank 0 stops us
    from onespec.engine.parts import RankParts     # (it imports this package)
    try:
        device = rank_device(resolve_device(config.device), rank)
        if device.type == "cpu":            # share the cores with the other ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        group = TensorParallel.join(rank, size, port, device)
        parts = RankParts.build(config, speculative_config, group, features)
        conn.send(("ready", None))
        _follow(parts.worker, group, conn)
    except BaseException:       # noqa: BLE001 - reported to rank 0, then exit
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        sys.exit(1)


def _follow(worker, group: TensorParallel, conn):
    while True:
        try:
            kind, header = pickle.loads(conn.recv_bytes())
        except EOFError:       # rank 0 is gone
            return
        if kind == "stop":
            return
        worker.step(broadcast.receive(group, header))
