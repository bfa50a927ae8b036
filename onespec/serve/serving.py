"""/v1/completions and /v1/chat/completions: prompt -> Job -> engine loop -> response.

Everything that can be rejected (model name, prompt, sampling fields, stop strings) is
checked before the request reaches the engine, so bad input answers 400 with nothing to
clean up. Once queued, a request is aborted as soon as its client goes away: a closed
stream cancels the SSE generator, a non-stream request is raced against a disconnect
watcher; either way the engine-loop generator's `finally` aborts and frees KV blocks.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, suppress
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from onespec.serve.async_engine import EngineError, EngineLoop
from onespec.serve.detokenize import IncrementalDetokenizer
from onespec.serve.errors import STATUS_CLIENT_CLOSED, APIError
from onespec.serve.metrics import ServerMetrics
from onespec.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from onespec.serve.responses import CHAT, COMPLETION, SSE_DONE, Job, sse
from onespec.structured.backend import GrammarError

DEFAULT_COMPLETION_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
# A text longer than max_model_len * (longest token in characters) * this has more tokens
# than max_model_len (normalizers such as NFC can merge up to three characters into one).
CHARS_PER_TOKEN_SLACK = 4
# A text longer than max_model_len * this many characters is first tokenized in part:
# if that part alone is over the limit (by a margin for the word cut at its end), it is
# rejected without tokenizing the rest.
PROBE_CHARS_PER_TOKEN = 8
PROBE_MARGIN_TOKENS = 64
# sampling fields a request may leave out, taken then from the model's generation config;
# without one there, temperature 1.0 (as OpenAI and vLLM)
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k")
DEFAULT_TEMPERATURE = 1.0


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


class AbortingStreamingResponse(StreamingResponse):
    """Closes its body iterator and calls on_close however the response ends, so a
    client gone mid-stream never leaves its request running (whatever the ASGI server)."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


