"""FP8 (e4m3) weights that stay FP8 in memory, with float32 scales.

Formats read (docs/DECODING.md, "Quantized checkpoints"), each from the exact fields and
keys of published checkpoints:

    block-scaled   quantization_config {"quant_method": "fp8", "weight_block_size": [128,
                   128], "activation_scheme": "dynamic"} (DeepSeek-V3/R1, Qwen3-FP8, GLM):
                   `X.weight` e4m3, `X.weight_scale_inv` [ceil(out/128), ceil(in/128)];
                   without weight_block_size one `X.weight_scale` per tensor
    compressed-    quantization_config {"quant_method": "compressed-tensors",
    tensors        "config_groups": {..: {"weights": {"num_bits": 8, "type": "float",
                   "strategy": "channel" | "tensor" | "block"}, "input_activations": ..}}}:
                   `X.weight_scale` [out, 1] / one value / per block, `X.input_scale`
    ModelOpt       hf_quant_config.json {"quantization": {"quant_algo": "FP8"}} or
                   quantization_config {"quant_method": "modelopt", "quant_algo": "FP8"}:
                   `X.weight_scale`, `X.input_scale` (one value each)

Which linears are quantized is read from the checkpoint's keys (a weight with a scale
key), so every ignore / exclude list is honoured as written. In memory a quantized linear
is an `FP8Linear`: `weight` e4m3 [out, in] and `weight_scale` float32, either per block
[ceil(out/bo), ceil(in/bi)] or per output channel [out]; a per-tensor scale becomes a
per-channel one at load (q, k and v, or gate and up, packed into one linear keep their own
scales that way). Stacked experts (models/moe.py) hold e4m3 `gate_up_proj` / `down_proj`
with `gate_up_proj_scale` / `down_proj_scale` the same way, one more leading dimension.

W = q * scale (the block's or the row's), in float32, then cast to the compute dtype.
The portable path dequantizes one layer at a time, on the fly, and is the reference;
activation scales (`input_scale`, static or dynamic schemes alike) are read, checked and
not applied: activations stay in the model's dtype (weight-only FP8). KV-cache scales are
taken out of the weight stream first (quant/kv_fp8.py: kv_cache_dtype="fp8").

`quantize_model` quantizes a loaded bf16/fp32 model per output channel
(`LLM(..., quantization="fp8")`, and `draft_dtype="fp8"` for a drafter's layers).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0            # the largest finite e4m3fn value
QUANTIZATION_CHOICES = ("fp8",)
# linears whose weight a layer reads directly, not through the ops object: dequantized
# once at load (MLA's kv_b_proj: W_UK / W_UV are applied as batched products)
DEQUANTIZED_AT_LOAD = ("kv_b_proj",)
# checkpoint tensors that are read, checked and dropped: activation and KV-cache scales
DROPPED_SCALES = (".input_scale", ".k_scale", ".v_scale")
SUPPORTED = ("'fp8' (e4m3, per block or per tensor), 'compressed-tensors' (FP8 weights: "
             "num_bits 8, type 'float', strategy 'tensor', 'channel' or 'block') and "
             "'modelopt' (quant_algo 'FP8'); and 'mxfp4' (gpt-oss experts, decoded at load)")


# ---- dequantization and quantization -------------------------------------------------

def expand_scale(scale: torch.Tensor, rows: int, cols: int,
                 block: tuple[int, int] | None) -> torch.Tensor:
    """scale [..., ceil(rows/bo), ceil(cols/bi)] (block) or [..., rows] -> one factor per
    weight element, broadcastable to [..., rows, cols]."""
    if block is None:
        return scale.unsqueeze(-1)
    bo, bi = block
    s = scale.repeat_interleave(bo, dim=-2)[..., :rows, :]
    return s.repeat_interleave(bi, dim=-1)[..., :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """e4m3 weight [..., rows, cols] * its scales, computed in float32, cast to dtype."""
    rows, cols = weight.shape[-2:]
    return (weight.float() * expand_scale(scale.float(), rows, cols, block)).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., rows, cols] -> (e4m3 weight, float32 scales): per output row, or per
    block (bo, bi); each scale maps the row's (block's) largest magnitude onto FP8_MAX."""
    w = weight.detach().float()
    rows, cols = w.shape[-2:]
    if block is None:
        amax = w.abs().amax(dim=-1)                                        # [..., rows]
    else:
        bo, bi = block
        pad = F.pad(w.abs(), (0, -cols % bi, 0, -rows % bo))
        lead = pad.shape[:-2]
        amax = pad.reshape(*lead, pad.shape[-2] // bo, bo, pad.shape[-1] // bi, bi) \
            .amax(dim=(-3, -1))                                            # [..., R, C]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / expand_scale(scale, rows, cols, block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


# ---- modules ---------------------------------------------------------------------------

class KeepsQuantized:
    """Mixin for an nn.Module holding e4m3 weights and their `*_scale` parameters: a cast
    of the whole model (`.to(dtype)`, `.half()`) only moves them, and sets
    `compute_dtype` (the dtype weights are dequantized to) to the dtype asked for."""

    compute_dtype: torch.dtype = torch.float32

    def _apply(self, fn, recurse=True):
        kept = {id(p) for name, p in self._parameters.items()
                if p is not None and (p.dtype == FP8 or name.endswith("_scale"))}

        def keep(t):
            out = fn(t)
            if id(t) in kept and out.dtype != t.dtype:
                self.compute_dtype = out.dtype
                return t.to(device=out.device)
            return out
        return super()._apply(keep, recurse)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class FP8Linear(KeepsQuantized, nn.Module):
    """y = x W^T (+ bias) for W = dequantize(weight, weight_scale, block): `weight` e4m3
    [out, in], `weight_scale` float32 [ceil(out/bo), ceil(in/bi)] (block) or [out]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block: tuple[int, int] | None = None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = tuple(block) if block else None
        shape = (-(-out_features // block[0]), -(-in_features // block[1])) if block \
            else (out_features,)
        self.weight = _frozen(torch.empty(out_features, in_features, dtype=FP8,
                                          device=device))
        self.weight_scale = _frozen(torch.ones(shape, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, block: tuple[int, int] | None) -> "FP8Linear":
        """An empty FP8Linear of linear's shape, on its device (meta at load)."""
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, block,
                  device=linear.weight.device)
        out.compute_dtype = linear.weight.dtype
        return out

    @classmethod
    def quantized(cls, linear: nn.Linear, block: tuple[int, int] | None = None
                  ) -> "FP8Linear":
        """linear's weight quantized (per output channel unless block), bias kept."""
        out = cls.like(linear, block)
        q, scale = quantize(linear.weight, block)
        out.weight.data, out.weight_scale.data = q, scale
        if linear.bias is not None:
            out.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return out

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.block,
                          dtype or self.compute_dtype)

    def forward(self, x):
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def scale_rows(self, offset: int, size: int, name: str) -> tuple[int, int]:
        """The rows of weight_scale that weight rows [offset, offset + size) own (a q/k/v or
        gate/up shard of a packed linear); a shard must start and end on block edges."""
        if self.block is None:
            return offset, size
        bo = self.block[0]
        end = offset + size
        if offset % bo or (end % bo and end != self.out_features):
            raise ValueError(f"weight scale {name!r}: its weight rows [{offset}, {end}) of a "
                             f"packed projection do not start and end on {bo}-row block "
                             "edges, so its blocks cannot be packed")
        return offset // bo, -(-end // bo) - offset // bo

    def extra_repr(self) -> str:
        scales = f"block={self.block}" if self.block else "per-channel"
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"e4m3, {scales}"


