"""The FastAPI app: routes, API-key check, request bodies, engine-loop lifespan."""
from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from onespec.serve.async_engine import EngineLoop
from onespec.serve.errors import APIError, ClientGone, install_error_handlers
from onespec.serve.limits import ServerLimits
from onespec.serve.metrics import CONTENT_TYPE, ServerMetrics
from onespec.serve.serving import OpenAIServing
from onespec.serve.stats_log import StatsLogger
from onespec.serve.worker_routes import add_worker_routes

# /health answers 503 while a request has been in admission (parsing, templating,
# tokenizing, compiling its grammar) this long: admission is stuck
ADMISSION_STUCK_S = 60.0
DEEP_HEALTH_TIMEOUT_S = 5.0        # /health?deep=1: the round trips must answer within this


def _api_key_check(api_keys: list[str], salt_per_key: bool):
    """A dependency answering 401 unless the request carries `Authorization: Bearer KEY`
    with one of api_keys (the scheme name in any case, as RFC 7235 says). It returns the
    request's prefix-cache salt: a digest of its key when salt_per_key, else None."""
    expected = [k.encode() for k in api_keys]

    async def check(request: Request) -> str | None:
        if not expected:
            return None
        got = request.headers.get("authorization")
        if got is None:
            raise APIError("missing API key: send 'Authorization: Bearer <key>'", status=401,
                           code="invalid_api_key")
        scheme, _, token = got.strip().partition(" ")
        token = token.strip().encode()
        # compare with every key, so the time taken does not say which one nearly matched
        matches = [secrets.compare_digest(token, k) for k in expected]
        if scheme.lower() != "bearer" or not any(matches):
            raise APIError("incorrect API key", status=401, code="invalid_api_key")
        return hashlib.sha256(b"onespec api key\0" + token).hexdigest()[:32] \
            if salt_per_key else None
    return check


# the first bytes of every body are not counted against max_inflight_body_bytes, so small
# requests are never refused for the big ones in flight
UNCOUNTED_BODY_BYTES = 64 << 10


class BodyReader:
    """Reads request bodies within the limits: at most max_request_body_bytes each (413),
    arriving within request_body_timeout seconds (408), and at most
    max_inflight_body_bytes held by all bodies being read or admitted together, past the
    first UNCOUNTED_BODY_BYTES of each (503)."""

    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self.inflight = 0

    @asynccontextmanager
    async def read(self, request: Request):
        """Yields the body; its bytes count as in flight until the block exits."""
        counted = [0]
        try:
            yield await asyncio.wait_for(self._read(request, counted),
                                         self.limits.request_body_timeout)
        except asyncio.TimeoutError:
            raise APIError(f"the request body did not arrive within "
                           f"{self.limits.request_body_timeout:g} s (--request-body-timeout)",
                           status=408, code="request_timeout") from None
        finally:
            self.inflight -= counted[0]

    async def _read(self, request: Request, counted: list[int]) -> bytes:
        limit = self.limits.max_request_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(f"{int(declared)} bytes", limit)
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(f"more than {limit} bytes", limit)
                more = max(0, size - UNCOUNTED_BODY_BYTES) - counted[0]
                if self.inflight + more > self.limits.max_inflight_body_bytes:
                    raise APIError("the server is reading too many large requests at once; "
                                   "try again", status=503, code="server_busy")
                self.inflight += more
                counted[0] += more
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
        return b"".join(chunks)


def _too_large(what: str, limit: int) -> APIError:
    return APIError(f"the request body has {what}; this server accepts at most {limit} "
                    "(--max-request-body-bytes)", status=413, code="request_too_large")


