"""The overlap scheduler's device-side inputs (kernels/chain.py): the Triton kernel against
its PyTorch reference (in Triton's interpreter without CUDA, see conftest)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from onespec.kernels.chain import chain_inputs, chain_inputs_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def layout(b: int, k: int, width: int):
    rows = b * (k + 1)
    o_tables = 2 * rows + b * k
    return 0, rows, 2 * rows, o_tables, o_tables + b * width, o_tables + b * width + b


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_chain_inputs_matches_reference(k):
    b, width = 4, 3
    g = torch.Generator().manual_seed(k)
    offsets = layout(b, k, width)
    inp = torch.randint(0, 1000, (offsets[-1],), generator=g)
    # rows 0 and 2 continue rows 2 and 0 of the previous step; 1 and 3 take host inputs
    inp[offsets[4]:] = torch.tensor([2, -1, 0, -1])
    rows = b * (k + 1)
    prev = torch.cat([torch.randint(0, 1000, (rows,), generator=g),
                      torch.randint(1, k + 2, (b,), generator=g),           # accepted 1..k+1
                      torch.randint(0, 1000, (b * k,), generator=g)])
    want = inp.clone()
    chain_inputs_reference(want, prev, offsets, b, k)
    got = inp.clone().to(DEV)
    chain_inputs(got, prev.to(DEV), offsets, b, k)
    assert torch.equal(got.cpu(), want)
    # the reference itself: row 0 is row 2's last accepted token and its drafts
    num = int(prev[rows + 2])
    assert want[0] == prev[2 * (k + 1) + num - 1]
    assert torch.equal(want[1:k + 1], prev[rows + b + 2 * k:rows + b + 3 * k])
    assert torch.equal(want[offsets[1]:offsets[1] + k + 1], inp[offsets[1]:offsets[1] + k + 1]
                       + num)
    untouched = torch.ones_like(inp, dtype=torch.bool)
    for i in (0, 2):
        untouched[i * (k + 1):(i + 1) * (k + 1)] = False
        untouched[offsets[1] + i * (k + 1):offsets[1] + (i + 1) * (k + 1)] = False
        untouched[offsets[2] + i * k:offsets[2] + (i + 1) * k] = False
    assert torch.equal(want[untouched], inp[untouched])