def linear_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a linear computes in (an FP8Linear's compute dtype, else its weight's)."""
    return layer.compute_dtype if isinstance(layer, FP8Linear) else layer.weight.dtype


def quantize_experts(experts: nn.Module, block: tuple[int, int] | None = None,
                     empty: bool = False):
    """Stacked experts' gate_up_proj / down_proj as e4m3 with `*_scale` parameters:
    quantized from their values, or (empty) allocated on their device for a load."""
    experts.block = tuple(block) if block else None
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(experts, name)
        if empty:
            rows, cols = w.shape[-2:]
            shape = (w.shape[0], -(-rows // block[0]), -(-cols // block[1])) if block \
                else (w.shape[0], rows)
            q = torch.empty(w.shape, dtype=FP8, device=w.device)
            scale = torch.ones(shape, dtype=torch.float32, device=w.device)
        else:
            q, scale = quantize(w, block)
        experts.compute_dtype = w.dtype
        setattr(experts, name, _frozen(q))
        setattr(experts, name + "_scale", _frozen(scale))


def quantize_model(model: nn.Module, skip: tuple[str, ...] = ("lm_head",),
                   block: tuple[int, int] | None = None) -> nn.Module:
    """Every nn.Linear of a loaded model (but those named in `skip` or DEQUANTIZED_AT_LOAD,
    and one tied to an embedding) and every stack of experts quantized to e4m3, per output
    channel (or per block): `quantization="fp8"`, `draft_dtype="fp8"`, benchmarks."""
    from onespec.models.moe import Experts
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child_name in skip:
                continue
            if type(child) is nn.Linear and child_name not in DEQUANTIZED_AT_LOAD and \
                    id(child.weight) not in tied:
                setattr(module, child_name, FP8Linear.quantized(child, block))
            elif isinstance(child, Experts) and child.gate_up_proj.dtype != FP8:
                quantize_experts(child, block)
    return model


def dequantize_direct_reads(model: nn.Module):
    """FP8 linears named in DEQUANTIZED_AT_LOAD back to dense nn.Linear (compute dtype)."""
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if child_name in DEQUANTIZED_AT_LOAD and isinstance(child, FP8Linear):
                dense = nn.Linear(child.in_features, child.out_features,
                                  child.bias is not None, device=child.weight.device,
                                  dtype=child.compute_dtype)
                dense.weight.data = child.dequantized()
                if child.bias is not None:
                    dense.bias.data = child.bias.data.to(child.compute_dtype)
                dense.requires_grad_(False)
                setattr(module, child_name, dense)


def quantized_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Bytes the model's parameters take once cast to dtype (FP8 and scales keep theirs)."""
    total = 0
    for module in model.modules():
        keeps = isinstance(module, KeepsQuantized)
        for name, p in module.named_parameters(recurse=False):
            kept = keeps and (p.dtype == FP8 or name.endswith("_scale"))
            total += p.numel() * (p.element_size() if kept else dtype.itemsize)
    return total


