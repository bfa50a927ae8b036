"""Mixture-of-experts pieces shared by the MoE targets, and the decoder shell around them.

Routing (pure functions, one per family):

    DeepSeek-V3   s = sigmoid(x W_r^T); choose with s + bias, within the top `topk_group`
                  of `n_group` groups (a group scores the sum of its best two); weights =
                  s of the chosen, / their sum if norm_topk_prob, * routed_scaling_factor
    Qwen3-MoE     p = softmax(x W_r^T); the top-k of p, / their sum if norm_topk_prob

Experts are stacked as Hugging Face 5.x stores them: gate_up_proj [E, 2I, H] (gate rows
first) and down_proj [E, H, I]; models/loader.py maps per-expert checkpoint keys
(`experts.{e}.gate_proj.weight`, ...) onto them. Few (token, expert) pairs gather their
experts' weights (no host sync, only the routed experts are read); more loop over the
experts the batch routes to (the portable path). The Triton backend routes decode-sized
batches in one kernel (kernels/moe_route.py) and runs every pass as a grouped GEMM over
the routed pairs (kernels/moe.py): no host sync, fixed shapes, graph-capturable.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from onespec.layers.attention import AttentionMetadata
from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TORCH_OPS, TorchOps
from onespec.models.llama import MLP, run_decoder
from onespec.quant.fp8 import FP8, KeepsQuantized, dequantize

GATHER_MAX_PAIRS = 16     # (token, expert) pairs up to which experts' weights are gathered


def deepseek_route(logits: torch.Tensor,        # [T, E] float32 router logits
                   bias: torch.Tensor,          # [E] e_score_correction_bias
                   top_k: int, num_groups: int, topk_groups: int, norm_topk_prob: bool,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor]:  # [T, k] x2
    """DeepSeek-V3 group-limited sigmoid routing -> (weights float32, expert ids)."""
    scores = logits.sigmoid()
    choice = scores + bias
    tokens, experts = choice.shape
    group_scores = choice.view(tokens, num_groups, -1).topk(min(2, experts // num_groups),
                                                           dim=-1).values.sum(-1)  # [T, G]
    groups = group_scores.topk(topk_groups, dim=-1).indices                        # [T, g]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, experts // num_groups) \
        .reshape(tokens, experts)                                                  # [T, E]
    ids = choice.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def softmax_route(logits: torch.Tensor,         # [T, E] router logits
                  top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE softmax top-k routing -> (weights in the logits' dtype, expert ids)."""
    probs = logits.float().softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), ids


