"""DeepSeek-V3 (and Kimi-K2, same architecture): multi-head latent attention and MoE.

MLA, per token (r = kv_lora_rank, n/p/v = qk_nope/qk_rope/v head dims, h = head):

    q          = q_b(norm(q_a(x)))  or  q_proj(x)                      # [heads, n + p]
    c, k_pe    = kv_a_proj_with_mqa(x)   ->  c = kv_a_layernorm(c)      # [r], [p]
    k_h, v_h   = kv_b(c) split per head                                 # [n], [v]
    score_h(j) = scale * (q_nope_h . k_h(j) + rope(q_pe_h) . rope(k_pe)(j))

The paged pool stores the latent [c, rope(k_pe)] ([r + p] per token and layer), not the
expanded keys and values. Batches of short requests (decode, verify, draft steps) attend in
the absorbed form, W_UK and W_UV being kv_b's per-head key and value rows:

    score_h(j) = scale * ([q_nope_h W_UK_h, q_pe_h] . latent(j));  out_h = (sum_j a_j c(j)) W_UV_h^T

Longer prefill chunks expand the cached latents through kv_b and attend as usual; with the
Triton backend every row attends in the absorbed form, in kernels/mla.py. RoPE may
be interleaved (pairs (x0, x1), (x2, x3), ...) and YaRN-scaled; YaRN's mscale_all_dim
multiplies the softmax scale by mscale^2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from onespec.engine.kv_cache import zeros_on_write
from onespec.layers.attention import AttentionMetadata
from onespec.layers.norm import RMSNorm
from onespec.layers.ops import TORCH_OPS, TorchOps
from onespec.layers.rotary import RotaryEmbedding, check_rope
from onespec.models.llama import MLP, check_architecture, check_field_types
from onespec.models.moe import Experts, Float32Router, MtpCausalLM, Router, mlp_step
from onespec.quant.fp8 import linear_dtype

ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "DeepseekV32ForCausalLM")
SPARSE_ARCHITECTURES = ("DeepseekV32ForCausalLM",)    # DSA: the lightning indexer (dsa.py)
ROPE_TYPES = ("default", "yarn")
ABSORB_MAX_ROWS = 16        # requests with at most this many rows attend in absorbed form
LATENT_NORM_EPS = 1e-6      # q_a_layernorm / kv_a_layernorm (not config.rms_norm_eps)


def _eos(cfg: dict) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


# config.json sizes read as positive integers (bounded as the dense models' are)
INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
              "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")


def _rope(cfg: dict) -> tuple[float, dict]:
    """(theta, scaling) from transformers 5.x rope_parameters or 4.x rope_scaling."""
    merged = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported for DeepSeek-V3; "
                         f"supported: {ROPE_TYPES}")
    merged["rope_type"] = kind
    if kind == "yarn":
        max_pos = cfg.get("max_position_embeddings", 4096)
        orig = merged.get("original_max_position_embeddings") or max_pos
        merged["original_max_position_embeddings"] = orig
        merged["factor"] = merged.get("factor") or max_pos / orig
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return check_rope(theta, merged, getattr(cfg, "source", "config.json")), merged


@dataclass
class DeepseekV3Config:
    """The fields of a DeepSeek-V3 config.json that the model needs."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict
    rope_interleave: bool
    max_position_embeddings: int
    attention_bias: bool
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: None = None
    mlp_layer_types: tuple[str, ...] | None = None    # "dense" / "sparse" per layer
    index_n_heads: int = 0          # DeepSeek-V3.2's indexer (0: dense attention)
    index_head_dim: int = 0
    index_topk: int = 0

    @classmethod
    def from_hf(cls, cfg: dict) -> "DeepseekV3Config":
        archs = check_architecture(cfg, ARCHITECTURES, "DeepSeek-V3")
        check_field_types(cfg, getattr(cfg, "source", "config.json"), INT_FIELDS)
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"scoring_func {cfg['scoring_func']!r} is not supported "
                             "(DeepSeek-V3 routing is 'sigmoid')")
        try:
            theta, scaling = _rope(cfg)
            mtp = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 0))
            arch = next(a for a in archs if a in ARCHITECTURES)
            types = cfg.get("mlp_layer_types")
            if types is not None and (not isinstance(types, list) or
                                      not set(types) <= {"dense", "sparse"}):
                raise ValueError(f"{getattr(cfg, 'source', 'config.json')}: field "
                                 "'mlp_layer_types' must be a list of 'dense' / 'sparse', "
                                 f"got {types!r}")
            index = _index_fields(cfg, arch)
            return cls(
                architecture=arch, **index,
                mlp_layer_types=None if types is None else tuple(types),
                vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                num_hidden_layers=cfg["num_hidden_layers"],
                num_attention_heads=cfg["num_attention_heads"],
                q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                qk_nope_head_dim=cfg["qk_nope_head_dim"],
                qk_rope_head_dim=cfg["qk_rope_head_dim"], v_head_dim=cfg["v_head_dim"],
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
                rope_scaling=scaling, rope_interleave=cfg.get("rope_interleave", True),
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                attention_bias=cfg.get("attention_bias", False),
                n_routed_experts=cfg.get("n_routed_experts") or 0,
                n_shared_experts=cfg.get("n_shared_experts") or 0,
                num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
                n_group=cfg.get("n_group") or 1, topk_group=cfg.get("topk_group") or 1,
                norm_topk_prob=cfg.get("norm_topk_prob", True),
                routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
                first_k_dense_replace=cfg.get("first_k_dense_replace") or 0,
                moe_layer_freq=cfg.get("moe_layer_freq") or 1,
                num_nextn_predict_layers=mtp or 0,
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                eos_token_ids=_eos(cfg),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks the required field {e.args[0]!r}") from None

    def is_moe_layer(self, i: int) -> bool:
        if self.mlp_layer_types is not None and i < len(self.mlp_layer_types):
            return self.n_routed_experts > 0 and self.mlp_layer_types[i] == "sparse"
        return (self.n_routed_experts > 0 and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    @property
    def sparse(self) -> bool:
        """DeepSeek Sparse Attention: each query attends to its indexer's top-k tokens."""
        return self.index_topk > 0


def _index_fields(cfg: dict, arch: str) -> dict:
    """The indexer's sizes of a DeepSeek-V3.2 config (none for the dense architectures)."""
    if arch not in SPARSE_ARCHITECTURES:
        return {}
    source = getattr(cfg, "source", "config.json")
    check_field_types(cfg, source, ("index_n_heads", "index_head_dim", "index_topk",
                                    "q_lora_rank"))
    out = {}
    for name in ("index_n_heads", "index_head_dim", "index_topk"):
        if cfg.get(name) is None:
            raise ValueError(f"{source} lacks the required field {name!r} ({arch})")
        out[name] = cfg[name]
    if cfg.get("q_lora_rank") is None:
        raise ValueError(f"{source}: {arch} needs 'q_lora_rank' (the indexer reads the "
                         "query's low-rank latent)")
    if out["index_head_dim"] < cfg["qk_rope_head_dim"]:
        raise ValueError(f"{source}: field 'index_head_dim' ({out['index_head_dim']}) must "
                         f"be at least qk_rope_head_dim ({cfg['qk_rope_head_dim']})")
    return out


# ---- rotary ----------------------------------------------------------------------------
def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between."""
    factor, orig = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation


class MLARotary(RotaryEmbedding):
    """RoPE on the rope parts of q and k: YaRN frequencies and cos/sin scale, and pairs
    de-interleaved first when `interleave` (the result is in neox layout, for q and k
    alike, so their dot products are those of the interleaved rotation)."""

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: dict,
                 interleave: bool, device):
        factor = 1.0
        if scaling["rope_type"] == "yarn":
            inv_freq = _yarn_inv_freq(dim, theta, scaling)
            factor = scaling.get("attention_factor")
            if factor is None:
                m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
                factor = (yarn_mscale(scaling["factor"], m) / yarn_mscale(scaling["factor"], m_all)
                          if m and m_all else yarn_mscale(scaling["factor"]))
        else:
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.cos_sin = torch.cat([freqs.cos() * factor, freqs.sin() * factor], -1).to(device)
        self.max_positions, self.fused_ok = max_positions, False
        self.interleave = interleave

    def __call__(self, positions, q, k):
        if self.interleave:
            q = torch.cat([q[..., 0::2], q[..., 1::2]], -1)
            k = torch.cat([k[..., 0::2], k[..., 1::2]], -1)
        return super().__call__(positions, q, k)


def softmax_scale(cfg: DeepseekV3Config) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling
    if s["rope_type"] != "default" and s.get("mscale_all_dim"):
        scale *= yarn_mscale(s["factor"], s["mscale_all_dim"]) ** 2
    return scale


# ---- attention -------------------------------------------------------------------------
class MLAttention(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.ops = ops
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.kv_lora_rank = heads, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                    cfg.v_head_dim)
        qk = self.nope_dim + self.rope_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk, bias=False)
        self.q_lora = cfg.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + self.rope_dim,
                                            bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (self.nope_dim + self.v_dim),
                                   bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=cfg.attention_bias)
        self.scale = softmax_scale(cfg)
        self.latent_cache = None     # [num_slots, r + p], set by the KV pool
        self.indexer = None          # DeepSeek-V3.2's lightning indexer (models/dsa.py)
        self.index_cache = None      # [num_slots, index_head_dim], its keys
        self.index_share = None      # an MTP layer's dsa.IndexShare, set by the drafter
        if cfg.sparse:
            from onespec.models.dsa import Indexer
            self.indexer = Indexer(h, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
                                   self.rope_dim, cfg.index_topk)
        self._fused_a = None         # [q or q_a; kv_a] as one linear (fuse_projections)

    def fuse_projections(self):
        """On the Triton backend, once the weights are in place: the two projections of x
        (q or q_a, and kv_a) become one linear whose weight holds both (the modules' own
        weights become views of it, no copy kept), so a decode step streams them in one
        GEMV launch instead of two. Kept out of the module tree (not a submodule)."""
        first = self.q_a_proj if self.q_lora else self.q_proj
        kv_a = self.kv_a_proj_with_mqa
        settings = getattr(self.ops, "settings", None)
        if settings is None or not settings.triton or first.bias is not None or \
                not isinstance(first, nn.Linear) or not isinstance(kv_a, nn.Linear) or \
                kv_a.bias is not None or first.weight.dtype != kv_a.weight.dtype:
            return
        weight = torch.cat([first.weight.data, kv_a.weight.data])
        n = first.weight.shape[0]
        first.weight.data, kv_a.weight.data = weight[:n], weight[n:]
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        fused.weight = nn.Parameter(weight, requires_grad=False)
        object.__setattr__(self, "_fused_a", fused)

    # the KV pool's hooks (engine/kv_cache.py)
    def cache_bytes_per_token(self) -> int:
        dtype_bytes = linear_dtype(self.o_proj).itemsize
        return (self._index_dim() + self.kv_lora_rank + self.rope_dim) * dtype_bytes

    def _index_dim(self) -> int:
        return 0 if self.indexer is None else self.indexer.head_dim

    def expanded_bytes_per_token(self) -> int:
        """What a cache of expanded keys and values would take, for comparison."""
        per_head = self.nope_dim + self.rope_dim + self.v_dim
        return self.num_heads * per_head * linear_dtype(self.o_proj).itemsize

    def allocate_cache(self, num_slots: int, device):
        self.latent_cache = zeros_on_write((num_slots, self.kv_lora_rank + self.rope_dim),
                                           linear_dtype(self.o_proj), device)
        if self.indexer is not None:
            self.index_cache = zeros_on_write((num_slots, self._index_dim()),
                                              linear_dtype(self.o_proj), device)

    def forward(self, x, positions, rotary: MLARotary, meta: AttentionMetadata,
                residual: torch.Tensor | None = None):
        """x [T, H] (normed) -> (residual +) o_proj(attention) [T, H]; writes this step's
        latents."""
        t, ops = positions.shape[0], self.ops       # (x may be a Prenormed: no shape)
        if self._fused_a is not None:
            both = ops.linear(self._fused_a, x)
            width = self.kv_lora_rank + self.rope_dim
            first, ckv = both.split([both.shape[1] - width, width], -1)   # [T, *], [T, r + p]
        else:
            first = ops.linear(self.q_a_proj if self.q_lora else self.q_proj, x)
            ckv = ops.linear(self.kv_a_proj_with_mqa, x)                   # [T, r + p]
        q_latent = ops.norm(self.q_a_layernorm, first) if self.q_lora else None
        q = ops.linear(self.q_b_proj, q_latent) if self.q_lora else first
        q = q.view(t, self.num_heads, -1)
        if meta.kv_slots is None:          # metadata built for the Triton kernels
            out = self.attend_paged(q, ckv, positions, rotary, meta)
        else:
            selection = None
            if self.indexer is not None:   # DSA: only the indexer's top-k keys
                from onespec.models.dsa import select_keys
                selection = select_keys(self, x, q_latent, positions, rotary, meta)
            out = self.attend_portable(q, ckv, positions, rotary, meta, selection)
        return ops.linear(self.o_proj, out.reshape(t, self.num_heads * self.v_dim), residual)

    def _padded(self, rows, meta: AttentionMetadata):
        """rows [T, heads, D] -> [B, heads, Qmax, D] by request (zeros in padding rows)."""
        out = rows.new_zeros(meta.kv_slots.shape[0], meta.max_q, *rows.shape[1:])
        out[meta.token_req, meta.token_idx] = rows
        return out.transpose(1, 2)

    def _unpadded(self, out, meta: AttentionMetadata):
        return out.transpose(1, 2)[meta.token_req, meta.token_idx]            # [T, heads, D]

    def _kv_b_heads(self):
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]      # W_UK [h, n, r], W_UV [h, v, r]

    def attend_portable(self, q, ckv, positions, rotary: MLARotary, meta: AttentionMetadata,
                        selection=None):
        """q [T, h, n + p], ckv [T, r + p] (the projections) -> [T, h, v] through PyTorch:
        rotary and the latents' write, then absorbed or expanded attention by row count;
        selection (a dsa.Selection, DeepSeek-V3.2): the only keys each row attends to,
        gathered in the absorbed form, a mask in the expanded one."""
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], -1)
        c, k_pe = ckv.split([self.kv_lora_rank, self.rope_dim], -1)
        q_pe, k_pe = rotary(positions, q_pe, k_pe.unsqueeze(1))
        latent = torch.cat([self.ops.norm(self.kv_a_layernorm, c), k_pe.squeeze(1)], -1)
        self.latent_cache.index_copy_(0, meta.slot_mapping, latent.to(self.latent_cache.dtype))
        if meta.max_q <= ABSORB_MAX_ROWS:
            if selection is not None:
                return self.attend_selected(q_nope, q_pe, meta, selection)
            return self.attend_absorbed(q_nope, q_pe, meta)
        mask = None if selection is None else selection.mask(meta.kv_slots.shape[1]) & meta.mask
        return self.attend_expanded(q_nope, q_pe, meta, mask)

    def _latent_query(self, q_nope):
        """q_nope_h W_UK_h [T, h, r]: the nope part of a query against the latents."""
        return torch.einsum("thn,hnr->thr", q_nope, self._kv_b_heads()[0])

    def _absorbed_query(self, q_nope, q_pe):
        """[q_nope_h W_UK_h, q_pe_h] [T, h, r + p]: a query against the latents."""
        return torch.cat([self._latent_query(q_nope), q_pe], -1)

    def _values(self, latent_out):
        """Attention-weighted latents [T, h, r] -> per-head values [T, h, v] (W_UV)."""
        return torch.einsum("thr,hvr->thv", latent_out, self._kv_b_heads()[1])

    def attend_absorbed(self, q_nope, q_pe, meta: AttentionMetadata):
        """q_nope [T, h, n], q_pe [T, h, p] -> [T, h, v], attending to the latents as one
        shared key/value head of width r + p (values: the first r)."""
        query = self._padded(self._absorbed_query(q_nope, q_pe), meta)   # [B, h, Qmax, r + p]
        latents = self.latent_cache[meta.kv_slots].unsqueeze(1)      # [B, 1, KV, r + p]
        out = F.scaled_dot_product_attention(query, latents, latents[..., :self.kv_lora_rank],
                                             attn_mask=meta.mask, scale=self.scale,
                                             enable_gqa=True)         # [B, h, Qmax, r]
        return self._values(self._unpadded(out, meta))

    def attend_selected(self, q_nope, q_pe, meta: AttentionMetadata, selection):
        """attend_absorbed over each row's selected latents only (gathered: a row reads its
        top-k latents, not its whole context); selection: a dsa.Selection."""
        query = self._padded(self._absorbed_query(q_nope, q_pe), meta)   # [B, h, Qmax, r + p]
        b, heads, qmax, width = query.shape
        picked = selection.picked.expand(b, qmax, -1)                    # [B, Qmax, n]
        n = picked.shape[-1]
        num_keys = meta.kv_slots.shape[1]
        slots = meta.kv_slots.gather(1, picked.clamp(max=num_keys - 1).reshape(b, -1))
        latents = self.latent_cache[slots].view(b * qmax, 1, n, width)  # [BQ, 1, n, r + p]
        valid = selection.valid.expand(b, qmax, -1).reshape(b * qmax, 1, 1, n)
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2).reshape(b * qmax, heads, 1, width), latents,
            latents[..., :self.kv_lora_rank], attn_mask=valid, scale=self.scale,
            enable_gqa=True)                                             # [BQ, h, 1, r]
        out = out.view(b, qmax, heads, -1).transpose(1, 2)               # [B, h, Qmax, r]
        return self._values(self._unpadded(out, meta))

    def attend_paged(self, q, ckv, positions, rotary: MLARotary, meta: AttentionMetadata):
        """attend_portable through the Triton kernels: one writes the latents and builds
        the absorbed queries, one walks the block tables (every row count: prefill chunks
        attend in the absorbed form too)."""
        from onespec.kernels import mla    # Triton: only on this backend
        norm = self.kv_a_layernorm
        query = mla.mla_rope_and_cache(q, self._latent_query(q[..., :self.nope_dim]), ckv,
                                       (norm.weight, norm.eps), rotary.cos_sin, positions,
                                       meta.slot_mapping, self.latent_cache,
                                       rotary.interleave)
        out = mla.mla_attention(query, self.latent_cache, meta.block_tables, meta.token_req,
                                positions, self.kv_lora_rank, self.scale, meta.block_size)
        return self._values(out)

    def attend_expanded(self, q_nope, q_pe, meta: AttentionMetadata, mask=None):
        """As attend_absorbed, with each cached latent expanded into per-head keys/values;
        mask [B, 1, Qmax, KV]: instead of meta.mask."""
        latents = self.latent_cache[meta.kv_slots]                   # [B, KV, r + p]
        c, k_pe = latents.split([self.kv_lora_rank, self.rope_dim], -1)
        kv = self.kv_b_proj(c).view(*c.shape[:2], self.num_heads, -1)
        k_nope, values = kv.split([self.nope_dim, self.v_dim], -1)   # [B, KV, h, n / v]
        keys = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.num_heads, -1)], -1)
        query = self._padded(torch.cat([q_nope, q_pe], -1), meta)
        out = F.scaled_dot_product_attention(query, keys.transpose(1, 2),
                                             values.transpose(1, 2),
                                             attn_mask=meta.mask if mask is None else mask,
                                             scale=self.scale)
        return self._unpadded(out, meta)


# ---- MoE and layers --------------------------------------------------------------------
class DeepseekRouter(Float32Router):
    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts),
                                                    requires_grad=False)


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.ops = ops
        self.router = Router(cfg.num_experts_per_tok, sigmoid=True,
                             norm_topk_prob=cfg.norm_topk_prob, num_groups=cfg.n_group,
                             topk_groups=cfg.topk_group, scaling=cfg.routed_scaling_factor)
        self.gate = DeepseekRouter(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               ops)
        self.shared_experts = MLP(cfg.hidden_size,
                                  cfg.moe_intermediate_size * cfg.n_shared_experts,
                                  ops=ops) if cfg.n_shared_experts else None

    takes_residual = True    # forward(x, residual, ...); off when split over ranks

    def forward(self, x, residual=None, next_norm: RMSNorm | None = None, last: bool = False):
        """x [T, H] -> routed experts + shared experts [T, H]. With a residual: (residual +
        that, next_norm of it or None), the residual added where the routed experts' pairs
        are summed (MLP.forward for next_norm and `last`)."""
        # float32 logits whatever the model's dtype: routing is sensitive to rounding
        logits = F.linear(x.float(), self.gate.weight.float())                  # [T, E]
        out = self.experts(x, logits, self.router, self.gate.e_score_correction_bias,
                           residual)
        if residual is None:
            return out if self.shared_experts is None else self.shared_experts(x, out)[0]
        if self.shared_experts is not None:
            return self.shared_experts(x, out, next_norm, last)
        return out, None if next_norm is None else self.ops.norm(next_norm, out)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, layer_idx: int, ops: TorchOps = TORCH_OPS):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekMoE(cfg, ops) if cfg.is_moe_layer(layer_idx) else \
            MLP(cfg.hidden_size, cfg.intermediate_size, ops=ops)
        self.ops = ops

    def forward(self, h, x, positions, rotary, meta, next_norm: RMSNorm | None = None,
                last: bool = False):
        """As DecoderLayer.forward in models/llama.py (x: the input norm the layer before
        left, or None), with MLA adding the residual in its o_proj GEMV."""
        ops = self.ops
        x = ops.norm(self.input_layernorm, h) if x is None else x
        h = self.self_attn(x, positions, rotary, meta, residual=h)
        x = ops.norm(self.post_attention_layernorm, h)
        return mlp_step(self.mlp, ops, x, h, next_norm, last)


class DeepseekV3ForCausalLM(MtpCausalLM):
    config_class = DeepseekV3Config
    layer_class = DeepseekDecoderLayer
    triton_tree_masks = False      # kernels/mla.py has no tree masks: trees run portable

    def make_rotary(self, max_positions: int, device) -> MLARotary:
        c = self.config
        return MLARotary(c.qk_rope_head_dim, max_positions, c.rope_theta, c.rope_scaling,
                         c.rope_interleave, device)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (models/dsa.py). Portable
    path only: kernels/mla.py attends to every cached latent, with no per-query selection
    (attention_backend='triton' is refused for it)."""
    supports_triton = False
