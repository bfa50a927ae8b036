"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("onespec.serve")

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               408: "invalid_request_error", 413: "invalid_request_error",
               500: "server_error", 503: "server_error"}
STATUS_CLIENT_CLOSED = 499                  # nginx's code: nobody reads it


class ClientGone(Exception):
    """The client closed the connection before its request was admitted; the argument
    says when (default: while its body was read)."""

UNION_FIELD_MESSAGES = {
    "prompt": "prompt must be a string, a list of token ids (ints), or a list of strings or "
              "of token-id lists",
    "stop": "stop must be a string or a list of strings",
    "messages": "messages must be a list of {role, content} objects with string content "
                "(or a list of text parts)",
}


class APIError(Exception):
    """An error answered to the client; status 400 unless said otherwise."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message,
                          "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def validation_error(errors) -> APIError:
    """The first pydantic (or FastAPI) error as an APIError."""
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return APIError(f"request body is not valid JSON: {err.get('msg', '')}")
    if not loc:
        return APIError(f"request body: {err.get('msg', 'invalid')}")
    field = loc[0]
    if err.get("type") == "missing":
        return APIError(f"missing required field '{'.'.join(loc)}'", param=field)
    if field in UNION_FIELD_MESSAGES:
        return APIError(UNION_FIELD_MESSAGES[field], param=field)
    return APIError(f"{'.'.join(loc)}: {err.get('msg', 'invalid value')}", param=field)


def install_error_handlers(app: FastAPI):
    """Every error the app can raise answers in the OpenAI shape (never FastAPI's 422)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        client = request.client
        when = exc.args[0] if exc.args else "before its request was read"
        logger.info("client disconnected %s (%s %s from %s)", when,
                    request.method, request.url.path,
                    f"{client.host}:{client.port}" if client else "?")
        return Response(status_code=STATUS_CLIENT_CLOSED)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        return validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return APIError(str(exc.detail), status=exc.status_code).response()

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("internal error while serving a request")
        return APIError(f"internal server error: {type(exc).__name__}: {exc}",
                        status=500).response()
