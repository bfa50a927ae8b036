"""Hugging Face checkpoint loading: config.json, safetensors (single or sharded) or
pytorch_model.bin (read with weights_only=True), mapped onto onespec modules by name."""
from __future__ import annotations

import json
import os
import pickle
import stat
import re

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from onespec.quant.fp8 import FP8, fit_scale

# checkpoint projection -> (packed onespec parameter, shard)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# checkpoint dtypes a floating-point parameter is loaded from (cast to the model's dtype);
# anything else (int8, uint8, packed 4-bit) is a quantized format onespec refuses, and
# float8 loads only into the FP8 parameters of a declared FP8 checkpoint (quant/fp8.py)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# per-expert checkpoint keys (and their FP8 scales) -> stacked expert parameters
# (models/moe.py Experts; experts without a gate stack up_proj alone)
EXPERT_KEY = re.compile(
    r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale)")
STACKED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|up_proj|down_proj)(_scale)?")


class HFConfig(dict):
    """A config.json's fields, and `source`: the file they came from (for messages)."""
    source: str = "config.json"


def checked_file(root: str, name: str, what: str) -> str:
    """root/name resolved (os.path.realpath), refused with a ValueError unless it is a
    regular file inside root (absolute names, '..', symlinks out and devices are refused).
    A Hugging Face cache snapshot (.../snapshots/REV) may also link into the repository's
    blobs/ folder, as the hub's own downloads do."""
    real_root = os.path.realpath(root)
    allowed = [real_root]
    if os.path.basename(os.path.dirname(real_root)) == "snapshots":
        allowed.append(os.path.join(os.path.dirname(os.path.dirname(real_root)), "blobs"))
    if os.path.isabs(name):
        raise ValueError(f"{what} names {name!r}: an absolute path (refused: weights must lie "
                         f"inside the model directory {root!r})")
    real = os.path.realpath(os.path.join(real_root, name))
    if not any(os.path.commonpath([real, a]) == a for a in allowed):
        raise ValueError(f"{what} names {name!r}, which resolves to {real!r}, outside the "
                         f"model directory {root!r} (refused)")
    if not os.path.exists(real):
        raise FileNotFoundError(f"{what} names {name!r}, which does not exist in {root!r}")
    if not stat.S_ISREG(os.stat(real).st_mode):
        raise ValueError(f"{what} names {name!r}, which is not a regular file (refused)")
    return real


def _read_json(file: str, what: str):
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({what}): {e}") from None


def read_config(path: str) -> HFConfig:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.lexists(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json: not a Hugging Face model directory")
    cfg = _read_json(checked_file(path, "config.json", f"{path!r}"), "the model's config")
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path} must hold a JSON object")
    out = HFConfig(cfg)
    out.source = cfg_path
    return out


def checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.lexists(index):
        data = _read_json(checked_file(path, "model.safetensors.index.json", repr(path)),
                          "the weight index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or \
                not all(isinstance(v, str) and v for v in weight_map.values()):
            raise ValueError(f"{index} must hold a non-empty \"weight_map\" object of "
                             "weight name -> shard file name")
        return [checked_file(path, s, index) for s in sorted(set(weight_map.values()))]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.lexists(os.path.join(path, name)):
            return [checked_file(path, name, repr(path))]
    raise FileNotFoundError(f"{path!r} holds no weights (model.safetensors, "
                            "model.safetensors.index.json or pytorch_model.bin)")


def _open_weights(file: str):
    """A .bin file's state dict, or a safetensors reader; a file that cannot be read is a
    ValueError that names it (not a deserializer's traceback). A pickle that would import
    code (anything but tensors and plain containers) is refused as such."""
    try:
        if file.endswith(".bin"):
            return torch.load(file, map_location="cpu", weights_only=True)
        return safe_open(file, framework="pt")
    except pickle.UnpicklingError as e:
        if "GLOBAL" in str(e) or "Unsupported global" in str(e):
            raise ValueError(f"refused: this file would run code on load: {file!r} is a "
                             "pickle that imports callables, not just tensors") from None
        raise _unreadable(file, e) from None
    except Exception as e:
        raise _unreadable(file, e) from None


def _unreadable(file: str, e: Exception) -> ValueError:
    return ValueError(f"cannot read weights file {file!r} ({type(e).__name__}): it is "
                      "truncated, corrupt or not in the format its name says")


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


def _expert_target(params: dict, name: str):
    """'...experts.3.up_proj.weight' -> (the stacked parameter's name, the rows it fills)."""
    m = EXPERT_KEY.fullmatch(name)
    if m is None:
        return None
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    ungated = f"{prefix}.up_proj" in params      # experts without a gate (up, act, down)
    param_name = f"{prefix}.{proj if proj == 'down_proj' or ungated else 'gate_up_proj'}" + \
        ("_scale" if m.group(4) == "weight_scale" else "")
    param = params.get(param_name)
    if param is None or e >= param.shape[0]:
        return param_name, None
    dest = param.data[e]
    if proj != "down_proj" and not ungated:
        half = dest.shape[0] // 2
        dest = dest.narrow(0, 0 if proj == "gate_proj" else half, half)
    return param_name, dest


def _checkpoint_names(param_name: str, param: torch.Tensor | None = None) -> list[str]:
    """The checkpoint keys that feed a parameter: '...qkv_proj.weight' <- q/k/v_proj."""
    m = STACKED_EXPERTS.fullmatch(param_name)
    if m is not None and param is not None:
        projs = {"down_proj": ("down_proj",), "up_proj": ("up_proj",)}.get(
            m.group(2), ("gate_proj", "up_proj"))
        key = "weight_scale" if m.group(3) else "weight"
        return [f"{m.group(1)}.{e}.{p}.{key}" for e in range(param.shape[0]) for p in projs]
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
        expert = _expert_target(params, name)
        if expert is not None:
            param_name, dest = expert
        elif name in params:        # a parameter of that very name (e.g. MLA's q_proj)
            param_name, dest = name, params[name].data
        else:
            try:
                param_name, offset, size = _packed_target(module, name)
            except AttributeError:
                unexpected.append(raw_name)
                continue
            param = params.get(param_name)
            if param is not None and offset is not None and param_name.endswith("_scale"):
                owner = module.get_submodule(param_name.rpartition(".")[0])
                offset, size = owner.scale_rows(offset, size, raw_name)
            dest = None if param is None else \
                param.data if offset is None else param.data.narrow(0, offset, size)
        if dest is None:
            unexpected.append(raw_name)
            continue
        if param_name.endswith("_scale"):       # an FP8 weight's scales (quant/fp8.py)
            tensor = fit_scale(raw_name, tensor, dest, what)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{what}: weight {raw_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        _check_dtype(raw_name, tensor, dest, what)
        dest.copy_(tensor)
        loaded.add(name)
    if strict and unexpected:
        raise ValueError(f"{what}: unexpected weights {sorted(unexpected)[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    missing = [n for pname, p in params.items() if pname not in loaded
               for n in _checkpoint_names(pname, p) if n not in loaded]
    if missing:
        raise ValueError(f"{what}: missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    return unexpected


def _check_dtype(name: str, tensor: torch.Tensor, dest: torch.Tensor, what: str):
    """float8 weights go only into FP8 parameters (and FP8 parameters take nothing else);
    other floating-point parameters load from WEIGHT_DTYPES."""
    stored = str(tensor.dtype).removeprefix("torch.")
    if dest.dtype == FP8:
        if tensor.dtype != FP8:
            raise ValueError(f"{what}: weight {name!r} is stored as {stored}, but its layer "
                             "is FP8 in this checkpoint (it has weight scales): every weight "
                             "of the layer must be float8_e4m3fn")
    elif dest.is_floating_point() and tensor.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{what}: weight {name!r} is stored as {stored}, which onespec does "
                         "not load here: weights must be float32, bfloat16, float16 or "
                         "float64, or float8_e4m3fn with a scale tensor in an FP8 checkpoint "
                         "(quantization_config quant_method 'fp8', 'compressed-tensors' or "
                         "'modelopt')")


def checkpoint_keys(path: str) -> list[str]:
    """Every tensor name of a checkpoint (from the index, or the files' headers)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.lexists(index):
        data = _read_json(checked_file(path, "model.safetensors.index.json", repr(path)),
                          "the weight index")
        if isinstance(data, dict) and isinstance(data.get("weight_map"), dict):
            return list(data["weight_map"])
    keys = []
    for file in checkpoint_files(path):
        opened = _open_weights(file)
        if isinstance(opened, dict):
            keys += list(opened)
        else:
            with opened as f:
                keys += list(f.keys())
    return keys


@torch.no_grad()
def init_dummy_weights(module: torch.nn.Module, seed: int = 0, std: float = 0.02):
    """Random weights in place (load_format="dummy"): matrices ~ N(0, std), norms ~ 1."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for p in module.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        else:
            p.fill_(1.0)
