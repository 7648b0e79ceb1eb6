"""The daemon's lifecycle, top to bottom: start, serve, signals, graceful shutdown.

Start: refuse early if another daemon is live on the socket; load the models
on the engine thread; only then bind, so a client never waits on a socket
that cannot answer. Shutdown (SIGTERM or SIGINT): stop accepting, let
in-flight requests finish within the grace period, cancel the rest, remove
the socket file, exit 0. A second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from ..protocol.codec import MAX_MESSAGE_BYTES
from ..protocol.errors import ErrorCode, RpcError
from .connection import Connection
from .engine import Engine, EngineSettings
from .handlers import DAEMON_VERSION, Handlers
from .jobs import FAILED
from .listener import bind_unix_socket, check_socket_path

log = structlog.get_logger("prefixd.server")


@dataclass(frozen=True)
class ServerSettings:
    socket_path: Path
    engine: EngineSettings
    grace_seconds: float = 10.0
    load_timeout_seconds: float = 600.0
    max_message_bytes: int = MAX_MESSAGE_BYTES


class DaemonServer:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.engine = Engine(settings.engine)
        self.handlers = Handlers(self.engine)
        self.connections: set[Connection] = set()
        self._stop_requested = asyncio.Event()
        self._num_signals = 0
        self._server: asyncio.AbstractServer | None = None

    async def run(self) -> int:
        path = self.settings.socket_path
        check_socket_path(path)  # fail before a long model load, not after
        started = time.monotonic()
        self.engine.start()
        await self.engine.wait_ready(self.settings.load_timeout_seconds)
        sock = bind_unix_socket(path)
        self._server = await asyncio.start_unix_server(self._on_client, sock=sock)
        self._install_signal_handlers()
        log.info(
            "daemon_started",
            version=DAEMON_VERSION,
            socket=str(path),
            pid=os.getpid(),
            models=list(self.engine.model_names),
            startup_s=round(time.monotonic() - started, 3),
        )
        await self._stop_requested.wait()
        await self._shutdown()
        return 0

    def request_stop(self) -> None:
        self._stop_requested.set()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)

    def _on_signal(self, signum: int) -> None:
        self._num_signals += 1
        if self._num_signals > 1 and signum == signal.SIGINT:
            log.warning("forced_exit", signal=signal.Signals(signum).name)
            self._remove_socket()
            os._exit(130)
        log.info("shutdown_requested", signal=signal.Signals(signum).name)
        self._stop_requested.set()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(reader, writer, self.handlers, self.settings.max_message_bytes)
        self.connections.add(conn)
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)

    def _num_in_flight(self) -> int:
        return sum(len(conn.jobs) for conn in self.connections)

    async def _shutdown(self) -> None:
        log.info("daemon_stopping", in_flight=self._num_in_flight())
        if self._server is not None:
            self._server.close()
        self._remove_socket()
        deadline = time.monotonic() + self.settings.grace_seconds
        while self._num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for job in self.engine.inbox.close():
            job.emit(FAILED, RpcError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
        for conn in list(self.connections):
            conn.cancel_all()
        # The engine answers cancelled jobs at its next step; give replies time to go out.
        deadline = time.monotonic() + 10.0
        while self._num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.writer.close()
        if self.connections:
            await asyncio.sleep(0.1)
        await asyncio.to_thread(self.engine.stop)
        log.info("daemon_stopped")

    def _remove_socket(self) -> None:
        try:
            os.unlink(self.settings.socket_path)
        except FileNotFoundError:
            pass
