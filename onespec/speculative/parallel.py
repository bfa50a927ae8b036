"""Parallel drafting (P-EAGLE; docs/DECODING.md, "Parallel drafting"): one head forward
a step proposes all K drafts.

The forward replaces the EAGLE-3 draft loop's first pass and its K - 1 later passes. Its
rows are the first pass's rows plus mask rows, laid out so that each request's rows sit
at consecutive positions and a plain causal mask is the right one:

- a context chunk keeps its rows; a chunk that ends its prompt gets K - 1 mask rows after
  its last row (positions end + 1 .. end + K - 1);
- a generation request of K + 1 verify rows at P .. P+K, n of them accepted, gets R =
  max(K + 1, 2K) rows at P .. P+R-1: row j < n is the first pass's row (the target's
  captured features at P + j, the accepted token after it); every row j >= n is a mask
  row (the mask token's embedding, fc(mask_hidden)). The rejected rows' KV would be
  stale anyway, so the mask rows take their places, and K - 1 more rows follow.

The drafts are read at the root row (the last real row: a chunk's last, a request's row
n - 1) and the K - 1 rows after it. Each real row writes its draft KV as in the first
pass; the mask rows' KV lies past the accepted prefix and is overwritten by the next
step's forward, as the chain loop's later passes' is. The slots are those a chain step
reserves already (engine/kv_cache.py slots_per_step).
"""
from __future__ import annotations

import torch

from onespec.layers.attention import build_attention_metadata, metadata_for_rows
from onespec.speculative.eagle3 import Eagle3Drafter


class ParallelDrafter(Eagle3Drafter):
    """An EAGLE-3 head trained for parallel drafting (a mask token and mask_hidden):
    SpecWorker runs `parallel_forward` once instead of the draft loop's passes."""

    parallel = True

    def __init__(self, head, target, capture_layers):
        super().__init__(head, target, capture_layers)
        cfg = head.config
        self.mask_token_id = cfg.mask_token_id
        self.max_depth = cfg.parallel_depth      # K may not exceed it (engine/parts.py)

    def mask_input(self):
        return self.head.mask_input()                                        # [1, H]


def gen_rows(k: int) -> int:
    """Draft rows of a generation request: max(K + 1, 2K)."""
    return max(k + 1, 2 * k)


def parallel_forward(drafter: ParallelDrafter, inp, captured, context_tokens, accepted,
                     num_accepted, attn_backend: str):
    """The step's one head forward (module docstring). accepted [Bg, K+1], num_accepted
    [Bg]. Returns the hidden rows of every drafting request's K drafts [K, Bd, H] (each
    draft's rows whole, for the picks) and its root positions [Bd], in draft_reqs order,
    or None when nothing is drafted (K = 0, or no request drafts)."""
    k, g, start = inp.k, inp.num_gen, inp.gen_start
    device = inp.positions.device
    ids = _real_ids(inp, context_tokens, accepted)                            # [T]
    h = drafter.initial_hidden(captured, None)                                # [T, H]
    mask_h = drafter.mask_input().to(h.dtype)                                 # [1, H]
    r = gen_rows(k)
    meta = inp.meta

    # generation requests: R rows each, real before num_accepted, mask rows from there
    j = torch.arange(r, device=device)                                        # [R]
    first = start + torch.arange(g, device=device) * (k + 1)                  # [Bg]
    real = j[None, :] < num_accepted[:, None]                                 # [Bg, R]
    src = first[:, None] + j.clamp(max=k)[None, :]                            # [Bg, R]
    g_ids = torch.where(real, ids[src], drafter.mask_token_id).reshape(-1)
    g_h = torch.where(real.reshape(-1, 1), h[src.reshape(-1)], mask_h)
    g_pos = (inp.positions[first][:, None] + j[None, :]).reshape(-1)

    if inp.num_ctx == 0:        # every request alike: R rows each (graphs take this path)
        if k == 0:
            out_meta = meta            # one row a request, at the verify's position
        else:
            out_meta = build_attention_metadata(inp.block_tables, r, g_pos, inp.block_size,
                                                inp.max_kv_draft, meta.sliding_window,
                                                attn_backend)
        out = drafter.forward(g_ids, g_pos, g_h, out_meta)                    # [Bg·R, H]
        if k == 0 or len(inp.draft_reqs) == 0:
            return None
        roots = torch.arange(g, device=device) * r + num_accepted - 1
        return out[roots[None, :] + torch.arange(k, device=device)[:, None]], \
            g_pos[roots]                                                      # [K, Bg, H]

    # context chunks first (as they are), then the generation rows, then the K - 1 mask
    # rows after each chunk that ends its prompt
    d = torch.arange(1, k, device=device)                                     # [K-1]
    c_rows = inp.draft_ctx_rows                                               # [Bdc]
    c_pos = (inp.positions[c_rows][:, None] + d[None, :]).reshape(-1)
    n_cm = c_pos.shape[0]
    all_ids = torch.cat([ids[:start], g_ids, g_ids.new_full((n_cm,), drafter.mask_token_id)])
    all_h = torch.cat([h[:start], g_h, mask_h.expand(n_cm, -1)])
    all_pos = torch.cat([inp.positions[:start], g_pos, c_pos])
    req = meta.token_req
    g_req = req[first].repeat_interleave(r)
    c_req = req[c_rows].repeat_interleave(max(k - 1, 0))
    token_req = torch.cat([req[:start], g_req, c_req])
    token_idx = None
    if meta.token_idx is not None:      # the torch backend's row index in its request
        c_idx = (meta.token_idx[c_rows][:, None] + d[None, :]).reshape(-1)
        token_idx = torch.cat([meta.token_idx[:start], j.repeat(g), c_idx])
    max_q = max(meta.max_q + k, r)
    out_meta = metadata_for_rows(inp.block_tables, token_req, token_idx, all_pos,
                                 inp.block_size, max_q, inp.max_kv_draft,
                                 meta.sliding_window, attn_backend)
    out = drafter.forward(all_ids, all_pos, all_h, out_meta)
    if k == 0 or len(inp.draft_reqs) == 0:
        return None
    n_c = c_rows.shape[0]
    c_first = start + g * r + torch.arange(n_c, device=device) * (k - 1)       # [Bdc]
    c_out = torch.cat([c_rows[:, None], c_first[:, None] + d[None, :] - 1], 1)  # [Bdc, K]
    g_root = start + torch.arange(g, device=device) * r + num_accepted - 1
    g_out = g_root[:, None] + torch.arange(k, device=device)[None, :]         # [Bg, K]
    root_pos = torch.cat([inp.positions[c_rows], all_pos[g_root]])
    return out[torch.cat([c_out, g_out]).T], root_pos                         # [K, Bd, H]


def _real_ids(inp, context_tokens, accepted) -> torch.Tensor:
    """The first pass's token of every target row: x(p + 1) (docs/DECODING.md, "the draft
    loop", step 0)."""
    if not inp.num_ctx:
        return accepted.reshape(-1)
    ids = inp.shift_ids.clone()
    last = inp.ctx_last_rows
    ids[last] = torch.where(ids[last] < 0, context_tokens, ids[last])
    ids[inp.gen_start:] = accepted.reshape(-1)
    return ids
