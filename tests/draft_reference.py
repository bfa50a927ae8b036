"""An EAGLE-3 head run from scratch, without any cache, over transformers' hidden states
(docs/DECODING.md, "draft loop"): the reference the engine's chain and tree drafts are
checked against."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class HeadReference:
    """Draft logits for a request whose committed tokens are `tokens`, after any path of
    draft tokens. Step 0 runs over every committed position; each draft token of a path is
    one more row that sees step 0's keys and its own path's keys only."""

    def __init__(self, hf, head, capture, tokens: list[int]):
        """hf: the transformers target, on the head's device."""
        self.head, self.n = head, len(tokens)
        self.device = dev = next(head.parameters()).device
        self.layer = head.layers[0]
        self.embed = hf.model.embed_tokens
        with torch.no_grad():
            hs = hf(torch.tensor([tokens[:-1]], device=dev),
                    output_hidden_states=True).hidden_states
            feats = torch.cat([hs[i + 1][0] for i in capture], -1)         # [n-1, 3H]
            positions = torch.arange(self.n - 1, device=dev)
            self.keys, self.values = [], []
            out = self._run(torch.tensor(tokens[1:], device=dev), head.fc(feats), positions,
                            self.keys, self.values)
        self.root = out[-1:]                                               # [1, H]

    def _run(self, ids, hidden, positions, keys, values):
        layer, attn = self.layer, self.layer.self_attn
        a = torch.cat([layer.input_layernorm(self.embed(ids)), layer.hidden_norm(hidden)], -1)
        q, k, v = attn.qkv_proj(a).split([attn.q_size, attn.kv_size, attn.kv_size], -1)
        q = q.view(-1, attn.num_heads, attn.head_dim)
        k = k.view(-1, attn.num_kv_heads, attn.head_dim)
        v = v.view(-1, attn.num_kv_heads, attn.head_dim)
        q, k = self.head.rotary(positions, q, k)
        keys.append(k)
        values.append(v)
        rep = attn.num_heads // attn.num_kv_heads
        kk = torch.cat(keys).repeat_interleave(rep, 1)
        vv = torch.cat(values).repeat_interleave(rep, 1)
        first = kk.shape[0] - len(ids)              # the new rows are the last keys
        rows = torch.arange(len(ids), device=ids.device)
        mask = torch.arange(kk.shape[0], device=ids.device)[None, :] <= first + rows[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1),
                                             vv.transpose(0, 1), attn_mask=mask)
        h = hidden + attn.o_proj(out.transpose(0, 1).reshape(len(ids), -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    @torch.no_grad()
    def logits_after(self, path: tuple[int, ...]) -> torch.Tensor:
        """Draft-vocabulary logits [Vd] after the draft tokens `path` (target ids)."""
        keys, values, h = list(self.keys), list(self.values), self.root
        for j, token in enumerate(path):
            h = self._run(torch.tensor([token], device=self.device), h,
                          torch.tensor([self.n - 1 + j], device=self.device), keys, values)
        return self.head.compute_logits(h)[0]

    def target_id(self, draft_id) -> int:
        return int(self.head.to_target_ids(torch.as_tensor(draft_id, device=self.device)))

    def chain(self, k: int) -> tuple[list[int], list[float]]:
        """k greedy drafts, and each step's top-2 logit margin (near-ties are float noise)."""
        drafts, margins = [], []
        for _ in range(k):
            logits = self.logits_after(tuple(drafts))
            top2 = logits.topk(2).values
            margins.append(float(top2[0] - top2[1]))
            drafts.append(self.target_id(logits.argmax()))
        return drafts, margins

    def tree(self, depth: int, top_k: int, num_nodes: int):
        """The EAGLE-2 expansion: (set of kept nodes as token paths from the root, smallest
        score gap at any cut the expansion makes: near-ties there are float noise)."""
        gaps = []

        def children(path, score):
            logp = torch.log_softmax(self.logits_after(path).float(), -1)
            top = logp.topk(top_k + 1)
            gaps.append(float(top.values[top_k - 1] - top.values[top_k]))
            return [(path + (self.target_id(i),), score + float(v))
                    for v, i in zip(top.values[:top_k], top.indices[:top_k])]

        def best(nodes, n):
            ranked = sorted(nodes, key=lambda c: -c[1])
            if len(ranked) > n:
                gaps.append(ranked[n - 1][1] - ranked[n][1])
            return ranked[:n]

        frontier = candidates = children((), 0.0)
        for _ in range(1, depth):
            grown = [c for path, score in frontier for c in children(path, score)]
            candidates = candidates + grown
            frontier = best(grown, top_k)
        return {path for path, _ in best(candidates, num_nodes)}, min(gaps)
