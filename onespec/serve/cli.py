"""`onespec serve --model DIR [--draft DIR --k N] [--host] [--port] ...`"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import fields

from onespec.serve.limits import HELP, ServerLimits
from onespec.serve.tools import PARSERS


def build_parser() -> argparse.ArgumentParser:
    from onespec.cli import Parser, _add_engine_args
    p = Parser(prog="onespec serve",
               description="OpenAI-compatible HTTP server (see docs/SERVING.md)")
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (loopback: local clients only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port, 0-65535")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the model dir's basename)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* routes; repeat the "
                        "flag to accept several keys")
    p.add_argument("--no-cache-salt-per-api-key", dest="cache_salt_per_api_key",
                   action="store_false",
                   help="let requests with different API keys share cached prefixes (by "
                        "default each key has its own prefix-cache namespace, so one "
                        "client cannot learn from cached_tokens what another sent)")
    for f in fields(ServerLimits):
        default = f.default
        p.add_argument("--" + f.name.replace("_", "-"), default=default,
                       type=int if f.type == "int" else float,
                       help=HELP[f.name])
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template for /v1/chat/completions, a file or the template "
                        "itself (default: the tokenizer's own)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="answer tool_choice \"auto\" (the default with tools): needs "
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="the format the model writes tool calls in")
    p.add_argument("--log-level", default="info", help="server log level",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log every request")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="log a line of running and waiting requests, throughput, acceptance "
                        "length and KV use every SECONDS while there is work (0: never)")
    return p


class StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record comes, not as it was at set-up (main()
    may run inside a process that swaps it, as a test runner does)."""

    def emit(self, record):
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(level: str):
    """onespec's own log lines (the start-up summary, stats, engine failures,
    disconnects) in uvicorn's format; once per process, however often main() runs."""
    logger = logging.getLogger("onespec")
    for old in [h for h in logger.handlers if isinstance(h, StderrHandler)]:
        logger.removeHandler(old)
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False


def served_name(model_dir: str) -> str:
    return os.path.basename(os.path.normpath(model_dir))


def read_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the value itself when it is Jinja."""
    if os.path.isfile(value):
        with open(value) as f:
            value = f.read()
    elif "{{" not in value and "{%" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    import jinja2
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e} "
                         f"(line {e.lineno})") from None
    return value


def bind_listener(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), as uvicorn binds it, taken before the model loads so
    that a port in use fails at once; uvicorn then listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = " (another process listens there: stop it or pass another --port)" \
            if e.errno == errno.EADDRINUSE else ""
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    sock.set_inheritable(True)
    return sock


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from onespec.cli import check_engine_args
    check_engine_args(parser, args)
    if not 0 <= args.port <= 65535:
        print(f"onespec serve: error: --port must be in [0, 65535], got {args.port}",
              file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        print("onespec serve: error: --enable-auto-tool-choice and --tool-call-parser go "
              "together", file=sys.stderr)
        return 2
    if not args.log_stats_interval >= 0:
        print("onespec serve: error: --log-stats-interval must be >= 0 seconds, got "
              f"{args.log_stats_interval}", file=sys.stderr)
        return 2
    try:
        limits = ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})
    except ValueError as e:
        print(f"onespec serve: error: {e}", file=sys.stderr)
        return 2
    import uvicorn  # noqa: F401    # a missing server module: one line from onespec.cli
    launched = None
    if args.tensor_parallel_size > 1:          # (torch is imported only then, before binding)
        from onespec.distributed.launch import launched_env
        try:
            launched = launched_env(args.tensor_parallel_size)
        except ValueError as e:
            print(f"onespec serve: error: {e}", file=sys.stderr)
            return 2
    if launched is not None and launched.rank != 0:
        return _follow_rank(args)       # torchrun's other ranks: rank 0 alone listens
    try:
        listener = bind_listener(args.host, args.port)
    except OSError as e:
        print(f"onespec serve: error: {e}", file=sys.stderr)
        return 2
    try:
        return _load_and_serve(args, listener, limits)
    finally:
        listener.close()


def _follow_rank(args) -> int:
    """A rank other than 0 of a torchrun launch: builds its shard and runs rank 0's steps;
    the process ends (SystemExit) when rank 0 stops (distributed/launch.py)."""
    from onespec.cli import build_llm, run_or_report
    configure_logging(args.log_level)
    return run_or_report("serve", build_llm, args)


def _load_and_serve(args, listener: socket.socket, limits: ServerLimits) -> int:
    import uvicorn

    from onespec.cli import build_llm
    from onespec.serve.app import create_app
    configure_logging(args.log_level)     # the engine's start-up summary is logged
    try:
        template = read_chat_template(args.chat_template) if args.chat_template else None
        llm = build_llm(args)
        if template is not None:
            if llm.engine.tokenizer is None:
                raise ValueError(f"--chat-template needs a tokenizer and {args.model!r} has "
                                 "no tokenizer files")
            llm.engine.tokenizer.chat_template = template
    except (ValueError, OSError) as e:          # bad files or settings: one line, no trace
        print(f"onespec serve: error: {e}", file=sys.stderr)
        return 2
    app = create_app(llm, args.served_model_name or served_name(args.model), args.api_key,
                     limits=limits, cache_salt_per_api_key=args.cache_salt_per_api_key,
                     tool_call_parser=args.tool_call_parser,
                     log_stats_interval=args.log_stats_interval or None)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=not args.no_access_log, timeout_graceful_shutdown=5)
    # uvicorn raises SIGTERM again once it has shut down gracefully; as SystemExit it ends
    # the process through `finally`, which stops the other ranks (torchrun's ranks wait for
    # rank 0's word, not for a pipe to close)
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if on_main_thread else None
    try:
        uvicorn.Server(config).run(sockets=[listener])
    finally:                        # Ctrl-C too: the tensor-parallel workers stop with us
        llm.close()
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
