"""Errors in the OpenAI shape `{"error": {"message", "type", "param", "code"}}`: every failure goes through
`APIError` or the handlers `install_error_handlers` installs, so clients always see the same envelope."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# OpenAI's `type` values: client mistakes vs. our own failures.
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error to return to the client as-is (status + OpenAI error body)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": _utf8(message), "type": type,
                      "param": None if param is None else _utf8(param), "code": code}}


def _utf8(text: str) -> str:
    # Messages may quote the request (a field name, a model name); a lone surrogate from its JSON would
    # make the error body itself unencodable.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def internal_error(request_id: str, exc: BaseException) -> APIError:
    """A 500 for an unexpected exception: logged in full under the request id, which is all the body
    names (exception text can hold other requests' data or the server's internals)."""
    logger.error("request %s: internal server error", request_id, exc_info=exc)
    return APIError(500, f"internal server error; the server log has the details under request id "
                         f"{request_id}", code="internal_error")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # Union branches show up as loc entries like "list[int]": not part of the client's field path.
    parts = [p for p in parts if "[" not in p and not p.startswith(("function-", "tagged-union"))]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic errors -> one readable 400 naming the first offending field."""
    errors = list(exc.errors())
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return bad_request(f"invalid JSON body: {ctx.get('error', first.get('msg'))}")
    if first.get("type") in ("model_attributes_type", "dict_type") and not _loc_to_param(
            tuple(first.get("loc", ()))):
        return bad_request("the request body must be a JSON object (with Content-Type: application/json)")
    messages = []
    for err in errors[:3]:
        param = _loc_to_param(tuple(err.get("loc", ())))
        if err.get("type") == "extra_forbidden":
            msg = f"unknown field `{param}`" if param else "unknown field"
        elif err.get("type") == "missing":
            msg = f"`{param}` is required" if param else "a request body is required"
        else:
            msg = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        messages.append(msg)
    more = f" (and {len(errors) - 3} more errors)" if len(errors) > 3 else ""
    return bad_request("; ".join(messages) + more, param=_loc_to_param(tuple(first.get("loc", ()))))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404), wrong methods (405), ...: same envelope as everything else.
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return APIError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # One request's bug must not take the server down: log it and fail only this request.
        return internal_error(request_id_of(request), exc).response()


def request_id_of(request: Request) -> str:
    """The id the endpoint gave this request, or a new one (for errors raised before it had one)."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        rid = request.state.request_id = f"req-{uuid.uuid4().hex}"
    return rid
