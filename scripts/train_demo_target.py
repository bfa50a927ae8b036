#!/usr/bin/env python
"""Train onespec's bundled demo *target* model: a small, deep Llama on Python code.

Input is the directory written by ``scripts/prepare_code_data.py`` (only its
``train.jsonl.gz`` / ``heldout.jsonl.gz`` are read).  Output is a Hugging Face
model directory loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer``:

* a byte-level BPE tokenizer trained on the train split (``<|endoftext|>`` is
  BOS and EOS, ``<|pad|>`` is padding; no token is added automatically on
  encode, and decode(encode(x)) == x for any text);
* a ``LlamaForCausalLM`` (24 layers, hidden 256, MLP 512, 4 heads / 2 KV heads, tied
  embeddings, ~16.3 M parameters) saved as bfloat16 safetensors. Deeper than wide on
  purpose: on a CPU a small model's step costs about the same per layer whatever its width,
  so a deep target costs many times a one-layer draft step, which is what lets
  speculation pay off there;
* ``generation_config.json``.

Training: every train file becomes ``<|endoftext|>`` + text; all of them are
concatenated into one token stream held on the device, and each step samples
``batch_size`` windows of ``seq_len + 1`` tokens at random offsets (seeded).
AdamW (0.9, 0.95, wd 0.1 on matrices), linear warmup + cosine decay to 10 %,
gradient clipping at 1.0, bf16 autocast on CUDA, float32 on CPU. ``--max-seconds`` sets
the number of steps from the measured speed of the first ones, so a run fits a time budget.
Held-out loss is measured every ``--eval-every`` steps on a fixed set of held-out windows.
JSON lines go to ``--log`` (default ``<out>/../target_train_log.jsonl``).

GPU run (defaults)::

    python scripts/train_demo_target.py --data data/code --out onespec/_demo/target --device cuda

CPU smoke run::

    python scripts/train_demo_target.py --data data/code --out /tmp/target --device cpu \
        --steps 20 --batch-size 4 --seq-len 128
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BOS_EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [BOS_EOS, PAD]  # ids 0 and 1
# A code model has no chat format of its own: user and system turns become comment lines,
# assistant turns are code, so /v1/chat/completions and `onespec chat` work on the demo pair.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ message['content'] }}\n{% else %}{{ '# ' + message['content'] | replace('\\n', '\\n# ') }}\n"
    "{% endif %}{% endfor %}"
)

# Architecture of the demo target (fixed; only the vocab size is overridable, for tests).
ARCH = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=24,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
)

PROBE_STEPS = (10, 30)               # steps timed (after warm-up ones) before --max-seconds fixes the step count
MAX_DIR_BYTES = 36 * 1024 * 1024    # the head must fit beside it in 40 MB


# --------------------------------------------------------------------------- data


def read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_split(data_dir: Path, name: str) -> list[dict]:
    path = data_dir / f"{name}.jsonl.gz"
    if not path.is_file():
        raise SystemExit(f"missing {path}; run scripts/prepare_code_data.py --out {data_dir} first")
    recs = read_jsonl_gz(path)
    recs.sort(key=lambda r: r["path"])  # order independent of how the file was written
    return recs


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int):
    """Byte-level BPE trained on ``texts``, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(BOS_EOS) == 0 and tok.token_to_id(PAD) == 1

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_EOS,
        eos_token=BOS_EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def check_roundtrip(tokenizer, texts: list[str]) -> None:
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"]
        back = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if back != text:
            i = next((k for k, (a, b) in enumerate(zip(back, text)) if a != b), min(len(back), len(text)))
            raise SystemExit(f"tokenizer round-trip failed at char {i}: {text[i - 20:i + 20]!r} vs {back[i - 20:i + 20]!r}")


def tokenize_stream(tokenizer, texts: list[str], bos_id: int) -> torch.Tensor:
    """``<|endoftext|>`` + text for every text, concatenated into one int32 tensor."""
    backend = tokenizer.backend_tokenizer
    ids: list[int] = []
    chunk = 64
    for i in range(0, len(texts), chunk):
        for enc in backend.encode_batch(texts[i : i + chunk], add_special_tokens=False):
            ids.append(bos_id)
            ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------- model


