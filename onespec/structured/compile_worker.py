"""Compiling one grammar spec with xgrammar, in-process or in a worker process.

`compile_spec` and `check_satisfiable` are what GrammarBackend calls in the engine's
process. Run as a script (`python compile_worker.py FD VOCAB_FILE`), this file is a
compile worker for the server's GrammarCompilePool (structured/compile_pool.py): it reads
the TokenizerInfo serialized in VOCAB_FILE, then answers compile jobs over the
multiprocessing Connection on file descriptor FD until it reads None or is killed. A
worker imports nothing from onespec, so it starts with xgrammar's import alone, and
killing it ends a compile that ran too long (xgrammar cannot be interrupted inside a
compile) and returns all the memory it took.

Messages: job (kind, text, max_bytes) -> ("ok", compiled grammar as xgrammar's JSON) or
("invalid", the compiler's message) or ("empty" | "too_big", why it is refused).
"""
from __future__ import annotations

import json
import os
import re
import sys

COMPACT = (",", ":")           # JSON separators: no whitespace between tokens
# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: "
_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
EMPTY_LANGUAGE = "it admits no output at all (no first token is allowed)"
# a worker yields the processor to decoding: a long compile must not slow other streams
COMPILE_NICENESS = 10


def compiler_message(error: Exception) -> str:
    """The compiler's own words, without its source location and stack."""
    text = str(error).strip().split("\nStack trace")[0]
    return _LOCATION.sub("", text).strip()


def compile_spec(compiler, kind: str, text: str):
    """The xgrammar CompiledGrammar of a StructuredOutputsParams key (kind, canonical text)."""
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=False, separators=COMPACT)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                            separators=COMPACT)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":       # JSON string literals are EBNF string literals
        return compiler.compile_grammar("root ::= " + " | ".join(
            json.dumps(s, ensure_ascii=False) for s in json.loads(text)))
    return compiler.compile_grammar(text)


def check_satisfiable(xgr, compiled, stop_token_ids: list[int]) -> bool:
    """Whether a matcher of `compiled` allows any first token (a stop token included): a
    regex such as `[^\\s\\S]` or a rule such as `root ::= root` compiles but admits none."""
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=not stop_token_ids)
    if matcher.is_completed():
        return True
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def serve(conn, info_file: str) -> None:
    os.nice(COMPILE_NICENESS)
    import xgrammar as xgr
    with open(info_file, encoding="utf-8") as f:
        info = xgr.TokenizerInfo.deserialize_json(f.read())
    stop_token_ids = list(info.stop_token_ids)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        job = conn.recv()
        if job is None:
            return
        kind, text, max_bytes = job
        try:
            compiled = compile_spec(compiler, kind, text)
        except Exception as e:          # noqa: BLE001 - the compiler raises RuntimeError & co.
            conn.send(("invalid", compiler_message(e)))
            continue
        if compiled.memory_size_bytes > max_bytes:
            conn.send(("too_big", f"its compiled grammar takes {compiled.memory_size_bytes} "
                                  f"bytes, more than the {max_bytes} allowed"))
        elif not check_satisfiable(xgr, compiled, stop_token_ids):
            conn.send(("empty", EMPTY_LANGUAGE))
        else:
            conn.send(("ok", compiled.serialize_json()))


if __name__ == "__main__":
    sys.path.pop(0)                     # this file's folder is no package root
    from multiprocessing.connection import Connection
    try:
        serve(Connection(int(sys.argv[1])), sys.argv[2])
    except (EOFError, KeyboardInterrupt, OSError):
        pass                            # the server went away: nothing left to do
