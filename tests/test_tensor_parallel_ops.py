"""The tensor-parallel layers through each backend (tensor_parallel_ops), on two gloo
ranks: this process and one spawned. Each rank holds half of a row-parallel linear's input
columns and half of a vocabulary-parallel LM head; what the sharded layers give through
the PyTorch backend and through the Triton backend (Triton's interpreter without CUDA)
must equal the whole layers through PyTorch on one rank."""
from __future__ import annotations

import importlib.util
import multiprocessing as mp
import traceback

import pytest
import torch
from torch import nn

from onespec.distributed.group import TensorParallel, rendezvous_store
from onespec.distributed.layers import (ParallelLMHead, RowParallelLinear,
                                        tensor_parallel_ops)
from onespec.kernels.settings import KernelSettings
from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TORCH_OPS, make_ops

HIDDEN, INTER, VOCAB, ROWS = 64, 96, 101, 8      # a vocabulary 2 ranks split unevenly
BACKENDS = ["torch"] + (["triton"] if importlib.util.find_spec("triton") else [])


def _layers(seed: int = 0):
    """The whole layers: down (INTER -> HIDDEN, with bias), a norm, an LM head; inputs."""
    gen = torch.Generator().manual_seed(seed)
    down = nn.Linear(INTER, HIDDEN)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    norm = RMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        for p in (down.weight, down.bias, head.weight, norm.weight):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (1.0 if p is norm.weight else 0))
    x = torch.randn(ROWS, INTER, generator=gen)
    residual = torch.randn(ROWS, HIDDEN, generator=gen)
    h = torch.randn(ROWS, HIDDEN, generator=gen)
    return down, head, norm, x, residual, h


def _results(ops, down, head, norm, x, residual, h) -> dict[str, torch.Tensor]:
    out = {"linear": ops.linear(down, x, residual)}
    out["add_norm_h"], out["add_norm"] = ops.add_norm(down, x, residual, norm)
    out["full_h"], out["full"] = ops.add_full_norm(down, x, residual, norm)
    out["logits"] = ops.logits(head, h, norm)
    out["greedy"] = ops.greedy(head, h, norm)
    return out


def _sharded_results(tp: TensorParallel, backend: str) -> dict[str, torch.Tensor]:
    down, head, norm, x, residual, h = _layers()
    cols = slice(*tp.shard_range(INTER))
    row = RowParallelLinear(INTER // tp.world_size, HIDDEN, True, tp)
    lm = ParallelLMHead(HIDDEN, VOCAB, tp)
    with torch.no_grad():
        row.weight.copy_(down.weight[:, cols])
        row.bias.copy_(down.bias)
        lm.weight.zero_()
        part = head.weight[lm.start:lm.start + lm.num_valid]
        lm.weight[:part.shape[0]].copy_(part)
    ops = tensor_parallel_ops(make_ops(KernelSettings(triton=backend == "triton")))
    with torch.no_grad():
        return _results(ops, row, lm, norm, x[:, cols], residual, h)


def _rank1(port: int, backend: str, queue, received):
    try:
        tp = TensorParallel.join(1, 2, port, torch.device("cpu"))
        queue.put(("ok", _sharded_results(tp, backend)))
    except BaseException:       # noqa: BLE001 - reported to the test
        queue.put(("error", traceback.format_exc()))
    # the tensors travel as file descriptors this process serves: it stays until rank 0
    # has them (exiting first resets rank 0's connection)
    received.wait(120)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_layers_equal_whole_layers(backend):
    with torch.no_grad():
        want = _results(TORCH_OPS, *_layers())
    store = rendezvous_store(2)
    ctx = mp.get_context("spawn")
    queue, received = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_rank1, args=(store.port, backend, queue, received),
                       daemon=True)
    proc.start()
    try:
        tp = TensorParallel.join(0, 2, store, torch.device("cpu"))
        got = _sharded_results(tp, backend)
        kind, other = queue.get(timeout=120)
        assert kind == "ok", other
    finally:
        received.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    for name, value in want.items():
        for rank, result in enumerate((got, other)):
            if name == "greedy":       # the same token ids, on every rank
                assert torch.equal(result[name], value), (name, rank)
            else:
                torch.testing.assert_close(result[name], value, atol=2e-5, rtol=2e-5,
                                           msg=f"{name} on rank {rank} ({backend})")
    shard = -(-VOCAB // 2)           # the greedy tokens come from both ranks' rows
    assert (want["greedy"] < shard).any() and (want["greedy"] >= shard).any()
