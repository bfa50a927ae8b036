"""Nemotron-H (`NemotronHForCausalLM`): a stack of single-mixer blocks, each
`h = h + mixer(norm(h))`, the mixer per `layers_block_type` (or the older
`hybrid_override_pattern`: M = Mamba2, * = attention, E = MoE, - = MLP):

- "linear_attention" (Mamba2): in_proj -> (z [I], xBC [I + 2 G N], dt [H]); xBC through a
  causal depthwise conv1d (with bias) and SiLU, whose last W - 1 inputs are the conv
  state; dt = softplus(dt + dt_bias) within `time_step_limit`; the selective scan
  (layers/recurrent.py mamba2_scan) over a [H, P, N] state per request with A = -exp(A_log),
  B and C per group, the D skip; then RMSNorm per group of y * silu(z), out_proj.
- "full_attention": GQA attention without positional encoding.
- "mlp": down(relu(up(x))^2).
- "moe": DeepSeek-style sigmoid group-limited routing (models/moe.py) over ungated
  experts (up, relu^2, down), optionally through a latent projection, plus a shared
  expert.

MTP (`num_nextn_predict_layers` = 1, `mtp_layers_block_type` or `mtp_hybrid_override_pattern`,
e.g. attention then MoE): one draft step runs those blocks in turn, `mtp.layers.{i}.*` in
the checkpoint; block 0 also holds `enorm`, `hnorm` and `eh_proj` (the input
eh_proj(concat(enorm(embed), hnorm(h)))), the last `final_layernorm` (the output norm):
models/mtp.py's MTPLayer with the blocks as its block (NemotronMTPBlock).

Checkpoints name the stack `backbone.` (`embeddings`, `layers.{i}.norm`, `layers.{i}.mixer`,
`norm_f`); here it is `model.` with `embed_tokens` and `norm`, as the drafters expect. The
recurrent state lives in the state pool as for models/qwen3_next.py (same RecurrentBatch
protocol). The attention and the mixers' linears compute through the backend's ops (on the
Triton backend its paged attention and decode GEMVs). The ungated experts run in PyTorch,
one expert at a time over the rows routed to it, which the host picks: a model with MoE
blocks runs its steps eagerly (`host_synced_experts`, combinations.py RUNS_EAGERLY).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from onespec.layers.attention import AttentionMetadata
from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TORCH_OPS, TorchOps
from onespec.layers.recurrent import RecurrentMixer, mamba2_chunked, mamba2_scan
from onespec.models.llama import DecoderConfig, SeparateProjAttention, check_architecture, \
    check_field_types
from onespec.models.moe import Float32Router, Router

ARCHITECTURES = ("NemotronHForCausalLM",)
PATTERN = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}
BLOCK_TYPES = tuple(PATTERN.values())


@dataclass
class NemotronHConfig(DecoderConfig):
    layer_types: tuple[str, ...] = ()
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    n_groups: int = 1
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 0
    mtp_layers_block_type: tuple[str, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> "NemotronHConfig":
        source = getattr(cfg, "source", "config.json")
        check_architecture(cfg, ARCHITECTURES, "Nemotron-H", source)
        check_field_types(cfg, source)
        types = cfg.get("layers_block_type") or cfg.get("layer_types")
        pattern = cfg.get("hybrid_override_pattern")
        if types is None and pattern is not None:
            bad = sorted(set(pattern) - set(PATTERN))
            if bad:
                raise ValueError(f"{source}: field 'hybrid_override_pattern' may hold only "
                                 f"{''.join(PATTERN)}, got {bad[0]!r}")
            types = [PATTERN[c] for c in pattern]
        if not types or any(t not in BLOCK_TYPES for t in types):
            raise ValueError(f"{source}: field 'layers_block_type' must list block types from "
                             f"{BLOCK_TYPES}, got {types!r}")
        mtp_types = cfg.get("mtp_layers_block_type")
        if mtp_types is None and cfg.get("mtp_hybrid_override_pattern") is not None:
            mtp_types = [PATTERN.get(c, c) for c in cfg["mtp_hybrid_override_pattern"]]
        mtp_types = tuple(mtp_types or ("full_attention", "moe"))
        if any(t not in ("full_attention", "moe", "mlp") for t in mtp_types):
            raise ValueError(f"{source}: field 'mtp_layers_block_type' may hold only "
                             f"'full_attention', 'moe' and 'mlp' blocks (an MTP step keeps no "
                             f"recurrent state), got {list(mtp_types)!r}")
        limit = cfg.get("time_step_limit") or cfg.get("mamba_dt_limit") or (0.0, float("inf"))
        limit = tuple(float("inf") if isinstance(v, dict) else float(v) for v in limit)
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        try:
            base = dict(
                architecture="NemotronHForCausalLM", vocab_size=cfg["vocab_size"],
                hidden_size=hidden, intermediate_size=cfg.get("intermediate_size", 0),
                num_hidden_layers=len(types), num_attention_heads=heads,
                num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                head_dim=cfg.get("head_dim") or hidden // heads,
                rms_norm_eps=cfg.get("layer_norm_epsilon", 1e-5), rope_theta=10000.0,
                rope_scaling={}, max_position_embeddings=cfg.get("max_position_embeddings",
                                                                 4096),
                attention_bias=cfg.get("attention_bias", False),
                mlp_bias=cfg.get("mlp_bias", False), qk_norm=False,
                tie_word_embeddings=cfg.get("tie_word_embeddings", False), sliding_window=None,
                eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list)
                else (eos,))
            own = dict(
                layer_types=tuple(types), mamba_num_heads=cfg["mamba_num_heads"],
                mamba_head_dim=cfg["mamba_head_dim"], ssm_state_size=cfg["ssm_state_size"],
                n_groups=cfg.get("n_groups", cfg.get("mamba_n_groups", 1)),
                conv_kernel=cfg.get("conv_kernel", cfg.get("mamba_d_conv", 4)),
                use_conv_bias=cfg.get("use_conv_bias", True), use_bias=cfg.get("use_bias", False),
                time_step_limit=limit, n_routed_experts=cfg.get("n_routed_experts", 0),
                num_experts_per_tok=cfg.get("num_experts_per_tok", 1),
                moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
                moe_shared_expert_intermediate_size=cfg.get(
                    "moe_shared_expert_intermediate_size", 0),
                moe_latent_size=cfg.get("moe_latent_size"), n_group=cfg.get("n_group", 1),
                topk_group=cfg.get("topk_group", 1),
                norm_topk_prob=cfg.get("norm_topk_prob", True),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                num_nextn_predict_layers=cfg.get("num_nextn_predict_layers", 0) or 0,
                mtp_layers_block_type=mtp_types)
        except KeyError as e:
            raise ValueError(f"{source} lacks the required field {e.args[0]!r}") from None
        if cfg.get("mlp_hidden_act", "relu2") != "relu2":
            raise ValueError(f"{source}: field 'mlp_hidden_act' must be 'relu2', got "
                             f"{cfg['mlp_hidden_act']!r}")
        if own["mamba_num_heads"] % own["n_groups"]:
            raise ValueError(f"{source}: field 'mamba_num_heads' must be a multiple of "
                             f"n_groups = {own['n_groups']}")
        assert set(base) | set(own) <= {f.name for f in fields(cls)}
        return cls(**base, **own)


class Mamba2Mixer(RecurrentMixer):
    """The Mamba2 mixer, its conv and SSM states in the state pool (state_shapes)."""

    def __init__(self, cfg: NemotronHConfig, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.ops = ops
        self.num_heads, self.head_dim = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.n_groups, self.state_size = cfg.n_groups, cfg.ssm_state_size
        self.inner = self.num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.n_groups * self.state_size
        self.kernel = cfg.conv_kernel
        self.in_proj = nn.Linear(cfg.hidden_size, self.inner + self.conv_dim + self.num_heads,
                                 bias=cfg.use_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel,
                                bias=cfg.use_conv_bias, groups=self.conv_dim,
                                padding=self.kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = RMSNorm(self.inner, cfg.rms_norm_eps)          # per group, gated
        self.out_proj = nn.Linear(self.inner, cfg.hidden_size, bias=cfg.use_bias)
        self.dt_limit = cfg.time_step_limit
        self.states: dict[str, torch.Tensor] = {}
        self.snapshots: dict[str, torch.Tensor] = {}

    def state_shapes(self, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"conv": ((self.conv_dim, self.kernel - 1), dtype),
                "ssm": ((self.num_heads, self.head_dim, self.state_size), torch.float32)}

    def gated_norm(self, y, z):
        """RMSNorm over each group of y * silu(z), then the weight: [T, I] float32 in."""
        t = y.shape[0]
        g = (y * F.silu(z.float())).view(t, self.n_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.norm.eps)
        return self.norm.weight * g.view(t, self.inner).to(z.dtype)

    def forward(self, x, meta: AttentionMetadata):
        rb = meta.recurrent
        z, xbc, dt = self.ops.linear(self.in_proj, x).split(
            [self.inner, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        a = -self.A_log.float().exp()
        gn = self.n_groups * self.state_size
        y = x.new_empty(x.shape[0], self.inner, dtype=torch.float32)

        def args_of(mixed, rows, n, length):
            xs, b, c = mixed.split([self.inner, gn, gn], dim=-1)
            return (xs.reshape(n, length, self.num_heads, self.head_dim),
                    dt[rows].view(n, length, -1), a, b.reshape(n, length, self.n_groups, -1),
                    c.reshape(n, length, self.n_groups, -1), self.D)

        for rows, out in self.recur(rb, xbc, self.conv1d.bias, args_of, mamba2_chunked,
                                    mamba2_scan, "mamba2_verify"):
            y[rows] = out.reshape(-1, self.inner)
        return self.ops.linear(self.out_proj, self.gated_norm(y, z).to(x.dtype))


class NoPEAttention(SeparateProjAttention):
    """GQA attention without positional encoding over the paged KV cache."""

    def forward(self, x, meta: AttentionMetadata):
        t, lin = x.shape[0], self.ops.linear
        q = lin(self.q_proj, x).view(t, self.num_heads, self.head_dim)
        k = lin(self.k_proj, x).view(t, self.num_kv_heads, self.head_dim)
        v = lin(self.v_proj, x).view(t, self.num_kv_heads, self.head_dim)
        out = self.ops.paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                                       kv_scales=getattr(self, "kv_scales", None))
        return lin(self.o_proj, out.reshape(t, self.q_size))


class ReluSquaredMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        return self.down_proj(F.relu(self.up_proj(x)).square())


class UngatedExperts(nn.Module):
    """Stacked experts up [E, I, H], down [E, H, I]: down(relu(up x)^2) per expert."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x, ids, weights):
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            y = F.linear(F.relu(F.linear(x[rows], self.up_proj[e])).square(), self.down_proj[e])
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        return out


