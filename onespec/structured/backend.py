"""The grammar backend: xgrammar compiles a request's constraint once (cached by its spec)
and each request gets its own GrammarMatcher, which walks the tokens it emits."""
from __future__ import annotations

import threading
from collections import OrderedDict

from onespec.structured.compile_worker import (EMPTY_LANGUAGE, check_satisfiable,
                                               compile_spec, compiler_message)
from onespec.structured.params import StructuredOutputsParams

DEFAULT_CACHE_BYTES = 256 << 20  # compiled grammars kept (least recently used dropped)
FILL_THREADS = 4               # threads filling a large batch's bitmasks
# fewer matchers than this fill on the calling thread: waking the pool costs more than the
# fills (about 10 us each for a JSON schema, against 0.1-0.4 ms for a pool round trip)
THREADED_FILL_ROWS = 32


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


class GrammarBackend:
    """Compiles StructuredOutputsParams for one tokenizer; thread-safe (the server compiles
    on its tokenizer thread while the engine thread creates matchers)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_bytes = cache_bytes
        self._xgr = None
        self._info = None
        self._compiler = None
        self._fillers = None           # xgrammar BatchGrammarMatcher: one thread, a pool
        # spec key -> (compiled grammar, its size in bytes), least recently used first
        self._cache: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()
        self._cached_bytes = 0
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
                self._info = info
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

    def tokenizer_info_json(self) -> str:
        """The vocabulary as xgrammar serializes it (what a compile worker starts from)."""
        self._setup()
        return self._info.serialize_json()

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of params; a spec the compiler rejects, or one that admits
        no output, raises GrammarError naming the field."""
        compiled = self.cached(params)
        if compiled is not None:
            return compiled
        key = params.key()
        try:
            compiled = compile_spec(self._compiler, *key)
        except Exception as e:      # the compiler raises RuntimeError (and its kin)
            raise GrammarError(key[0], compiler_message(e)) from None
        if not check_satisfiable(self._xgr, compiled, self.stop_token_ids):
            raise GrammarError(key[0], EMPTY_LANGUAGE)
        return self._store(key, compiled)

    def cached(self, params: StructuredOutputsParams):
        """The compiled grammar of params if it is in the cache, else None."""
        self._setup()
        key = params.key()
        with self._lock:
            if key not in self._cache:
                return None
            self._cache.move_to_end(key)
            return self._cache[key][0]

    def add_serialized(self, params: StructuredOutputsParams, grammar_json: str):
        """Caches and returns a grammar a compile worker built for params."""
        compiled = self.xgr.CompiledGrammar.deserialize_json(grammar_json, self._info)
        return self._store(params.key(), compiled)

    def _store(self, key: tuple[str, str], compiled):
        size = compiled.memory_size_bytes
        with self._lock:
            if key in self._cache:
                self._cached_bytes -= self._cache.pop(key)[1]
            self._cache[key] = (compiled, size)
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                self._cached_bytes -= self._cache.popitem(last=False)[1][1]
        return compiled

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def matcher(self, params: StructuredOutputsParams, compiled=None):
        """A fresh GrammarMatcher for one request (ends at one of the stop tokens, or, for
        a model without any, as soon as the grammar is complete); `compiled`: its grammar
        when the caller has it already (the server compiles before the engine sees it)."""
        compiled = compiled if compiled is not None else self.compile(params)
        return self.xgr.GrammarMatcher(compiled,
                                       terminate_without_stop_token=not self.stop_token_ids)
