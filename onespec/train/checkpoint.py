"""Resumable training state under <out>/checkpoint/: head, optimizer, position, RNG."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass

import torch

STATE_FILE = "state.pt"


@dataclass
class Position:
    step: int = 0                # optimizer steps done
    epoch: int = 0               # epoch in progress
    batch: int = 0               # batches of that epoch done


def checkpoint_dir(out: str) -> str:
    return os.path.join(out, "checkpoint")


def has_checkpoint(out: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint_dir(out), STATE_FILE))


def save_checkpoint(out: str, head, optimizer, pos: Position, meta: dict):
    """Written to a temporary file first, then renamed: a crash never leaves half a state."""
    path = checkpoint_dir(out)
    os.makedirs(path, exist_ok=True)
    state = {
        "head": head.state_dict(), "optimizer": optimizer.state_dict(),
        "step": pos.step, "epoch": pos.epoch, "batch": pos.batch, "meta": meta,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
    }
    tmp = os.path.join(path, STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(path, STATE_FILE))


def load_checkpoint(out: str, head, optimizer, meta: dict) -> Position:
    state = torch.load(os.path.join(checkpoint_dir(out), STATE_FILE), map_location="cpu",
                       weights_only=True)
    changed = {k: (state["meta"].get(k), v) for k, v in meta.items() if state["meta"].get(k) != v}
    if changed:
        raise ValueError(f"cannot resume from {checkpoint_dir(out)}: settings changed "
                         f"(checkpoint, now): {changed}")
    head.load_state_dict(state["head"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(_as_tuple(state["rng"]["python"]))
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return Position(state["step"], state["epoch"], state["batch"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