# ---- checkpoint schemes ----------------------------------------------------------------

@dataclass(frozen=True)
class FP8Scheme:
    """An FP8 checkpoint's layout: `method` as its config names it, `block` (bo, bi) for
    per-block scales (else per channel or per tensor), `scale_key` the suffix of a
    weight's scale tensor (`X.weight_scale_inv` or `X.weight_scale`)."""
    method: str
    block: tuple[int, int] | None
    scale_key: str
    source: str


def _int_pair(v) -> bool:
    return isinstance(v, (list, tuple)) and len(v) == 2 and \
        all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v)


def checkpoint_scheme(cfg: dict, path: str | None = None) -> FP8Scheme | None:
    """The FP8 scheme a checkpoint declares (config.json's quantization_config, or
    ModelOpt's hf_quant_config.json beside it), None for an unquantized or an MXFP4 one;
    any other scheme is a ValueError naming it and the supported ones."""
    source = f"{getattr(cfg, 'source', 'config.json')}: quantization_config"
    qc = cfg.get("quantization_config", cfg.get("compression_config"))
    if qc is None and path is not None:
        modelopt = os.path.join(path, "hf_quant_config.json")
        if os.path.isfile(modelopt):
            with open(modelopt, encoding="utf-8") as f:
                data = json.load(f)
            qc = data.get("quantization") if isinstance(data, dict) else None
            source = f"{modelopt}: quantization"
            if not isinstance(qc, dict):
                raise ValueError(f"{modelopt} must hold a \"quantization\" object")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"{source} must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method is None and "quant_algo" in qc:
        method = "modelopt"
    if method == "mxfp4":          # not FP8: quant/mxfp4.py decodes it at load
        return None
    if method == "fp8":
        return _fp8_method(qc, source)
    if method == "compressed-tensors":
        return _compressed_tensors(qc, source)
    if method == "modelopt":
        algo = qc.get("quant_algo")
        if algo != "FP8":
            raise ValueError(f"{source}: ModelOpt quant_algo {algo!r} is not supported; "
                             "onespec loads quant_algo 'FP8'")
        return FP8Scheme("modelopt", None, "weight_scale", source)
    raise ValueError(f"{source}: quant_method {method!r} is not supported; onespec loads "
                     f"{SUPPORTED}")


