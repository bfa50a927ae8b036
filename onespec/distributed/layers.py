"""Megatron-style sharding of a target decoder over the tensor-parallel ranks.

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
multiple of world_size (zero rows at the end of the last shard, never picked).

MLA (DeepSeek-V3) is split by heads: q_b_proj (or q_proj) and kv_b_proj column-parallel,
o_proj row-parallel. The low-rank parts (q_a_proj, kv_a_proj_with_mqa and their norms)
are replicated: the latent [c_kv, k_pe] is one per token for all heads, so every rank
computes and caches the whole of it and expands it through its own heads' kv_b rows.

An MoE block splits every expert the way a dense MLP is split: each rank holds every
expert's share of the intermediate rows (gate/up rows, down columns), the router is
replicated (the residual stream is whole on every rank, so each routes alike), and shared
experts are split likewise. The routed and shared experts' partial sums are added before
the block's one all-reduce. Each rank does an equal share of every routed pair's work
whatever the routing, where expert parallelism (whole experts per rank) would leave
ranks idle when the batch's tokens pick one rank's experts.

The model is sharded on the meta device before any weight is loaded, and shard_weights
slices each checkpoint tensor to this rank's part as it streams in, so no rank holds the
full model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from onespec.distributed.attention_dp import make_data_parallel
from onespec.distributed.group import TensorParallel
from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TorchOps
from onespec.models.deepseek_v3 import DeepseekV3Config, MLAttention
from onespec.models.llama import MLP
from onespec.models.moe import Experts
from onespec.models.qwen3_moe import Qwen3MoeConfig

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
             "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")
MOE_CONFIGS = {"Qwen3MoeForCausalLM": Qwen3MoeConfig, "DeepseekV3ForCausalLM": DeepseekV3Config}
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# checkpoint modules split by output rows (column-parallel: a rank's heads' or intermediate
# rows) and by input columns (row-parallel); k_proj / v_proj go by KV heads (kv_head_range)
COLUMN_PARALLEL = ("q_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def check_tensor_parallel(cfg: dict, size: int, attention_dp: bool = False):
    """A ValueError unless a checkpoint of config.json `cfg` can be split over `size` ranks
    (under attention DP the attention is not split: its heads need not divide)."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if isinstance(a, str)), None) if isinstance(archs, list) \
        else None
    if arch not in SUPPORTED:
        raise ValueError(f"tensor_parallel_size > 1 is not supported for {arch or archs!r} "
                         f"(supported: {SUPPORTED}); use tensor_parallel_size=1")
    heads = cfg.get("num_attention_heads")
    if not attention_dp and (not isinstance(heads, int) or heads % size):
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={heads}")
    kv_heads = cfg.get("num_key_value_heads") or heads
    if not attention_dp and arch not in MLA_ARCHITECTURES and kv_heads % size and \
            size % kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={kv_heads}: "
                         "one must divide the other")
    for name, value in _mlp_sizes(cfg, arch).items():
        if not isinstance(value, int) or value % size:
            raise ValueError(f"tensor_parallel_size={size} must divide {name}={value}")


def _mlp_sizes(cfg: dict, arch: str) -> dict[str, int]:
    """The intermediate sizes the layers' MLPs split (MTP layers included): dense MLPs'
    intermediate_size, MoE experts' moe_intermediate_size (shared experts are multiples)."""
    if arch not in MOE_CONFIGS:
        return {"intermediate_size": cfg.get("intermediate_size")}
    c = MOE_CONFIGS[arch].from_hf(cfg)
    num_layers = c.num_hidden_layers + getattr(c, "num_nextn_predict_layers", 0)
    moe = [c.is_moe_layer(i) for i in range(num_layers)]
    sizes = {}
    if not all(moe):
        sizes["intermediate_size"] = c.intermediate_size
    if any(moe):
        sizes["moe_intermediate_size"] = c.moe_intermediate_size
    return sizes


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard @ W_shard.T) + b: this rank's input columns only."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    @property
    def partial(self) -> "_Partial":
        """This rank's term of the sum, x_shard @ W_shard.T, neither reduced nor biased:
        a linear layer to a backend (its weight is this layer's)."""
        return _Partial(self.weight)

    def forward(self, x):
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class _Partial:
    """What a backend reads of a linear layer (weight, bias, calling it), unreduced."""
    __slots__ = ("weight", "bias")

    def __init__(self, weight: nn.Parameter):
        self.weight, self.bias = weight, None

    def __call__(self, x):
        return F.linear(x, self.weight)


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


