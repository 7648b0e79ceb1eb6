"""One client connection: read and decode messages, dispatch requests, write replies.

Requests are handled as independent tasks, so a client may pipeline many
msgids on one connection. Every outgoing message goes through one writer
task, so messages are never interleaved and a slow reader only slows itself.
When the client goes away, its in-flight requests are cancelled.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Awaitable, Callable

import structlog

from ...protocol import codec
from ...protocol.errors import ErrorCode, RpcError
from ...protocol.messages import Message, Notification, Request, Response
from ..engine.jobs import GenerateJob
from .peer_auth import PeerPolicy, peer_credentials

log = structlog.get_logger("prefixd.connection")
_connection_ids = itertools.count(1)
READ_SIZE = 256 * 1024

Handler = Callable[["Connection", Request], Awaitable[Any]]


class Connection:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        max_message_bytes: int,
        peer_policy: PeerPolicy | None = None,
    ):
        self.client_id = f"c{next(_connection_ids)}"
        self.reader = reader
        self.writer = writer
        self.handler = handler
        self.decoder = codec.StreamDecoder(max_message_bytes)
        self.peer = peer_credentials(writer.get_extra_info("socket"))
        self.peer_pid, self.peer_uid = self.peer.pid, self.peer.uid
        self.peer_policy = peer_policy or PeerPolicy()
        self.jobs: dict[int, GenerateJob] = {}  # in-flight generate jobs by msgid
        self._tasks: set[asyncio.Task] = set()
        self._outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._writer_task: asyncio.Task | None = None
        self.closed = asyncio.Event()

    # -- sending ------------------------------------------------------------------

    def send(self, message: Message) -> None:
        if not self.closed.is_set():
            self._outbox.put_nowait(codec.encode(message))

    async def _write_loop(self) -> None:
        try:
            while (data := await self._outbox.get()) is not None:
                self.writer.write(data)
                await self.writer.drain()
        except (ConnectionError, OSError):
            pass  # the read side notices and cleans up
        finally:
            self.closed.set()

    # -- reading ------------------------------------------------------------------

    async def serve(self) -> None:
        """Read until EOF or a fatal framing error; then cancel what is still running."""
        refusal = self.peer_policy.refusal(self.peer)
        if refusal is not None:
            log.warning("client_refused", client=self.client_id, pid=self.peer_pid, uid=self.peer_uid, reason=refusal)
            self.closed.set()
            self.writer.close()
            return
        self._writer_task = asyncio.create_task(self._write_loop())
        log.info("client_connected", client=self.client_id, pid=self.peer_pid, uid=self.peer_uid)
        reason = "eof"
        try:
            while not self.closed.is_set():
                data = await self.reader.read(READ_SIZE)
                if not data:
                    break
                try:
                    self.decoder.feed(data)
                    for item in self.decoder:
                        self._dispatch(item)
                except RpcError as err:  # bytes we cannot resynchronise after
                    reason = "framing_error"
                    log.warning("client_protocol_error", client=self.client_id, code=err.code, error=err.message)
                    self.send(Response(None, err.to_wire(), None))
                    break
        except (ConnectionError, OSError):
            reason = "connection_error"
        finally:
            await self._finish(reason)

    def _dispatch(self, item: Message | RpcError) -> None:
        if isinstance(item, RpcError):
            self.send(Response(None, item.to_wire(), None))
        elif isinstance(item, Request):
            task = asyncio.create_task(self._answer(item))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(item, Notification):
            # Clients such as Neovim send notifications of their own
            # (nvim_error_event ...); the protocol says unknown ones are ignored.
            log.debug("client_notification_ignored", client=self.client_id, method=item.method)

    async def _answer(self, request: Request) -> None:
        # Every log line of this request names the peer.
        structlog.contextvars.bind_contextvars(client=self.client_id, pid=self.peer_pid, uid=self.peer_uid)
        log.debug("request", method=request.method, msgid=request.msgid)
        try:
            result = await self.handler(self, request)
        except RpcError as err:
            self.send(Response(request.msgid, err.to_wire(), None))
        except asyncio.CancelledError:
            self.send(Response(request.msgid, RpcError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down").to_wire(), None))
            raise
        except Exception as exc:
            log.exception("handler_failed", client=self.client_id, method=request.method)
            self.send(Response(request.msgid, RpcError(ErrorCode.INTERNAL, f"internal error: {exc}").to_wire(), None))
        else:
            self.send(Response(request.msgid, None, result))

    async def _finish(self, reason: str) -> None:
        for job in self.jobs.values():
            job.cancel()
        if self.jobs or self.decoder.num_buffered_bytes:
            log.info(
                "client_gone",
                client=self.client_id,
                reason=reason,
                cancelled_requests=len(self.jobs),
                unread_bytes=self.decoder.num_buffered_bytes,
            )
        # Let handlers send their final replies (the engine answers a
        # cancelled job at its next step) before the writer stops.
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=30)
        self._outbox.put_nowait(None)
        if self._writer_task is not None:
            await asyncio.wait([self._writer_task], timeout=5)
        self.closed.set()
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass
        log.info("client_disconnected", client=self.client_id, reason=reason)

    def cancel_all(self) -> None:
        for job in self.jobs.values():
            job.cancel()