class NemotronGate(Float32Router):
    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))


class NemotronMoE(nn.Module):
    def __init__(self, cfg: NemotronHConfig):
        super().__init__()
        self.router = Router(cfg.num_experts_per_tok, sigmoid=True,
                             norm_topk_prob=cfg.norm_topk_prob, num_groups=cfg.n_group,
                             topk_groups=cfg.topk_group, scaling=cfg.routed_scaling_factor)
        self.gate = NemotronGate(cfg)
        inner = cfg.moe_latent_size or cfg.hidden_size
        self.experts = UngatedExperts(cfg.n_routed_experts, inner, cfg.moe_intermediate_size)
        self.shared_experts = ReluSquaredMLP(cfg.hidden_size,
                                             cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias)
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, inner, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(inner, cfg.hidden_size, bias=cfg.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x):
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = self.router.route(logits, self.gate.e_score_correction_bias)
        inner = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        routed = self.experts(inner, ids, weights)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: NemotronHConfig, layer_idx: int, ops: TorchOps = TORCH_OPS,
                 block_type: str | None = None):
        super().__init__()
        self.block_type = block_type or cfg.layer_types[layer_idx]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = {"linear_attention": lambda: Mamba2Mixer(cfg, ops),
                      "full_attention": lambda: NoPEAttention(cfg, ops),
                      "moe": lambda: NemotronMoE(cfg),
                      "mlp": lambda: ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size,
                                                    cfg.mlp_bias)}[self.block_type]()

    def forward(self, h, meta):
        x = self.norm(h)
        if self.block_type in ("linear_attention", "full_attention"):
            return h + self.mixer(x, meta)
        return h + self.mixer(x)


