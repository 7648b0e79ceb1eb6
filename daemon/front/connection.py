"""One client connection: read and decode messages, dispatch requests, write replies.

Requests are handled as independent tasks, so a client may pipeline many
msgids on one connection. A message goes to the socket at once while nothing
waits before it (the usual case: a streamed token's chunk, to a client that
reads along), else into the outbox that one writer task empties in order, so
messages are never interleaved and a slow reader only slows itself. When the
client goes away, its in-flight requests are cancelled.

Backpressure: the engine never waits for a socket (it would stall every
client's decoding), so what a client does not read piles up in its outbox.
A client that leaves more than ``max_outbox_bytes`` unread is too slow: its
requests are cancelled and its connection is closed, and the daemon's memory
stays bounded whatever the client does.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections import deque
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
MAX_OUTBOX_BYTES = 16 * 1024 * 1024  # unread replies one client may leave queued: one message of the largest size
# Messages up to this size go to the socket at once while nothing waits before them: below the
# transport's low-water mark, so what a direct write leaves unsent is as little as the writer's drain leaves.
DIRECT_WRITE_MAX_BYTES = 16 * 1024
OUTBOX_LIMIT_ENV = "PREFIXD_MAX_OUTBOX_BYTES"  # overrides MAX_OUTBOX_BYTES (tests, tuning)


def outbox_limit_from_environment() -> int:
    """``$PREFIXD_MAX_OUTBOX_BYTES`` if set, else MAX_OUTBOX_BYTES; a bad value is an error at start-up."""
    text = os.environ.get(OUTBOX_LIMIT_ENV, "").strip()
    if not text:
        return MAX_OUTBOX_BYTES
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{OUTBOX_LIMIT_ENV} must be a whole number of bytes, at least 1; got {text!r}")
    return int(text)


_DEFAULT_OUTBOX_LIMIT = outbox_limit_from_environment()  # read once, when the daemon imports this module

Handler = Callable[["Connection", Request], Awaitable[Any]]


class Connection:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        max_message_bytes: int,
        peer_policy: PeerPolicy | None = None,
        max_outbox_bytes: int | None = None,
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
        # How this connection cancels its jobs; the server sets engine.cancel, which also frees a
        # queued job's place in line at once (a bare flag waits for admission).
        self.cancel_job: Callable[[GenerateJob], None] = lambda job: job.cancel()
        self._tasks: set[asyncio.Task] = set()
        # Encoded messages not yet taken by the socket; the first is the one
        # being written, and it leaves the deque only once the socket has it.
        self._outbox: deque[bytes] = deque()
        self._outbox_filled = asyncio.Event()
        self._outbox_closing = False  # set by _finish: the writer stops once the outbox is empty
        self.max_outbox_bytes = _DEFAULT_OUTBOX_LIMIT if max_outbox_bytes is None else max_outbox_bytes
        self._num_unwritten_bytes = 0  # sum of the outbox
        self._writer_task: asyncio.Task | None = None
        self._close_reason: str | None = None  # why the daemon closed the connection, if it did
        self.closed = asyncio.Event()

    # -- sending ------------------------------------------------------------------

    def send(self, message: Message) -> None:
        """Queue a message for the writer; a client that leaves too much unread is dropped instead."""
        if self.closed.is_set():
            return
        data = codec.encode(message)
        if len(data) <= DIRECT_WRITE_MAX_BYTES and not self._outbox and self._socket_keeps_up():
            # Nothing queued and the socket took all it was given: write now. Waking the
            # writer task for each streamed token cost the loop a task switch and a drain.
            try:
                self.writer.write(data)
            except (ConnectionError, OSError):
                pass  # the read side notices and cleans up
            return
        # What waits behind the message being written is what the client has
        # left unread; judged before this one joins, so a single large reply
        # to a client that reads along never counts as slowness.
        num_waiting = self._num_unwritten_bytes - (len(self._outbox[0]) if self._outbox else 0)
        if num_waiting > self.max_outbox_bytes:
            self._drop_slow_reader(self._num_unwritten_bytes + len(data))
            return
        self._num_unwritten_bytes += len(data)
        self._outbox.append(data)
        self._outbox_filled.set()

    def _socket_keeps_up(self) -> bool:
        """True while the transport holds nothing unsent (so a direct write cannot pile up unaccounted)."""
        transport = self.writer.transport
        return not transport.is_closing() and transport.get_write_buffer_size() == 0

    async def _write_loop(self) -> None:
        try:
            while self._outbox or not self._outbox_closing:
                if not self._outbox:
                    self._outbox_filled.clear()
                    await self._outbox_filled.wait()
                    continue
                if self.writer.is_closing():
                    break  # closed under the writer (uvloop then lets drain() return): writing would raise
                data = self._outbox[0]
                self.writer.write(data)
                await self.writer.drain()  # waits while the client does not read
                if self._outbox and self._outbox[0] is data:  # (a dropped client's outbox is already empty)
                    self._outbox.popleft()
                    self._num_unwritten_bytes -= len(data)
        except (ConnectionError, OSError):
            pass  # the read side notices and cleans up
        finally:
            self.closed.set()

    def _close_outbox(self) -> None:
        """Let the writer finish what is queued, then stop."""
        self._outbox_closing = True
        self._outbox_filled.set()

    def _drop_slow_reader(self, num_queued_bytes: int) -> None:
        log.warning(
            "client_too_slow",
            client=self.client_id,
            queued_bytes=num_queued_bytes,
            limit_bytes=self.max_outbox_bytes,
            cancelled_requests=len(self.jobs),
        )
        self._close_reason = "too_slow"
        self.closed.set()  # send() drops everything from now on
        self.cancel_all()
        self._outbox.clear()  # free the unread replies now, not when the connection is collected
        self._num_unwritten_bytes = 0
        self._close_outbox()
        # close() would wait to flush the buffer to a reader that does not
        # read; abort() drops it, and the read loop sees the end at once.
        self.writer.transport.abort()

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
                except Exception as exc:  # a decoder bug: the stream's position is lost, but the client hears why
                    reason = "decoder_failed"
                    log.exception("client_decoder_failed", client=self.client_id)
                    self.send(
                        Response(
                            None,
                            RpcError(ErrorCode.INTERNAL, f"internal error decoding the stream: {exc!r}").to_wire(),
                            None,
                        )
                    )
                    break
        except (ConnectionError, OSError):
            reason = "connection_error"
        finally:
            await self._finish(self._close_reason or reason)

    def _dispatch(self, item: Message | RpcError) -> None:
        if isinstance(item, RpcError):  # a message that is not msgpack-RPC: the client's mistake, and it is told so
            log.warning("client_invalid_message", client=self.client_id, code=item.code, error=item.message)
            self.send(Response(None, item.to_wire(), None))
        elif isinstance(item, Request):
            task = asyncio.create_task(self._answer(item))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif isinstance(item, Notification):
            # Clients such as Neovim send notifications of their own
            # (nvim_error_event ...); the protocol says unknown ones are ignored.
            log.debug("client_notification_ignored", client=self.client_id, method=item.method)
        elif isinstance(item, Response):
            # The daemon sends no requests, so no response from a client answers anything.
            log.warning(
                "client_response_ignored",
                client=self.client_id,
                msgid=item.msgid,
                reason="the daemon sends no requests; a response from a client answers nothing",
            )

    async def _answer(self, request: Request) -> None:
        # Every log line of this request names the peer.
        structlog.contextvars.bind_contextvars(client=self.client_id, pid=self.peer_pid, uid=self.peer_uid)
        log.debug("request", method=request.method, msgid=request.msgid)
        try:
            result = await self.handler(self, request)
        except RpcError as err:
            self.send(Response(request.msgid, err.to_wire(), None))
        except asyncio.CancelledError:
            self.send(
                Response(
                    request.msgid, RpcError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down").to_wire(), None
                )
            )
            raise
        except Exception as exc:
            log.exception("handler_failed", client=self.client_id, method=request.method)
            self.send(Response(request.msgid, RpcError(ErrorCode.INTERNAL, f"internal error: {exc}").to_wire(), None))
        else:
            self.send(Response(request.msgid, None, result))

    async def _finish(self, reason: str) -> None:
        for job in list(self.jobs.values()):
            self.cancel_job(job)
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
        self._close_outbox()
        if self._writer_task is not None:
            done, _ = await asyncio.wait([self._writer_task], timeout=5)
            if not done:  # the client is not reading what is left; close() would wait for it forever
                self.writer.transport.abort()
        self.closed.set()
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass
        log.info("client_disconnected", client=self.client_id, reason=reason)

    def cancel_all(self) -> None:
        for job in list(self.jobs.values()):
            self.cancel_job(job)

    def stop_reading(self) -> None:
        """The daemon is stopping: read nothing more; replies still owed go out, then the connection closes.

        The read loop sees the end of the stream and _finish does the rest:
        it waits for the handlers' last replies and for the writer to drain.
        """
        self._close_reason = self._close_reason or "shutdown"
        self.writer.transport.pause_reading()  # bytes arriving after the end would trip the reader
        self.reader.feed_eof()

    def abort(self) -> None:
        """Drop the connection now, unsent replies included (a client that did not read them in time)."""
        self.writer.transport.abort()
