"""The recurrent-state pool of hybrid targets, beside the paged KV pool.

A recurrent layer (models/qwen3_next.py GatedDeltaNet) keeps, per request, a fixed-size
state (its conv inputs and its delta-rule / SSM state) that cannot be rolled back by
moving `num_computed` as paged KV can. So:

- every running request holds one slot (`Request.state_slot`), taken when the scheduler
  admits it and given back on every exit (finish, abort, error, preemption: a preempted
  request recomputes from position 0, where a layer starts from zeros);
- a forward never writes the slots: each request leaves snapshots in a scratch buffer
  (a prompt chunk its state after its last row, a generation request the state after
  each of its K+1 verify rows), and the step commits one snapshot per request into its
  slot once acceptance is known (speculative/shape.py ChainShape.commit_states: the
  state after the last accepted input). A rejected draft leaves no trace in any slot,
  and a step that raises before its commit leaves every slot as it was.

Each layer holds `states[name]` [slots, ...] and `snapshots[name]` [rows, ...] for the
names and shapes its `state_shapes(dtype)` gives; the pool hands out slot ids. One more
slot (`scratch_slot`) is never handed out: a CUDA-graph step's padding requests read and
commit it (engine/cuda_graph.py), as their KV goes to a scratch block.

Nothing here syncs with the host once a RecurrentBatch is built: its slots are a device
tensor (a graph's input buffer, written before each replay), its segments fixed by the
batch's shape, and the commit an index copy on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def state_bytes(layers, dtype: torch.dtype) -> int:
    """Bytes of one request's state over `layers` (one slot, or one snapshot row)."""
    total = 0
    for layer in layers:
        for shape, dt in layer.state_shapes(dtype).values():
            n = 1
            for d in shape:
                n *= d
            total += n * dt.itemsize
    return total


@dataclass
class RecurrentBatch:
    """One step's requests as the recurrent layers see them, in batch order (prompt
    chunks, then generation requests of `gen_rows` rows each)."""
    slots: torch.Tensor          # [B] state slot of each request
    fresh: torch.Tensor          # [B] bool: starts at position 0 (zero state)
    q_lens: list[int]            # rows of each request
    num_ctx: int
    gen_rows: int                # rows of a generation request (K + 1)

    @property
    def num_gen(self) -> int:
        return len(self.q_lens) - self.num_ctx

    def segments(self):
        """(rows, requests, snapshot rows, keep_all) per run of the recurrence: prompt
        chunks, consecutive ones of one length together (one snapshot each: its final
        state), then the generation requests together (a snapshot after every row)."""
        dev = self.slots.device
        start, i = 0, 0
        while i < self.num_ctx:
            n, j = self.q_lens[i], i + 1
            while j < self.num_ctx and self.q_lens[j] == n:
                j += 1
            yield slice(start, start + n * (j - i)), list(range(i, j)), \
                torch.arange(i, j, device=dev), False
            start, i = start + n * (j - i), j
        if self.num_gen:
            b, rows = self.num_gen, self.gen_rows
            snaps = torch.arange(self.num_ctx, self.num_ctx + b * rows, device=dev)
            yield slice(start, start + b * rows), list(range(self.num_ctx, self.num_ctx + b)), \
                snaps, True

    @staticmethod
    def select(reqs: list[int]) -> slice:
        """The batch positions of a segment's requests (consecutive) as a slice: indexing
        with it copies nothing from the host (a CUDA graph captures it)."""
        return slice(reqs[0], reqs[-1] + 1)

    def initial(self, states: dict[str, torch.Tensor], reqs: list[int]) -> dict:
        """The requests' states before this step: their slots', zeros where fresh."""
        idx = self.select(reqs)
        slots, fresh = self.slots[idx], self.fresh[idx]
        out = {}
        for name, pool in states.items():
            s = pool[slots]
            out[name] = torch.where(fresh.view(-1, *[1] * (s.dim() - 1)), 0, s)
        return out

    @staticmethod
    def save(snapshots: dict[str, torch.Tensor], rows: torch.Tensor, values: dict):
        """Writes states (final [n, ...] or per row [n, L, ...]) to snapshot `rows`."""
        for name, v in values.items():
            pool = snapshots[name]
            snapshots[name][rows] = v.reshape(-1, *pool.shape[1:]).to(pool.dtype)

    def snapshot_rows(self, gen_offsets: torch.Tensor) -> torch.Tensor:
        """[B] snapshot row each request commits: a prompt chunk its own, a generation
        request the row `gen_offsets` [Bg] into its K+1."""
        dev = self.slots.device
        ctx = torch.arange(self.num_ctx, device=dev)
        gen = self.num_ctx + torch.arange(self.num_gen, device=dev) * self.gen_rows + \
            gen_offsets.to(dev)
        return torch.cat([ctx, gen])


class StatePool:
    """Slots of recurrent state for `num_slots` requests (plus the scratch slot), and
    `num_snapshots` scratch rows (a step's prompt chunks plus its generation requests' K+1
    rows)."""

    def __init__(self, layers, num_slots: int, num_snapshots: int, dtype: torch.dtype,
                 device):
        self.layers = list(layers)
        self.num_slots = num_slots
        self.scratch_slot = num_slots        # padding requests' (never handed out)
        for layer in self.layers:
            shapes = layer.state_shapes(dtype)
            layer.states = {n: torch.zeros(num_slots + 1, *s, dtype=dt, device=device)
                            for n, (s, dt) in shapes.items()}
            layer.snapshots = {n: torch.zeros(num_snapshots, *s, dtype=dt, device=device)
                               for n, (s, dt) in shapes.items()}
        self.free_slots = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int:
        if not self.free_slots:
            raise RuntimeError(f"recurrent state pool exhausted ({self.num_slots} slots)")
        return self.free_slots.pop()

    def free(self, slot: int):
        self.free_slots.append(slot)

    def batch(self, context, generation, k: int, device) -> RecurrentBatch:
        """The RecurrentBatch of a scheduled step (context chunks, generation requests)."""
        reqs = [c.req for c in context] + list(generation)
        missing = [r.request_id for r in reqs if r.state_slot is None]
        if missing:
            raise RuntimeError(f"request {missing[0]} holds no recurrent state slot")
        return RecurrentBatch(
            slots=torch.tensor([r.state_slot for r in reqs], dtype=torch.int64, device=device),
            fresh=torch.tensor([c.start == 0 for c in context] + [False] * len(generation),
                               device=device),
            q_lens=[c.length for c in context] + [k + 1] * len(generation),
            num_ctx=len(context), gen_rows=k + 1)

    def commit(self, rb: RecurrentBatch, gen_offsets: torch.Tensor):
        """Copies each request's chosen snapshot (RecurrentBatch.snapshot_rows) into its
        slot, for every layer and state: index copies on the device, gen_offsets a device
        tensor (the accepted counts less one), so a graph captures it."""
        src = rb.snapshot_rows(gen_offsets)
        for layer in self.layers:
            for name, pool in layer.states.items():
                pool[rb.slots] = layer.snapshots[name][src]

    def release(self):
        """Drops the layers' state tensors (Engine.close)."""
        for layer in self.layers:
            layer.states, layer.snapshots = {}, {}
