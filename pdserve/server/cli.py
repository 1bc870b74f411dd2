"""The server's part of `pdserve serve` (registered by `pdserve.launch.cli`): its flags, and the
OpenAI-compatible server on one engine, under uvicorn.

SIGTERM (or Ctrl-C) stops accepting connections, gives in-flight requests `--shutdown-grace`
seconds, aborts the rest with a final `finish_reason: abort` event, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import socket
from collections.abc import Callable

import uvicorn

from pdserve.core.config import Mode, SchedulerConfig
from pdserve.flags import flag
from pdserve.server.settings import ServerSettings

DEFAULT_PORT = 8000
MODES = tuple(mode.value for mode in Mode)

SERVER_FLAGS = (
    flag(
        "--mode",
        choices=MODES,
        default=SchedulerConfig.scheduling.value,
        help="colocated: whole-prompt continuous batching; chunked: chunked "
        "prefill; disagg: a router plus prefill and decode worker "
        "processes (see --prefill-workers, --decode-workers)",
    ),
    flag("--host", default="127.0.0.1"),
    flag("--port", type=int, default=DEFAULT_PORT),
    flag(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PDSERVE_API_KEY)",
    ),
    flag(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients may use for the model (default: the model's name)",
    ),
    flag(
        "--max-queue",
        type=int,
        default=ServerSettings.max_queue,
        help="waiting requests beyond which new ones get 429",
    ),
    flag(
        "--burst-gap",
        type=float,
        default=ServerSettings.burst_gap_s,
        help="seconds an idle engine waits for a burst's next request, so that the burst's "
        "prompts share one prefill step (0: start at once)",
    ),
    flag("--max-body-bytes", type=int, default=ServerSettings.max_body_bytes),
    flag(
        "--shutdown-grace",
        type=float,
        default=ServerSettings.shutdown_grace_s,
        help="seconds in-flight requests get to finish on SIGTERM",
    ),
    flag(
        "--health-timeout",
        type=float,
        default=ServerSettings.health_timeout_s,
        help="/health is 503 when the engine loop stalls this long",
    ),
)


# A launcher binds its worker's port and hands the listening socket over (this variable holds
# its descriptor): the port is the worker's from before it starts, so no other process (a
# worker placed on this host at the same moment) can take it while the model loads.
LISTEN_FD_ENV = "PDSERVE_LISTEN_FD"


def inherited_sockets() -> list[socket.socket] | None:
    """The listening socket a launcher handed this process (`uvicorn.Server.run`'s
    `sockets`), taken from the environment; None: bind --host/--port here."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    return None if fd is None else [socket.socket(fileno=int(fd))]


def run_server(args: argparse.Namespace) -> int:
    """Serve one engine (`--mode colocated` or `chunked`) until SIGINT/SIGTERM."""
    # Start-up keeps hundreds of thousands of objects (the GGUF reader alone ~400k), and every
    # full collection rescanned them: 8 took 0.87 s of a 6.2 s start (Zen 4). One collection
    # runs when the heap is frozen (freeze_startup_heap), which turns the collector back on.
    gc.disable()
    from pdserve.api.asgi import freeze_startup_heap
    from pdserve.engine.args import engine_config_from_args
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.fleet import take_fleet_secret, take_fleet_tls
    from pdserve.server.app import create_app

    fleet_secret = take_fleet_secret()
    fleet_tls = take_fleet_tls()
    llm_engine = LLMEngine(engine_config_from_args(args, fleet_secret, fleet_tls))
    settings = ServerSettings(
        served_model_names=tuple(args.served_model_name or (llm_engine.model_name,)),
        api_key=args.api_key,
        fleet_secret=fleet_secret,
        max_queue=args.max_queue,
        burst_gap_s=args.burst_gap,
        max_body_bytes=args.max_body_bytes,
        shutdown_grace_s=args.shutdown_grace,
        health_timeout_s=args.health_timeout,
    )
    app = create_app(llm_engine, settings)
    # One line per request comes from our own access logger, whatever --log-level says.
    logging.getLogger("pdserve.server.access").setLevel(logging.INFO)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 10,
        # --fleet-tls: HTTPS that admits only the deployment's certificates.
        ssl_context_factory=None
        if fleet_tls is None
        else lambda config, default: fleet_tls.server_context(),
    )
    server = GracefulServer(
        config, on_exit=lambda: app.state.pdserve.engine.begin_shutdown(settings.shutdown_grace_s)
    )
    logging.getLogger(__name__).warning(
        "pdserve serving %s on %s://%s:%d",
        settings.served_model_names[0],
        "http" if fleet_tls is None else "https",
        args.host,
        args.port,
    )
    sockets = inherited_sockets()
    freeze_startup_heap()
    server.run(sockets)
    return 0 if server.started else 1


class GracefulServer(uvicorn.Server):
    """uvicorn's server, plus: a stop signal starts the engine's drain, and the process then
    exits normally (0) instead of re-raising the signal after shutdown."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # handled here: do not re-raise it after shutdown
        if self._loop is not None:
            # A signal handler must not take locks the interrupted code may hold.
            self._loop.call_soon_threadsafe(self._on_exit)
