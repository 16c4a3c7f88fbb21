"""HTTP errors: one JSON shape for every route, and body parsing that reports the bad field.

Every error body is OpenAI's shape, which SGLang clients also read::

    {"error": {"message": "...", "type": "invalid_request_error", "code": 400, "param": "field"}}
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from phloem.runtime.errors import InvalidRequest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable",
    500: "internal_error",
}


class ApiError(Exception):
    """An error that becomes an HTTP response with the shared error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _ERROR_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, type_=self.type)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, *, param: str | None = None, type_: str | None = None) -> dict:
    type_ = type_ or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": type_, "code": status, "param": param}}


def from_invalid_request(exc: InvalidRequest) -> ApiError:
    field = getattr(exc, "field", None)
    message = getattr(exc, "message", None) or str(exc)
    if field and field not in message:
        message = f"{field}: {message}"
    return ApiError(400, message, param=field or None)


# ---- pydantic errors -> the field they are about --------------------------------------------------
# Union members and validator wrappers appear in error locations ("text", "list[str]", 0); they are
# not field names, so they are dropped from what the client sees.
_TAG = re.compile(
    r"^(str|int|float|bool|dict|list|none|function-.*|constrained-.*|tagged-union.*|"
    r"literal.*|json-or-python.*|lax-or-strict.*)(\[.*\])?$|.*\[.*\]|^[A-Z]\w*$"
)


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    return [str(p) for p in loc if isinstance(p, int) or not _TAG.match(str(p))]


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """The first pydantic error as a 400 naming its field (``param`` is the top-level field)."""
    if not errors:
        return ApiError(400, "invalid request body")
    err = errors[0]
    loc = tuple(p for p in err.get("loc", ()) if p != "body")
    if err.get("type") == "json_invalid":
        return ApiError(400, f"malformed JSON body: {err.get('msg', '')}", param=None)
    path = _field_path(loc)
    if not path:
        return ApiError(400, f"request body: {err.get('msg', 'invalid')}")
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        msg = "field required"
    return ApiError(400, f"{'.'.join(path)}: {msg}", param=path[0])


async def parse_body(request: Request, model: type[M]) -> M:
    """Validate the JSON body against ``model``; any problem is an ``ApiError`` 400."""
    raw = await request.body()
    if not raw.strip():
        raw = b"{}"
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


# ---- handlers ------------------------------------------------------------------------------------
def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(InvalidRequest, _on_invalid_request)
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(Exception, _on_unexpected)


def _refused(request: Request, err: ApiError) -> JSONResponse:
    """The error's response, and one log line an operator can see (the client gets the same text)."""
    logger.warning(
        "refused %s %s: %d %s", request.method, request.url.path, err.status, str(err.message)[:300]
    )
    return err.response()


async def _on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _refused(request, exc)


async def _on_invalid_request(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidRequest)
    return _refused(request, from_invalid_request(exc))


async def _on_request_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return _refused(request, from_validation_errors(list(exc.errors())))


async def _on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    return _refused(request, ApiError(exc.status_code, message))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    """An engine fault: the traceback goes to the server log, the client gets no internals."""
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return ApiError(500, "internal error").response()
