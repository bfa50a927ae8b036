"""EAGLE-3 head training with training-time test: `train_eagle3(TrainConfig) -> (head, history)`.

    records --(--regenerate)--> samples --> draft vocab (d2t, t2d) --> fresh head
    per batch: target dense forward (no grad) --> TTT forward over K steps --> AdamW step
Target features are computed online; the target is frozen and its embedding is shared.
CUDA: target in bf16, head in fp32 master weights under bf16 autocast. CPU: float32.
"""
from __future__ import annotations

import gc
import json
import math
import os
import random
import stat
import sys
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from onespec.models.registry import load_target, load_tokenizer, resolve_device
from onespec.models.eagle3 import default_capture_layers
from onespec.models.eagle3_io import save_eagle3_head
from onespec.train.checkpoint import (Position, has_checkpoint, load_checkpoint,
                                      save_checkpoint)
from onespec.train.data import (collate, make_batches, read_records, records_to_samples,
                                write_records)
from onespec.train.features import target_batch
from onespec.train.head import build_head
from onespec.train.peagle import peagle_forward
from onespec.train.ttt import StepStats, ttt_forward, ttt_loss
from onespec.train.vocab import count_tokens, draft_vocab_maps

FORMATS = ("safeailab", "speculators")
METHODS = ("eagle3", "peagle")
REGENERATED_FILE = "regenerated.jsonl"


@dataclass
class TrainConfig:
    target: str                       # Hugging Face target model directory
    data: str                         # .jsonl / .jsonl.gz (see train/data.py)
    out: str                          # head directory (config.json + model.safetensors)
    ttt_steps: int = 7                # K unrolled draft steps
    loss_decay: float = 0.8           # step i weighs decay^i
    draft_vocab: int = 32000          # capped at the target vocab (no map when >= V)
    max_len: int = 2048               # tokens per sample (longer texts are windowed)
    epochs: int = 1
    lr: float = 1e-4
    batch_tokens: int = 8192          # padded tokens per optimizer step
    warmup_ratio: float = 0.02        # linear warmup, then cosine decay to 0
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    fmt: str = "safeailab"            # output checkpoint format
    device: str = "auto"
    seed: int = 0
    capture_layers: tuple[int, ...] | None = None   # outputs-of ids; default (1, L//2-1, L-4)
    save_every: int = 1000            # optimizer steps between checkpoints (0: none on the way)
    save_state: bool = False          # keep the resumable state at the end of even a short run
    log: str | None = None            # JSONL log (default <out>/train_log.jsonl)
    log_every: int = 10
    resume: bool = False
    regenerate: bool = False
    max_steps: int | None = None      # stop early (the LR schedule spans min(total, max_steps))
    max_seconds: float | None = None  # stop after this much training time (regeneration not
                                      # counted); the LR schedule then also spans that time
    eval_data: str | None = None      # held-out records: per-step accuracy at save points
    progress: bool = True
    # "eagle3" (TTT over ttt_steps) | "peagle" (parallel head of depth ttt_steps, COD sampling)
    method: str = "eagle3"
    num_layers: int = 1               # head layers (TTT trains one-layer heads only)
    cod_ratio: float = 0.7            # peagle: depth d keeps max(ratio^d, ratio_min) anchors
    cod_ratio_min: float = 0.2

    def __post_init__(self):
        for name in ("ttt_steps", "draft_vocab", "epochs", "batch_tokens", "log_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_len, int) or self.max_len < 3:
            raise ValueError(f"max_len must be an integer >= 3, got {self.max_len!r}")
        if self.batch_tokens < self.max_len:
            raise ValueError(f"batch_tokens ({self.batch_tokens}) must be >= max_len "
                             f"({self.max_len})")
        if not (0.0 < self.loss_decay <= 1.0):
            raise ValueError(f"loss_decay must be in (0, 1], got {self.loss_decay!r}")
        if not (self.lr > 0.0):
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not (0.0 <= self.warmup_ratio < 1.0):
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if not (self.grad_clip > 0.0):
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip!r}")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 1 or \
                (self.method == "eagle3" and self.num_layers != 1):
            raise ValueError("num_layers must be an integer >= 1 (1 for eagle3), got "
                             f"{self.num_layers!r}")
        if not (0.0 < self.cod_ratio <= 1.0 and 0.0 <= self.cod_ratio_min <= 1.0):
            raise ValueError("cod_ratio must be in (0, 1] and cod_ratio_min in [0, 1], got "
                             f"{self.cod_ratio!r}, {self.cod_ratio_min!r}")
        if self.fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {self.fmt!r}")
        if not isinstance(self.save_every, int) or self.save_every < 0:
            raise ValueError(f"save_every must be an integer >= 0, got {self.save_every!r}")
        if self.max_steps is not None and (not isinstance(self.max_steps, int)
                                           or self.max_steps < 1):
            raise ValueError(f"max_steps must be an integer >= 1 or None, got {self.max_steps!r}")
        if self.max_seconds is not None and not (self.max_seconds > 0):
            raise ValueError(f"max_seconds must be > 0 or None, got {self.max_seconds!r}")
        if self.capture_layers is not None:
            self.capture_layers = tuple(self.capture_layers)
            if not self.capture_layers or any(not isinstance(i, int) or i < 0
                                              for i in self.capture_layers):
                raise ValueError("capture_layers must be a non-empty tuple of layer ids >= 0, "
                                 f"got {self.capture_layers!r}")


