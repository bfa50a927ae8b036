"""Hybrid gated-DeltaNet targets: Qwen3-Next (`Qwen3NextForCausalLM`) and Qwen3.5
(`Qwen3_5ForCausalLM` dense, `Qwen3_5MoeForCausalLM`, and the published vision-language
checkpoints `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration`, whose
language model is read from `text_config` and `model.language_model.*`; the vision tower
is not loaded: text prompts only).

Layer i is `layer_types[i]` ("linear_attention" or "full_attention"; without it, every
`full_attention_interval`-th layer, default 4, is full attention):

- linear attention (GatedDeltaNet): projections to q, k, v (through a causal depthwise
  conv1d with SiLU, whose last W - 1 inputs are the layer's conv state), z (output gate),
  b (beta = sigmoid(b)) and a (decay g = -exp(A_log) * softplus(a + dt_bias)); the gated
  delta rule (layers/recurrent.py) over a [Hv, Dk, Dv] state per request; an RMSNorm of
  each head's output gated by silu(z); out_proj. Qwen3-Next packs q/k/v/z and b/a per key
  head (`in_proj_qkvz`, `in_proj_ba`), Qwen3.5 projects them apart (`in_proj_qkv`,
  `in_proj_z`, `in_proj_b`, `in_proj_a`).
- full attention: q_proj gives each head's query and an output gate (sigmoid) side by
  side; q/k RMSNorm per head; rotary on the first `partial_rotary_factor` of each head
  (Qwen3.5's multimodal rotary reduces to this for text); the paged KV cache.

Every RMSNorm except the gated one is zero-centred: x / rms(x) * (1 + w). MLPs are dense
(Qwen3.5) or MoE with softmax top-k routing plus a shared expert scaled by
sigmoid(shared_expert_gate(x)) (Qwen3-Next: per `decoder_sparse_step` / `mlp_only_layers`;
Qwen3.5-MoE: every layer).

The recurrent states live in the state pool (engine/state_pool.py), one slot per request;
a forward reads them and writes snapshots through the step's RecurrentBatch
(`meta.recurrent`), and the step commits a snapshot per request (speculative/shape.py).
The attention layers and the linears of both layer kinds compute through the backend's ops
(layers/ops.py): on the Triton backend the paged attention and the decode GEMVs are its
kernels, the norms and gates PyTorch, the recurrences kernels/recurrent.py's; nothing in a
generation step syncs with the host, so it is captured in CUDA graphs (engine/cuda_graph.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from onespec.layers.attention import AttentionMetadata
from onespec.layers.ops import TORCH_OPS, TorchOps
from onespec.layers.recurrent import RecurrentMixer, gated_delta_chunked, gated_delta_scan
from onespec.layers.rotary import RotaryEmbedding
from onespec.models.llama import MLP, DecoderConfig, SeparateProjAttention, check_field_types
from onespec.models.moe import PagedCausalLM, SoftmaxMoe

ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                 "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
TEXT_MODEL = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
              "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM"}
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class HybridConfig(DecoderConfig):
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0       # MTP layers in the checkpoint (`mtp.layers.*`)

    @classmethod
    def from_hf(cls, cfg: dict) -> "HybridConfig":
        source = getattr(cfg, "source", "config.json")
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{source}: not a Qwen3-Next / Qwen3.5 config: architectures "
                             f"{archs!r}")
        arch = TEXT_MODEL.get(arch, arch)
        text = {**cfg, **(cfg.get("text_config") or {})}     # Qwen3.5 may nest it
        check_field_types(text, source)
        base = DecoderConfig.from_hf({**text, "architectures": ["Qwen3ForCausalLM"]}, source)
        try:
            n = text["num_hidden_layers"]
            types = text.get("layer_types")
            if types is None:
                every = text.get("full_attention_interval") or 4
                types = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                         for i in range(n)]
            bad = [t for t in types if t not in LAYER_TYPES]
            if len(types) != n or bad:
                raise ValueError(f"{source}: field 'layer_types' must list "
                                 f"num_hidden_layers = {n} entries from {LAYER_TYPES}, got "
                                 f"{types!r}")
            rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
            factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
            moe = arch != "Qwen3_5ForCausalLM"
            own = dict(
                layer_types=tuple(types), partial_rotary_factor=float(factor),
                linear_num_key_heads=text["linear_num_key_heads"],
                linear_num_value_heads=text["linear_num_value_heads"],
                linear_key_head_dim=text["linear_key_head_dim"],
                linear_value_head_dim=text["linear_value_head_dim"],
                linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
                num_experts=text.get("num_experts", 0) if moe else 0,
                num_experts_per_tok=text.get("num_experts_per_tok", 1),
                moe_intermediate_size=text.get("moe_intermediate_size", 0),
                shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0),
                # Qwen3.5-MoE always renormalises the chosen experts' weights
                norm_topk_prob=text.get("norm_topk_prob", True) or arch != "Qwen3NextForCausalLM",
                decoder_sparse_step=text.get("decoder_sparse_step") or 1,
                mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
                num_nextn_predict_layers=text.get("mtp_num_hidden_layers",
                                                  text.get("num_nextn_predict_layers", 0)) or 0)
        except KeyError as e:
            raise ValueError(f"{source} lacks the required field {e.args[0]!r}") from None
        if own["linear_num_value_heads"] % own["linear_num_key_heads"]:
            raise ValueError(f"{source}: field 'linear_num_value_heads' must be a multiple of "
                             f"linear_num_key_heads = {own['linear_num_key_heads']}")
        if not 0 < own["partial_rotary_factor"] <= 1:
            raise ValueError(f"{source}: rope field 'partial_rotary_factor' must be in (0, 1], "
                             f"got {factor!r}")
        base_fields = {f.name: getattr(base, f.name) for f in fields(DecoderConfig)}
        base_fields.update(architecture=arch, tie_word_embeddings=bool(
            cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))))
        return cls(**base_fields, **own)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        if self.num_experts == 0 or i in self.mlp_only_layers:
            return False
        return self.architecture != "Qwen3NextForCausalLM" or \
            (i + 1) % self.decoder_sparse_step == 0


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in float32, cast back (a zero weight is the identity)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x):
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """w * x / rms(x) * silu(z) per head (the DeltaNet output norm; w is not zero-centred)."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x, z):
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class GatedAttention(SeparateProjAttention):
    """Full attention with an output gate, per-head q/k norm and partial rotary."""

    def __init__(self, cfg: HybridConfig, ops: TorchOps = TORCH_OPS):
        super().__init__(cfg, ops, q_outputs=2)       # q_proj: query and gate per head
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_dim = cfg.rotary_dim

    def forward(self, x, positions, rotary: RotaryEmbedding, meta: AttentionMetadata):
        """x [T, H] (normed) -> o_proj(attention * sigmoid(gate)) [T, H]; writes this
        step's keys and values to the cache."""
        t, lin = x.shape[0], self.ops.linear
        q, gate = lin(self.q_proj, x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, -1)
        q = self.q_norm(q)
        k = self.k_norm(lin(self.k_proj, x).view(t, self.num_kv_heads, self.head_dim))
        v = lin(self.v_proj, x).view(t, self.num_kv_heads, self.head_dim)
        r = self.rotary_dim
        q_rot, k_rot = rotary(positions, q[..., :r], k[..., :r])
        q = torch.cat([q_rot, q[..., r:]], -1)
        k = torch.cat([k_rot, k[..., r:]], -1)
        out = self.ops.paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                                       kv_scales=getattr(self, "kv_scales", None))
        out = out.reshape(t, self.q_size) * torch.sigmoid(gate.reshape(t, self.q_size))
        return lin(self.o_proj, out)


