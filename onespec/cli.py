"""`onespec demo | generate | serve | bench | train` (also `python -m onespec`)."""
from __future__ import annotations

import argparse
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser):
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--draft", default=None, help="EAGLE-3 head directory")
    p.add_argument("--k", type=int, default=3, help="draft length (with --draft)")
    p.add_argument("--mtp", type=int, default=None, metavar="K",
                   help="draft K tokens with the target's own MTP layer (MTP-Eagle)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-tokens", type=int, default=2048)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=None)


def build_llm(args):
    from onespec import LLM, Eagle3Config, MTPConfig
    if args.draft and args.mtp:
        raise ValueError("--draft and --mtp are two drafters: pass one of them")
    spec = Eagle3Config(args.draft, max_draft_len=args.k) if args.draft else \
        MTPConfig(num_nextn_predict_layers=args.mtp) if args.mtp else None
    return LLM(args.model, speculative_config=spec, dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len, max_num_tokens=args.max_num_tokens,
               max_batch_size=args.max_batch_size, num_kv_blocks=args.num_kv_blocks)


def stream_request(llm, prompt, sp, out=sys.stdout):
    """Runs one request to completion, writing text as tokens arrive. Returns the request."""
    eng = llm.engine
    req = eng.add_request(prompt, sp)
    printed = ""
    while not req.is_finished:
        eng.step()
        text = llm.decode(req.output_token_ids)
        if eng.tokenizer is None:
            text = " ".join(map(str, req.output_token_ids))
        if text.startswith(printed) and len(text) > len(printed):
            out.write(text[len(printed):])
            out.flush()
            printed = text
    out.write("\n")
    return req


def cmd_generate(args):
    from onespec import SamplingParams
    llm = build_llm(args)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                        ignore_eos=args.ignore_eos)
    prompt = args.prompt
    if args.prompt_ids:
        prompt = [int(t) for t in args.prompt_ids.split(",")]
    start = time.perf_counter()
    req = stream_request(llm, prompt, sp)
    elapsed = time.perf_counter() - start
    m = req.metrics
    line = (f"[{len(req.output_token_ids)} tokens in {elapsed:.2f}s, "
            f"{len(req.output_token_ids) / elapsed:.1f} tok/s, target steps {m.target_steps}")
    if args.draft or args.mtp:
        line += (f", acceptance length {m.acceptance_length:.2f}, drafts accepted "
                 f"{m.num_accepted_draft_tokens}/{m.num_draft_tokens}")
    print(line + "]", file=sys.stderr)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="onespec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from one prompt, streaming the text")
    _add_engine_args(g)
    g.add_argument("--prompt", default="")
    g.add_argument("--prompt-ids", default=None, help="comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    for name, module in (("demo", "onespec.demo"), ("serve", "onespec.serve.cli"),
                         ("bench", "onespec.bench_cli"), ("train", "onespec.train.cli")):
        p = sub.add_parser(name, help=f"see `onespec {name} --help`", add_help=False)
        p.set_defaults(module=module)

    args, rest = parser.parse_known_args(argv)
    if hasattr(args, "module"):
        import importlib
        return importlib.import_module(args.module).main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"onespec: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
