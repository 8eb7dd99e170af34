"""Every error the server sends is JSON in the shape of the API that was called.

OpenAI's {"error": {"message", "type", "param", "code"}} by default; Anthropic's {"type": "error",
"error": {"type", "message"}} under /v1/messages; Ollama's {"error": "..."} under /api/. The path alone
picks the shape (`error_body_for`), so route code, the exception handlers and the middleware all raise
or send one APIError. Bad input is a 4xx with a message that says what to change; only a bug in runlm
may give a 500, and even that is JSON in the same shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runlm.engine import QueueFullError
from runlm.engine.grammar import GrammarUnavailableError
from runlm.engine.scheduler import ReplicaLostError, SchedulerClosedError
from runlm.errors import (
    CatalogError,
    ContextOverflowError,
    DownloadError,
    InvalidInputError,
    ModelAccessError,
    ModelNotFoundError,
    RunlmError,
    TokenizerError,
    UnsupportedOperationError,
)

log = logging.getLogger("runlm.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 500: "server_error",
          501: "server_error", 502: "server_error"}


class APIError(Exception):
    """An HTTP error with OpenAI fields, raised by route code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or _TYPES.get(status, "invalid_request_error")
        self.headers = headers


def _clean(text: str | None) -> str | None:
    """Error text may quote client input; lone surrogates in it would make the JSON unencodable."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> dict:
    return {"error": {"message": _clean(message), "type": type_ or _TYPES.get(status, "invalid_request_error"),
                      "param": _clean(param), "code": code}}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(err: APIError) -> dict:
    """Anthropic's error shape (also the data of a stream's `error` event)."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(err.status, "api_error"),
                                       "message": _clean(err.message)}}


def ollama_error_body(err: APIError) -> dict:
    return {"error": _clean(err.message)}


def openai_error_body(err: APIError) -> dict:
    return error_body(err.status, err.message, err.param, err.code, err.type)


# Path prefix -> the error shape of the API served there; anything else is OpenAI-shaped.
ERROR_SHAPES = (("/v1/messages", anthropic_error_body), ("/api/", ollama_error_body))


def error_body_for(path: str, err: APIError) -> dict:
    """The error body in the shape of the API that `path` belongs to."""
    shape = next((shape for prefix, shape in ERROR_SHAPES if path.startswith(prefix)), openai_error_body)
    return shape(err)


def shaped_error_response(path: str, err: APIError) -> JSONResponse:
    return JSONResponse(error_body_for(path, err), status_code=err.status, headers=err.headers)


def api_error_from(exc: BaseException) -> APIError:
    """Map runlm's exceptions onto HTTP statuses."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="server_busy", headers={"Retry-After": "1"})
    if isinstance(exc, SchedulerClosedError):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, ReplicaLostError):
        return APIError(503, str(exc), code="replica_lost", headers={"Retry-After": "1"})
    if isinstance(exc, GrammarUnavailableError):
        return APIError(501, str(exc), param="response_format", code="not_implemented")
    if isinstance(exc, InvalidInputError):
        param = str(exc).split(":", 1)[0] if ":" in str(exc) and " " not in str(exc).split(":", 1)[0] else None
        return APIError(400, str(exc), param=param, code="invalid_value")
    if isinstance(exc, TokenizerError | UnsupportedOperationError):
        return APIError(400, str(exc), code="invalid_value")
    if isinstance(exc, ModelNotFoundError):
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ModelAccessError):
        return APIError(403, str(exc), param="model", code="model_access_denied")
    if isinstance(exc, DownloadError):  # the model's host, or the way to it, failed: not the request
        return APIError(502, str(exc), code="download_failed")
    if isinstance(exc, CatalogError):  # a name that means several files, a repo missing parts of a split model
        return APIError(400, str(exc), param="model", code="invalid_value")
    if isinstance(exc, RunlmError):
        return APIError(500, f"internal error: {exc}", code="internal_error")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}


def _loc(loc: tuple) -> str:
    """Field path of a validation error, without pydantic's union-member tags ('constrained-str'...)."""
    parts = []
    for p in loc:
        if p == "body":
            continue
        if isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p or p[:1].isupper()):
            continue
        parts.append(str(p))
    return ".".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if not errors:
            return shaped_error_response(request.url.path, APIError(400, "invalid request body"))
        first = errors[0]
        param = _loc(tuple(first.get("loc", ()))) or None
        kind = first.get("type", "")
        if kind == "json_invalid":
            message = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})"
            param = None
        elif kind == "missing" and not param:
            message = "the request body is missing: send a JSON object"
        elif kind == "missing":
            message = f"{param}: required field is missing"
        else:
            message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid")
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return shaped_error_response(request.url.path, APIError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return shaped_error_response(request.url.path,
                                     APIError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return shaped_error_response(request.url.path, exc)

    @app.exception_handler(RunlmError)
    async def _runlm(request: Request, exc: RunlmError) -> JSONResponse:
        return shaped_error_response(request.url.path, api_error_from(exc))

    @app.exception_handler(Exception)
    async def _any(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return shaped_error_response(request.url.path, api_error_from(exc))