class NemotronMTPBlock(nn.Module):
    """The blocks of one MTP step, called as a decoder layer (models/mtp.py MTPLayer)."""

    def __init__(self, cfg: NemotronHConfig, ops: TorchOps):
        super().__init__()
        self.blocks = nn.ModuleList(NemotronHBlock(cfg, 0, ops, t)
                                    for t in cfg.mtp_layers_block_type)

    def attention_layers(self) -> list[nn.Module]:
        return [b.mixer for b in self.blocks if b.block_type == "full_attention"]

    def forward(self, h, x, positions, rotary, meta, next_norm=None, last: bool = False):
        for block in self.blocks:
            h = block(h, meta)
        return h, None


class NemotronHStack(nn.Module):
    def __init__(self, cfg: NemotronHConfig, ops: TorchOps):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, i, ops)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class NemotronHForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], meta, capture) -> (final-normed hidden [T, H],
    the residual streams after the `capture` blocks [T, len·H] or None)."""

    config_class = NemotronHConfig
    supports_triton = True     # attention and linears through TritonOps (module docstring)
    triton_tree_masks = False
    recurrent = True

    def __init__(self, cfg: NemotronHConfig, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.config, self.ops = cfg, ops
        # MoE blocks (the target's or its MTP step's): the ungated experts' rows are picked
        # on the host, so the steps run eagerly (combinations.py RUNS_EAGERLY)
        self.host_synced_experts = "moe" in cfg.layer_types or (
            cfg.num_nextn_predict_layers > 0 and "moe" in cfg.mtp_layers_block_type)
        self.model = NemotronHStack(cfg, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = None

    def attention_layers(self) -> list[nn.Module]:
        return [b.mixer for b in self.model.layers if b.block_type == "full_attention"]

    def recurrent_layers(self) -> list[nn.Module]:
        return [b.mixer for b in self.model.layers if b.block_type == "linear_attention"]

    def setup_rotary(self, max_positions: int, device):
        """No positional encoding (the attention layers are NoPE)."""

    def make_rotary(self, max_positions: int, device):
        return None

    def make_decoder_layer(self, layer_idx: int) -> NemotronMTPBlock:
        """The blocks of an MTP step (mtp_layers_block_type)."""
        return NemotronMTPBlock(self.config, self.ops)

    def mtp_rename(self, num_target_layers: int, num_layers: int):
        """Checkpoint key of the MTP blocks -> MTPLayer parameter name (one step):
        'mtp.layers.0.{enorm, hnorm, eh_proj}' -> 'layers.0.*', the last block's
        final_layernorm -> 'layers.0.shared_head.norm', 'mtp.layers.{i}.X' ->
        'layers.0.block.blocks.{i}.X'."""
        last = len(self.config.mtp_layers_block_type) - 1

        def rename(name: str) -> list[str]:
            name = name.removeprefix("language_model.")
            parts = name.split(".", 3)
            if len(parts) < 4 or parts[:2] != ["mtp", "layers"] or not parts[2].isdigit():
                return []
            i, rest = int(parts[2]), parts[3]
            if i == 0 and rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
                return [f"layers.0.{rest}"]
            if i == last and rest.startswith("final_layernorm."):
                return ["layers.0.shared_head.norm." + rest.split(".", 1)[1]]
            return [f"layers.0.block.blocks.{i}.{rest}"] if i <= last else []
        return rename

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                capture: tuple[int, ...] = ()):
        h = self.model.embed_tokens(input_ids)
        saved = {}
        for i, block in enumerate(self.model.layers):
            h = block(h, meta)
            if i in capture:
                saved[i] = h
        captured = torch.cat([saved[i] for i in capture], dim=-1) if capture else None
        return self.model.norm(h), captured

    def compute_logits(self, hidden):
        return self.ops.logits(self.lm_head, hidden)

    def greedy_tokens(self, hidden):
        return self.ops.greedy(self.lm_head, hidden)

    def checkpoint_rename(self, name: str) -> str | None:
        """backbone.{embeddings, norm_f, layers} -> model.{embed_tokens, norm, layers};
        MTP layers (`mtp.*`) are not read."""
        if name.startswith(("mtp.", "language_model.mtp.")):
            return None
        name = name.removeprefix("language_model.")
        for old, new in (("backbone.embeddings.", "model.embed_tokens."),
                         ("backbone.norm_f.", "model.norm."), ("backbone.", "model."),
                         ("model.embeddings.", "model.embed_tokens."),
                         ("model.norm_f.", "model.norm.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return None
        return name