class TensorParallelOps:
    """Mixed in before a backend (TorchOps or TritonOps; tensor_parallel_ops builds the
    class): a row-parallel linear's partial product goes through the backend's own kernel,
    is all-reduced, and only then takes its bias, the residual and the norm after it; the
    vocabulary-parallel LM head's logits are gathered and its greedy tokens picked from
    per-rank (max, index) pairs. Any other layer goes to the backend as it is."""

    def linear(self, layer: nn.Linear, x, residual=None, out_dtype=None):
        if not isinstance(layer, RowParallelLinear):
            return super().linear(layer, x, residual, out_dtype)
        y = layer.tp.all_reduce(super().linear(layer.partial, x))
        if layer.bias is not None:
            y = y + layer.bias
        if residual is not None:
            y = residual + y
        return y if out_dtype is None else y.to(out_dtype)

    def add_norm(self, layer: nn.Linear, x, residual, norm: RMSNorm,
                 early_release: bool = False):
        if not isinstance(layer, RowParallelLinear):
            return super().add_norm(layer, x, residual, norm, early_release)
        return self.add_full_norm(layer, x, residual, norm)

    def add_full_norm(self, layer: nn.Linear, x, residual, norm: RMSNorm):
        if not isinstance(layer, RowParallelLinear):
            return super().add_full_norm(layer, x, residual, norm)
        h = self.linear(layer, x, residual)
        return h, self.norm(norm, h)

    def logits(self, layer: nn.Linear, x, norm: RMSNorm | None = None) -> torch.Tensor:
        y = super().logits(layer, x, norm)
        return layer.gather(y) if isinstance(layer, ParallelLMHead) else y

    def greedy(self, layer: nn.Linear, x, norm: RMSNorm | None = None,
               offsets: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(layer, ParallelLMHead):
            return super().greedy(layer, x, norm, offsets)
        return layer.greedy(super().logits(layer, x, norm))


def tensor_parallel_ops(base: TorchOps) -> TorchOps:
    """The backend `base` with TensorParallelOps in front (its settings kept)."""
    cls = type(f"TensorParallel{type(base).__name__}", (TensorParallelOps, type(base)), {})
    ops = cls.__new__(cls)
    ops.__dict__.update(base.__dict__)
    return ops


def kv_head_range(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """[first, end) of the KV heads this rank holds (one head, shared, when Hkv < ranks)."""
    if num_kv_heads >= tp.world_size:
        return tp.shard_range(num_kv_heads)
    first = tp.rank // (tp.world_size // num_kv_heads)
    return first, first + 1


def shard_decoder(model: nn.Module, tp: TensorParallel):
    """Replaces a (meta-device) target's layers, embedding and LM head by this rank's
    shards."""
    cfg = model.config
    for layer in model.model.layers:
        shard_layer(layer, tp)
    with torch.device("meta"):
        model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        model.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)


def shard_layer(layer: nn.Module, tp: TensorParallel):
    """A (meta-device) decoder layer's attention (GQA or MLA) and MLP (dense or MoE)
    replaced by this rank's shards, in place (under attention DP the attention stays
    whole: attention_dp.py)."""
    with torch.device("meta"):
        if tp.attention_dp:              # whole, each rank attending for its own requests
            make_data_parallel(layer.self_attn, tp)
        elif isinstance(layer.self_attn, MLAttention):
            _shard_mla(layer.self_attn, tp)
        else:
            _shard_attention(layer.self_attn, tp)
        if isinstance(layer.mlp, MLP):
            _shard_mlp(layer.mlp, tp)
        else:
            _shard_moe(layer.mlp, tp)


def _column(linear: nn.Linear, out_features: int) -> nn.Linear:
    return nn.Linear(linear.in_features, out_features, bias=linear.bias is not None)


def _row(linear: nn.Linear, in_features: int, tp: TensorParallel) -> RowParallelLinear:
    return RowParallelLinear(in_features, linear.out_features, linear.bias is not None, tp)


def _shard_attention(attn: nn.Module, tp: TensorParallel):
    """GQA (models/llama.py Attention): this rank's query heads and their KV heads."""
    kv_first, kv_end = kv_head_range(attn.num_kv_heads, tp)
    attn.num_heads //= tp.world_size
    attn.num_kv_heads = kv_end - kv_first
    attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    attn.qkv_proj = _column(attn.qkv_proj, attn.q_size + 2 * attn.kv_size)
    attn.o_proj = _row(attn.o_proj, attn.q_size, tp)


def _shard_mla(attn: MLAttention, tp: TensorParallel):
    """MLA: this rank's heads' query and kv_b rows, o_proj columns; the rest whole."""
    attn.num_heads //= tp.world_size
    qk = attn.num_heads * (attn.nope_dim + attn.rope_dim)
    if attn.q_lora:
        attn.q_b_proj = _column(attn.q_b_proj, qk)
    else:
        attn.q_proj = _column(attn.q_proj, qk)
    attn.kv_b_proj = _column(attn.kv_b_proj, attn.num_heads * (attn.nope_dim + attn.v_dim))
    attn.o_proj = _row(attn.o_proj, attn.num_heads * attn.v_dim, tp)


def _shard_mlp(mlp: MLP, tp: TensorParallel, reduce: bool = True):
    """This rank's intermediate rows; `reduce`: down_proj all-reduces its partial sums
    (else the caller does, once for several partial sums)."""
    inter = mlp.down_proj.in_features // tp.world_size
    mlp.gate_up_proj = _column(mlp.gate_up_proj, 2 * inter)
    mlp.down_proj = _row(mlp.down_proj, inter, tp) if reduce else \
        nn.Linear(inter, mlp.down_proj.out_features, bias=False)    # MoE MLPs have no bias


def _shard_moe(moe: nn.Module, tp: TensorParallel):
    """Every expert's share of the intermediate rows, shared experts' too; the router
    whole. The block's output (routed + shared partial sums) is all-reduced once, by a
    forward hook, so the model's code is unchanged (the layer adds the residual after
    it: takes_residual)."""
    experts = moe.experts
    _, hidden, inter = experts.down_proj.shape
    moe.experts = Experts(experts.num_experts, hidden, inter // tp.world_size, experts.ops)
    if getattr(moe, "shared_experts", None) is not None:
        _shard_mlp(moe.shared_experts, tp, reduce=False)
    moe.register_forward_hook(lambda _module, _args, out: tp.all_reduce(out))
    moe.takes_residual = False     # the residual must not enter the partial sums


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
    tensor: q/k/v, q_b/kv_b and gate/up rows (experts' too), o/down columns, embedding and
    LM head vocabulary rows; anything else (norms, routers, MLA's low-rank parts) whole."""
    for name, t in weights:
        yield name, _shard_tensor(name, t, cfg, tp)


def _shard_tensor(name: str, t: torch.Tensor, cfg, tp: TensorParallel) -> torch.Tensor:
    parts = name.split(".")
    if tp.attention_dp and "self_attn" in parts:     # attention whole on every rank
        return t
    module, leaf = (parts[-2], parts[-1]) if len(parts) > 1 else ("", name)
    if module in ("k_proj", "v_proj"):
        first, end = kv_head_range(cfg.num_key_value_heads, tp)
        return _slice(t, 0, first * cfg.head_dim, end * cfg.head_dim)
    if module in COLUMN_PARALLEL:
        return _slice(t, 0, *tp.shard_range(t.shape[0]))
    if module in ROW_PARALLEL and leaf == "weight":
        return _slice(t, 1, *tp.shard_range(t.shape[1]))
    if module == "experts" and leaf == "gate_up_proj":     # stacked [E, 2I, H], gate first
        gate, up = t.chunk(2, dim=1)
        return torch.cat([_slice(gate, 1, *tp.shard_range(gate.shape[1])),
                          _slice(up, 1, *tp.shard_range(up.shape[1]))], dim=1)
    if module == "experts" and leaf == "down_proj":        # stacked [E, H, I]
        return _slice(t, 2, *tp.shard_range(t.shape[2]))
    if module in ("embed_tokens", "lm_head") or name.endswith("shared_head.head.weight"):
        return _vocab_rows(t, cfg, tp)
    return t