def _fp8_method(qc: dict, source: str) -> FP8Scheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{source}: fp8 fmt {fmt!r} is not supported; onespec loads 'e4m3'")
    act = qc.get("activation_scheme", "dynamic")
    if act not in ("dynamic", "static"):
        raise ValueError(f"{source}: activation_scheme must be 'dynamic' or 'static', "
                         f"got {act!r}")
    block = qc.get("weight_block_size")
    if block is None:
        return FP8Scheme("fp8", None, "weight_scale", source)
    if not _int_pair(block):
        raise ValueError(f"{source}: weight_block_size must be two positive integers "
                         f"[rows, cols], got {block!r}")
    return FP8Scheme("fp8", tuple(block), "weight_scale_inv", source)


def _compressed_tensors(qc: dict, source: str) -> FP8Scheme:
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise ValueError(f"{source}: compressed-tensors format {fmt!r} is not supported; "
                         "onespec loads 'float-quantized' (FP8) checkpoints")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{source}: compressed-tensors needs a non-empty config_groups")
    blocks = set()
    for gname, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(w, dict):
            raise ValueError(f"{source}: config_groups.{gname} has no weights scheme")
        kind = (w.get("num_bits"), w.get("type"), w.get("strategy"))
        if kind[:2] != (8, "float") or kind[2] not in ("tensor", "channel", "block") or \
                w.get("symmetric", True) is not True or w.get("dynamic", False):
            raise ValueError(
                f"{source}: compressed-tensors scheme config_groups.{gname}.weights "
                f"(num_bits={kind[0]!r}, type={kind[1]!r}, strategy={kind[2]!r}, "
                f"symmetric={w.get('symmetric', True)!r}, dynamic={w.get('dynamic', False)!r}) "
                "is not supported; onespec loads static symmetric FP8 weights (num_bits 8, "
                "type 'float', strategy 'tensor', 'channel' or 'block')")
        act = group.get("input_activations")
        if act is not None and (act.get("num_bits"), act.get("type")) != (8, "float"):
            raise ValueError(f"{source}: compressed-tensors config_groups.{gname}."
                             f"input_activations (num_bits={act.get('num_bits')!r}, "
                             f"type={act.get('type')!r}) are not supported with FP8 weights; "
                             "onespec reads FP8 (num_bits 8, type 'float') or none")
        if kind[2] == "block":
            if not _int_pair(w.get("block_structure")):
                raise ValueError(f"{source}: config_groups.{gname}.weights.block_structure "
                                 f"must be two positive integers, got "
                                 f"{w.get('block_structure')!r}")
            blocks.add(tuple(w["block_structure"]))
        else:
            blocks.add(None)
    if len(blocks) > 1:
        raise ValueError(f"{source}: compressed-tensors groups mix block sizes / strategies "
                         f"{sorted(map(str, blocks))}; onespec loads one block layout")
    return FP8Scheme("compressed-tensors", blocks.pop(), "weight_scale", source)


