"""The FastAPI app: routes, API-key check, engine-loop lifespan."""
from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from onespec.serve.async_engine import EngineLoop
from onespec.serve.errors import APIError, ClientGone, install_error_handlers
from onespec.serve.metrics import CONTENT_TYPE, ServerMetrics
from onespec.serve.serving import OpenAIServing
from onespec.serve.stats_log import StatsLogger

DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20


def _api_key_check(api_key: str | None):
    """A dependency answering 401 unless the request carries `Authorization: Bearer KEY`
    (the scheme name in any case, as RFC 7235 says)."""
    expected = (api_key or "").encode()

    async def check(request: Request):
        if api_key is None:
            return
        got = request.headers.get("authorization")
        if got is None:
            raise APIError("missing API key: send 'Authorization: Bearer <key>'", status=401,
                           code="invalid_api_key")
        scheme, _, token = got.strip().partition(" ")
        if scheme.lower() != "bearer" or \
                not secrets.compare_digest(token.strip().encode(), expected):
            raise APIError("incorrect API key", status=401, code="invalid_api_key")
    return check


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it is known to pass `limit` bytes: from its
    Content-Length before reading, else while reading (nothing more is buffered). A client
    gone mid-upload raises ClientGone."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(f"more than {limit} bytes", limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def _too_large(what: str, limit: int) -> APIError:
    return APIError(f"the request body has {what}; this server accepts at most {limit} "
                    "(--max-request-body-bytes)", status=413, code="request_too_large")


def create_app(llm, served_model_name: str, api_key: str | None = None,
               max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
               log_stats_interval: float | None = None) -> FastAPI:
    """An OpenAI-compatible app over `llm` (an onespec.LLM). Its lifespan starts the engine
    loop, so run it under an ASGI server (or `with TestClient(app)`). With an API key the
    /docs, /redoc and /openapi.json pages are off. log_stats_interval: seconds between
    the stats lines logged while there is work (None: none)."""
    if not (isinstance(max_request_body_bytes, int) and max_request_body_bytes >= 1):
        raise ValueError("max_request_body_bytes must be an integer >= 1, "
                         f"got {max_request_body_bytes!r}")
    loop = EngineLoop(llm.engine)
    metrics = ServerMetrics(llm.engine.max_draft_len)
    serving = OpenAIServing(loop, served_model_name, metrics)
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
            serving.executor.shutdown(wait=False)

    docs = {} if api_key is None else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="onespec", summary="OpenAI-compatible onespec server",
                  lifespan=lifespan, **docs)
    app.state.engine_loop, app.state.serving = loop, serving
    install_error_handlers(app)
    _add_status_routes(app, loop, metrics)
    _add_api_routes(app, serving, [Depends(_api_key_check(api_key))], max_request_body_bytes)
    return app


def _add_status_routes(app: FastAPI, loop: EngineLoop, metrics: ServerMetrics):
    """/health (JSON, KV pool and queue numbers) and /metrics (Prometheus); no API key."""

    @app.get("/health")
    async def health():
        snap = loop.snapshot
        body = {"status": "ok" if loop.is_running else "engine loop stopped",
                "kv_blocks_total": snap.num_blocks, "kv_blocks_free": snap.num_free_blocks,
                "num_requests_waiting": snap.num_waiting,
                "num_requests_running": snap.num_running}
        return JSONResponse(body, status_code=200 if loop.is_running else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(loop.snapshot), media_type=CONTENT_TYPE)


def _add_api_routes(app: FastAPI, serving: OpenAIServing, auth: list, max_body: int):
    engine = serving.loop.engine
    created = int(time.time())

    def model_card() -> dict:
        return {"id": serving.model_name, "object": "model", "created": created,
                "owned_by": "onespec", "max_model_len": engine.max_model_len,
                "speculative_max_draft_len": engine.max_draft_len}

    @app.get("/v1/models", dependencies=auth)
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=auth)
    async def retrieve_model(model: str):
        serving.check_model(model)
        return model_card()

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        job, stream = await serving.prepare(await read_body(request, max_body), chat=False)
        return await serving.serve(job, request, stream)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        job, stream = await serving.prepare(await read_body(request, max_body), chat=True)
        return await serving.serve(job, request, stream)
