"""The grammar backend: xgrammar compiles a request's constraint once (cached by its spec)
and each request gets its own GrammarMatcher, which walks the tokens it emits."""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from onespec.structured.params import StructuredOutputsParams

CACHE_SIZE = 256               # compiled grammars kept (least recently used dropped)
FILL_THREADS = 4               # threads filling a large batch's bitmasks
# fewer matchers than this fill on the calling thread: waking the pool costs more than the
# fills (about 10 us each for a JSON schema, against 0.1-0.4 ms for a pool round trip)
THREADED_FILL_ROWS = 32
COMPACT = (",", ":")           # JSON separators: no whitespace between tokens
# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: "
_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarError(ValueError):
    """The grammar compiler rejected a spec: `kind` names the field, `detail` says why."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"structured_outputs.{kind} is invalid: {detail}")
        self.kind, self.detail = kind, detail


def import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError("structured outputs need xgrammar: pip install 'onespec[structured]'") \
            from None
    return xgrammar


def compiler_message(error: Exception) -> str:
    """The compiler's own words, without its source location and stack."""
    text = str(error).strip().split("\nStack trace")[0]
    return _LOCATION.sub("", text).strip()


class GrammarBackend:
    """Compiles StructuredOutputsParams for one tokenizer; thread-safe (the server compiles
    on its tokenizer thread while the engine thread creates matchers)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._xgr = None
        self._compiler = None
        self._fillers = None           # xgrammar BatchGrammarMatcher: one thread, a pool
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def _setup(self):
        with self._lock:
            if self._compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs need a tokenizer and this model has "
                                     "none")
                xgr = import_xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._fillers = (xgr.BatchGrammarMatcher(max_threads=1),
                                 xgr.BatchGrammarMatcher(max_threads=FILL_THREADS))
                self._xgr = xgr
        return self._xgr

    @property
    def xgr(self):
        return self._setup()

    def fill(self, matchers: list, bitmask, indices: list[int]):
        """Writes each matcher's next-token mask into row indices[i] of the host bitmask."""
        filler = self._fillers[len(matchers) >= THREADED_FILL_ROWS]
        filler.batch_fill_next_token_bitmask(matchers, bitmask, indices=indices)

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of params; a spec the compiler rejects raises ValueError
        with the compiler's message, naming the field."""
        self._setup()
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = self._compile(key)
        except Exception as e:      # the compiler raises RuntimeError (and its kin)
            raise GrammarError(key[0], compiler_message(e)) from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, key: tuple[str, str]):
        kind, text = key
        c = self._compiler
        if kind == "json":
            return c.compile_json_schema(text, any_whitespace=False, separators=COMPACT)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                         separators=COMPACT)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":       # JSON string literals are EBNF string literals
            return c.compile_grammar("root ::= " + " | ".join(
                json.dumps(s, ensure_ascii=False) for s in json.loads(text)))
        return c.compile_grammar(text)

    def matcher(self, params: StructuredOutputsParams):
        """A fresh GrammarMatcher for one request (ends at one of the stop tokens, or, for
        a model without any, as soon as the grammar is complete)."""
        compiled = self.compile(params)
        return self.xgr.GrammarMatcher(compiled,
                                       terminate_without_stop_token=not self.stop_token_ids)
