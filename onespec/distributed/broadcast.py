"""A step's inputs from rank 0 to the other ranks: the tensors by broadcast, the rest as a
small header over the rank's pipe.

pack() swaps each tensor of a nest of dataclasses, lists, tuples and dicts for a TensorRef
(its dtype, shape and offset) and concatenates the tensors of each dtype into one flat
buffer; the header (the nest with its refs, and each buffer's dtype and length) holds
only host values. Rank 0 broadcasts the buffers (one collective per dtype); each other
rank allocates them on its own device from the header, receives them, and unpack() puts
views of them back in place. A tensor referenced twice travels once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from onespec.distributed.group import TensorParallel


@dataclass(frozen=True)
class TensorRef:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int                 # into the flat buffer of its dtype


@dataclass(frozen=True)
class _Object:
    cls: type
    fields: dict


@dataclass
class Header:
    nest: object                                # the inputs with TensorRefs for tensors
    buffers: list[tuple[torch.dtype, int]]      # (dtype, numel) of each buffer, in order


def pack(obj) -> tuple[Header, list[torch.Tensor]]:
    """The header of obj and its flat buffers, one [N] tensor per dtype, on obj's device."""
    parts: dict[torch.dtype, list[torch.Tensor]] = {}
    sizes: dict[torch.dtype, int] = {}
    seen: dict[int, TensorRef] = {}

    def strip(x):
        if isinstance(x, torch.Tensor):
            if id(x) not in seen:
                offset = sizes.get(x.dtype, 0)
                seen[id(x)] = TensorRef(x.dtype, tuple(x.shape), offset)
                parts.setdefault(x.dtype, []).append(x.reshape(-1))
                sizes[x.dtype] = offset + x.numel()
            return seen[id(x)]
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return _Object(type(x), {k: strip(v) for k, v in vars(x).items()})
        if isinstance(x, (list, tuple)):
            return type(x)(strip(v) for v in x)
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        return x

    nest = strip(obj)
    buffers = [torch.cat(ts) for ts in parts.values()]
    return Header(nest, [(b.dtype, b.numel()) for b in buffers]), buffers


def unpack(header: Header, buffers: list[torch.Tensor]):
    """The inputs header describes, their tensors views of buffers (as pack made them)."""
    by_dtype = {b.dtype: b for b in buffers}

    def fill(x):
        if isinstance(x, TensorRef):
            n = 1
            for d in x.shape:
                n *= d
            return by_dtype[x.dtype][x.offset:x.offset + n].view(x.shape)
        if isinstance(x, _Object):
            obj = object.__new__(x.cls)
            for k, v in x.fields.items():
                object.__setattr__(obj, k, fill(v))
            return obj
        if isinstance(x, (list, tuple)):
            return type(x)(fill(v) for v in x)
        if isinstance(x, dict):
            return {k: fill(v) for k, v in x.items()}
        return x

    return fill(header.nest)


def send(group: TensorParallel, buffers: list[torch.Tensor]):
    """Rank 0: broadcasts the buffers pack() made (their header went ahead)."""
    for b in buffers:
        group.broadcast(b)


def receive(group: TensorParallel, header: Header):
    """Another rank: the inputs of header, their tensors received from rank 0."""
    buffers = [group.broadcast(torch.empty(n, dtype=dtype, device=group.device))
               for dtype, n in header.buffers]
    return unpack(header, buffers)
