"""The one error envelope of both apps: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause maps to a 4xx naming the offending field; handlers never let
an exception escape as a bare 500. The server and the router answer the same bad request with
the same body.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match


class ErrorType(enum.Enum):
    """OpenAI's error `type` strings, with the HTTP status each one carries."""

    INVALID_REQUEST = ("invalid_request_error", 400)
    AUTHENTICATION = ("authentication_error", 401)
    PERMISSION = ("permission_error", 403)
    NOT_FOUND = ("not_found_error", 404)
    METHOD_NOT_ALLOWED = ("method_not_allowed", 405)
    CONFLICT = ("conflict_error", 409)
    REQUEST_TOO_LARGE = ("request_too_large", 413)
    RATE_LIMIT = ("rate_limit_exceeded", 429)
    INTERNAL = ("internal_error", 500)
    # The router's worker failed in a way the client cannot fix.
    BAD_GATEWAY = ("upstream_error", 502)
    UNAVAILABLE = ("service_unavailable", 503)

    @property
    def type_name(self) -> str:
        return self.value[0]

    @property
    def status_code(self) -> int:
        return self.value[1]

    @classmethod
    def from_status(cls, status_code: int) -> ErrorType:
        for member in cls:
            if member.status_code == status_code:
                return member
        return cls.INVALID_REQUEST if status_code < 500 else cls.INTERNAL


class APIError(Exception):
    """Raised anywhere in a handler; becomes the OpenAI error response."""

    def __init__(
        self,
        error_type: ErrorType,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type.type_name,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(
            self.body(), status_code=self.error_type.status_code, headers=self.headers
        )


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="OpenAI's error type, e.g. invalid_request_error")
    param: str | None = Field(description="the request field at fault, e.g. messages[0].role")
    code: str | None


class ErrorBody(BaseModel):
    """The envelope (`APIError.body()`), for the OpenAPI document."""

    error: ErrorDetail


OnError = Callable[[APIError, str], None]


def invalid(param: str | None, message: str) -> APIError:
    return APIError(ErrorType.INVALID_REQUEST, message, param)


def _param_from_loc(loc: Sequence[str | int]) -> str | None:
    """pydantic's error location to OpenAI's param spelling: ("body", "messages", 0, "role")
    becomes "messages[0].role"."""
    param = ""
    for part in loc:
        if part == "body" and not param:
            continue
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _is_type_tag(part):
            param += f".{part}" if param else str(part)
    return param or None


def _field_parts(loc: Sequence[str | int]) -> list[str | int]:
    return [p for p in loc if p != "body" and not (isinstance(p, str) and _is_type_tag(p))]


def _is_type_tag(part: str) -> bool:
    # pydantic names union members in locations ("str", "list[int]", "constrained-str",
    # "function-after[...]"); our field names are identifiers.
    return part in {"str", "int", "float", "bool", "list", "dict"} or not part.isidentifier()


def _validation_error(exc: RequestValidationError) -> APIError:
    """The most specific pydantic error about the first bad field, phrased for a client.

    A union field reports one error per member. The member whose type matched (its error is
    not a type mismatch, e.g. a list too long rather than "not a string"), and within it the
    deepest location, is the one that tells the client what to fix."""
    errors = exc.errors()
    if not errors:
        return invalid(None, "invalid request body")
    field = _field_parts(errors[0].get("loc", ()))[:1]
    same_field = [e for e in errors if _field_parts(e.get("loc", ()))[:1] == field]
    first = max(
        same_field,
        key=lambda e: (
            not e.get("type", "").endswith("_type"),
            len(_field_parts(e.get("loc", ()))),
        ),
    )
    if first.get("type") == "json_invalid":
        return invalid(None, f"request body is not valid JSON: {first.get('msg')}")
    param = _param_from_loc(first.get("loc", ()))
    message = first.get("msg", "invalid value")
    if param is None:
        return invalid(None, f"request body: {message}")
    return invalid(param, f"{param}: {message}")


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette's 405 names only the first
    route's, e.g. GET of GET /workers when POST /workers exists too)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


def install_handlers(app, on_error: OnError) -> None:
    """Route every exception class a request can raise to an OpenAI error response.

    `on_error(error, path)` is called for each error response (metrics, logging)."""

    def respond(request: Request, error: APIError) -> JSONResponse:
        on_error(error, request.url.path)
        return error.response()

    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc)

    async def request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, _validation_error(exc))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = ErrorType.from_status(exc.status_code)
        headers = exc.headers
        if error_type is ErrorType.METHOD_NOT_ALLOWED:
            headers = {**(headers or {}), "Allow": ", ".join(_allowed_methods(request))}
        return respond(request, APIError(error_type, str(exc.detail), headers=headers))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return respond(
            request, APIError(ErrorType.INTERNAL, f"internal error: {type(exc).__name__}")
        )

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