async def wait_for_disconnect(request: Request):
    """Returns when the client closes the connection (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class OpenAIServing:
    def __init__(self, loop: EngineLoop, served_model_name: str, metrics: ServerMetrics):
        self.loop = loop
        engine = loop.engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model.config.vocab_size
        self.grammars = engine.grammars     # thread-safe: compiles on the tokenizer thread
        self.metrics = metrics
        self.defaults = generation_defaults(engine.config.model)
        self.max_prompt_chars = None if self.tokenizer is None else \
            self.max_model_len * longest_token_chars(self.tokenizer) * CHARS_PER_TOKEN_SLACK
        # parsing bodies, chat templates, tokenizing and compiling grammars run here, off the
        # event loop (the engine then finds each compiled grammar in the cache); one
        # thread, so two encodes never overlap (transformers may reset a fast tokenizer's
        # truncation settings before encoding, which another encode must not see)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="onespec-tokenize")

    async def prepare(self, body: bytes, chat: bool) -> tuple[Job, bool]:
        """Parses a request body and builds its job (with the prompt's token ids) on the
        tokenizer thread, so that a big prompt never holds up the event loop. Returns the
        job and whether the client asked for a stream."""
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, self._prepare, body, chat)

    def _prepare(self, body: bytes, chat: bool) -> tuple[Job, bool]:
        if chat:
            req = parse_body(ChatCompletionRequest, body)
            return self.chat_job(req), req.stream
        req = parse_body(CompletionRequest, body)
        return self.completion_job(req), req.stream

    # ---- requests -> jobs ----------------------------------------------------------------
    def check_model(self, name: str):
        if name != self.model_name:
            raise APIError(f"the model '{name}' does not exist; this server serves "
                           f"'{self.model_name}'", status=404, param="model",
                           code="model_not_found")

    def completion_job(self, req: CompletionRequest) -> Job:
        self.check_model(req.model)
        if isinstance(req.prompt, str):
            ids = self._encode(req.prompt, "prompt", self._tokenizer("text prompts", "prompt"))
        else:
            ids = list(req.prompt)
            if not all(0 <= t < self.vocab_size for t in ids):
                raise APIError(f"prompt token ids must be in [0, {self.vocab_size})",
                               param="prompt")
        self._check_prompt_length(ids, "prompt")
        return self._job(COMPLETION, req, ids, DEFAULT_COMPLETION_MAX_TOKENS)

    def chat_job(self, req: ChatCompletionRequest) -> Job:
        self.check_model(req.model)
        tok = self._tokenizer("chat completions", "messages")
        if not getattr(tok, "chat_template", None):
            raise APIError(f"the model '{self.model_name}' has no chat template; use "
                           "/v1/completions", param="messages")
        self._check_chars(sum(len(m.as_template_dict()["content"]) for m in req.messages),
                          "messages")
        try:
            text = tok.apply_chat_template([m.as_template_dict() for m in req.messages],
                                           add_generation_prompt=True, tokenize=False)
        except Exception as e:      # jinja2 errors: the template rejected the messages
            raise APIError(f"the chat template failed on these messages: {e}",
                           param="messages") from None
        ids = self._encode(text, "messages", tok, add_special_tokens=False)
        self._check_prompt_length(ids, "messages")
        return self._job(CHAT, req, ids, self.max_model_len - len(ids))

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
        if len(text) > probe:
            num = len(tok.encode(text[:probe], add_special_tokens=False))
            if num >= self.max_model_len + PROBE_MARGIN_TOKENS:
                raise self._too_long(f"more than {num - PROBE_MARGIN_TOKENS} tokens", param)
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

    def _job(self, kind: str, req, ids: list[int], default_max_tokens: int) -> Job:
        stop = req.stop_strings()
        if stop and self.tokenizer is None:
            raise APIError("stop strings need a tokenizer; use stop_token_ids", param="stop")
        structured, field = req.structured()
        sp = req.sampling_params(default_max_tokens, structured, self.defaults)
        if structured is not None:
            self._compile(structured, field)
        detok = IncrementalDetokenizer(self._decode, stop)
        return Job(kind, self.model_name, ids, sp, detok, return_token_ids=req.return_token_ids,
                   include_usage=req.include_usage())

    def _compile(self, structured, field: str):
        """Compiles the request's grammar here, so the engine finds it in the cache."""
        param = field.split(".")[0]
        try:
            self.grammars.compile(structured)
        except GrammarError as e:
            name = f"{field}.{e.kind}" if field == "structured_outputs" else field
            raise APIError(f"{name} is invalid: {e.detail}", param=param) from None
        except (ValueError, ImportError) as e:   # no tokenizer, or xgrammar not installed
            raise APIError(str(e), param=param) from None

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # ---- jobs -> responses ---------------------------------------------------------------
    async def serve(self, job: Job, request: Request, stream: bool) -> Response:
        try:
            queue = await self.loop.add(job.prompt_token_ids, job.sampling_params,
                                        job.request_id)
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            raise APIError(str(e), param=field if field == "stop_token_ids" else None) from None
        except EngineError as e:
            raise APIError(str(e), status=503) from None
        updates = self._advance(job, self.loop.updates(job.request_id, queue))
        if stream:
            return AbortingStreamingResponse(
                self._sse(job, updates), on_close=lambda: self.loop.abort(job.request_id),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._complete(job, updates, request)

    async def _advance(self, job: Job, updates) -> AsyncIterator[tuple[str, list[int]]]:
        """Yields (text delta, new token ids) per engine step until the job is finished;
        records the request in the metrics however it ends (with the times its tokens
        arrived, for the latency histograms)."""
        token_times: list[float] = []
        times = None
        try:
            async with aclosing(updates) as it:
                async for u in it:
                    if u.new_token_ids:
                        token_times.append(time.monotonic())
                    times = u.times
                    job.metrics = u.metrics
                    delta = job.detok.update(u.new_token_ids, u.finish_reason is not None)
                    job.finish_reason = "stop" if job.detok.stopped else u.finish_reason
                    yield delta, u.new_token_ids
                    if job.finish_reason is not None:
                        return          # a stop string: closing `updates` aborts the request
        finally:
            self.metrics.record_request(job.kind, job.finish_reason or "abort",
                                        len(job.prompt_token_ids), job.metrics, times,
                                        token_times, token_times[-1] if token_times else None)

    async def _complete(self, job: Job, updates, request: Request) -> Response:
        async def consume():
            async with aclosing(updates) as it:
                async for _ in it:
                    pass

        work = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watcher, work):
                if not task.done():
                    task.cancel()
                    with suppress(asyncio.CancelledError):
                        await task
        if work.cancelled():
            return Response(status_code=STATUS_CLIENT_CLOSED)
        if isinstance(work.exception(), EngineError):
            raise APIError(str(work.exception()), status=500)
        work.result()
        return JSONResponse(job.response())

    async def _sse(self, job: Job, updates) -> AsyncIterator[str]:
        if job.kind == CHAT:
            yield job.chunk("", role=True)
        try:
            async with aclosing(updates) as it:
                async for delta, token_ids in it:
                    if delta or job.finish_reason or (job.return_token_ids and token_ids):
                        yield job.chunk(delta, token_ids, job.finish_reason)
        except EngineError as e:
            yield sse(APIError(str(e), status=500).body())
        else:
            if job.include_usage:
                yield job.usage_chunk()
        yield SSE_DONE


def longest_token_chars(tokenizer) -> int:
    """The most characters any one token stands for (its vocabulary string: byte-level
    tokens spell one character per byte, so this bounds decoded characters too)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)