def lr_at(step: int, total: int, peak: float, warmup: int, time_progress: float = 0.0) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total` or, in a run
    bounded by time, at the end of that time (whichever comes first)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = max((step - warmup) / max(1, total - warmup), time_progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class StatsMeter:
    """Per-step loss and accuracy summed on the device over a log interval (no host sync
    until summary())."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self.sums = None                     # [3, K]: loss, correct, scored
        self.num_batches = self.num_tokens = 0

    def add(self, stats: list[StepStats], num_tokens: int):
        batch = torch.stack([torch.stack([s.loss.detach().float(), s.num_correct.float(),
                                          s.num_scored.float()]) for s in stats], dim=1)
        self.sums = batch if self.sums is None else self.sums + batch
        self.num_batches += 1
        self.num_tokens += num_tokens

    def summary(self, decay: float) -> dict:
        loss_sum, correct, scored = (self.sums.tolist() if self.sums is not None
                                     else [[0.0] * self.num_steps] * 3)
        loss = [x / max(1, self.num_batches) for x in loss_sum]
        acc = [c / s if s else 0.0 for c, s in zip(correct, scored)]
        return {"loss": sum(decay ** i * x for i, x in enumerate(loss)),
                "loss_per_step": [round(x, 5) for x in loss],
                "acc_per_step": [round(x, 5) for x in acc]}


def prepare_records(cfg: TrainConfig, tokenizer, device) -> list[dict]:
    records = read_records(cfg.data)
    if not cfg.regenerate:
        return records
    path = os.path.join(cfg.out, REGENERATED_FILE)
    if cfg.resume and os.path.isfile(path):
        return read_records(path)
    from onespec.train.regen import regenerate
    records = regenerate(records, cfg.target, tokenizer, cfg.max_len, str(device))
    write_records(path, records)
    gc.collect()                              # the engine's KV pool goes before training
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


class Trainer:
    """Set-up (data, vocab, head, optimizer, resume) in __init__; run() trains and saves."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.device = device = resolve_device(cfg.device)
        self.use_bf16 = device.type == "cuda"
        os.makedirs(cfg.out, exist_ok=True)
        tokenizer = load_tokenizer(cfg.target)
        records = prepare_records(cfg, tokenizer, device)
        self.target = target = load_target(cfg.target, device,
                                           torch.bfloat16 if self.use_bf16 else torch.float32)
        target.requires_grad_(False)
        tcfg = target.config
        self.capture = cfg.capture_layers or default_capture_layers(tcfg.num_hidden_layers)
        if any(i >= tcfg.num_hidden_layers for i in self.capture):
            raise ValueError(f"capture_layers {self.capture} fall outside the target's "
                             f"{tcfg.num_hidden_layers} layers (outputs-of ids)")
        max_len = min(cfg.max_len, tcfg.max_position_embeddings)
        self.samples = records_to_samples(records, tokenizer, max_len, tcfg.vocab_size)
        self.eval_samples = records_to_samples(read_records(cfg.eval_data), tokenizer, max_len,
                                               tcfg.vocab_size) if cfg.eval_data else []
        draft_ids, d2t, t2d = draft_vocab_maps(count_tokens(self.samples, tcfg.vocab_size),
                                               min(cfg.draft_vocab, tcfg.vocab_size))
        parallel = cfg.ttt_steps if cfg.method == "peagle" else None
        self.head = build_head(target, self.capture, draft_ids, d2t, t2d, cfg.num_layers,
                               parallel).to(device)
        self.generator = torch.Generator().manual_seed(cfg.seed)      # COD sampling
        target.setup_rotary(max_len, device)
        self.head.setup_rotary(max_len + cfg.ttt_steps, device)
        self.draft_ids = None if draft_ids is None else draft_ids.to(device)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=cfg.lr, betas=(0.9, 0.95),
                                           weight_decay=cfg.weight_decay)
        self.lengths = [len(s.input_ids) for s in self.samples]
        per_epoch = len(make_batches(self.lengths, cfg.batch_tokens, cfg.seed, 0))
        self.total = cfg.epochs * per_epoch
        if cfg.max_steps and cfg.max_steps > self.total:
            print(f"onespec train: note: --max-steps {cfg.max_steps}, but the data makes "
                  f"{per_epoch} batch{'es' if per_epoch > 1 else ''} of --batch-tokens "
                  f"{cfg.batch_tokens} per epoch ({len(self.samples)} samples, "
                  f"{sum(self.lengths)} tokens) x --epochs {cfg.epochs}: training stops after "
                  f"{self.total} step{'s' if self.total > 1 else ''}; lower --batch-tokens or "
                  "raise --epochs for more", file=sys.stderr)
        self.total = min(self.total, cfg.max_steps or self.total)
        self.warmup = max(1, int(cfg.warmup_ratio * self.total))
        self.meta = {"draft_vocab_size": self.head.config.draft_vocab_size,
                     "capture": list(self.capture), "ttt_steps": cfg.ttt_steps,
                     "num_samples": len(self.samples)}
        self.pos = Position()
        if cfg.resume and has_checkpoint(cfg.out):
            self.pos = load_checkpoint(cfg.out, self.head, self.optimizer, self.meta)
        self.history: list[dict] = []

    def forward(self, samples) -> list[StepStats]:
        """Target features (no grad) + TTT forward for one batch of samples."""
        ids, mask = collate(samples, self.device)
        tb = target_batch(self.target, ids, self.capture, self.draft_ids)
        cfg = self.cfg
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16):
            if cfg.method == "peagle":
                return peagle_forward(self.head, self.head.embed_tokens, self.head.rotary,
                                      ids, mask, tb, cfg.ttt_steps, cfg.cod_ratio,
                                      cfg.cod_ratio_min, self.generator)
            return ttt_forward(self.head, self.target.model.embed_tokens, self.head.rotary, ids,
                               mask, tb, self.cfg.ttt_steps)

    def train_step(self, batch: list[int]) -> tuple[list[StepStats], float]:
        cfg = self.cfg
        stats = self.forward([self.samples[i] for i in batch])
        lr = lr_at(self.pos.step, self.total, cfg.lr, self.warmup, self.time_progress())
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        ttt_loss(stats, cfg.loss_decay).backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.pos.step, self.pos.batch = self.pos.step + 1, self.pos.batch + 1
        return stats, lr

    @torch.no_grad()
    def evaluate(self) -> dict:
        meter = StatsMeter(self.cfg.ttt_steps)
        self.head.eval()
        lengths = [len(s.input_ids) for s in self.eval_samples]
        for batch in make_batches(lengths, self.cfg.batch_tokens, 0, 0):
            meter.add(self.forward([self.eval_samples[i] for i in batch]),
                      sum(lengths[i] for i in batch))
        self.head.train()
        return meter.summary(self.cfg.loss_decay)

    def log(self, entry: dict):
        self.history.append(entry)
        self.log_file.write(json.dumps(entry) + "\n")
        self.log_file.flush()

    def save_point(self, state: bool = True):
        if state:
            save_checkpoint(self.cfg.out, self.head, self.optimizer, self.pos, self.meta)
        if self.eval_samples:
            self.log({"step": self.pos.step, "eval": True, **self.evaluate()})

    def time_progress(self) -> float:
        """Share of --max-seconds used so far (0 without a time limit). The clock starts
        after the first step, so one-off warm-up (kernel compilation, allocator growth)
        does not eat the schedule."""
        if self.cfg.max_seconds is None or self.start is None:
            return 0.0
        return (time.perf_counter() - self.start) / self.cfg.max_seconds

    def run(self):
        cfg, pos = self.cfg, self.pos
        self.start = None
        log_path = cfg.log or os.path.join(cfg.out, "train_log.jsonl")
        self.log_file = open(log_path, "a" if pos.step else "w")
        meter, tick = StatsMeter(cfg.ttt_steps), time.perf_counter()
        bar = tqdm(total=self.total, initial=pos.step, desc=f"train {cfg.method}",
                   disable=None if cfg.progress else True)      # None: off a terminal, none
        self.head.train()
        while pos.step < self.total and pos.epoch < cfg.epochs and self.time_progress() < 1:
            batches = make_batches(self.lengths, cfg.batch_tokens, cfg.seed, pos.epoch)
            for batch in batches[pos.batch:]:
                if pos.step >= self.total or self.time_progress() >= 1:
                    break
                stats, lr = self.train_step(batch)
                self.start = self.start or time.perf_counter()
                meter.add(stats, sum(self.lengths[i] for i in batch))
                bar.update(1)
                if pos.step % cfg.log_every == 0 or pos.step == self.total \
                        or self.time_progress() >= 1:
                    summary = meter.summary(cfg.loss_decay)
                    rate = meter.num_tokens / (time.perf_counter() - tick)
                    self.log({"step": pos.step, "epoch": pos.epoch, "lr": lr, **summary,
                              "tokens_per_s": round(rate, 1)})
                    bar.set_postfix(loss=f"{summary['loss']:.3f}",
                                    acc0=f"{summary['acc_per_step'][0]:.3f}")
                    meter, tick = StatsMeter(cfg.ttt_steps), time.perf_counter()
                if cfg.save_every and pos.step % cfg.save_every == 0 and pos.step < self.total:
                    self.save_point()
            else:
                pos.epoch, pos.batch = pos.epoch + 1, 0
        bar.close()
        # the final resumable state (optimizer included: 3x the head) only when asked for or
        # when one was written on the way, which it then brings up to date
        self.save_point(state=cfg.save_state or has_checkpoint(cfg.out))
        self.log_file.close()
        self.save_head()
        return self.head, self.history

    def save_head(self):
        """The head (config.json + model.safetensors) and train_config.json, whose paths are
        absolute so they still point at the inputs from any directory."""
        cfg = self.cfg
        save_eagle3_head(self.head, cfg.out, cfg.fmt, speculative_tokens=cfg.ttt_steps,
                         dtype=torch.bfloat16 if self.use_bf16 else None)
        # safetensors writes 0600; give the weights the mode config.json got (the umask's)
        mode = stat.S_IMODE(os.stat(os.path.join(cfg.out, "config.json")).st_mode)
        os.chmod(os.path.join(cfg.out, "model.safetensors"), mode)
        paths = {k: os.path.abspath(getattr(cfg, k)) for k in ("target", "data", "out",
                                                                "log", "eval_data")
                 if getattr(cfg, k) is not None}
        with open(os.path.join(cfg.out, "train_config.json"), "w") as f:
            json.dump({**asdict(cfg), **paths, "capture_layers": list(self.capture)}, f,
                      indent=2)


def train_eagle3(cfg: TrainConfig):
    """Trains a head for cfg.target on cfg.data and saves it to cfg.out.
    Returns (head, history): the trained head (on the training device, fp32) and the list
    of logged dicts (the JSONL log's lines; eval entries carry "eval": True)."""
    return Trainer(cfg).run()
