"""The FastAPI app: routes, API-key check, engine-loop lifespan."""
from __future__ import annotations

import secrets
import time
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from onespec.serve.async_engine import EngineLoop
from onespec.serve.errors import APIError, install_error_handlers
from onespec.serve.metrics import CONTENT_TYPE, ServerMetrics
from onespec.serve.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from onespec.serve.serving import OpenAIServing


def _api_key_check(api_key: str | None):
    """A dependency answering 401 unless the request carries `Authorization: Bearer KEY`."""
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request):
        if api_key is None:
            return
        got = request.headers.get("authorization")
        if got is None:
            raise APIError("missing API key: send 'Authorization: Bearer <key>'", status=401,
                           code="invalid_api_key")
        if not secrets.compare_digest(got.encode(), expected):
            raise APIError("incorrect API key", status=401, code="invalid_api_key")
    return check


def create_app(llm, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """An OpenAI-compatible app over `llm` (an onespec.LLM). Its lifespan starts the engine
    loop, so run it under an ASGI server (or `with TestClient(app)`)."""
    loop = EngineLoop(llm.engine)
    metrics = ServerMetrics(llm.engine.max_draft_len)
    serving = OpenAIServing(loop, served_model_name, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        loop.start()
        try:
            yield
        finally:
            await loop.stop()

    app = FastAPI(title="onespec", summary="OpenAI-compatible onespec server",
                  lifespan=lifespan)
    app.state.engine_loop, app.state.serving = loop, serving
    install_error_handlers(app)
    _add_status_routes(app, loop, metrics)
    _add_api_routes(app, serving, [Depends(_api_key_check(api_key))])
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


def _add_api_routes(app: FastAPI, serving: OpenAIServing, auth: list):
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
        req = parse_body(CompletionRequest, await request.body())
        return await serving.serve(serving.completion_job(req), request, req.stream)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        req = parse_body(ChatCompletionRequest, await request.body())
        return await serving.serve(serving.chat_job(req), request, req.stream)
