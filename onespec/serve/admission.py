"""Admission: a request body becomes a Reply of jobs, ready for the engine (prompts
tokenized, chat templates rendered, sampling fields checked, the grammar compiled).

Admission runs in three places, so that no request holds up any other: the event loop
only reads bodies (bounded in bytes and time, app.py); parsing, chat templates and
tokenizing run on `admission_threads` threads, after cheap checks on the raw JSON
(counts of messages and stop ids) have refused what is too big; grammar compiles run in
worker processes with a time limit, killed when their client goes away
(structured/compile_pool.py). Everything that can be rejected is rejected here, so bad
input answers 400 with nothing to clean up.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress

from fastapi import Request

from onespec.sampling_params import SamplingParams
from onespec.serve.async_engine import EngineLoop
from onespec.serve.detokenize import IncrementalDetokenizer
from onespec.serve.errors import APIError, ClientGone
from onespec.serve.limits import ServerLimits
from onespec.serve.protocol import (ChatCompletionRequest, CompletionRequest,
                                    DetokenizeRequest, TokenizeRequest, parse_body)
from onespec.serve.responses import CHAT, COMPLETION, Job, Reply
from onespec.serve.tools import PARSERS, ToolMode, forced_schema, tool_parser
from onespec.structured.compile_pool import (CompileBusy, CompileTimeout,
                                             GrammarCompilePool)
from onespec.structured.params import StructuredOutputsParams, spec_size

DEFAULT_COMPLETION_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
# A text longer than max_model_len * (longest token in characters) * this has more tokens
# than max_model_len (normalizers such as NFC can merge up to three characters into one).
CHARS_PER_TOKEN_SLACK = 4
# A text longer than max_model_len * this many characters is first tokenized in part:
# if that part alone is over the limit (by a margin for the word cut at its end), it is
# rejected without tokenizing the rest.
PROBE_CHARS_PER_TOKEN = 8
PROBE_MARGIN_TOKENS = 64
# one compiled grammar may take at most this share of the grammar cache's bytes
MAX_GRAMMAR_CACHE_SHARE = 4
# sampling fields a request may leave out, taken then from the model's generation config;
# without one there, temperature 1.0 (as OpenAI and vLLM)
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k")
DEFAULT_TEMPERATURE = 1.0


def _count_ints(body: bytes, key: bytes) -> int:
    """Entries of the array of integers under `key` in a JSON body (0 if it has none)."""
    found = re.search(rb'"' + key + rb'"\s*:\s*\[', body)
    if found is None:
        return 0
    end = body.find(b"]", found.end())
    items = body[found.end():end if end >= 0 else len(body)]
    return items.count(b",") + 1 if items.strip() else 0


def generation_defaults(model_dir: str) -> dict:
    """{temperature, top_p, top_k} from the model's generation_config.json, where it sets
    them; temperature 1.0 where it does not."""
    defaults = {}
    try:
        with open(os.path.join(model_dir, "generation_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict):
        defaults = {k: config[k] for k in GENERATION_DEFAULT_FIELDS
                    if isinstance(config.get(k), (int, float)) and
                    not isinstance(config.get(k), bool)}
    defaults.setdefault("temperature", DEFAULT_TEMPERATURE)
    return defaults



async def wait_for_disconnect(request: Request):
    """Returns when the client closes the connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def first_or_disconnect(work: asyncio.Future, request: Request) -> bool:
    """Waits for work unless the client goes away first (then work is cancelled); returns
    whether work finished."""
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (watcher, work):
            if not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
    return not work.cancelled()




