"""Hugging Face checkpoint loading: config.json, safetensors (single or sharded) or
pytorch_model.bin (read with weights_only=True), mapped onto onespec modules by name."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

# checkpoint projection -> (packed onespec parameter, shard)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json: not a Hugging Face model directory")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path} must hold a JSON object")
    return cfg


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(os.path.join(path, name)):
            return [os.path.join(path, name)]
    raise FileNotFoundError(f"{path!r} holds no weights (model.safetensors, "
                            "model.safetensors.index.json or pytorch_model.bin)")


def _open_weights(file: str):
    """A .bin file's state dict, or a safetensors reader; a file that cannot be read is a
    ValueError that names it (not a deserializer's traceback)."""
    try:
        if file.endswith(".bin"):
            return torch.load(file, map_location="cpu", weights_only=True)
        return safe_open(file, framework="pt")
    except Exception as e:
        raise ValueError(f"cannot read weights file {file!r} ({type(e).__name__}): it is "
                         "truncated, corrupt or not in the format its name says") from e


def iter_weights(path: str, desc: str = "loading weights"):
    """Yields (name, tensor) over every weight file of a checkpoint, with a progress bar."""
    files = checkpoint_files(path)
    # off a terminal no bar (disable=None); on one, every update drawn, so it ends at 100 %
    with tqdm(total=len(files), desc=desc, unit="file", leave=False, disable=None,
              mininterval=0) as bar:
        for file in files:
            opened = _open_weights(file)
            if isinstance(opened, dict):
                yield from opened.items()
            else:
                with opened as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
            bar.update(1)


def _packed_target(module: torch.nn.Module, name: str):
    """Maps e.g. 'model.layers.0.self_attn.q_proj.weight' onto (param name, slice)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in PACKED_MODULES:
            packed, shard = PACKED_MODULES[part]
            owner = module.get_submodule(".".join(parts[:i]))
            param_name = ".".join(parts[:i] + [packed] + parts[i + 1:])
            if shard in ("q", "k", "v"):
                sizes = {"q": owner.q_size, "k": owner.kv_size, "v": owner.kv_size}
                offset = {"q": 0, "k": owner.q_size, "v": owner.q_size + owner.kv_size}[shard]
                return param_name, offset, sizes[shard]
            half = getattr(owner, packed).out_features // 2
            return param_name, shard * half, half
    return name, None, None


def _checkpoint_names(param_name: str) -> list[str]:
    """The checkpoint keys that feed a parameter: '...qkv_proj.weight' <- q/k/v_proj."""
    parts = param_name.split(".")
    shards = [s for s, (packed, _) in PACKED_MODULES.items()
              if len(parts) > 1 and packed == parts[-2]]
    return [".".join(parts[:-2] + [s, parts[-1]]) for s in shards] or [param_name]


def load_weights(module: torch.nn.Module, weights, rename=lambda n: n, strict: bool = True,
                 what: str = "checkpoint"):
    """Copies (name, tensor) pairs into module's parameters. Checks every shape, names the
    first bad key, and (strict) reports missing and unexpected keys."""
    params = dict(module.named_parameters())
    loaded, unexpected = set(), []
    for raw_name, tensor in weights:
        if raw_name.endswith(IGNORED_SUFFIXES):
            continue
        name = rename(raw_name)
        if name is None:
            continue
        try:
            param_name, offset, size = _packed_target(module, name)
        except AttributeError:
            unexpected.append(raw_name)
            continue
        param = params.get(param_name)
        if param is None:
            unexpected.append(raw_name)
            continue
        dest = param.data if offset is None else param.data.narrow(0, offset, size)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{what}: weight {raw_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        loaded.add(name)
    if strict and unexpected:
        raise ValueError(f"{what}: unexpected weights {sorted(unexpected)[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    missing = [n for pname in params if pname not in loaded
               for n in _checkpoint_names(pname) if n not in loaded]
    if missing:
        raise ValueError(f"{what}: missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return unexpected


@torch.no_grad()
def init_dummy_weights(module: torch.nn.Module, seed: int = 0, std: float = 0.02):
    """Random weights in place (load_format="dummy"): matrices ~ N(0, std), norms ~ 1."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for p in module.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        else:
            p.fill_(1.0)
