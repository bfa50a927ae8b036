"""What one request may cost the server before it is refused, and how long admission may
take: the limits that keep one client from stalling admission or decoding for the others.

Every limit has a `onespec serve` flag of the same name (`--max-chat-messages` for
max_chat_messages); docs/SERVING.md ("Limits") lists them with their defaults.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

# flag help, by field; the default is added by the CLI
HELP = {
    "max_request_body_bytes": "answer 413 to a request body larger than this",
    "max_inflight_body_bytes": "answer 503 while request bodies being read or parsed "
                               "hold more than this many bytes together",
    "request_body_timeout": "answer 408 to a request whose body has not arrived within "
                            "this many seconds",
    "max_chat_messages": "answer 400 to a chat request with more messages",
    "max_stop_token_ids": "answer 400 to a request with more stop_token_ids",
    "max_grammar_chars": "answer 400 to a structured-output spec (schema, regex, grammar, "
                         "choices) longer than this many characters",
    "max_grammar_alternatives": "answer 400 to a spec with more enum values or choices",
    "grammar_compile_timeout": "answer 400 to a spec whose grammar does not compile within "
                               "this many seconds (the compile is killed)",
    "grammar_compile_workers": "processes compiling grammars; compiles wait for a free one "
                               "at most --grammar-compile-timeout seconds, then get 503",
    "grammar_cache_bytes": "compiled grammars kept for reuse, in bytes",
    "admission_threads": "threads parsing, templating and tokenizing requests",
}


@dataclass(frozen=True)
class ServerLimits:
    max_request_body_bytes: int = 8 << 20
    max_inflight_body_bytes: int = 64 << 20
    request_body_timeout: float = 30.0
    max_chat_messages: int = 4096
    max_stop_token_ids: int = 1024
    max_grammar_chars: int = 64 << 10
    max_grammar_alternatives: int = 4096
    grammar_compile_timeout: float = 10.0
    grammar_compile_workers: int = 1
    grammar_cache_bytes: int = 256 << 20
    admission_threads: int = 4

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
                want = "an integer >= 1"
            else:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
                    0 < value <= 86400
                want = "a number of seconds in (0, 86400]"
            if not ok:
                raise ValueError(f"--{f.name.replace('_', '-')} must be {want}, got {value!r}")
