"""A step's inputs cross ranks as flat per-dtype buffers and a header of host values
(distributed/broadcast.py): unpacking gives back every tensor, in place, once each."""
from dataclasses import dataclass

import pytest
import torch

from onespec.distributed.broadcast import TensorRef, pack, unpack


@dataclass(frozen=True)
class Inner:
    rows: torch.Tensor          # [N]
    host_rows: tuple[int, ...]


@dataclass
class Outer:
    ids: torch.Tensor           # [T]
    mask: torch.Tensor          # [2, 3] bool
    inner: Inner
    again: torch.Tensor         # the same tensor as ids
    nothing: None = None
    k: int = 3


def test_pack_round_trip_sends_each_tensor_once_and_only_host_values_in_the_header():
    ids = torch.tensor([5, 6, 7])
    obj = Outer(ids, torch.tensor([[True, False, True]] * 2),
                Inner(torch.tensor([0.5, 1.5]), (0, 1)), ids)
    header, buffers = pack(obj)
    assert [(b.dtype, b.numel()) for b in buffers] == header.buffers == \
        [(torch.int64, 3), (torch.bool, 6), (torch.float32, 2)]
    assert header.nest.fields["again"] == TensorRef(torch.int64, (3,), 0)
    out = unpack(header, [b.clone() for b in buffers])
    assert isinstance(out, Outer) and isinstance(out.inner, Inner)
    for name in ("ids", "mask", "again"):
        assert torch.equal(getattr(out, name), getattr(obj, name))
    assert torch.equal(out.inner.rows, obj.inner.rows) and out.inner.host_rows == (0, 1)
    assert out.nothing is None and out.k == 3
    assert out.again.data_ptr() == out.ids.data_ptr()          # one copy on the wire


@pytest.mark.parametrize("empty", [torch.zeros(0, dtype=torch.int64), torch.zeros(2, 0)])
def test_empty_tensors_keep_their_shape(empty):
    header, buffers = pack([empty])
    assert unpack(header, buffers)[0].shape == empty.shape
