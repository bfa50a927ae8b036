"""Which model class serves a checkpoint's architecture, and the target loader built on it.

A new target family (e.g. a mixture-of-experts decoder) registers its class here under the
`architectures` names of its config.json.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from onespec.distributed.layers import shard_decoder, shard_weights
from onespec.engine.memory import require_bytes
from onespec.layers.ops import TORCH_OPS, TorchOps
from onespec.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM
from onespec.models.glm4_moe import Glm4MoeForCausalLM
from onespec.models.gpt_oss import GptOssForCausalLM
from onespec.models.llama import ARCHITECTURES, LlamaForCausalLM
from onespec.models.loader import (checked_file, checkpoint_keys, init_dummy_weights,
                                   iter_weights, load_weights, read_config)
from onespec.models.nemotron_h import NemotronHForCausalLM
from onespec.models.qwen3_moe import Qwen3MoeForCausalLM
from onespec.models.qwen3_next import ARCHITECTURES as HYBRID_ARCHITECTURES
from onespec.models.qwen3_next import Qwen3NextForCausalLM
from onespec.quant import fp8, kv_fp8
from onespec.quant.mxfp4 import dequantized_weights

TARGET_MODELS: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in ARCHITECTURES}
TARGET_MODELS["DeepseekV3ForCausalLM"] = DeepseekV3ForCausalLM
TARGET_MODELS["Qwen3MoeForCausalLM"] = Qwen3MoeForCausalLM
TARGET_MODELS["GptOssForCausalLM"] = GptOssForCausalLM
TARGET_MODELS["Glm4MoeForCausalLM"] = Glm4MoeForCausalLM
TARGET_MODELS["Glm4MoeLiteForCausalLM"] = DeepseekV3ForCausalLM     # MLA + GLM's MoE
TARGET_MODELS["DeepseekV32ForCausalLM"] = DeepseekV32ForCausalLM
TARGET_MODELS.update({arch: Qwen3NextForCausalLM for arch in HYBRID_ARCHITECTURES})
TARGET_MODELS["NemotronHForCausalLM"] = NemotronHForCausalLM


def register_target(architecture: str, cls: type[nn.Module]):
    """Serve checkpoints whose config.json names `architecture` with `cls`."""
    TARGET_MODELS[architecture] = cls


def target_class(cfg: dict) -> type[nn.Module]:
    """The model class serving a config.json's `architectures`."""
    archs = cfg.get("architectures")
    for arch in archs if isinstance(archs, list) else []:
        if isinstance(arch, str) and arch in TARGET_MODELS:
            return TARGET_MODELS[arch]
    source = getattr(cfg, "source", "config.json")
    raise ValueError(f"{source}: unsupported architecture {archs!r}; supported: "
                     f"{tuple(TARGET_MODELS)}")