def build_model(vocab_size: int, bos_id: int, pad_id: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=bos_id,
        eos_token_id=bos_id,
        pad_token_id=pad_id,
        **ARCH,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model


def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dir with train.jsonl.gz / heldout.jsonl.gz")
    p.add_argument("--out", required=True, help="output model dir (e.g. onespec/_demo/target)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps (at most, with --max-seconds)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="fewer steps if needed so training takes about this long, from the speed of the first "
                        f"steps {PROBE_STEPS[0]}-{PROBE_STEPS[1]}; the learning rate decays over the steps kept")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: min(200, steps//20), >=1)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=8192, help="tokenizer/model vocab (8192 for the real model)")
    p.add_argument("--eval-every", type=int, default=250, help="held-out eval interval in steps (also at the end)")
    p.add_argument("--eval-windows", type=int, default=64, help="number of fixed held-out windows")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--log", default=None, help="JSON-lines log path (default <out>/../target_train_log.jsonl)")
    p.add_argument("--no-progress", action="store_true", help="disable the tqdm bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm.auto import tqdm

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available; pass --device cpu (and small --steps/--batch-size) for a CPU run")
    device = torch.device(args.device)
    is_cuda = device.type == "cuda"
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = Path(args.log) if args.log else out.resolve().parent / "target_train_log.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_f = open(log_path, "w", encoding="utf-8")

    def log(rec: dict) -> None:
        log_f.write(json.dumps(rec) + "\n")
        log_f.flush()

    t0 = time.time()
    data_dir = Path(args.data)
    train_recs = load_split(data_dir, "train")
    held_recs = load_split(data_dir, "heldout")
    train_texts = [r["text"] for r in train_recs]
    held_texts = [r["text"] for r in held_recs]
    print(f"data: {len(train_texts)} train files, {len(held_texts)} held-out files from {data_dir}")

    # ---- tokenizer
    tokenizer = train_tokenizer(train_texts, args.vocab_size, ARCH["max_position_embeddings"])
    check_roundtrip(tokenizer, held_texts[:8] + train_texts[:8])
    bos_id = tokenizer.convert_tokens_to_ids(BOS_EOS)
    pad_id = tokenizer.convert_tokens_to_ids(PAD)
    n_tok_vocab = len(tokenizer)
    if n_tok_vocab > args.vocab_size:
        raise SystemExit(f"tokenizer vocab {n_tok_vocab} > --vocab-size {args.vocab_size}")
    print(f"tokenizer: vocab {n_tok_vocab} (bos=eos={bos_id}, pad={pad_id}), trained in {time.time() - t0:.1f}s")

    # ---- token streams
    t1 = time.time()
    train_ids = tokenize_stream(tokenizer, train_texts, bos_id)
    held_ids = tokenize_stream(tokenizer, held_texts, bos_id)
    n_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    print(
        f"tokens: train {train_ids.numel():,} ({n_bytes / train_ids.numel():.2f} bytes/token), "
        f"held-out {held_ids.numel():,}; tokenized in {time.time() - t1:.1f}s"
    )
    T = args.seq_len
    if train_ids.numel() < T + 2:
        raise SystemExit(f"train stream ({train_ids.numel()} tokens) shorter than --seq-len {T}")
    train_ids = train_ids.to(device)

    # Fixed held-out windows: evenly spaced, non-overlapping where possible.
    n_held = held_ids.numel()
    if n_held < T + 1:  # tiny test data: repeat the stream
        held_ids = held_ids.repeat((T + 1) // n_held + 1)
        n_held = held_ids.numel()
    max_start = n_held - (T + 1)
    n_eval = max(1, min(args.eval_windows, max_start // T + 1))
    starts = torch.linspace(0, max_start, n_eval).long() if n_eval > 1 else torch.zeros(1, dtype=torch.long)
    eval_batch = torch.stack([held_ids[s : s + T + 1] for s in starts.tolist()]).long().to(device)

    # ---- model / optimiser
    model = build_model(args.vocab_size, bos_id, pad_id, args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: LlamaForCausalLM {n_params / 1e6:.2f} M params on {device}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt_kwargs = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if is_cuda:
        opt_kwargs["fused"] = True
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        **opt_kwargs,
    )
    warmup = args.warmup if args.warmup is not None else max(1, min(200, args.steps // 20))
    amp = torch.autocast(device_type="cuda", dtype=torch.bfloat16) if is_cuda else torch.autocast("cpu", enabled=False)

    def loss_on(batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        with amp:
            logits = model(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        total, n = 0.0, 0
        for i in range(0, eval_batch.size(0), max(1, args.batch_size)):
            b = eval_batch[i : i + args.batch_size]
            total += loss_on(b).item() * b.size(0)
            n += b.size(0)
        model.train()
        return total / n

    # All window offsets drawn up front from a CPU generator: the same windows on any device, and
    # no host->device copy inside the loop.
    gen = torch.Generator().manual_seed(args.seed + 1)
    ar = torch.arange(T + 1, device=device)
    n_train = train_ids.numel()
    all_offs = torch.randint(0, n_train - T - 1, (args.steps, args.batch_size), generator=gen).to(device)
    tokens_per_step = args.batch_size * T

    log({"event": "start", "n_params": n_params, "vocab": args.vocab_size, "train_tokens": n_train,
         "heldout_tokens": int(n_held), "eval_windows": int(eval_batch.size(0)), **{k: v for k, v in vars(args).items()}})
    print(f"training {args.steps} steps x {args.batch_size} x {T} = {args.steps * tokens_per_step / 1e6:.1f} M tokens "
          f"({args.steps * tokens_per_step / n_train:.1f} epochs), warmup {warmup}, log -> {log_path}")

    model.train()
    heldout_loss = None
    t_train = time.time()
    t_win, tok_win = time.time(), 0
    total = args.steps
    pbar = tqdm(total=total, desc="train", dynamic_ncols=True, disable=args.no_progress)
    for step in range(args.steps):
        if step == total:
            break
        if args.max_seconds is not None and step == PROBE_STEPS[0]:
            if is_cuda:
                torch.cuda.synchronize()
            t_probe = time.time()
        if args.max_seconds is not None and step == PROBE_STEPS[1]:
            if is_cuda:
                torch.cuda.synchronize()
            per_step = (time.time() - t_probe) / (PROBE_STEPS[1] - PROBE_STEPS[0])
            left = args.max_seconds - (time.time() - t_train)
            total = max(step + 1, min(args.steps, step + int(left / per_step)))
            pbar.total = total
            tqdm.write(f"{per_step * 1e3:.1f} ms a step: {total} steps fit {args.max_seconds:.0f} s")
            log({"event": "steps", "ms_per_step": round(per_step * 1e3, 2), "steps": total})
        lr = lr_at(step, total, warmup, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = train_ids[all_offs[step][:, None] + ar].long()
        loss = loss_on(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        tok_win += tokens_per_step

        done = step + 1
        pbar.update(1)
        do_eval = done % args.eval_every == 0 or done == total
        if done % args.log_every == 0 or do_eval:
            loss_v = loss.item()  # syncs
            dt = time.time() - t_win
            tps = tok_win / max(dt, 1e-9)
            t_win, tok_win = time.time(), 0
            rec = {"step": done, "loss": round(loss_v, 4), "lr": lr, "grad_norm": round(float(gnorm), 4),
                   "tokens_per_s": round(tps, 1)}
            if do_eval:
                heldout_loss = evaluate()
                rec["heldout_loss"] = round(heldout_loss, 4)
                tqdm.write(f"step {done:5d}  loss {loss_v:.4f}  heldout_loss {heldout_loss:.4f}  {tps:,.0f} tok/s")
                t_win = time.time()  # exclude eval time from throughput
            log(rec)
            pbar.set_postfix(loss=f"{loss_v:.3f}", tok_s=f"{tps:,.0f}")
    pbar.close()
    train_s = time.time() - t_train
    avg_tps = total * tokens_per_step / max(train_s, 1e-9)
    print(f"trained {total} steps in {train_s:.1f}s ({avg_tps:,.0f} tokens/s incl. eval)")

    # ---- save (bf16)
    from transformers import GenerationConfig

    model = model.to("cpu", dtype=torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=bos_id, pad_token_id=pad_id)
    for stale in ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"):
        if (out / stale).exists():
            (out / stale).unlink()
    model.save_pretrained(out)  # safetensors is the only format in transformers 5
    tokenizer.save_pretrained(out)
    # Name the generic fast-tokenizer class so transformers 4.x loads the dir too (5.x maps it to
    # TokenizersBackend), then make every file world-readable (safetensors is written 0600).
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)
    size = dir_size(out)
    files = {f.name: f.stat().st_size for f in sorted(out.iterdir()) if f.is_file()}
    for name, sz in files.items():
        print(f"  {name:32s} {sz / 1e6:8.3f} MB")
    print(f"saved {out}: {size / 2**20:.2f} MiB total ({size:,} bytes)")
    log({"event": "done", "steps": total, "final_loss": round(loss.item(), 4), "heldout_loss": heldout_loss,
         "train_seconds": round(train_s, 1), "tokens_per_s": round(avg_tps, 1), "dir_bytes": size, "files": files,
         "total_seconds": round(time.time() - t0, 1)})
    log_f.close()
    if size > MAX_DIR_BYTES:
        print(f"ERROR: {out} is {size / 2**20:.2f} MiB > 20 MiB budget", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