# ---- loading ---------------------------------------------------------------------------

EXPERT_SCALE = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def prepare_for_checkpoint(model: nn.Module, scheme: FP8Scheme, keys, rename,
                           what: str) -> int:
    """Before a load (model on the meta device): every linear whose checkpoint weight has
    a scale key becomes an empty FP8Linear of the scheme's layout, and every stack of
    experts whose experts have scales holds e4m3. -> the number of modules quantized."""
    from onespec.models.loader import _packed_target
    from onespec.models.moe import Experts
    params = dict(model.named_parameters())
    linears, experts = set(), set()
    suffix = "." + scheme.scale_key
    for key in keys:
        if not key.endswith(suffix):
            continue
        name = rename(key[:-len(suffix)] + ".weight")
        if name is None:
            continue
        m = EXPERT_SCALE.fullmatch(name)
        if m is not None:
            experts.add(m.group(1))
            continue
        if name not in params:
            try:
                name = _packed_target(model, name)[0]
            except AttributeError:
                continue        # load_weights names it as unexpected
        if name in params and name.endswith(".weight"):
            linears.add(name[:-len(".weight")])
    for path in sorted(linears):
        parent_name, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{what}: the checkpoint has a weight scale for {path!r}, which "
                             "is not a linear layer")
        setattr(parent, child, FP8Linear.like(linear, scheme.block))
    for path in sorted(experts):
        module = model.get_submodule(path)
        if not isinstance(module, Experts):
            raise ValueError(f"{what}: expert scales for {path!r}, which holds no experts")
        if scheme.block is not None and (module.gate_up_proj.shape[1] // 2) % scheme.block[0]:
            raise ValueError(f"{what}: the experts of {path!r} have intermediate size "
                             f"{module.gate_up_proj.shape[1] // 2}, not a multiple of the "
                             f"{scheme.block[0]}-row scale blocks")
        quantize_experts(module, scheme.block, empty=True)
    return len(linears) + len(experts)


def scale_rename(scheme: FP8Scheme, rename):
    """rename for load_weights over an FP8 checkpoint: `X.weight_scale_inv` is the scale of
    `X.weight` (stored as X.weight_scale), activation / KV scales are dropped."""
    inv = "." + scheme.scale_key

    def renamed(name: str):
        if name.endswith(DROPPED_SCALES):
            return None
        if inv != ".weight_scale" and name.endswith(inv):
            name = name[:-len(inv)] + ".weight_scale"
        return rename(name)
    return renamed


def checked_activation_scales(weights, what: str):
    """Passes (name, tensor) through, refusing an activation or KV scale that is not one
    per-tensor value (these scales are dropped: weight-only FP8)."""
    for name, t in weights:
        if name.endswith(DROPPED_SCALES) and t.numel() != 1:
            raise ValueError(f"{what}: scale {name!r} has shape {tuple(t.shape)}, expected "
                             "one per-tensor value (shape () or (1,))")
        yield name, t


def fit_scale(name: str, tensor: torch.Tensor, dest: torch.Tensor, what: str
              ) -> torch.Tensor:
    """A checkpoint scale shaped for the rows `dest` it fills: per block exactly
    `dest`'s shape; per channel [rows, 1] or [rows]; one per-tensor value spread over the
    rows (a packed linear keeps each shard's own)."""
    if not tensor.is_floating_point():
        raise ValueError(f"{what}: weight scale {name!r} is stored as {tensor.dtype}, "
                         "expected a floating-point scale")
    if dest.dim() == 1:
        rows = dest.shape[0]
        if tensor.numel() == 1:
            return tensor.reshape(()).expand(dest.shape)
        if tuple(tensor.shape) in ((rows,), (rows, 1)):
            return tensor.reshape(dest.shape)
        raise ValueError(f"{what}: weight scale {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected ({rows}, 1), ({rows},) or one per-tensor value")
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ValueError(f"{what}: weight scale {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(dest.shape)} (one scale per block of its weight)")
    return tensor