class Admission:
    """The request side of the server (OpenAIServing adds the engine side)."""

    def __init__(self, loop: EngineLoop, served_model_name: str,
                 limits: ServerLimits | None = None, tool_call_parser: str | None = None):
        self.loop = loop
        engine = loop.engine
        self.tool_parser = None if tool_call_parser is None else tool_parser(tool_call_parser)
        self.eos_token_ids = set(engine.model.config.eos_token_ids)
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model.config.vocab_size
        self.limits = limits or ServerLimits()
        self.grammars = engine.grammars     # thread-safe: its cache is read on any thread
        self.grammars.cache_bytes = self.limits.grammar_cache_bytes
        self.compile_pool: GrammarCompilePool | None = None     # started on first use
        self.defaults = generation_defaults(engine.config.model)
        self.max_prompt_chars = None if self.tokenizer is None else \
            self.max_model_len * longest_token_chars(self.tokenizer) * CHARS_PER_TOKEN_SLACK
        self.executor = ThreadPoolExecutor(max_workers=self.limits.admission_threads,
                                           thread_name_prefix="onespec-admit")
        # transformers may reset a fast tokenizer's truncation settings before encoding,
        # which another encode must not see: one encode at a time
        self._encode_lock = threading.Lock()
        self._admitting: dict[int, float] = {}      # admission jobs under way: start times


    def close(self):
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.compile_pool is not None:
            self.compile_pool.close()

    @property
    def num_admitting(self) -> int:
        return len(self._admitting)

    def oldest_admission_s(self) -> float:
        """How long the oldest request still in admission has been there (0: none)."""
        starts = list(self._admitting.values())
        return time.monotonic() - min(starts) if starts else 0.0

    @contextmanager
    def _admission(self):
        token = object()
        self._admitting[id(token)] = time.monotonic()
        try:
            yield
        finally:
            del self._admitting[id(token)]

    async def ping_admission(self) -> None:
        """Returns once an admission thread has run a no-op (for /health?deep=1)."""
        await asyncio.get_running_loop().run_in_executor(self.executor, lambda: None)

    async def prepare(self, body: bytes, chat: bool, request: Request,
                      salt: str | None = None) -> tuple[Reply, bool]:
        """Parses a request body and builds its reply's jobs (the prompts' token ids, the
        compiled grammar) off the event loop. Returns the reply and whether the client asked
        for a stream. salt: the prefix-cache namespace of the request's API key, if any."""
        with self._admission():
            reply, stream, structured, field = \
                await asyncio.get_running_loop().run_in_executor(
                    self.executor, self._prepare, body, chat)
            if structured is not None:
                compiled = await self._compile(structured, field, request)
                for job in reply.jobs:
                    job.compiled_grammar = compiled
        if salt is not None:
            for job in reply.jobs:
                job.cache_salt = salt if job.cache_salt is None else f"{salt}:{job.cache_salt}"
        return reply, stream

    def _prepare(self, body: bytes, chat: bool):
        self._precheck(body, chat)
        if chat:
            req = parse_body(ChatCompletionRequest, body)
            self._check_count("messages", len(req.messages))
            reply, structured, field = self.chat_reply(req)
        else:
            req = parse_body(CompletionRequest, body)
            reply, structured, field = self.completion_reply(req)
        self._check_count("stop_token_ids", len(req.stop_token_ids or ()))
        return reply, req.stream, structured, field

    def _precheck(self, body: bytes, chat: bool):
        """Refuses, from the raw bytes, what is too big to parse into objects and template:
        a chat with too many messages, too many stop_token_ids. Counting bytes takes
        milliseconds for the largest body and, unlike parsing it, holds the interpreter
        lock too briefly to slow the engine's steps (which need it between kernels). The
        parsed request is counted again (_check_count): keys spelled with escapes pass
        here."""
        self._check_count("stop_token_ids", _count_ints(body, b"stop_token_ids"))
        if chat:     # every message has a "role" key ("role" in quotes: a key or a value)
            self._check_count("messages", body.count(b'"role"'))

    def _check_count(self, name: str, count: int):
        limit, flag = (self.limits.max_chat_messages, "--max-chat-messages") \
            if name == "messages" else (self.limits.max_stop_token_ids, "--max-stop-token-ids")
        if count > limit:
            raise APIError(f"{name} may hold at most {limit} entries on this server ({flag}), "
                           f"got {count}", param=name)

    # ---- requests -> jobs ----------------------------------------------------------------
    def check_model(self, name: str):
        if name != self.model_name:
            raise APIError(f"the model '{name}' does not exist; this server serves "
                           f"'{self.model_name}'", status=404, param="model",
                           code="model_not_found")

    def completion_reply(self, req: CompletionRequest):
        self.check_model(req.model)
        prompts = []
        for prompt in req.prompts():
            if isinstance(prompt, str):
                ids = self._encode(prompt, "prompt", self._tokenizer("text prompts", "prompt"))
            else:
                ids = list(prompt)
                if not all(0 <= t < self.vocab_size for t in ids):
                    raise APIError(f"prompt token ids must be in [0, {self.vocab_size})",
                                   param="prompt")
            self._check_prompt_length(ids, "prompt")
            prompts.append(ids)
        return self._reply(COMPLETION, req, prompts, DEFAULT_COMPLETION_MAX_TOKENS)

    def chat_reply(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        choice, tools = req.effective_tool_choice(), req.tool_dicts()
        text = self._render_chat(req.messages, add_generation_prompt=True, tools=tools)
        ids = self._encode(text, "messages", self.tokenizer, add_special_tokens=False)
        self._check_prompt_length(ids, "messages")
        mode, forced = None, None
        if choice == "auto":
            if self.tool_parser is None:
                raise APIError(
                    "tool_choice \"auto\" (the default with tools) needs a tool-call parser: "
                    "start the server with --enable-auto-tool-choice --tool-call-parser NAME "
                    f"({', '.join(PARSERS)}), or send tool_choice \"required\" or a named "
                    "function, which need none", param="tool_choice")
            mode = ToolMode(choice, tools, self.tool_parser)
        elif choice != "none":
            mode = ToolMode(choice, tools)
            forced = StructuredOutputsParams(
                json=forced_schema(tools, choice, req.parallel_tool_calls))
        return self._reply(CHAT, req, [ids], self.max_model_len - len(ids), mode, forced)

    def _render_chat(self, messages: list, add_generation_prompt: bool,
                     tools: list[dict] | None = None) -> str:
        """The messages (and tools) as the chat template renders them (checked for length
        first)."""
        tok = self._tokenizer("chat completions", "messages")
        if not getattr(tok, "chat_template", None):
            raise APIError(f"the model '{self.model_name}' has no chat template; use "
                           "/v1/completions", param="messages")
        self._check_chars(sum(len(m.as_template_dict()["content"]) for m in messages),
                          "messages")
        try:
            return tok.apply_chat_template([m.as_template_dict() for m in messages],
                                           tools=tools or None,
                                           add_generation_prompt=add_generation_prompt,
                                           tokenize=False)
        except Exception as e:      # jinja2 errors: the template rejected the messages
            raise APIError(f"the chat template failed on these messages: {e}",
                           param="messages") from None

    def _tokenizer(self, what: str, param: str):
        if self.tokenizer is None:
            raise APIError(f"{what} need a tokenizer and the model '{self.model_name}' has "
                           "none; send prompts as lists of token ids", param=param)
        return self.tokenizer

    def _encode(self, text: str, param: str, tok, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; a text that is certainly too long is rejected without
        tokenizing all of it (_check_chars, then a tokenized prefix)."""
        self._check_chars(len(text), param)
        probe = self.max_model_len * PROBE_CHARS_PER_TOKEN
        with self._encode_lock:
            if len(text) > probe:
                num = len(tok.encode(text[:probe], add_special_tokens=False))
                if num >= self.max_model_len + PROBE_MARGIN_TOKENS:
                    raise self._too_long(f"more than {num - PROBE_MARGIN_TOKENS} tokens",
                                         param)
            return tok.encode(text, add_special_tokens=add_special_tokens)

    def _check_chars(self, num_chars: int, param: str):
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise self._too_long(f"{num_chars} characters, too many for "
                                 f"{self.max_model_len} tokens of this model", param)

    def _too_long(self, what: str, param: str) -> APIError:
        return APIError(f"the prompt has {what}; this model's maximum context length is "
                        f"{self.max_model_len} tokens, so prompts must be at most "
                        f"{self.max_model_len - 1}", param=param, code="context_length_exceeded")

    def _check_prompt_length(self, ids: list[int], param: str):
        if not ids:
            raise APIError("the prompt is empty", param=param)
        if len(ids) >= self.max_model_len:
            raise self._too_long(f"{len(ids)} tokens", param)

    def _reply(self, kind: str, req, prompts: list[list[int]], default_max_tokens: int,
               tools: ToolMode | None = None, forced: StructuredOutputsParams | None = None):
        """(the Reply: n jobs per prompt, its structured-output spec or None, the field that
        gave the spec). Sample s of a seeded request uses seed + s (wrapped to int64), so
        n = 1 decodes exactly as before and every sample is reproducible. forced: the
        schema of a forced tool choice."""
        stop = req.stop_strings()
        if stop and self.tokenizer is None:
            raise APIError("stop strings need a tokenizer; use stop_token_ids", param="stop")
        structured, field = req.structured()
        if forced is not None:
            if structured is not None:
                raise APIError(f"{field.split('.')[0]} and a forced tool_choice both constrain "
                               "the output: send one of them", param="tool_choice")
            structured, field = forced, "tool_choice"
        sp = req.sampling_params(default_max_tokens, structured, self.defaults)
        if structured is not None:
            self._check_spec(structured, field)
        n = req.num_decoded
        # a parser reads markers that may be special tokens: keep them in the text
        decode = self._decode_keeping_markers if tools and tools.parser else self._decode
        ranked = n > req.num_samples     # best_of: samples ranked by their log-probability
        scored = dataclasses.replace(sp, logprobs=sp.logprobs or 0) if ranked else sp
        jobs = [Job(ids, sample_params(scored, s), IncrementalDetokenizer(decode, stop),
                    index=p * n + s, counts_prompt=s == 0, cache_salt=req.cache_salt)
                for p, ids in enumerate(prompts) for s in range(n)]
        echo = kind == COMPLETION and req.echo
        reply = Reply(kind, self.model_name, jobs, return_token_ids=req.return_token_ids,
                      include_usage=req.include_usage(),
                      continuous_usage=req.continuous_usage(), tools=tools,
                      logprobs=sp.logprobs, echo=echo, echo_only=echo and req.echo_only,
                      num_samples=n, num_returned=req.num_samples,
                      token_text=self._token_text,
                      prompt_text=[self._decode(ids) if isinstance(p, list) else p
                                   for p, ids in zip(req.prompts(), prompts)] if echo else [])
        return reply, structured, field

    def _check_spec(self, structured: StructuredOutputsParams, field: str):
        """Refuses, before any compile, a spec this server would not run or that is too big."""
        param = field.split(".")[0]
        try:
            self.loop.engine.check_structured_outputs()
            self.grammars.xgr             # xgrammar installed, a tokenizer to compile for
        except (ValueError, ImportError) as e:
            raise APIError(str(e), param=param) from None
        chars, alternatives = spec_size(structured)
        if chars > self.limits.max_grammar_chars:
            raise APIError(f"{field} has {chars} characters; this server compiles specs of at "
                           f"most {self.limits.max_grammar_chars} (--max-grammar-chars)",
                           param=param)
        if alternatives > self.limits.max_grammar_alternatives:
            raise APIError(f"{field} has {alternatives} enum values or choices; this server "
                           f"compiles specs with at most {self.limits.max_grammar_alternatives} "
                           "(--max-grammar-alternatives)", param=param)

    async def _compile(self, structured: StructuredOutputsParams, field: str,
                       request: Request):
        """The request's compiled grammar: from the cache, or compiled in a worker process
        raced against the time limit and the client's disconnect."""
        compiled = self.grammars.cached(structured)
        if compiled is not None:
            return compiled
        if self.compile_pool is None:
            info = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.grammars.tokenizer_info_json)
            if self.compile_pool is None:
                self.compile_pool = GrammarCompilePool(
                    info, self.limits.grammar_compile_workers,
                    self.limits.grammar_compile_timeout,
                    self.limits.grammar_cache_bytes // MAX_GRAMMAR_CACHE_SHARE)
        kind, text = structured.key()
        param = field.split(".")[0]
        name = f"{field}.{kind}" if field == "structured_outputs" else field
        work = asyncio.ensure_future(self.compile_pool.compile(kind, text))
        if not await first_or_disconnect(work, request):
            raise ClientGone("while its grammar compiled")
        try:
            status, payload = work.result()
        except CompileTimeout:
            raise APIError(f"{name} did not compile within {self.limits.grammar_compile_timeout:g}"
                           " s (--grammar-compile-timeout); simplify the spec", param=param,
                           code="grammar_too_complex") from None
        except CompileBusy:
            raise APIError("every grammar compile worker stayed busy for "
                           f"{self.limits.grammar_compile_timeout:g} s; try again", status=503,
                           code="server_busy") from None
        if status != "ok":
            raise APIError(f"{name} is invalid: {payload}", param=param)
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, self.grammars.add_serialized, structured, payload)

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _token_text(self, token: int) -> str:
        """One token's text (log-probability entries name tokens by it)."""
        if self.tokenizer is None:
            return str(token)
        return self.tokenizer.decode([token])

    def _decode_keeping_markers(self, token_ids: list[int]) -> str:
        """The text with special tokens (a parser's markers such as [TOOL_CALLS]), less
        the end-of-sequence tokens."""
        kept = [t for t in token_ids if t not in self.eos_token_ids]
        return self.tokenizer.decode(kept, skip_special_tokens=False)

    # ---- /tokenize and /detokenize ----------------------------------------------------------
    async def tokenize(self, body: bytes) -> dict:
        return await self._on_admission_thread(self._tokenize, body)

    def _tokenize(self, body: bytes) -> dict:
        req = parse_body(TokenizeRequest, body)
        if req.model is not None:
            self.check_model(req.model)
        if req.prompt is not None:
            ids = self._encode(req.prompt, "prompt", self._tokenizer("text prompts", "prompt"),
                               add_special_tokens=req.add_special_tokens)
        else:
            self._precheck(body, chat=True)
            text = self._render_chat(req.messages, req.add_generation_prompt)
            ids = self._encode(text, "messages", self.tokenizer, add_special_tokens=False)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    async def detokenize(self, body: bytes) -> dict:
        return await self._on_admission_thread(self._detokenize, body)

    async def _on_admission_thread(self, fn, body: bytes) -> dict:
        with self._admission():
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, body)

    def _detokenize(self, body: bytes) -> dict:
        req = parse_body(DetokenizeRequest, body)
        if req.model is not None:
            self.check_model(req.model)
        tok = self._tokenizer("detokenizing", "tokens")
        if not all(0 <= t < self.vocab_size for t in req.tokens):
            raise APIError(f"tokens must be token ids in [0, {self.vocab_size})",
                           param="tokens")
        return {"prompt": tok.decode(req.tokens)}


def sample_params(sp: SamplingParams, s: int) -> SamplingParams:
    """The SamplingParams of sample s of a request (seed + s, wrapped to int64)."""
    if s == 0 or sp.seed is None:
        return sp
    seed = (sp.seed + s + 2**63) % 2**64 - 2**63
    return dataclasses.replace(sp, seed=seed)


def longest_token_chars(tokenizer) -> int:
    """The most characters any one token stands for (its vocabulary string: byte-level
    tokens spell one character per byte, so this bounds decoded characters too)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)
