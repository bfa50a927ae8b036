"""Dynamic trees as pure tensor functions: pruning against brute-force enumeration,
acceptance against a walk from the root, forced paths, ancestor matrices, the moves of the
accepted path, and the tree options' validation."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from onespec import Eagle3Config
from onespec.engine.kv_cache import allocate_kv_cache
from onespec.speculative.tree import (ancestor_matrix, compact_cache, compact_rows, depths_of,
                                      forced_tree_accept, select_tree, tree_accept)


def random_candidates(rng: random.Random, top_k: int, depth: int):
    """Candidates as the expansion makes them: top_k under the root, then top_k children
    for each of top_k frontier nodes per depth; distinct scores, a child below its parent."""
    scores, parents, frontier = [], [], []
    for i in range(top_k):
        scores.append(-rng.uniform(0.01, 2.0))
        parents.append(-1)
        frontier.append(i)
    for _ in range(1, depth):
        children = []
        for f in frontier:
            for _ in range(top_k):
                parents.append(f)
                scores.append(scores[f] - rng.uniform(0.01, 2.0))
                children.append(len(scores) - 1)
        frontier = sorted(children, key=lambda c: -scores[c])[:top_k]
    return scores, parents


def brute_force_best(scores, parents, n):
    """The size-n set closed under parents with the largest total score, by enumeration."""
    best, best_sum = None, float("-inf")
    for subset in itertools.combinations(range(len(scores)), n):
        chosen = set(subset)
        if all(parents[c] < 0 or parents[c] in chosen for c in subset):
            total = sum(scores[c] for c in subset)
            if total > best_sum:
                best, best_sum = subset, total
    return best


def test_select_tree_worked_example():
    tokens, parents = select_tree(torch.tensor([[-.1, -.5, -.3, -.9]]),
                                  torch.tensor([[10, 11, 12, 13]]),
                                  torch.tensor([[-1, -1, 0, 0]]), 3)
    assert tokens.tolist() == [[10, 11, 12]]
    assert parents.tolist() == [[0, 0, 1]]


@pytest.mark.parametrize("top_k,depth,n", [(2, 2, 3), (2, 3, 4), (3, 2, 5), (2, 3, 6), (1, 4, 4)])
def test_select_tree_matches_brute_force(top_k, depth, n):
    rng = random.Random(top_k * 100 + depth * 10 + n)
    for _ in range(5):
        scores, cand_parents = random_candidates(rng, top_k, depth)
        want = brute_force_best(scores, cand_parents, n)
        tokens, parents = select_tree(torch.tensor([scores]), torch.arange(len(scores))[None],
                                      torch.tensor([cand_parents]), n)
        kept = tokens[0].tolist()          # tokens are the candidate indices here
        assert tuple(kept) == want
        for i, p in enumerate(parents[0].tolist()):      # a valid tree in parent-first order
            assert p <= i
            assert (cand_parents[kept[i]] < 0) == (p == 0)
            if p:
                assert kept[p - 1] == cand_parents[kept[i]]


def test_select_tree_keeps_parents_on_ties():
    """A child with log-probability 0 ties with its parent: the parent is kept first."""
    tokens, parents = select_tree(torch.tensor([[-1.0, -1.0, -3.0]]),
                                  torch.tensor([[5, 6, 7]]), torch.tensor([[-1, 0, -1]]), 1)
    assert tokens.tolist() == [[5]] and parents.tolist() == [[0]]


def test_ancestor_matrix_and_depths():
    parents = torch.tensor([[0, 0, 1, 3]])               # rows 1,2 under root, 3 under 1, 4 under 3
    anc = ancestor_matrix(parents, 3)[0].int().tolist()
    assert anc[4] == [1, 1, 0, 1, 1]
    assert anc[2] == [1, 0, 1, 0, 0]
    assert depths_of([0, 0, 1, 3]) == [0, 1, 1, 2, 3]


def test_tree_accept_worked_example():
    parents = torch.tensor([[0, 0, 2]])
    accepted, n, path = tree_accept(torch.tensor([[7, 8, 9]]), parents,
                                    ancestor_matrix(parents, 3), torch.tensor([[8, 5, 9, 4]]), 3)
    assert path.tolist() == [[0, 2, 3, 3]]               # past the path: its own index
    assert accepted[0, :3].tolist() == [8, 9, 4]
    assert n.tolist() == [3]


def walk(tokens, parents, target):
    """Acceptance by walking from the root: follow the child equal to the target's token."""
    cur, path = 0, [0]
    while True:
        nxt = [i + 1 for i, p in enumerate(parents) if p == cur and tokens[i] == target[cur]]
        if not nxt:
            return [target[r] for r in path], path
        cur = nxt[0]
        path.append(cur)


def random_tree(rng: random.Random, n: int, depth: int, vocab: int):
    parents, depths, tokens = [], [0], []
    for i in range(n):
        p = rng.choice([r for r in range(i + 1)
                        if depths[r] < depth and parents.count(r) < vocab])
        siblings = {tokens[j] for j in range(i) if parents[j] == p}
        tokens.append(rng.choice([t for t in range(vocab) if t not in siblings]))
        parents.append(p)
        depths.append(depths[p] + 1)
    return tokens, parents


def test_tree_accept_matches_walk_from_root():
    rng = random.Random(0)
    depth, n, vocab = 4, 9, 4
    trees = [random_tree(rng, n, depth, vocab) for _ in range(200)]
    tokens = torch.tensor([t for t, _ in trees])
    parents = torch.tensor([p for _, p in trees])
    target = torch.randint(0, vocab, (len(trees), n + 1),
                           generator=torch.Generator().manual_seed(1))
    accepted, num, path = tree_accept(tokens, parents, ancestor_matrix(parents, depth),
                                      target, depth)
    lengths = set()
    for b, (t, p) in enumerate(trees):
        want, want_path = walk(t, p, target[b].tolist())
        assert num[b] == len(want)
        assert accepted[b, :len(want)].tolist() == want
        assert path[b, :len(want)].tolist() == want_path
        lengths.add(len(want))
    assert len(lengths) >= 3                               # the cases reach several depths


