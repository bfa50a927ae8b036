"""`onespec train eagle3|peagle --target DIR --data FILE --out DIR [options]`."""
from __future__ import annotations

import argparse
import sys

from onespec.cli import Parser, resolve_model_dir
from onespec.train.trainer import FORMATS, TrainConfig, train_eagle3

METHODS = {"eagle3": "train an EAGLE-3 draft head with training-time test",
           "peagle": "train a P-EAGLE head (parallel drafting) with COD sampling"}


def _layer_ids(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def build_parser() -> argparse.ArgumentParser:
    """`onespec train`: lists the methods (each parses its own options, eagle3_parser)."""
    parser = Parser(prog="onespec train", description=__doc__)
    sub = parser.add_subparsers(dest="method", metavar="METHOD", required=True)
    for name, summary in METHODS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def eagle3_parser(method: str = "eagle3") -> argparse.ArgumentParser:
    """The options of `onespec train METHOD` (peagle: --depth, --layers, --cod-ratio*)."""
    p = Parser(prog=f"onespec train {method}", description=METHODS[method])
    p.add_argument("--target", required=True, help="Hugging Face target model directory")
    p.add_argument("--data", required=True,
                   help=".jsonl/.jsonl.gz of {'text'}, {'messages'} or {'input_ids'} lines")
    p.add_argument("--out", required=True, help="output head directory")
    if method == "peagle":
        p.add_argument("--depth", dest="ttt_steps", type=int, default=8,
                       help="tokens one forward proposes (the largest K it serves)")
        p.add_argument("--layers", dest="num_layers", type=int, default=2,
                       help="decoder layers of the head")
        p.add_argument("--cod-ratio", type=float, default=0.7,
                       help="COD sampling: depth d keeps ratio^d of the anchors ...")
        p.add_argument("--cod-ratio-min", type=float, default=0.2, help="... at least this")
    else:
        p.add_argument("--ttt-steps", type=int, default=7, help="unrolled draft steps K")
    p.add_argument("--loss-decay", type=float, default=0.8,
                   help="weight of step (depth) i: decay^i")
    p.add_argument("--draft-vocab", type=int, default=32000,
                   help="draft vocab size (most frequent target tokens; capped at target V)")
    p.add_argument("--max-len", type=int, default=2048, help="tokens per training sample")
    p.add_argument("--epochs", type=int, default=1, help="passes over the data")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-ratio", type=float, default=0.02,
                   help="share of the steps in linear warmup, then cosine decay")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="padded tokens per optimizer step")
    p.add_argument("--capture-layers", type=_layer_ids, default=None,
                   help="comma-separated outputs-of layer ids (default 1,L//2-1,L-4)")
    p.add_argument("--format", dest="fmt", choices=FORMATS,
                   default="speculators" if method == "peagle" else "safeailab",
                   help="checkpoint layout of the head")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, help="data order and initialisation")
    p.add_argument("--save-every", type=int, default=1000,
                   help="steps between resumable checkpoints in <out>/checkpoint (0: none)")
    p.add_argument("--save-state", action="store_true",
                   help="also keep the resumable state (head, optimizer, position) at the end "
                        "of a run shorter than --save-every, to continue it with --resume")
    p.add_argument("--log", default=None, help="JSONL log file (default <out>/train_log.jsonl)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    p.add_argument("--regenerate", action="store_true",
                   help="first rewrite the data with the target's own greedy outputs")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps (default: every batch of every "
                        "epoch)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop after this much training time (regeneration not counted); the "
                        "learning rate decays over it")
    p.add_argument("--eval-data", default=None,
                   help="held-out records: per-step accuracy logged at each checkpoint")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (there is none off a terminal anyway)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in METHODS:
        build_parser().parse_args(argv)           # prints help or the error; exits
        return 2
    args = vars(eagle3_parser(argv[0]).parse_args(argv[1:]))
    args["method"] = argv[0]
    try:
        args["target"] = resolve_model_dir(args["target"], "--target")
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