class GatedDeltaNet(RecurrentMixer):
    """Linear attention by the gated delta rule, with its conv and recurrent state held in
    the state pool (state_shapes; engine/state_pool.py allocates `states`, `snapshots`)."""

    def __init__(self, cfg: HybridConfig, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.ops = ops
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        h = cfg.hidden_size
        self.packed = cfg.architecture == "Qwen3NextForCausalLM"
        if self.packed:      # per key head: q, k, v, z and b, a
            self.in_proj_qkvz = nn.Linear(h, self.conv_dim + self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * self.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, bias=False,
                                groups=self.conv_dim, padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self.states: dict[str, torch.Tensor] = {}      # name -> [slots, ...] (state pool)
        self.snapshots: dict[str, torch.Tensor] = {}   # name -> [snapshot rows, ...]

    def state_shapes(self, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What one request's state is: the conv inputs kept and the delta-rule state."""
        return {"conv": ((self.conv_dim, self.kernel - 1), dtype),
                "ssm": ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32)}

    def project(self, x):
        """x [T, H] -> (q|k|v [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        t, lin = x.shape[0], self.ops.linear
        if not self.packed:
            return (lin(self.in_proj_qkv, x), lin(self.in_proj_z, x).view(t, self.num_v_heads, -1),
                    lin(self.in_proj_b, x), lin(self.in_proj_a, x))
        hk, rep, dk, dv = self.num_k_heads, self.num_v_heads // self.num_k_heads, \
            self.head_k_dim, self.head_v_dim
        qkvz = lin(self.in_proj_qkvz, x).view(t, hk, 2 * dk + 2 * rep * dv)
        q, k, v, z = qkvz.split([dk, dk, rep * dv, rep * dv], dim=-1)
        b, a = lin(self.in_proj_ba, x).view(t, hk, 2 * rep).split([rep, rep], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
        return (qkv, z.reshape(t, self.num_v_heads, dv), b.reshape(t, -1),
                a.reshape(t, -1))

    def forward(self, x, meta: AttentionMetadata):
        """x [T, H] (normed) -> [T, H]. Each request of meta.recurrent starts from its slot's
        state (zeros at position 0) and leaves snapshots: a prompt chunk its final state,
        a generation request the state after each of its rows."""
        rb = meta.recurrent
        qkv, z, b, a = self.project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = x.new_empty(x.shape[0], self.num_v_heads, self.head_v_dim)

        def args_of(mixed, rows, n, length):
            q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            return (q.reshape(n, length, self.num_k_heads, self.head_k_dim),
                    k.reshape(n, length, self.num_k_heads, self.head_k_dim),
                    v.reshape(n, length, self.num_v_heads, self.head_v_dim),
                    g[rows].view(n, length, -1), beta[rows].view(n, length, -1))

        for rows, o in self.recur(rb, qkv, None, args_of, gated_delta_chunked,
                                  gated_delta_scan, "gated_delta_verify"):
            core[rows] = o.reshape(-1, self.num_v_heads, self.head_v_dim).to(x.dtype)
        out = self.norm(core, z).reshape(x.shape[0], self.value_dim)
        return self.ops.linear(self.out_proj, out)


class SharedExpertMoe(SoftmaxMoe):
    """Softmax top-k routed experts plus one shared expert gated by a sigmoid."""

    def __init__(self, cfg: HybridConfig, ops: TorchOps = TORCH_OPS):
        super().__init__(cfg, ops)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, ops=ops)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x):
        routed = self.routed(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return routed + shared


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, layer_idx: int, ops: TorchOps = TORCH_OPS,
                 layer_type: str | None = None):
        super().__init__()
        self.layer_type = layer_type or cfg.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, ops)
        else:
            self.self_attn = GatedAttention(cfg, ops)
        self.mlp = SharedExpertMoe(cfg, ops) if cfg.is_moe_layer(layer_idx) else \
            MLP(cfg.hidden_size, cfg.intermediate_size, ops=ops)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, x, positions, rotary, meta, next_norm=None, last: bool = False):
        """As DecoderLayer.forward in models/llama.py: (h after the layer, next_norm of it
        or None), x the input norm the layer before left (or None)."""
        if x is None:
            x = self.input_layernorm(h)
        if self.layer_type == "linear_attention":
            h = h + self.linear_attn(x, meta)
        else:
            h = h + self.self_attn(x, positions, rotary, meta)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, None if next_norm is None else next_norm(h)


class Qwen3NextForCausalLM(PagedCausalLM):
    """Qwen3-Next and Qwen3.5 (dense and MoE): forward(input_ids, positions, meta, capture)
    as PagedCausalLM's; meta.recurrent (engine/state_pool.py RecurrentBatch) carries the
    step's recurrent-state slots."""

    config_class = HybridConfig
    supports_triton = True     # attention and linears through TritonOps (module docstring)
    triton_tree_masks = False
    recurrent = True          # has recurrent layers: a state pool beside the KV pool

    def __init__(self, cfg: HybridConfig, ops: TorchOps = TORCH_OPS):
        super().__init__(cfg, lambda i: HybridDecoderLayer(cfg, i, ops), ops)
        self.model.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attention_layers(self) -> list[nn.Module]:
        """The layers that keep paged KV (full attention)."""
        return [layer.self_attn for layer in self.model.layers if hasattr(layer, "self_attn")]

    def recurrent_layers(self) -> list[nn.Module]:
        """The layers that keep recurrent state (state pool)."""
        return [layer.linear_attn for layer in self.model.layers
                if hasattr(layer, "linear_attn")]

    def setup_rotary(self, max_positions: int, device):
        self.rotary = self.make_rotary(max_positions, device)

    def make_rotary(self, max_positions: int, device) -> RotaryEmbedding:
        c = self.config
        return RotaryEmbedding(c.rotary_dim, max_positions, c.rope_theta, c.rope_scaling, device)

    def make_decoder_layer(self, layer_idx: int) -> HybridDecoderLayer:
        """An MTP block: a full-attention layer, MoE where the target is."""
        return HybridDecoderLayer(self.config, layer_idx, self.ops, "full_attention")

    def make_norm(self) -> ZeroCenteredRMSNorm:
        """The norm kind of this family (MTP layers' norms are the same)."""
        return ZeroCenteredRMSNorm(self.config.hidden_size, self.config.rms_norm_eps)

    @staticmethod
    def mtp_rename(num_target_layers: int, num_layers: int):
        """Checkpoint key of the MTP module -> MTPLayer parameter name: 'mtp.fc' ->
        'layers.0.eh_proj', the embedding / hidden pre-norms -> enorm / hnorm,
        'mtp.norm' -> shared_head.norm, 'mtp.layers.{i}.X' -> 'layers.{i}.block.X' (one
        fc and norm serve the module: with several layers, each takes them)."""
        own = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm",
               "pre_fc_norm_hidden": "hnorm", "norm": "shared_head.norm"}
        layer_key = re.compile(r"mtp\.layers\.(\d+)\.(.+)")

        def rename(name: str) -> list[str]:
            m = layer_key.fullmatch(name)
            if m:
                i = int(m.group(1))
                return [f"layers.{i}.block.{m.group(2)}"] if i < num_layers else []
            parts = name.split(".", 2)
            if parts[0] == "mtp" and len(parts) == 3 and parts[1] in own:
                return [f"layers.{i}.{own[parts[1]]}.{parts[2]}" for i in range(num_layers)]
            return []
        return rename

    def checkpoint_rename(self, name: str) -> str | None:
        if name.startswith(("mtp.", "model.visual.")):
            return None          # MTP: read by the MTP drafter; the vision tower: unused
        name = name.replace("model.language_model.", "model.", 1)
        return super().checkpoint_rename(name)
