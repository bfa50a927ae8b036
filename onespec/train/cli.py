"""`onespec train eagle3 --target DIR --data FILE --out DIR [options]`."""
from __future__ import annotations

import argparse
import sys

from onespec.train.trainer import FORMATS, TrainConfig, train_eagle3


def _layer_ids(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onespec train", description=__doc__)
    sub = parser.add_subparsers(dest="method", required=True)
    p = sub.add_parser("eagle3", help="train an EAGLE-3 draft head with training-time test")
    p.add_argument("--target", required=True, help="Hugging Face target model directory")
    p.add_argument("--data", required=True,
                   help=".jsonl/.jsonl.gz of {'text'}, {'messages'} or {'input_ids'} lines")
    p.add_argument("--out", required=True, help="output head directory")
    p.add_argument("--ttt-steps", type=int, default=7, help="unrolled draft steps K")
    p.add_argument("--loss-decay", type=float, default=0.8, help="weight of step i: decay^i")
    p.add_argument("--draft-vocab", type=int, default=32000,
                   help="draft vocab size (most frequent target tokens; capped at target V)")
    p.add_argument("--max-len", type=int, default=2048, help="tokens per training sample")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-ratio", type=float, default=0.02)
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="padded tokens per optimizer step")
    p.add_argument("--capture-layers", type=_layer_ids, default=None,
                   help="comma-separated outputs-of layer ids (default 1,L//2-1,L-4)")
    p.add_argument("--format", dest="fmt", choices=FORMATS, default="safeailab")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=1000,
                   help="steps between checkpoints in <out>/checkpoint (0: at the end only)")
    p.add_argument("--log", default=None, help="JSONL log file (default <out>/train_log.jsonl)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    p.add_argument("--regenerate", action="store_true",
                   help="first rewrite the data with the target's own greedy outputs")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--eval-data", default=None,
                   help="held-out records: per-step accuracy logged at each checkpoint")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return parser


def main(argv=None) -> int:
    args = vars(build_parser().parse_args(argv))
    args.pop("method")
    try:
        cfg = TrainConfig(**args)
        _, history = train_eagle3(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"onespec train: error: {e}", file=sys.stderr)
        return 2
    final = [h for h in history if not h.get("eval")]
    if final:
        last = final[-1]
        print(f"saved {cfg.fmt} head to {cfg.out} after {last['step']} steps: loss "
              f"{last['loss']:.4f}, accuracy per step {last['acc_per_step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