def test_forced_path_reaches_the_forced_depth():
    parents = torch.tensor([[0, 0, 2, 2, 3], [0, 0, 2, 2, 3]])   # rows 3, 4 under 2; 5 under 3
    anc = ancestor_matrix(parents, 3)
    target = torch.arange(12).view(2, 6)
    accepted, n, path = forced_tree_accept(anc, target, 3, torch.tensor([4, 1]))
    assert n.tolist() == [4, 1]
    assert path[0].tolist() == [0, 2, 3, 5] and accepted[0].tolist() == [0, 2, 3, 5]
    assert path[1, 0] == 0 and accepted[1, 0] == 6
    parents = torch.tensor([[0, 0, 2, 0]])        # depth 2 at most: a forced 4 stops there
    accepted, n, path = forced_tree_accept(ancestor_matrix(parents, 3),
                                           torch.tensor([[5, 6, 7, 8, 9]]), 3, torch.tensor([4]))
    assert n.tolist() == [3] and path[0].tolist()[:3] == [0, 2, 3]


def test_compact_rows_moves_accepted_path():
    x = torch.arange(11).float()[:, None]          # 1 context row, 2 requests of 5 rows
    out = compact_rows(x, 1, 5, torch.tensor([[0, 2, 4], [0, 1, 2]]))
    assert out[:, 0].tolist() == [0, 1, 3, 5, 4, 5, 6, 7, 8, 9, 10]


class _Attn(torch.nn.Module):
    """What allocate_kv_cache reads of an attention layer."""
    def __init__(self, heads: int, dim: int, dtype=torch.float32):
        super().__init__()
        self.num_kv_heads, self.head_dim = heads, dim
        self.o_proj = torch.nn.Linear(1, 1, dtype=dtype)


@pytest.mark.parametrize("given", ["all", "some"])
def test_compact_cache_moves_every_layer_of_a_pool_at_once(given):
    """The target's layers share one cache tensor; moving the accepted paths' entries of all
    of them is one index operation, and gives what moving each layer's keys and values
    does. Layers of another pool (the drafter's), of another shape, and (given "some")
    the pool's layers not passed keep their entries."""
    torch.manual_seed(0)
    target = [_Attn(2, 4) for _ in range(3)] + [_Attn(1, 8)]
    draft = [_Attn(2, 4)]
    for layers in (target, draft):
        allocate_kv_cache(layers, 6, 4, "cpu")
    pool = target[0].kv_pool
    assert pool.shape == (2, 3, 24, 2, 4) and target[3].kv_pool is not pool
    assert draft[0].kv_pool is not pool and target[1].k_cache.data_ptr() == pool[0, 1].data_ptr()
    caches = [c for a in target + draft for c in (a.k_cache, a.v_cache)]
    for c in caches:
        c.copy_(torch.randn(c.shape))
    before = [c.clone() for c in caches]
    tables = torch.tensor([[3, 0, 5], [1, 2, 4]])
    base = torch.tensor([2, 5])                                # P of each request
    path = torch.tensor([[0, 2, 3, 6], [0, 1, 4, 3]])    # (a row past the path: itself)
    moved = target if given == "all" else target[1:]
    compact_cache(moved, tables, base, path, 4)

    def slot(g, p):
        return int(tables[g, p // 4]) * 4 + p % 4
    for a, (k0, v0) in zip(target + draft, zip(before[::2], before[1::2])):
        want_k, want_v = k0.clone(), v0.clone()
        if a in moved:
            for g in range(2):
                for d in range(4):
                    src, dst = slot(g, int(base[g] + path[g, d])), slot(g, int(base[g]) + d)
                    want_k[dst], want_v[dst] = k0[src], v0[src]
        assert torch.equal(a.k_cache, want_k) and torch.equal(a.v_cache, want_v)
    assert not torch.equal(target[1].k_cache, before[2])


@pytest.mark.parametrize("kw,field", [
    (dict(dynamic_tree_max_topK=0), "dynamic_tree_max_topK"),
    (dict(max_total_draft_tokens=2), "max_total_draft_tokens"),       # < depth 3
    (dict(max_total_draft_tokens=100), "max_total_draft_tokens"),     # > 4 + 2·16 scored
    (dict(max_draft_len=0), "max_draft_len"),
    (dict(use_rejection_sampling=True), "use_rejection_sampling"),
    (dict(draft_len_schedule={4: 2}), "draft_len_schedule"),
    (dict(use_dynamic_tree=1), "use_dynamic_tree"),
    (dict(draft_len_schedule="auto"), "draft_len_schedule='auto'"),
    (dict(force_acceptance_rates=(0.5, 0.5, 0.5)), "force_acceptance_rates"),
    (dict(use_sa_enhancer=True), "use_sa_enhancer"),
])
def test_tree_options_are_validated(kw, field):
    with pytest.raises(ValueError, match=field):
        Eagle3Config("head", **{"max_draft_len": 3, "use_dynamic_tree": True, **kw})


def test_tree_defaults():
    cfg = Eagle3Config("head", max_draft_len=6, use_dynamic_tree=True)
    assert (cfg.dynamic_tree_max_topK, cfg.max_total_draft_tokens) == (4, 24)
    assert Eagle3Config("head", use_dynamic_tree=True,
                        draft_len_schedule={1: 3, 8: 0}).draft_len_schedule == {1: 3, 8: 0}
