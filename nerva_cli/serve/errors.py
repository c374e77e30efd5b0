"""Errors a client gets: one object, in the shape of the API it called. /v1 speaks OpenAI's
(`{"error": {"message", "type", "param", "code"}}`), everything else ollama's (`{"error": "..."}`)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

# OpenAI's error types by status, as its API returns them
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                 503: "server_overloaded"}
RETRY_AFTER_S = 1  # what a 503 for a full queue says: a slot frees when any answer ends


class ApiError(Exception):
    """A request refused or failed, with its HTTP status; the message is the whole report."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def body(self, openai: bool) -> dict:
        if not openai:
            return {"error": self.message}
        kind = _OPENAI_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, code=code, param=param)


def overloaded() -> ApiError:
    return ApiError(503, "the server is busy: every slot is taken and the queue is full; retry shortly",
                    code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})


def speaks_openai(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def error_response(path: str, err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(speaks_openai(path)), status_code=err.status, headers=err.headers)


async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error_response(request.url.path, exc)


async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, a method the route does not take) in the API's shape."""
    message = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(request.url.path, ApiError(exc.status_code, message, headers=dict(exc.headers or {})))


async def on_bug(request: Request, exc: Exception) -> JSONResponse:
    """A fault of the server's, not the client's: a generic 500 for the client (nothing of the
    server's insides), the traceback for whoever runs it (Starlette re-raises it to uvicorn's log)."""
    return error_response(request.url.path, ApiError(500, "internal server error (the server's log has the details)"))
