"""Time to first token of a long prompt whose first tokens are in the prefix cache, against
the same length uncached, on a random-weight target (`bench/prefix_ttft.py`).

Each trial draws a fresh prefix of --cached-len tokens: an uncached prompt of --prompt-len
tokens is timed, then a prompt of the prefix and another tail is run once (untimed) to fill
the cache, then the prefix with a third tail is timed. One JSON line per run goes to
stdout, its last line the medians and their ratio:
  python bench/prefix_ttft.py --prompt-len 16384 --cached-len 15360
  python bench/prefix_ttft.py --shape tiny --device cpu --prompt-len 256 --cached-len 192
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

from onespec.bench.decode import (SHAPES, make_emitter, release_memory, shape_label, sync,
                               write_model_dirs)


def parse_args(argv):
    from onespec.cli import Parser
    p = Parser(prog="bench/prefix_ttft.py", description=__doc__)
    p.add_argument("--prompt-len", type=int, default=16384, help="prompt tokens")
    p.add_argument("--cached-len", type=int, default=15360,
                   help="leading prompt tokens already in the cache (whole blocks count)")
    p.add_argument("--trials", type=int, default=3, help="timed prompt pairs")
    p.add_argument("--max-num-tokens", type=int, default=2048,
                   help="tokens per engine step (the prefill chunk)")
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.which = "prefix_ttft"
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.trials < 1 or not 0 < args.cached_len < args.prompt_len:
        p.error("--trials must be >= 1 and 0 < --cached-len < --prompt-len")
    return args


def time_prefill(llm, prompt: list[int], device: str) -> tuple[float, int]:
    """(ms to the first token, cached prompt tokens) of one request."""
    from onespec import SamplingParams
    sync(device)
    t0 = time.perf_counter()
    out = llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True))[0]
    sync(device)
    return 1e3 * (time.perf_counter() - t0), out.num_cached_tokens


def run_trial(llm, args, gen: torch.Generator) -> dict:
    vocab = llm.engine.model.config.vocab_size

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=gen).tolist()
    tail = args.prompt_len - args.cached_len
    uncached_ms, hit = time_prefill(llm, tokens(args.prompt_len), args.device)
    assert hit == 0, "a random prompt found cached blocks"
    prefix = tokens(args.cached_len)
    time_prefill(llm, prefix + tokens(tail), args.device)           # fills the cache
    cached_ms, hit = time_prefill(llm, prefix + tokens(tail), args.device)
    return {"ttft_ms_uncached": uncached_ms, "ttft_ms_cached": cached_ms,
            "num_cached_tokens": hit}


def main(argv=None) -> int:
    from onespec import LLM
    args = parse_args(argv)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    emit = make_emitter(args, shape_label(args.shape), device_name)
    gen = torch.Generator().manual_seed(args.seed)
    head = {"prompt_len": args.prompt_len, "cached_len": args.cached_len,
            "max_num_tokens": args.max_num_tokens}
    with tempfile.TemporaryDirectory(prefix="onespec-bench-") as root:
        target_dir, _ = write_model_dirs(args.shape, root)
        llm = LLM(target_dir, load_format="dummy", dtype=args.dtype, device=args.device,
                  max_batch_size=1, max_model_len=args.prompt_len + 1,
                  max_num_tokens=args.max_num_tokens, seed=args.seed,
                  num_kv_blocks=3 * (-(-(args.prompt_len + 2) // 16)))
        run_trial(llm, args, gen)                               # warm-up: kernels compiled
        rows = []
        for trial in range(args.trials):
            rows.append(run_trial(llm, args, gen))
            emit({**head, "trial": trial, **rows[-1]})
        uncached = statistics.median(r["ttft_ms_uncached"] for r in rows)
        cached = statistics.median(r["ttft_ms_cached"] for r in rows)
        emit({**head, "trials": args.trials, "ttft_ms_uncached": uncached,
              "ttft_ms_cached": cached, "ratio": cached / uncached,
              "num_cached_tokens": rows[-1]["num_cached_tokens"]})
        del llm
        release_memory(args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
