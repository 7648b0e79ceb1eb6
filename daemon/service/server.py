"""The daemon's lifecycle, top to bottom: start, serve, signals, graceful shutdown.

Start: take the listening socket systemd or launchd passed, if any; else
refuse early if another daemon is live on the socket path. Load the models on
the engine thread; only then bind (or serve the passed socket), so a client
never waits on a socket that cannot answer, and tell systemd READY=1.
Shutdown (SIGTERM or SIGINT): STOPPING=1, stop accepting, let in-flight
requests finish within the grace period, cancel the rest, remove the socket
file (unless a service manager owns it), exit 0. A second SIGINT exits at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from ...protocol.codec import MAX_MESSAGE_BYTES
from ...protocol.errors import ErrorCode, RpcError
from ..engine.engine import Engine
from ..engine.inbox import Inbox
from ..engine.jobs import FAILED
from ..engine.local_inputs import LocalInputs
from ..engine.settings import EngineSettings
from ..front.connection import Connection
from ..front.handlers import DAEMON_VERSION, Handlers
from ..front.http_options import HttpSettings
from ..front.listener import bind_unix_socket, check_socket_path
from ..front.peer_auth import PeerPolicy
from ..persist.cache_dir import RESPONSES_FOLDER
from ..persist.persistence import DiskCacheSettings, Persistence
from .socket_activation import take_inherited_socket
from .systemd import Notifier, watchdog_interval

if TYPE_CHECKING:
    from ..front.http_front import HttpFront  # aiohttp is imported only when --http asks for it

log = structlog.get_logger("prefixd.server")
LISTEN_BACKLOG = 1024  # asyncio's default (100) dropped most of a 300-connection burst


@dataclass(frozen=True)
class ServerSettings:
    socket_path: Path
    engine: EngineSettings
    grace_seconds: float  # on SIGTERM, how long running requests may finish
    status_interval_seconds: float  # how often systemd's STATUS= line is refreshed
    load_timeout_seconds: float = 600.0
    max_message_bytes: int = MAX_MESSAGE_BYTES
    disk_cache: DiskCacheSettings | None = None  # the prefix cache on disk, off when None
    http: HttpSettings | None = None  # the OpenAI-compatible front, off when None
    allowed_uids: tuple[int, ...] = ()  # socket peers besides our own uid (--allow-uid)


class DaemonServer:
    def __init__(self, settings: ServerSettings, engine: Engine | None = None):
        self.settings = settings
        # A rank of several passes its own, on the lock-step's inputs (service/ranks.py).
        self.engine = engine or Engine(
            LocalInputs(Inbox(settings.engine.max_queued, settings.engine.max_queued_per_client)), settings.engine
        )
        self.handlers = Handlers(self.engine)
        self.connections: set[Connection] = set()
        self._stop_requested = asyncio.Event()
        self._num_signals = 0
        self._exit_code = 0  # 1 once the engine died: a service manager should restart us
        self._server: asyncio.AbstractServer | None = None
        self._owns_socket_path = False  # False when systemd/launchd created the socket
        self.notifier = Notifier()  # does nothing outside systemd
        self._reporters: list[asyncio.Task] = []
        self.persistence: Persistence | None = None  # when the disk cache is on
        self.peer_policy = PeerPolicy(settings.allowed_uids)
        self.http_front: "HttpFront | None" = None  # while it runs

    async def run(self) -> int:
        path = self.settings.socket_path
        inherited = take_inherited_socket()
        if inherited is None:
            check_socket_path(path)  # fail before a long model load, not after
        started = time.monotonic()
        self._start_watchdog()  # systemd counts from our start, so ping while the models load too
        self.notifier.notify(STATUS=f"loading {', '.join(self.settings.engine.model_specs)}")
        loop = asyncio.get_running_loop()
        self.engine.on_dead = lambda reason: _call_soon(loop, self._on_engine_dead, reason)
        self.engine.start()
        try:
            await self.engine.wait_ready(self.settings.load_timeout_seconds)
        except BaseException as exc:
            self.notifier.notify(STATUS=f"failed to load the models: {exc}")
            raise
        if inherited is None:
            # Remember which file we bound: at shutdown only that one is removed (see _remove_socket).
            (sock, self._socket_file), activation = bind_unix_socket(path), "none"
            self._owns_socket_path = True
        else:
            sock, activation = inherited
            path = Path(sock.getsockname() or path)
        # A burst of clients (editors starting together, a pool) waits in the kernel, not refused.
        self._server = await asyncio.start_unix_server(self._on_client, sock=sock, backlog=LISTEN_BACKLOG)
        await self._start_http()
        self._install_signal_handlers()
        self.notifier.notify(
            READY=1, MAINPID=os.getpid(), STATUS=f"serving {', '.join(self.engine.model_names)} on {path}"
        )
        if self.notifier.enabled:
            self._reporters.append(asyncio.create_task(self._report_status()))
        if self.settings.disk_cache is not None:
            self.persistence = Persistence(self.engine, self.settings.disk_cache)
            self.handlers.prefetch = self.persistence.prefetch  # a prompt's own entries first while it loads
            await self.persistence.start()  # loads in the background: serving starts now
        log.info(
            "daemon_started",
            version=DAEMON_VERSION,
            socket=str(path),
            activation=activation,
            pid=os.getpid(),
            models=list(self.engine.model_names),
            startup_s=round(time.monotonic() - started, 3),
        )
        await self._stop_requested.wait()
        await self._shutdown()
        return self._exit_code

    def _on_engine_dead(self, reason: str) -> None:
        """The engine gave up (it logged why and failed every request): stop, and exit non-zero."""
        self._exit_code = 1
        self.notifier.notify(STATUS=f"engine failed: {reason}; exiting")
        self._stop_requested.set()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)

    def _on_signal(self, signum: int) -> None:
        self._num_signals += 1
        if self._num_signals > 1 and signum == signal.SIGINT:
            log.warning("forced_exit", signal=signal.Signals(signum).name)
            self.notifier.notify(STOPPING=1, STATUS="forced exit")
            self._remove_socket()
            if self.http_front is not None:
                self.http_front.remove_socket_file()  # no cleanup() on this path: it would wait for requests
            os._exit(130)
        log.info("shutdown_requested", signal=signal.Signals(signum).name)
        self._stop_requested.set()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Connection(reader, writer, self.handlers, self.settings.max_message_bytes, peer_policy=self.peer_policy)
        conn.cancel_job = self.engine.cancel
        self.connections.add(conn)
        try:
            await conn.serve()
        finally:
            self.connections.discard(conn)

    def _num_in_flight(self) -> int:
        return sum(len(conn.jobs) for conn in self.connections) + (
            self.http_front.num_in_flight if self.http_front else 0
        )

    # -- systemd: status line and watchdog ---------------------------------------------

    def _start_watchdog(self) -> None:
        interval = watchdog_interval()
        if self.notifier.enabled and interval is not None:
            self._reporters.append(asyncio.create_task(self._ping_watchdog(interval)))

    async def _report_status(self) -> None:
        while True:
            await asyncio.sleep(self.settings.status_interval_seconds)
            try:
                stats = await asyncio.wait_for(self.engine.call(self.engine.controls.stats), timeout=5.0)
            except Exception:  # a busy or failing engine: report what the front knows
                stats = {}
            self.notifier.notify(STATUS=status_line(self.engine.model_names, stats, self._num_in_flight()))

    async def _ping_watchdog(self, interval: float) -> None:
        # A dead engine thread stops the pings, so systemd restarts the daemon.
        while self.engine.is_alive and self.engine.dead_reason is None:  # the task first runs after engine.start()
            self.notifier.notify(WATCHDOG=1)
            await asyncio.sleep(interval)
        log.error("engine_thread_dead", action="watchdog pings stopped")

    # -- shutdown -------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        self.notifier.notify(STOPPING=1, STATUS=f"stopping: {self._num_in_flight()} requests in flight")
        log.info("daemon_stopping", in_flight=self._num_in_flight())
        if self._server is not None:
            self._server.close()
        self._remove_socket()
        http_closed = asyncio.create_task(self._stop_http())
        deadline = time.monotonic() + self.settings.grace_seconds
        while self._num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for job in self.engine.inbox.close():
            job.emit(FAILED, RpcError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
        for conn in list(self.connections):
            conn.cancel_all()
        if self.http_front is not None:
            self.http_front.cancel_all()
        # The engine answers cancelled jobs at its next step; give replies time to go out.
        deadline = time.monotonic() + 10.0
        while self._num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.stop_reading()  # each closes once its last replies are written
        deadline = time.monotonic() + 10.0
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.abort()  # not reading what it was sent: it does not hold up the exit
        await http_closed
        if self.persistence is not None:
            await self._save_disk_cache()
        await asyncio.to_thread(self.engine.stop)
        self.handlers.intake.close()
        for task in self._reporters:
            task.cancel()
        self.notifier.close()
        log.info("daemon_stopped")

    async def _save_disk_cache(self) -> None:
        self.notifier.notify(STATUS="stopping: saving the prefix cache to disk")
        try:
            await self.persistence.stop()
        except Exception:  # never lose the clean exit over the cache
            log.exception("disk_cache_save_failed")

    def _remove_socket(self) -> None:
        if not self._owns_socket_path:
            return  # systemd/launchd keep listening on it and start us again on demand
        # Not by path: if our file was deleted and another daemon bound the path since, the file is its.
        self._socket_file.remove()

    # -- the OpenAI-compatible HTTP front (opt-in: --http / --http-socket) ---------------

    async def _start_http(self) -> None:
        http = self.settings.http
        if http is None:
            return
        from ..front.http_front import start_http_front  # aiohttp only when asked for

        try:
            self.http_front = await start_http_front(
                self.handlers,
                host=http.host,
                port=http.port,
                unix_path=http.unix_path,
                token=http.token,
                peer_policy=self.peer_policy,
                shutdown_timeout=self.settings.grace_seconds,
                max_output_tokens=http.max_output_tokens,
                keep_billing_header=http.keep_billing_header,
                responses_dir=self.settings.disk_cache.directory / RESPONSES_FOLDER
                if self.settings.disk_cache
                else None,
            )
        except BaseException:
            self._remove_socket()
            raise

    async def _stop_http(self) -> None:
        """Stop listening at once; running HTTP requests get the grace period, then are cancelled."""
        if self.http_front is not None:
            await self.http_front.cleanup()


def status_line(model_names: tuple[str, ...], stats: dict, num_in_flight: int) -> str:
    """systemd's STATUS= text: the models, the prefix cache's size, the requests being served."""
    parts = [f"serving {', '.join(model_names)}"]
    cache = (stats.get("cache") or {}).get("total") or {}
    if "num_bytes" in cache:
        parts.append(f"cache {cache['num_bytes'] / (1 << 20):.1f} MiB in {cache.get('num_sequences', 0)} sequences")
    parts.append(f"{num_in_flight} active requests")
    requests = stats.get("requests") or {}
    if requests.get("queued"):
        parts.append(f"{requests['queued']} queued")
    if "completed" in requests:
        parts.append(f"{requests['completed']} completed")
    return " · ".join(parts)


def _call_soon(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """Hand a call from another thread to the loop; nothing to do once the loop is gone."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass
