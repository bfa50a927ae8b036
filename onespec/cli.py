"""`onespec demo | generate | serve | bench | train` (also `python -m onespec`)."""
from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import re
import sys
import time

from onespec import __version__

# name -> ("module:function" taking the command's own argv, one-line description)
COMMANDS = {
    "demo": ("onespec.demo:main",
             "the bundled code model and its EAGLE-3 head: plain vs speculative, no arguments"),
    "generate": ("onespec.cli:generate_main", "generate from one prompt, streaming the text"),
    "serve": ("onespec.serve.cli:main", "OpenAI-compatible HTTP server"),
    "bench": ("onespec.bench.decode:main",
              "decode benchmark of a random-weight model, plain and speculative"),
    "train": ("onespec.train.cli:main",
              "train an EAGLE-3 or P-EAGLE draft head for a target model"),
}
DEFAULT_K = 3
# dependencies a command imports only when it runs (the server's)
LATE_IMPORTS = ("fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; '(default: X)' after every option that has a default
    (not after None, nor after a flag: --no-progress's default True says nothing)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or \
                isinstance(action, argparse._StoreConstAction):   # store_true / store_false
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with the defaults in --help, and a mistyped option answered with this
    command's usage and the closest option: `--max-tokns` -> did you mean --max-tokens?"""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        """An unknown --option is reported as such before argparse parses, which could
        otherwise take its value for a positional and complain about that instead."""
        args = sys.argv[1:] if args is None else list(args)
        for arg in args:
            if arg == "--":
                break
            name = arg.split("=")[0]          # with a space it is a value, as for argparse
            if name.startswith("--") and " " not in name and not any(
                    o.startswith(name) for o in self._option_string_actions):
                self.error(f"unrecognized arguments: {arg}")
        return super().parse_args(args, namespace)

    def error(self, message):
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            option = unknown.group(1).split("=")[0]
            close = difflib.get_close_matches(option, list(self._option_string_actions), n=1)
            if close:
                message += f" (did you mean {close[0]}?)"
        super().error(message)


# ---- engine options shared by generate and serve -----------------------------------------
def _add_engine_args(p: argparse.ArgumentParser):
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="Hugging Face model directory (local), or a hub id in the local cache")
    p.add_argument("--model", default=None, help="the same as MODEL (give one of them)")
    p.add_argument("--draft", default=None, help="EAGLE-3 head directory: speculative decoding")
    p.add_argument("--k", type=int, default=None,
                   help=f"draft length, >= 1 (with --draft; default {DEFAULT_K})")
    p.add_argument("--tree-topk", type=int, default=None, metavar="TOPK",
                   help="with --draft: draft a dynamic tree of depth --k, expanding the TOPK "
                        "best nodes per depth (docs/DECODING.md, 'Dynamic trees')")
    p.add_argument("--tree-nodes", type=int, default=None, metavar="N",
                   help="with --tree-topk: tree nodes verified per step (default TOPK x depth)")
    p.add_argument("--mtp", type=int, default=None, metavar="K",
                   help="draft K tokens with the target's own MTP layer (MTP-Eagle)")
    p.add_argument("--ngram", type=int, default=None, metavar="K",
                   help="draft K tokens by prompt lookup (n-gram), no draft model needed")
    p.add_argument("--sa-enhancer", type=int, default=None, metavar="N",
                   help="with --draft or --mtp: drafts from the request's own earlier tokens "
                        "replace the model's when N or more tokens match (suffix automaton)")
    p.add_argument("--speculative-config", type=speculative_json, default=None, metavar="JSON",
                   help="vLLM's form, instead of --draft/--mtp/--ngram: "
                        '\'{"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}\' '
                        "(method eagle3, mtp or ngram; any field of the method's config too)")
    p.add_argument("--draft-len-schedule", type=draft_len_schedule, default=None,
                   metavar="auto|B:K,...",
                   help="draft length per step: 'auto' (a cost model picks K from 0 to the "
                        "draft length each step, from step times measured at start-up and "
                        "cached, and the acceptance seen; --draft or --mtp), or batch sizes "
                        "and their K: 1:4,8:2,32:1 (up to B running requests, K drafts; "
                        "above the largest B, none)")
    p.add_argument("--rejection-sampling", action="store_true",
                   help="sampled requests accept drafts by rejection sampling against the "
                        "drafter's distribution (higher acceptance at temperature > 0), not "
                        "by exact match with the target's sample")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize the target's linears and experts to e4m3 per output "
                        "channel at load (an FP8 checkpoint loads as it is without it)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the paged KV cache: auto (the model's dtype) or fp8 (e4m3 with per-"
                        "layer k/v scales from the checkpoint, else 1.0; half the bytes)")
    p.add_argument("--draft-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "fp8"],
                   help="the drafter's weights (--draft's head; --mtp's layers: auto or "
                        "fp8); fp8: e4m3 per output channel (default: the target's)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per request (default: the model's limit)")
    p.add_argument("--max-num-tokens", type=int, default=2048, help="tokens per engine step")
    p.add_argument("--max-batch-size", type=int, default=64, help="requests decoded together")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks (default: sized from memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85, metavar="FRACTION",
                   help="the most of the free memory, in (0, 1], that the KV cache may take "
                        "(of the GPU's after the weights are loaded; of the host's available "
                        "memory on the CPU): EngineConfig.kv_cache_memory_fraction")
    p.add_argument("--seed", type=int, default=None,
                   help="random seed, >= 0: the engine's sampling generator (generate: also "
                        "the request's seed) (default: 0)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV of prompt prefixes seen before")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the target over N GPUs (N CPU processes on the CPU)")
    p.add_argument("--enable-attention-dp", action="store_true",
                   help="with --tensor-parallel-size N, an MLA/MoE target (DeepSeek-V3, "
                        "Qwen3-MoE) attends data-parallel: each rank for its own requests, "
                        "with its own KV blocks; the MoE/MLP stay split (docs/SCALING.md)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: the Triton kernels on CUDA (one rank), else PyTorch")


def speculative_json(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as "
                                         f'{{"method": "ngram"}}, got {text!r}')
    return value


def draft_len_schedule(text: str) -> str | dict[int, int]:
    """--draft-len-schedule: 'auto', or 'B:K,...' (a JSON object {"B": K} too)."""
    if text == "auto":
        return text
    try:
        pairs = json.loads(text).items() if text.lstrip().startswith("{") else \
            [item.split(":") for item in text.split(",")]
        return {int(b): int(k) for b, k in pairs}
    except (ValueError, TypeError, AttributeError):
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or batch sizes and draft lengths such as 1:4,8:2,32:1, "
            f"got {text!r}") from None


def check_engine_args(parser: argparse.ArgumentParser, args):
    """--k only means something with --draft: refuse it otherwise, and refuse K < 1;
    --draft, --mtp and --ngram are three drafters, one at a time, and --speculative-config
    replaces them all; --sa-enhancer goes on a model drafter; tree options need --draft; the
    model comes as MODEL or --model. Which drafting options go together is combinations.py's
    to say, for every entry."""
    check_model_arg(parser, args)
    if args.speculative_config is not None:
        given = [o for o, v in (("--draft", args.draft), ("--mtp", args.mtp),
                                ("--ngram", args.ngram), ("--k", args.k),
                                ("--tree-topk", args.tree_topk),
                                ("--tree-nodes", args.tree_nodes),
                                ("--sa-enhancer", args.sa_enhancer),
                                ("--draft-len-schedule", args.draft_len_schedule),
                                ("--rejection-sampling", args.rejection_sampling or None),
                                ("--draft-dtype",
                                 None if args.draft_dtype == "auto" else args.draft_dtype))
                 if v is not None]
        if given:
            parser.error(f"--speculative-config holds every drafting option: pass {given[0]} "
                         "inside it instead")
        return
    check_host_draft_args(parser, args)
    if args.draft is None and args.mtp is None and args.ngram is None and \
            (args.draft_len_schedule is not None or args.rejection_sampling):
        parser.error("--draft-len-schedule and --rejection-sampling shape speculative "
                     "decoding: pass a drafter (--draft, --mtp or --ngram)")
    if args.draft is None and args.mtp is None and args.draft_dtype != "auto":
        parser.error("--draft-dtype sets the drafter's weights: pass --draft or --mtp too")
    if args.draft is None and (args.tree_topk is not None or args.tree_nodes is not None):
        parser.error("--tree-topk and --tree-nodes shape the EAGLE-3 head's tree: they need "
                     "--draft")
    if args.tree_nodes is not None and args.tree_topk is None:
        parser.error("--tree-nodes needs --tree-topk (which turns the tree on)")
    if args.mtp is not None:
        if args.draft is not None:
            parser.error("--draft and --mtp are two drafters: pass one of them")
        if args.k is not None:
            parser.error("--k goes with --draft; with --mtp K the draft length is K")
        if args.mtp < 1:
            parser.error(f"--mtp must be >= 1, got {args.mtp}")
        return
    if args.draft is None:
        if args.k is not None:
            parser.error(f"--k {args.k} needs --draft (the EAGLE-3 head that proposes the "
                         "drafts); without --draft onespec decodes plainly")
        return
    if args.k is None:
        args.k = DEFAULT_K
    if args.k < 1:
        parser.error(f"--k must be >= 1 with --draft, got {args.k}; leave out --draft to "
                     "decode without speculation")


def check_model_arg(parser: argparse.ArgumentParser, args):
    """Sets args.model from the positional MODEL or --model (as vLLM takes either), and
    args.model_option to the one given, for messages."""
    if args.model_path is not None and args.model is not None and \
            args.model_path != args.model:
        parser.error(f"the model is given twice, as MODEL {args.model_path!r} and --model "
                     f"{args.model!r}: give one")
    args.model_option = "--model" if args.model is not None else "MODEL"
    args.model = args.model if args.model is not None else args.model_path
    if args.model is None:
        parser.error(f"the model is missing: {parser.prog} MODEL (a Hugging Face model "
                     "directory), or --model MODEL")


def check_host_draft_args(parser: argparse.ArgumentParser, args):
    if args.ngram is not None:
        if args.draft is not None or args.mtp is not None:
            parser.error("--ngram is a drafter of its own: pass it without --draft and --mtp")
        if args.k is not None:
            parser.error("--k goes with --draft; with --ngram K the draft length is K")
        if args.ngram < 1:
            parser.error(f"--ngram must be >= 1, got {args.ngram}")
    if args.sa_enhancer is not None:
        if args.draft is None and args.mtp is None:
            parser.error("--sa-enhancer enhances a model drafter: pass --draft or --mtp too "
                         "(or --ngram K for drafts without a model)")
        if args.sa_enhancer < 1:
            parser.error(f"--sa-enhancer must be >= 1, got {args.sa_enhancer}")


def resolve_model_dir(path: str, option: str) -> str:
    """A local directory as given; a Hugging Face hub id from the local cache (no network);
    anything else a FileNotFoundError naming the option."""
    if os.path.isdir(path):
        return path
    if not os.path.exists(path) and HUB_ID.match(path):
        try:
            from huggingface_hub import snapshot_download
            return snapshot_download(path, local_files_only=True)
        except Exception:                     # noqa: BLE001 - not cached: explained below
            pass
        raise FileNotFoundError(
            f"{option} {path!r} is not a local directory: onespec loads local directories, "
            "and this hub id is not in the local Hugging Face cache; download it first (e.g. "
            f"`hf download {path} --local-dir DIR`) and pass {option} DIR")
    raise FileNotFoundError(f"{option} directory {path!r} does not exist")


def build_llm(args):
    from onespec import LLM, Eagle3Config, MTPConfig, NGramConfig
    model = resolve_model_dir(args.model, getattr(args, "model_option", "--model"))
    draft = resolve_model_dir(args.draft, "--draft") if args.draft else None
    sa = dict(use_sa_enhancer=True, sa_min_match_len=args.sa_enhancer) \
        if args.sa_enhancer else {}
    drafting = dict(draft_len_schedule=args.draft_len_schedule,
                    use_rejection_sampling=args.rejection_sampling)
    tree = dict(use_dynamic_tree=True, dynamic_tree_max_topK=args.tree_topk,
                max_total_draft_tokens=args.tree_nodes) if args.tree_topk is not None else {}
    head_dtype = dict(draft_dtype=args.draft_dtype)
    spec = Eagle3Config(draft, max_draft_len=args.k or DEFAULT_K, **sa, **tree, **drafting,
                        **head_dtype) if draft else \
        MTPConfig(num_nextn_predict_layers=args.mtp, **sa, **drafting, **head_dtype) \
        if args.mtp else \
        NGramConfig(max_draft_len=args.ngram, **drafting) if args.ngram else \
        speculative_dict(args.speculative_config)
    import torch
    try:
        return LLM(model, speculative_config=spec, dtype=args.dtype, device=args.device,
                   quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                   max_model_len=args.max_model_len, max_num_tokens=args.max_num_tokens,
                   max_batch_size=args.max_batch_size, num_kv_blocks=args.num_kv_blocks,
                   enable_prefix_caching=args.enable_prefix_caching,
                   tensor_parallel_size=args.tensor_parallel_size,
                   enable_attention_dp=args.enable_attention_dp,
                   attention_backend=args.attention_backend,
                   kv_cache_memory_fraction=args.gpu_memory_utilization,
                   seed=0 if args.seed is None else args.seed)
    except (MemoryError, torch.OutOfMemoryError) as e:   # past the checks made before
        raise ValueError(f"out of memory while building the engine for {args.model!r} "
                         f"({str(e).splitlines()[0]}); lower --max-batch-size, "
                         "--max-model-len or --num-kv-blocks") from None


def speculative_dict(spec: dict | None) -> dict | None:
    """--speculative-config with its draft model directory resolved as --draft's is."""
    if spec is None or not isinstance(spec.get("model"), str):
        return spec
    return {**spec, "model": resolve_model_dir(spec["model"], "--speculative-config model")}


# ---- generate ------------------------------------------------------------------------------
def token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integer token ids such as 1,2,3, got {text!r}") from None


def stream_request(llm, prompt, sp, out=sys.stdout):
    """Runs one request to completion, writing text as tokens arrive, and a final newline
    (flushed, so what follows on stderr starts on its own line). Returns the request."""
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
    out.flush()
    return req


def warn_if_cut(llm, prompt_ids: list[int], max_tokens: int):
    limit = llm.engine.max_model_len
    room = limit - len(prompt_ids)
    if 0 < room < max_tokens:
        print(f"onespec generate: warning: the prompt's {len(prompt_ids)} tokens + --max-tokens "
              f"{max_tokens} exceed --max-model-len {limit}: the output stops after at most "
              f"{room} tokens (finish_reason length)", file=sys.stderr)


def cmd_generate(args):
    from onespec import SamplingParams
    llm = build_llm(args)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                        ignore_eos=args.ignore_eos)
    prompt = llm.engine.tokenize(args.prompt_ids if args.prompt is None else args.prompt)
    warn_if_cut(llm, prompt, args.max_tokens)
    start = time.perf_counter()
    req = stream_request(llm, prompt, sp)
    elapsed = time.perf_counter() - start
    m = req.metrics
    line = (f"[{len(req.output_token_ids)} tokens in {elapsed:.2f}s, "
            f"{len(req.output_token_ids) / elapsed:.1f} tok/s, target steps {m.target_steps}")
    if args.draft or args.mtp or args.ngram or args.speculative_config:
        line += (f", acceptance length {m.acceptance_length:.2f}, drafts accepted "
                 f"{m.num_accepted_draft_tokens}/{m.num_draft_tokens}")
    if args.sa_enhancer:
        line += (f", automaton drafts accepted {m.num_sa_accepted_draft_tokens}/"
                 f"{m.num_sa_draft_tokens}")
    print(f"{line}, finish_reason {req.finish_reason}]", file=sys.stderr)


def generate_parser() -> Parser:
    g = Parser(prog="onespec generate",
               description="Generates from one prompt: the text streams to stdout, a stats line "
                           "follows on stderr.")
    _add_engine_args(g)
    prompt = g.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text prompt (the model needs tokenizer files)")
    prompt.add_argument("--prompt-ids", type=token_ids, help="comma-separated token ids: 1,2,3")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-k", type=int, default=0, help="0: off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0: off")
    g.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-text")
    return g


def generate_main(argv=None) -> int:
    parser = generate_parser()
    args = parser.parse_args(argv)
    check_engine_args(parser, args)
    return run_or_report("generate", cmd_generate, args)


def run_or_report(command: str, fn, *args) -> int:
    """fn(*args) for `onespec COMMAND`: 0, or 2 after one line on stderr (no trace) where
    files or settings are bad (ValueError, OSError)."""
    try:
        fn(*args)
    except (ValueError, OSError) as e:
        print(f"onespec {command}: error: {e}", file=sys.stderr)
        return 2
    return 0


# ---- dispatch ------------------------------------------------------------------------------
def top_parser() -> Parser:
    parser = Parser(prog="onespec", description=__doc__,
                    epilog="`onespec COMMAND --help` lists a command's options.")
    parser.add_argument("--version", action="version", version=f"onespec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, summary) in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = top_parser()
    if argv and argv[0] in COMMANDS:
        module, function = COMMANDS[argv[0]][0].split(":")
        try:
            return getattr(importlib.import_module(module), function)(argv[1:])
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in LATE_IMPORTS:
                raise
            print(f"onespec {argv[0]}: error: it needs {e.name!r}, which is not installed; "
                  "install onespec's dependencies again: pip install -e . (from a checkout) "
                  "or pip install onespec", file=sys.stderr)
            return 2
    if argv and not argv[0].startswith("-"):
        close = [c for c in COMMANDS if c.startswith(argv[0])] or \
            difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        parser.error(f"unknown command {argv[0]!r}{hint}; commands: {', '.join(COMMANDS)}")
    parser.parse_args(argv)           # --help, or no command: prints and exits
    return 2


if __name__ == "__main__":
    sys.exit(main())
