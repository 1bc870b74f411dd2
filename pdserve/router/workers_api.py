"""Runtime scaling: ``GET /workers``, ``POST /workers``, ``DELETE /workers/{id}`` (drain)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.router.config import normalize_worker_url
from pdserve.router.errors import RouterHTTPError
from pdserve.router.policies import PoolRole
from pdserve.router.pool import DuplicateWorkerError
from pdserve.router.request_body import read_json_body
from pdserve.router.runtime import RouterRuntime

_MAX_BODY_BYTES = 4096


def workers_router(runtime: RouterRuntime) -> APIRouter:
    router = APIRouter()

    @router.get("/workers")
    async def list_workers() -> JSONResponse:
        return JSONResponse({"workers": [w.to_dict() for w in runtime.registry.all_workers()]})

    @router.post("/workers")
    async def add_worker(request: Request) -> JSONResponse:
        """Body ``{"url": "http://host:port", "role": "prefill" | "decode"}``. The worker is
        health-checked at once and joins rotation when that passes (201 either way)."""
        body = await read_json_body(request, _MAX_BODY_BYTES)
        role = _role(body.get("role"))
        try:
            worker = runtime.registry.add(normalize_worker_url(body.get("url"), "url"), role)
        except DuplicateWorkerError as exc:
            raise RouterHTTPError(409, str(exc), param="url") from exc
        except ValueError as exc:
            raise RouterHTTPError(400, str(exc), param="url") from exc
        await runtime.health.check(worker)
        return JSONResponse(worker.to_dict(), status_code=201)

    @router.delete("/workers/{worker_id}")
    async def drain_worker(worker_id: str) -> JSONResponse:
        """Stop routing to the worker; it is removed once its in-flight requests finish.
        200 with ``removed: true`` when that is already so, 202 while it drains."""
        worker = runtime.registry.drain(worker_id)
        if worker is None:
            raise RouterHTTPError(404, f"no worker with id {worker_id!r}", param="worker_id")
        is_removed = not runtime.registry.is_registered(worker)
        return JSONResponse(
            {**worker.to_dict(), "removed": is_removed}, status_code=200 if is_removed else 202
        )

    return router


def _role(value: object) -> PoolRole:
    roles = [r.value for r in PoolRole]
    if value not in roles:
        raise RouterHTTPError(400, f"role must be one of {roles}, got {value!r}", param="role")
    return PoolRole(value)