def resolve_device(device: str) -> torch.device:
    """'auto' (CUDA if present, else CPU) or a torch device name, checked."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} "
                         "CUDA devices")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' (bfloat16 on CUDA, float32 elsewhere) or a torch dtype name."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def load_target(path: str, device, dtype, dummy: bool = False,
                ops: TorchOps = TORCH_OPS, parallel=None,
                quantization: str | None = None) -> LlamaForCausalLM:
    """The target model at `path` (random weights if `dummy`), built with the backend `ops`
    (classes without Triton kernels, `supports_triton = False`, take the portable path);
    `parallel` (a distributed.TensorParallel): this rank's shards only. An FP8 checkpoint
    (quant/fp8.py) loads as it is quantized; quantization="fp8" quantizes any other one per
    output channel as it loads (its lm_head and embedding stay in `dtype`). Random weights
    (`dummy`) of an FP8 config are quantized in its layout (its blocks, else per channel)."""
    raw = read_config(path)
    cls = target_class(raw)
    qc = raw.get("quantization_config")
    mxfp4 = isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"   # decoded at load
    declared = fp8.checkpoint_scheme(raw, path)
    scheme = None if dummy else declared
    cfg = cls.config_class.from_hf(raw)
    if parallel is not None and not getattr(cls, "supports_tensor_parallel", True):
        raise ValueError(f"{cls.__name__} does not support tensor_parallel_size > 1 yet")
    bad_eos = [t for t in cfg.eos_token_ids if t >= cfg.vocab_size]
    if bad_eos:
        raise ValueError(f"{raw.source}: field 'eos_token_id' must hold token ids in "
                         f"[0, vocab_size = {cfg.vocab_size}), got {bad_eos[0]}")
    with torch.device("meta"):
        model = cls(cfg, ops if cls.supports_triton else TORCH_OPS)
    if parallel is not None:
        shard_decoder(model, parallel)
    rename = model.checkpoint_rename
    if scheme is not None:
        fp8.prepare_for_checkpoint(model, scheme, checkpoint_keys(path), rename, path)
        rename = fp8.scale_rename(scheme, rename)
    num_bytes = fp8.quantized_bytes(model, dtype)
    if (quantization == "fp8" or declared is not None) and scheme is None:
        num_bytes = _fp8_bytes(model, dtype)
    require_bytes(num_bytes, torch.device(device), f"{raw.source}: loading the model's weights in "
                  f"{str(dtype).removeprefix('torch.')} (hidden_size={cfg.hidden_size}, "
                  f"num_hidden_layers={cfg.num_hidden_layers}, vocab_size={cfg.vocab_size})")
    model.to_empty(device=device if dummy else "cpu")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if dummy:
        init_dummy_weights(model)
        if quantization == "fp8" or declared is not None:
            fp8.quantize_model(model, block=declared.block if declared else None)
        return _fused(model.to(dtype=dtype).eval(), parallel)
    what = f"checkpoint {path!r}"
    # KV-cache scales (applied under kv_cache_dtype="fp8"; quant/kv_fp8.py)
    kv_scales: dict = {}
    weights = kv_fp8.collect_kv_scales(iter_weights(path), kv_scales, what)
    if mxfp4:
        weights = dequantized_weights(weights, dtype)
    if parallel is not None:        # each tensor sliced to this rank's part as it streams
        weights = shard_weights(weights, cfg, parallel)
    if scheme is not None:
        weights = fp8.checked_activation_scales(weights, what)
    load_weights(model, weights, rename=rename, what=what)
    kv_fp8.attach_kv_scales(model, kv_scales, model.checkpoint_rename, what)
    if quantization == "fp8" and scheme is None:
        fp8.quantize_model(model)       # on the CPU, before the move: FP8 bytes on the device
    model = model.to(device=device, dtype=dtype).eval()
    fp8.dequantize_direct_reads(model)
    return _fused(model, parallel)


def _fp8_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """What the model takes once quantize_model has made its linears and experts FP8."""
    total = 0
    for name, p in model.named_parameters():
        quantized = name.endswith((".weight", "gate_up_proj", "down_proj")) and p.dim() >= 2 \
            and "embed_tokens" not in name and not name.startswith("lm_head")
        total += p.numel() * (1 if quantized else dtype.itemsize)
    return total


def _fused(model, parallel):
    """Lets layers that can fuse projections sharing an input (fuse_projections: MLA's q
    and kv_a) do so once their weights are final; on one rank only (sharded projections
    keep their own layout)."""
    if parallel is None:
        for module in model.modules():
            if hasattr(module, "fuse_projections"):
                module.fuse_projections()
    return model


# files a Hugging Face tokenizer may read from its directory
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                   "spiece.model", "chat_template.jinja", "chat_template.json")


def load_tokenizer(path: str):
    """The Hugging Face tokenizer at `path`, or None when it has no tokenizer files. Every
    tokenizer file must be a regular file inside `path` (as the weights must)."""
    present = [n for n in TOKENIZER_FILES if os.path.lexists(os.path.join(path, n))]
    for name in present:
        checked_file(path, name, f"the tokenizer of {path!r}")
    if not any(n in present for n in TOKENIZER_FILES[:4]):
        return None
    from transformers import AutoTokenizer     # slow to import; only when there is one
    tokenizer = AutoTokenizer.from_pretrained(path)
    # the engine checks lengths against max_model_len itself; transformers' own limit only
    # adds an "indexing errors" warning before that message (or before a windowed sample)
    tokenizer.model_max_length = int(1e30)
    return tokenizer
