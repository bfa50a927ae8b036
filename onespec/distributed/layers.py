"""Megatron-style sharding of a Llama-family decoder over the tensor-parallel ranks.

    qkv_proj, gate_up_proj   column-parallel: each rank holds its heads' / its share of
                             the intermediate rows, no communication
    o_proj, down_proj        row-parallel: each rank multiplies its columns, one all-reduce
    embed_tokens             vocabulary-parallel: a rank gathers the rows it holds (zeros
                             elsewhere), one all-reduce
    lm_head                  vocabulary-parallel: a rank computes its logits; full logits
                             are gathered only for sampled rows, greedy rows reduce
                             per-rank (max, index) pairs (TensorParallelOps)

KV heads are split with the query heads; with fewer KV heads than ranks each KV head is
held by the world_size / Hkv ranks whose query heads read it. The vocabulary is padded to a
multiple of world_size (zero rows at the end of the last shard, never picked). The model
is sharded on the meta device before any weight is loaded, and shard_weights slices each
checkpoint tensor to this rank's part as it streams in, so no rank holds the full model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onespec.distributed.group import TensorParallel
from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TorchOps

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def check_tensor_parallel(cfg: dict, size: int):
    """A ValueError unless a checkpoint of config.json `cfg` can be split over `size` ranks."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if isinstance(a, str)), None) if isinstance(archs, list) \
        else None
    if arch not in SUPPORTED:
        raise ValueError(f"tensor_parallel_size > 1 is not supported for {arch or archs!r} "
                         f"(supported: {SUPPORTED}); use tensor_parallel_size=1")
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    inter = cfg.get("intermediate_size")
    if not isinstance(heads, int) or heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={heads}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={kv_heads}: "
                         "one must divide the other")
    if not isinstance(inter, int) or inter % size:
        raise ValueError(f"tensor_parallel_size={size} must divide intermediate_size={inter}")


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard @ W_shard.T) + b: this rank's input columns only."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x):
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + shard) of the table; other ids embed to zeros before the sum."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        self.shard = -(-vocab_size // tp.world_size)
        super().__init__(self.shard, hidden_size)
        self.tp, self.start = tp, tp.rank * self.shard

    def forward(self, ids):
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)                        # [T]
        rows = F.embedding(torch.where(inside, local, 0), self.weight)      # [T, H]
        return self.tp.all_reduce(rows.masked_fill(~inside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """The logits of vocabulary rows [start, start + shard); forward gives this rank's."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel):
        self.shard = -(-vocab_size // tp.world_size)
        super().__init__(hidden_size, self.shard, bias=False)
        self.tp, self.vocab_size, self.start = tp, vocab_size, tp.rank * self.shard
        self.num_valid = max(0, min(self.shard, vocab_size - self.start))   # past: padding

    def gather(self, local):                # [N, shard] -> [N, V] on every rank
        full = self.tp.all_gather(local)                                    # [W, N, shard]
        return full.permute(1, 0, 2).reshape(local.shape[0], -1)[:, :self.vocab_size]

    def greedy(self, local):                # [N, shard] -> [N] argmax over the whole vocab
        local = local[:, :self.num_valid]
        idx = local.argmax(-1)                                              # first on ties
        best = local.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        values = self.tp.all_gather(best)                                   # [W, N]
        ids = self.tp.all_gather(idx + self.start)
        rank = values.argmax(0, keepdim=True)        # the lowest rank (= id) on ties
        return ids.gather(0, rank).squeeze(0)


class TensorParallelOps(TorchOps):
    """The portable backend, with the vocabulary-parallel LM head's logits gathered and its
    greedy tokens picked from (max, index) pairs; any other layer as TorchOps."""

    def logits(self, layer: nn.Linear, x, norm: RMSNorm | None = None) -> torch.Tensor:
        y = super().logits(layer, x, norm)
        return layer.gather(y) if isinstance(layer, ParallelLMHead) else y

    def greedy(self, layer: nn.Linear, x, norm: RMSNorm | None = None,
               offsets: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(layer, ParallelLMHead):
            return super().greedy(layer, x, norm, offsets)
        return layer.greedy(TorchOps.logits(self, layer, x, norm))


def kv_head_range(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """[first, end) of the KV heads this rank holds (one head, shared, when Hkv < ranks)."""
    if num_kv_heads >= tp.world_size:
        return tp.shard_range(num_kv_heads)
    first = tp.rank // (tp.world_size // num_kv_heads)
    return first, first + 1


def shard_decoder(model: nn.Module, tp: TensorParallel):
    """Replaces a (meta-device) LlamaForCausalLM's layers by this rank's shards."""
    cfg = model.config
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    kv_first, kv_end = kv_head_range(cfg.num_key_value_heads, tp)
    inter = cfg.intermediate_size // tp.world_size
    with torch.device("meta"):
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.num_heads = cfg.num_attention_heads // tp.world_size
            attn.num_kv_heads = kv_end - kv_first
            attn.q_size, attn.kv_size = (attn.num_heads * attn.head_dim,
                                         attn.num_kv_heads * attn.head_dim)
            attn.qkv_proj = nn.Linear(hidden, attn.q_size + 2 * attn.kv_size,
                                      bias=cfg.attention_bias)
            attn.o_proj = RowParallelLinear(attn.q_size, hidden, False, tp)
            mlp.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=cfg.mlp_bias)
            mlp.down_proj = RowParallelLinear(inter, hidden, cfg.mlp_bias, tp)
        model.model.embed_tokens = VocabParallelEmbedding(vocab, hidden, tp)
        model.lm_head = ParallelLMHead(hidden, vocab, tp)


def _slice(t: torch.Tensor, dim: int, start: int, end: int) -> torch.Tensor:
    return t.narrow(dim, start, end - start)


def _vocab_rows(t: torch.Tensor, cfg, tp: TensorParallel) -> torch.Tensor:
    shard = -(-cfg.vocab_size // tp.world_size)
    start = tp.rank * shard
    rows = t[start:start + shard]
    if rows.shape[0] == shard:
        return rows
    return torch.cat([rows, rows.new_zeros(shard - rows.shape[0], *rows.shape[1:])])


def shard_weights(weights, cfg, tp: TensorParallel):
    """(name, tensor) checkpoint pairs -> the same names with this rank's part of each
    tensor (q/k/v, gate/up rows; o/down columns; embedding and LM head vocabulary rows)."""
    d = cfg.head_dim
    q = tp.shard_range(cfg.num_attention_heads)
    kv = kv_head_range(cfg.num_key_value_heads, tp)
    inter = tp.shard_range(cfg.intermediate_size)
    rows = {"q_proj": (q[0] * d, q[1] * d), "k_proj": (kv[0] * d, kv[1] * d),
            "v_proj": (kv[0] * d, kv[1] * d), "gate_proj": inter, "up_proj": inter}
    cols = {"o_proj": (q[0] * d, q[1] * d), "down_proj": inter}
    for name, t in weights:
        parts = name.split(".")
        module = parts[-2] if len(parts) > 1 else ""
        if module in rows:
            t = _slice(t, 0, *rows[module])
        elif module in cols and parts[-1] == "weight":
            t = _slice(t, 1, *cols[module])
        elif module in ("embed_tokens", "lm_head"):
            t = _vocab_rows(t, cfg, tp)
        yield name, t