@dataclass(frozen=True)
class Router:
    """How a family turns router logits into (weights, expert ids): sigmoid = DeepSeek-V3
    (deepseek_route, with the gate's score-correction bias), else Qwen3-MoE's softmax.
    `route` is the PyTorch path; the Triton backend may fuse it (kernels/moe_route.py)."""
    top_k: int
    sigmoid: bool
    norm_topk_prob: bool
    num_groups: int = 1
    topk_groups: int = 1
    scaling: float = 1.0

    def route(self, logits: torch.Tensor, bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sigmoid:
            return deepseek_route(logits, bias.float(), self.top_k, self.num_groups,
                                  self.topk_groups, self.norm_topk_prob, self.scaling)
        return softmax_route(logits, self.top_k, self.norm_topk_prob)


class Experts(KeepsQuantized, nn.Module):
    """Stacked experts; in an FP8 model (quant/fp8.py) gate_up_proj / down_proj are e4m3
    with `gate_up_proj_scale` / `down_proj_scale` (per block of `block`, or per row)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.block = None           # FP8 scale blocks (quant/fp8.py quantize_experts)
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                     hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.ops = ops

    def forward(self, x, logits, router: Router, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None):
        """x [T, H], router logits [T, E] -> (residual +) sum_j weights[:, j] *
        expert_{ids[:, j]}(x) [T, H], (weights, ids) being router.route(logits, bias)."""
        return self.ops.routed_experts(self, x, logits, router, bias, residual)

    @property
    def quantized(self) -> bool:
        return self.gate_up_proj.dtype == FP8

    def weight(self, name: str, index=None) -> torch.Tensor:
        """The experts' `name` weights (gate_up_proj or down_proj), all or `index`ed,
        dequantized to the compute dtype if FP8 (only the experts indexed)."""
        w = getattr(self, name)
        if index is not None:
            w = w[index]
        if w.dtype != FP8:
            return w
        scale = getattr(self, name + "_scale")
        return dequantize(w, scale if index is None else scale[index], self.block,
                          self.compute_dtype)

    def portable(self, x, ids, weights):
        """x [T, H], ids / weights [T, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x),
        through PyTorch operations (any device, autograd)."""
        if ids.numel() <= GATHER_MAX_PAIRS:
            return self._gathered(x, ids, weights)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], self.weight("gate_up_proj", e)).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.weight("down_proj", e)) * \
                weights[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    def _gathered(self, x, ids, weights):
        gate_up = torch.matmul(self.weight("gate_up_proj", ids),
                               x[:, None, :, None]).squeeze(-1)
        gate, up = gate_up.chunk(2, dim=-1)                                 # [T, k, I]
        y = torch.matmul(self.weight("down_proj", ids),
                         (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (y * weights.unsqueeze(-1)).sum(1).to(x.dtype)               # [T, H]


class Float32Router(nn.Module):
    """Router weights that stay float32 whatever dtype the model is cast to (checkpoints
    ship them so; routing decisions are sensitive to rounding)."""

    def _apply(self, fn, recurse=True):
        def keep_float32(t):
            out = fn(t)
            if t.is_floating_point() and out.dtype != t.dtype:
                return t.to(device=out.device)
            return out
        return super()._apply(keep_float32, recurse)


class SoftmaxMoe(nn.Module):
    """The routed part of the Qwen MoE blocks (models/qwen3_moe.py SparseMoeBlock,
    models/qwen3_next.py SharedExpertMoe): a linear router `gate`, softmax top-k routing,
    the stacked experts."""

    def __init__(self, cfg, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.router = Router(cfg.num_experts_per_tok, sigmoid=False,
                             norm_topk_prob=cfg.norm_topk_prob)
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               ops)

    def routed(self, x, residual=None):
        """x [T, H] -> the routed experts' sum [T, H] (plus residual where given)."""
        return self.experts(x, F.linear(x, self.gate.weight), self.router, None, residual)


def mlp_step(mlp: nn.Module, ops: TorchOps, x, h: torch.Tensor,
             next_norm: RMSNorm | None, last: bool):
    """A decoder layer's MLP (dense models/llama.py MLP, or an MoE block) on its input norm
    x, with the residual stream h: (h + mlp(x), next_norm of it or None). The residual
    goes into the block's last kernel unless the block is split over ranks
    (takes_residual off: its partial sums are all-reduced after it)."""
    if getattr(mlp, "takes_residual", True):
        return mlp(x, h, next_norm, last)
    h = h + mlp(x)
    return h, None if next_norm is None else ops.norm(next_norm, h)


class MoeDecoderLayer(nn.Module):
    """The decoder layer of the GQA MoE targets: input norm, attention (returning o_proj's
    input), post-attention norm, then an MoE block or a dense MLP through mlp_step.
    Subclasses build input_layernorm, self_attn, post_attention_layernorm, mlp and ops."""

    def forward(self, h, x, positions, rotary, meta, next_norm: RMSNorm | None = None,
                last: bool = False):
        """As DecoderLayer.forward in models/llama.py: (h after the layer, next_norm of it
        or None), x the input norm the layer before left (or None)."""
        ops = self.ops
        if x is None:
            x = ops.norm(self.input_layernorm, h)
        out = self.self_attn(x, positions, rotary, meta)                     # [T, Hq·D]
        # a dense MLP's GEMVs take the norm begun; the router and experts need it whole
        add_norm = ops.add_norm if isinstance(self.mlp, MLP) else ops.add_full_norm
        h, x = add_norm(self.self_attn.o_proj, out, h, self.post_attention_layernorm)
        return mlp_step(self.mlp, ops, x, h, next_norm, last)


class DecoderStack(nn.Module):
    """embed_tokens, layers, norm: the `model.` part of a Hugging Face causal LM."""

    def __init__(self, cfg, make_layer: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class PagedCausalLM(nn.Module):
    """The decoder shell of the MoE targets: forward(input_ids [T], positions [T], meta,
    capture) -> (final-normed hidden [T, H], captured residual streams [T, len·H] or None),
    over self.model (a DecoderStack of make_layer(i) layers, each called as
    models/llama.py's DecoderLayer.forward) and self.lm_head. Subclasses
    give the layers (built with the backend `ops`) and the rotary table (setup_rotary).
    Under the Triton backend the step is graph-capturable: attention and experts run
    kernels that read their metadata on the device, the rest is PyTorch without host
    syncs."""

    supports_triton = True
    triton_tree_masks = True   # GQA attention (TritonOps); MLA's kernel has no tree masks

    def __init__(self, cfg, make_layer: Callable[[int], nn.Module], ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.rotary = None
        self.model = DecoderStack(cfg, make_layer)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                capture: tuple[int, ...] = ()):
        return run_decoder(self, input_ids, positions, meta, capture)

    def compute_logits(self, hidden):
        return self.ops.logits(self.lm_head, hidden)                        # [N, V] float32

    def greedy_tokens(self, hidden):
        """compute_logits(hidden).argmax(-1), without writing the logits where the backend
        can (the Triton backend's argmax inside the lm_head GEMV)."""
        return self.ops.greedy(self.lm_head, hidden)                        # [N]

    def checkpoint_rename(self, name: str) -> str | None:
        """Checkpoint key -> parameter name (None: skip it)."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name


class MtpCausalLM(PagedCausalLM):
    """A PagedCausalLM whose checkpoint stores MTP layers after the target's (DeepSeek-V3,
    GLM-4 MoE): `layer_class(cfg, layer_idx, ops)` builds a decoder block, for the target
    and for models/mtp.py (make_decoder_layer); make_rotary builds the rotary table for
    both; the MTP layers' checkpoint keys are left to the MTP drafter."""

    layer_class: type = None

    def __init__(self, cfg, ops: TorchOps = TORCH_OPS):
        super().__init__(cfg, lambda i: self.layer_class(cfg, i, ops), ops)

    def setup_rotary(self, max_positions: int, device):
        self.rotary = self.make_rotary(max_positions, device)

    def make_rotary(self, max_positions: int, device):
        raise NotImplementedError

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        """A decoder block as layer `layer_idx` of the checkpoint has (MTP layers too)."""
        return self.layer_class(self.config, layer_idx, self.ops)

    def checkpoint_rename(self, name: str) -> str | None:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= self.config.num_hidden_layers:
            return None          # MTP layers: read by the MTP drafter, not the target
        return super().checkpoint_rename(name)
