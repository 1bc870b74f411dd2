"""The published OpenAPI document says what each route answers, and nothing it never sends.

A route declares its own answers (`answers(...)`: its success and the errors its handler can
raise); `document_front_door` adds what the front door does to every route: 400 for a request
that fails validation (replacing FastAPI's 422, which is never sent), 413 on bodies over the
limit, and 401 plus the Bearer scheme on the key-protected paths. Errors are the one envelope
(`ErrorBody`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from pdserve.api.errors import ErrorBody, ErrorType
from pdserve.api.protocol import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
)

_ERROR_NOTES = {
    ErrorType.INVALID_REQUEST: "invalid request: `error.param` names the field",
    ErrorType.AUTHENTICATION: "missing or wrong API key (`Authorization: Bearer KEY`)",
    ErrorType.PERMISSION: "the key is right but this deployment does not allow the action",
    ErrorType.NOT_FOUND: "`error.param` names what does not exist",
    ErrorType.CONFLICT: "`error.param` names the field that conflicts",
    ErrorType.REQUEST_TOO_LARGE: "the body exceeds the server's --max-body-bytes",
    ErrorType.RATE_LIMIT: "the waiting queue is full; retry after `Retry-After` seconds",
    ErrorType.INTERNAL: "the engine failed the request",
    ErrorType.BAD_GATEWAY: "no worker could take the request",
    ErrorType.UNAVAILABLE: "the engine is stopping, or no worker is healthy",
}
_ERROR_HEADERS = {
    ErrorType.AUTHENTICATION: {"WWW-Authenticate": "Bearer"},
    ErrorType.RATE_LIMIT: {"Retry-After": "whole seconds"},
}
_SECURITY_SCHEME = "bearer"
# A generation endpoint's answer and its stream's events.
_GENERATION_ANSWERS = {
    COMPLETIONS: (CompletionResponse, CompletionChunk),
    CHAT_COMPLETIONS: (ChatCompletionResponse, ChatCompletionChunk),
}
# What a generation request meets at a server besides a bad body: an unknown model, a full
# queue, a failed request, a stopped engine. The router relays all four.
GENERATION_ERRORS = (
    ErrorType.NOT_FOUND,
    ErrorType.RATE_LIMIT,
    ErrorType.INTERNAL,
    ErrorType.UNAVAILABLE,
)
_REF = "#/components/schemas/"


def error_answer(error_type: ErrorType) -> dict[str, Any]:
    answer: dict[str, Any] = {"model": ErrorBody, "description": _ERROR_NOTES[error_type]}
    headers = _ERROR_HEADERS.get(error_type)
    if headers:
        answer["headers"] = {
            name: {"description": note, "required": True, "schema": {"type": "string"}}
            for name, note in headers.items()
        }
    return answer


def json_answer(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"model": model, "description": description}


def generation_route(path: str, *errors: ErrorType) -> dict[str, Any]:
    """``app.post(**generation_route(path, ...))``: a generation endpoint, its answer (JSON
    or streamed) and `errors` documented."""
    ok = _generation_answer(*_GENERATION_ANSWERS[path])
    return {"path": path, "response_model": None, "responses": answers({200: ok}, *errors)}


def _generation_answer(model: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    """200 of a generation endpoint: one JSON body, or (``stream: true``) server-sent events:
    `chunk`s, an error envelope if the request fails after its stream began, then ``[DONE]``.
    In Open API 3.1 an event stream's schema describes one event."""
    chunk_schema = chunk.model_json_schema(ref_template=_REF + "{model}")
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [chunk_schema, {"$ref": _REF + "ErrorBody"}]},
            },
        ]
    }
    return {
        "model": model,
        "description": "the answer; with `stream: true`, server-sent events instead",
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {"event": {"const": "message"}, "data": data},
                }
            }
        },
    }


def answers(ok: dict[int, dict[str, Any]], *errors: ErrorType) -> dict[int | str, dict[str, Any]]:
    """A route's ``responses=``: its successes and the errors its handler can raise."""
    return {**ok, **{e.status_code: error_answer(e) for e in errors}}


def document_front_door(app: FastAPI, *, protected_prefixes: Sequence[str] | None) -> None:
    """Patch `app.openapi` to add the front door's answers to every route (see the module
    docstring); `protected_prefixes` None: no API key is required."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _add_front_door(build(), protected_prefixes)  # `build` caches what it returns
        return app.openapi_schema

    app.openapi = openapi


def _add_front_door(document: dict[str, Any], protected_prefixes: Sequence[str] | None) -> None:
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    envelope = ErrorBody.model_json_schema(ref_template=_REF + "{model}")
    schemas.update(envelope.pop("$defs"), ErrorBody=envelope)
    _hoist_definitions(document["paths"], schemas)
    for path, item in document["paths"].items():
        for operation in item.values():
            responses = operation["responses"]
            responses.pop("422", None)
            extra = []
            if _can_fail_validation(operation):
                extra.append(ErrorType.INVALID_REQUEST)
            if "requestBody" in operation:
                extra.append(ErrorType.REQUEST_TOO_LARGE)
            if protected_prefixes is not None and path.startswith(tuple(protected_prefixes)):
                extra.append(ErrorType.AUTHENTICATION)
                operation["security"] = [{_SECURITY_SCHEME: []}]
            for error_type in extra:
                responses[str(error_type.status_code)] = _rendered_error(error_type)
            operation["responses"] = dict(sorted(responses.items()))
    if protected_prefixes is not None:
        components["securitySchemes"] = {_SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}}


def _hoist_definitions(node: Any, schemas: dict[str, Any]) -> None:
    """Move the `$defs` of schemas FastAPI did not render (the stream events') into
    components, where their references (`_REF`) point."""
    if isinstance(node, dict):
        for name, definition in node.pop("$defs", {}).items():
            schemas.setdefault(name, definition)
        for value in node.values():
            _hoist_definitions(value, schemas)
    elif isinstance(node, list):
        for value in node:
            _hoist_definitions(value, schemas)


def _can_fail_validation(operation: dict[str, Any]) -> bool:
    """A body, or a parameter that is more than any string (our path ids are strings)."""
    return "requestBody" in operation or any(
        parameter.get("schema", {}).get("type") != "string" or len(parameter["schema"]) > 2
        for parameter in operation.get("parameters", ())
    )


def _rendered_error(error_type: ErrorType) -> dict[str, Any]:
    """`error_answer` as FastAPI renders it into the document (the envelope by reference)."""
    answer = error_answer(error_type)
    rendered: dict[str, Any] = {
        "description": answer["description"],
        "content": {"application/json": {"schema": {"$ref": _REF + "ErrorBody"}}},
    }
    if "headers" in answer:
        rendered["headers"] = answer["headers"]
    return rendered