def create_app(llm, served_model_name: str, api_key: str | list[str] | None = None,
               max_request_body_bytes: int | None = None, limits: ServerLimits | None = None,
               cache_salt_per_api_key: bool = True, tool_call_parser: str | None = None,
               log_stats_interval: float | None = None) -> FastAPI:
    """An OpenAI-compatible app over `llm` (an onespec.LLM). Its lifespan starts the engine
    loop, so run it under an ASGI server (or `with TestClient(app)`). With API keys the
    /docs, /redoc and /openapi.json pages are off, and (cache_salt_per_api_key) each key
    has its own prefix-cache namespace. max_request_body_bytes overrides limits' value.
    tool_call_parser ("hermes", "llama3_json", "mistral"): reads tool calls of
    tool_choice "auto" from the model's output. log_stats_interval: seconds between the
    stats lines logged while there is work (None: none)."""
    limits = limits or ServerLimits()
    if max_request_body_bytes is not None:
        limits = ServerLimits(**{**limits.__dict__,
                                 "max_request_body_bytes": max_request_body_bytes})
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    loop = EngineLoop(llm.engine)
    metrics = ServerMetrics(llm.engine.max_draft_len)
    serving = OpenAIServing(loop, served_model_name, metrics, limits, tool_call_parser)
    stats_log = StatsLogger(loop, log_stats_interval) if log_stats_interval else None

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loop.start()
        stats_task = asyncio.create_task(stats_log.run()) if stats_log else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await loop.stop()
            serving.close()

    docs = {} if not api_keys else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="onespec", summary="OpenAI-compatible onespec server",
                  lifespan=lifespan, **docs)
    app.state.engine_loop, app.state.serving = loop, serving
    install_error_handlers(app)
    _add_status_routes(app, loop, serving, metrics)
    add_worker_routes(app, loop, serving, served_model_name, _deep_problems)
    _add_api_routes(app, serving, _api_key_check(api_keys, cache_salt_per_api_key),
                    BodyReader(limits))
    return app


def _add_status_routes(app: FastAPI, loop: EngineLoop, serving: OpenAIServing,
                       metrics: ServerMetrics):
    """/health (JSON, KV pool, queue and admission numbers) and /metrics (Prometheus);
    no API key."""

    @app.get("/health")
    async def health(deep: bool = False):
        snap = loop.snapshot
        oldest = serving.oldest_admission_s()
        problems = [] if loop.is_running else ["engine loop stopped"]
        if oldest > ADMISSION_STUCK_S:
            problems.append(f"a request has been in admission for {oldest:.0f} s")
        if deep and not problems:
            problems += await _deep_problems(loop, serving)
        pool = serving.compile_pool
        body = {"status": "; ".join(problems) or "ok",
                "kv_blocks_total": snap.num_blocks, "kv_blocks_free": snap.num_free_blocks,
                "num_requests_waiting": snap.num_waiting,
                "num_requests_running": snap.num_running,
                "num_requests_admitting": serving.num_admitting,
                "oldest_admission_s": round(oldest, 3),
                "num_grammar_compiles_running": pool.num_running if pool else 0}
        return JSONResponse(body, status_code=503 if problems else 200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(loop.snapshot), media_type=CONTENT_TYPE)


async def _deep_problems(loop: EngineLoop, serving: OpenAIServing) -> list[str]:
    """Round trips through an admission thread and the engine loop, each within
    DEEP_HEALTH_TIMEOUT_S."""
    problems = []
    for name, ping in (("admission threads", serving.ping_admission),
                       ("engine loop", loop.ping)):
        start = time.monotonic()
        try:
            await asyncio.wait_for(ping(), DEEP_HEALTH_TIMEOUT_S)
        except asyncio.TimeoutError:
            problems.append(f"the {name} did not answer within {DEEP_HEALTH_TIMEOUT_S:g} s")
        except Exception as e:     # noqa: BLE001 - the loop is gone: say so, do not raise
            problems.append(f"the {name} failed: {e} (after {time.monotonic() - start:.1f} s)")
    return problems


def _add_api_routes(app: FastAPI, serving: OpenAIServing, auth, bodies: BodyReader):
    engine = serving.loop.engine
    created = int(time.time())
    auth_only = [Depends(auth)]

    def model_card() -> dict:
        return {"id": serving.model_name, "object": "model", "created": created,
                "owned_by": "onespec", "max_model_len": engine.max_model_len,
                "speculative_max_draft_len": engine.max_draft_len}

    @app.get("/v1/models", dependencies=auth_only)
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=auth_only)
    async def retrieve_model(model: str):
        serving.check_model(model)
        return model_card()

    async def generate(request: Request, salt: str | None, chat: bool):
        async with bodies.read(request) as body:
            reply, stream = await serving.prepare(body, chat, request, salt)
        return await serving.serve(reply, request, stream)

    @app.post("/tokenize")
    async def tokenize(request: Request, _: str | None = Depends(auth)):
        async with bodies.read(request) as body:
            return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(request: Request, _: str | None = Depends(auth)):
        async with bodies.read(request) as body:
            return await serving.detokenize(body)

    @app.post("/v1/completions")
    async def completions(request: Request, salt: str | None = Depends(auth)):
        return await generate(request, salt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, salt: str | None = Depends(auth)):
        return await generate(request, salt, chat=True)
