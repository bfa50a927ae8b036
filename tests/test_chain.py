"""The overlap scheduler's device-side inputs (kernels/chain.py): the Triton kernel against
its PyTorch reference (in Triton's interpreter without CUDA, see conftest), and the tree
steps' chaining against a loop over the rows."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from onespec.kernels.chain import (chain_inputs, chain_inputs_reference,  # noqa: E402
                                   chain_tree_inputs)
from onespec.speculative.shape import ChainShape, ResultsLayout, TreeShape  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def layout(b: int, k: int, width: int):
    """The chain step's input offsets, written out: ids, positions, drafts, tables,
    sources, end (what ChainShape.input_layout must give)."""
    rows = b * (k + 1)
    o_tables = 2 * rows + b * k
    offsets = 0, rows, 2 * rows, o_tables, o_tables + b * width, o_tables + b * width + b
    lay = ChainShape().input_layout(b, k, width)
    assert (0, lay.pos_at, lay.drafts_at, lay.tables_at, lay.src_at, lay.size) == offsets
    return lay, offsets


@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_chain_inputs_matches_reference(k):
    b, width = 4, 3
    g = torch.Generator().manual_seed(k)
    lay, offsets = layout(b, k, width)
    inp = torch.randint(0, 1000, (offsets[-1],), generator=g)
    # rows 0 and 2 continue rows 2 and 0 of the previous step; 1 and 3 take host inputs
    inp[offsets[4]:] = torch.tensor([2, -1, 0, -1])
    rows = b * (k + 1)
    prev = torch.cat([torch.randint(0, 1000, (rows,), generator=g),
                      torch.randint(1, k + 2, (b,), generator=g),           # accepted 1..k+1
                      torch.randint(0, 1000, (b * k,), generator=g)])
    want = inp.clone()
    chain_inputs_reference(want, prev, lay, ResultsLayout(b, k, k, False))
    got = inp.clone().to(DEV)
    chain_inputs(got, prev.to(DEV), lay, ResultsLayout(b, k, k, False))
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


@pytest.mark.parametrize("depth,nodes", [(1, 2), (4, 10)])
def test_chain_tree_inputs(depth, nodes):
    """A chained tree step's inputs: rows with a source take its last accepted token, its
    new nodes and their parents, and move their positions on by its accepted count; rows
    without one, and everything past the nodes' parents, keep the host's values."""
    b, width, r = 4, 3, nodes + 1
    g = torch.Generator().manual_seed(depth)
    o_tables = 2 * b * r + 2 * b * nodes
    offsets = (0, b * r, 2 * b * r, o_tables, o_tables + b * width, o_tables + b * width + b)
    lay = TreeShape(depth=depth, top_k=2, num_nodes=nodes).input_layout(b, depth, width)
    assert (0, lay.pos_at, lay.drafts_at, lay.tables_at, lay.src_at, lay.size) == offsets
    assert lay.parents_at == offsets[2] + b * nodes
    inp = torch.randint(0, 1000, (offsets[-1],), generator=g)
    inp[offsets[4]:] = torch.tensor([2, -1, 0, -1])
    rows = b * (depth + 1)
    prev = torch.cat([torch.randint(0, 1000, (rows,), generator=g),
                      torch.randint(1, depth + 2, (b,), generator=g),
                      torch.randint(0, 1000, (b * nodes,), generator=g),
                      torch.randint(0, nodes, (b * nodes,), generator=g)])
    want = inp.clone()
    for i, j in ((0, 2), (2, 0)):
        num = int(prev[rows + j])
        drafts = prev[rows + b + j * nodes:rows + b + (j + 1) * nodes]
        parents = prev[rows + b + b * nodes + j * nodes:rows + b + b * nodes + (j + 1) * nodes]
        want[i * r] = prev[j * (depth + 1) + num - 1]
        want[i * r + 1:(i + 1) * r] = drafts
        want[offsets[1] + i * r:offsets[1] + (i + 1) * r] += num
        want[offsets[2] + i * nodes:offsets[2] + (i + 1) * nodes] = drafts
        p0 = offsets[2] + b * nodes + i * nodes
        want[p0:p0 + nodes] = parents
    got = inp.clone().to(DEV)
    chain_tree_inputs(got, prev.to(DEV), lay, ResultsLayout(b, depth, nodes, True))
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(want, inp)


def test_chain_tree_inputs_without_sources_ignore_stale_results():
    """A step with no chained row (a new batch, or a graph of another bucket run before it)
    finds in the results buffer whatever the last step left, in that step's layout: counts
    may be token ids. Nothing is read from there, and nothing fails (an out-of-range gather
    index is a device-side assert on CUDA, fatal to the process)."""
    b, depth, nodes, width = 4, 4, 10, 3
    lay = TreeShape(depth=depth, top_k=3, num_nodes=nodes).input_layout(b, depth, width)
    g = torch.Generator().manual_seed(0)
    inp = torch.randint(0, 1000, (lay.size,), generator=g)
    inp[lay.src_at:] = -1
    prev = torch.randint(100, 1000, (b * (depth + 2 + 2 * nodes),), generator=g)
    got = inp.clone().to(DEV)
    chain_tree_inputs(got, prev.to(DEV), lay, ResultsLayout(b, depth, nodes, True))
    assert torch.equal(got.cpu(), inp)


def test_results_layout_packs_and_unpacks_what_the_shapes_say():
    """accepted | counts | drafts | parents: a chain's without parents, a tree's with its
    N nodes' parents, a tree's K = 0 step a chain's; unpack returns the real rows only."""
    assert ChainShape().results_layout(4, 3) == ResultsLayout(4, 3, 3, False)
    tree = TreeShape(depth=2, top_k=2, num_nodes=3)
    layout = tree.results_layout(2, 2)
    assert layout == ResultsLayout(2, 2, 3, True)
    assert (layout.num_accepted_at, layout.drafts_at, layout.parents_at, layout.size) == \
        (6, 8, 14, 20)
    assert tree.results_layout(2, 0) == ResultsLayout(2, 0, 0, False)
    accepted = torch.tensor([[1, 2, 3], [4, 5, 6]])
    flat = layout.pack(accepted, torch.tensor([2, 1]), torch.tensor([[7, 8, 9], [10, 11, 12]]),
                       torch.tensor([[0, 1, 1], [0, 0, 2]]))
    assert flat.tolist() == [1, 2, 3, 4, 5, 6, 2, 1, 7, 8, 9, 10, 11, 12, 0, 1, 1, 0, 0, 2]
    assert layout.unpack(flat.tolist(), 1) == ([2], [[1, 2, 3]], [[7, 8, 9]], [[0, 1, 1]])
    chain = ChainShape().results_layout(2, 1)
    flat = chain.pack(torch.tensor([[1, 2], [3, 4]]), torch.tensor([1, 2]),
                      torch.tensor([[5], [6]]))
    assert chain.unpack(flat.tolist(), 2) == ([1, 2], [[1, 2], [3, 4]], [[5], [6]], None)


def test_results_layout_of_an_eager_step_has_its_own_draft_rows():
    """An eager step drafts for its generation requests and for prompts finished in the
    step: its drafts have their own row count, read back with unpack(n, n_drafts)."""
    num_acc, drafts = torch.tensor([1, 3]), torch.tensor([[7, 8], [9, 10], [11, 12]])
    layout = ResultsLayout.of(2, num_acc, drafts)
    assert layout == ResultsLayout(2, 2, 2, False, 3)
    flat = layout.pack(torch.tensor([[1, 2, 3], [4, 5, 6]]), num_acc, drafts)
    assert layout.size == flat.numel() == 6 + 2 + 6
    assert layout.unpack(flat.tolist(), 2, 3) == ([1, 3], [[1, 2, 3], [4, 5, 6]],
                                                  [[7, 8], [9, 10], [11, 12]], None)
