"""`onespec serve --model DIR [--draft DIR --k N] [--host] [--port] ...`"""
from __future__ import annotations

import argparse
import logging
import os
import sys
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
    return p


def configure_logging(level: str):
    """onespec's own log lines (engine failures, disconnects) in uvicorn's format."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger = logging.getLogger("onespec")
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
    try:
        limits = ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})
    except ValueError as e:
        print(f"onespec serve: error: {e}", file=sys.stderr)
        return 2
    import uvicorn                  # a missing server module: one line from onespec.cli

    from onespec.cli import build_llm
    from onespec.serve.app import create_app
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
    configure_logging(args.log_level)
    app = create_app(llm, args.served_model_name or served_name(args.model), args.api_key,
                     limits=limits, cache_salt_per_api_key=args.cache_salt_per_api_key,
                     tool_call_parser=args.tool_call_parser)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    access_log=not args.no_access_log, timeout_graceful_shutdown=5)
    finally:                        # Ctrl-C too: the tensor-parallel workers stop with us
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
