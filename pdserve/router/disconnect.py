"""Abandon an upstream call as soon as the client goes away.

While a leg is awaited no response has started, so nothing else listens for the client's
``http.disconnect``; `until_disconnected` races the leg against it and cancels the leg (httpx
then closes the upstream connection, which the worker sees as its client leaving).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed its connection before the response started."""


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        raise ClientDisconnected
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
