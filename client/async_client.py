"""The asyncio client: many calls in flight on one connection.

A reader task decodes everything the daemon sends and hands each reply to
the waiter registered under its msgid: a future for a plain call, a queue for
a stream (which also receives the ``generate.chunk`` notifications whose
``id`` is that msgid). The daemon writes a stream's chunks before its final
reply, and one reader preserves that order, so a stream's queue ends with the
reply. When the connection dies every waiter fails with ConnectionLost.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, AsyncIterator, Iterable, Unpack

from prefixd.protocol import methods
from prefixd.protocol.codec import StreamDecoder
from prefixd.protocol.errors import RpcError
from prefixd.protocol.messages import Notification, Response

from .calls import (
    READ_CHUNK_BYTES,
    GenerateOptions,
    MsgidCounter,
    PromptOptions,
    cancel_params,
    chunk_target,
    connection_level_error,
    encode_request,
    generate_params,
    prompt_params,
    resolve_socket_path,
    result_of,
)
from .daemon_owner import refuse_foreign_daemon
from .errors import Cancelled, ConnectionLost, DaemonUnavailable, PrefixdError, RequestTimeout, unavailable

_Waiter = asyncio.Future | asyncio.Queue


class AsyncClient:
    """asyncio prefixd client; ``timeout`` (seconds, None = forever) bounds each wait for a reply or chunk.

    Use ``client = await AsyncClient.connect(path)`` or ``async with
    AsyncClient(path) as client``; a call on an unopened client opens it.
    The daemon must run as this process's uid or root, else opening raises
    DaemonUnavailable before anything is sent; ``trusted_uids`` names other
    uids whose daemon may be used (one shared through ``--allow-uid``).
    """

    def __init__(
        self,
        socket_path: str | os.PathLike | None = None,
        timeout: float | None = None,
        trusted_uids: Iterable[int] = (),
    ):
        self.socket_path = resolve_socket_path(socket_path)
        self.timeout = timeout
        self.trusted_uids = tuple(trusted_uids)
        self._msgids = MsgidCounter()
        self._waiters: dict[int, _Waiter] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._lost: PrefixdError | None = None
        self._open_lock = asyncio.Lock()

    @classmethod
    async def connect(
        cls,
        socket_path: str | os.PathLike | None = None,
        timeout: float | None = None,
        trusted_uids: Iterable[int] = (),
    ) -> AsyncClient:
        client = cls(socket_path, timeout, trusted_uids)
        await client.open()
        return client

    async def open(self) -> None:
        """Connect (raises DaemonUnavailable when no daemon listens); calls do it when needed."""
        async with self._open_lock:  # two first calls at once must not open two connections
            if self._writer is not None:
                return
            try:
                reader, self._writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(str(self.socket_path), limit=READ_CHUNK_BYTES), self.timeout
                )
            except TimeoutError:
                raise DaemonUnavailable(f"{self.socket_path} did not accept within {self.timeout} s") from None
            except OSError as exc:
                raise unavailable(self.socket_path, exc) from None
            try:
                refuse_foreign_daemon(self._writer.get_extra_info("socket"), self.socket_path, self.trusted_uids)
            except DaemonUnavailable:
                self._writer.close()
                self._writer = None  # not open: a later call tries again, and is refused again
                raise
            self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader))

    async def close(self) -> None:
        """Close the connection; the daemon cancels whatever was still running for it."""
        if self._writer is None:
            return
        self._lost = self._lost or ConnectionLost("the client was closed")
        self._writer.close()
        if self._reader_task is not None:
            await asyncio.gather(self._reader_task, return_exceptions=True)
        self._fail_all(self._lost)
        try:
            await self._writer.wait_closed()
        except OSError:
            pass  # already broken: closing is all we wanted

    async def __aenter__(self) -> AsyncClient:
        await self.open()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    # -- methods (same names as the blocking Client) ---------------------------

    async def hello(self) -> dict[str, Any]:
        return await self._call(methods.HELLO, {})

    async def ping(self) -> dict[str, Any]:
        return await self._call(methods.PING, {})

    async def models(self) -> dict[str, Any]:
        return await self._call(methods.MODELS, {})

    async def stats(self) -> dict[str, Any]:
        return await self._call(methods.STATS, {})

    async def tokenize(self, prompt=None, messages=None, tokens=None, model=None) -> dict[str, Any]:
        params = prompt_params(prompt, messages=messages, tokens=tokens, model=model)
        return await self._call(methods.TOKENIZE, params)

    async def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> dict[str, Any]:
        """Run a generation to its end and return the final result map."""
        return await self._call(methods.GENERATE, generate_params(prompt, **options), cancel_on_abandon=True)

    def stream(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> AsyncGenerateStream:
        """A streamed generation: ``async with client.stream(...) as s: async for chunk in s``."""
        return AsyncGenerateStream(self, generate_params(prompt, stream=True, **options))

    async def cancel(self, msgid: int) -> dict[str, Any]:
        """Cancel a request of this connection by msgid: {cancelled: bool}."""
        return await self._call(methods.CANCEL, cancel_params(msgid))

    async def cache_warm(self, prompt: str | None = None, **options: Unpack[PromptOptions]) -> dict[str, Any]:
        return await self._call(methods.CACHE_WARM, prompt_params(prompt, **options), cancel_on_abandon=True)

    async def cache_pin(self, prompt: str | None = None, **options: Unpack[PromptOptions]) -> dict[str, Any]:
        return await self._call(methods.CACHE_PIN, prompt_params(prompt, **options))

    async def cache_unpin(self, prompt: str | None = None, **options: Unpack[PromptOptions]) -> dict[str, Any]:
        return await self._call(methods.CACHE_UNPIN, prompt_params(prompt, **options))

    # -- plumbing --------------------------------------------------------------

    async def _call(self, method: str, params: dict[str, Any], cancel_on_abandon: bool = False) -> Any:
        future = asyncio.get_running_loop().create_future()
        msgid = await self._start(method, params, future)
        try:
            response = await asyncio.wait_for(future, self.timeout)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if cancel_on_abandon:
                self._cancel_quietly(msgid)  # nobody waits for it: stop the daemon's work too
            if isinstance(exc, TimeoutError):
                raise RequestTimeout(f"no reply from the daemon within {self.timeout} s") from None
            raise
        finally:
            self._waiters.pop(msgid, None)
        return result_of(response)

    async def _start(self, method: str, params: dict[str, Any], waiter: _Waiter) -> int:
        await self.open()
        if self._lost is not None:
            raise ConnectionLost(self._lost.message)
        msgid = self._msgids.take()
        self._waiters[msgid] = waiter
        self._writer.write(encode_request(msgid, method, params))
        try:
            await self._writer.drain()  # backpressure for large prompts
        except OSError as exc:
            self._waiters.pop(msgid, None)
            raise ConnectionLost(f"the daemon closed the connection ({exc.strerror or exc})") from None
        return msgid

    def _cancel_quietly(self, msgid: int) -> None:
        """Send a cancel without waiting for its reply (which finds no waiter and is dropped)."""
        if self._lost is None and self._writer is not None and not self._writer.is_closing():
            self._writer.write(encode_request(self._msgids.take(), methods.CANCEL, cancel_params(msgid)))

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        decoder = StreamDecoder()
        error: PrefixdError = ConnectionLost("the daemon closed the connection")
        try:
            while data := await reader.read(READ_CHUNK_BYTES):
                decoder.feed(data)
                for message in decoder:
                    if (fatal := self._route(message)) is not None:
                        error = fatal
        except RpcError as err:  # bad framing: the stream cannot be resynchronised
            error = ConnectionLost(f"the daemon sent an unreadable message: {err.message}")
        except OSError as exc:
            error = ConnectionLost(f"the connection to the daemon broke ({exc.strerror or exc})")
        finally:
            self._fail_all(error)
            if self._writer is not None:
                self._writer.close()

    def _route(self, message: Any) -> PrefixdError | None:
        """Hand a message to the waiter of its msgid; drop what nobody waits for."""
        if isinstance(message, Response):
            if (fatal := connection_level_error(message)) is not None:
                return fatal
            waiter, item = self._waiters.get(message.msgid), message
        elif isinstance(message, Notification) and (target := chunk_target(message)):
            waiter, item = self._waiters.get(target[0]), target[1]
        else:
            return None  # other notifications, requests, undecodable items
        if isinstance(waiter, asyncio.Queue):
            waiter.put_nowait(item)
        elif waiter is not None and isinstance(item, Response) and not waiter.done():
            waiter.set_result(item)
        return None

    def _fail_all(self, error: PrefixdError) -> None:
        self._lost = error = self._lost or error  # the first reason is the one worth telling
        for waiter in self._waiters.values():
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(error)
            elif not waiter.done():
                waiter.set_exception(error)
        self._waiters.clear()


class AsyncGenerateStream:
    """Chunk maps ({id, text, tokens, index}) of one streamed generate, in order.

    The request is sent on entering ``async with`` or on the first iteration.
    After iteration ends, ``result`` holds the final result. ``aclose()`` (or
    leaving the ``async with`` block) before the end cancels the request and
    waits for its final result (finish_reason "cancelled"). ``break`` alone
    does not close it; dropping the last reference sends the cancel unawaited.
    """

    def __init__(self, client: AsyncClient, params: dict[str, Any]):
        self.msgid: int | None = None
        self.result: dict[str, Any] | None = None
        self._client = client
        self._params = params
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False

    async def start(self) -> None:
        if self.msgid is None and not self._done:
            self.msgid = await self._client._start(methods.GENERATE, self._params, self._queue)

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._done:
            raise StopAsyncIteration
        try:
            await self.start()
            item = await asyncio.wait_for(self._queue.get(), self._client.timeout)
        except TimeoutError:
            self._abandon()
            raise RequestTimeout(f"no chunk from the daemon within {self._client.timeout} s") from None
        except BaseException:
            self._abandon()
            raise
        if isinstance(item, PrefixdError):
            self._finish()
            raise item
        if isinstance(item, Response):
            self._finish()
            self.result = result_of(item)
            raise StopAsyncIteration
        return item

    async def text(self) -> str:
        """Read the stream to its end and return the whole generated text."""
        return "".join([chunk.get("text", "") async for chunk in self])

    async def aclose(self) -> None:
        """Cancel the request if it is still running, and wait for its final result."""
        if self._done or self.msgid is None:
            self._finish()
            return
        try:
            await self._client.cancel(self.msgid)
            async for _ in self:
                pass
        except Cancelled:
            pass  # a request cancelled before it produced anything may answer with an error
        finally:
            self._finish()

    async def __aenter__(self) -> AsyncGenerateStream:
        await self.start()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            await self.aclose()
            return
        try:
            await self.aclose()
        except PrefixdError:
            pass  # keep the exception that ended the block, not one about cleaning up

    def _abandon(self) -> None:
        if not self._done and self.msgid is not None:
            self._client._cancel_quietly(self.msgid)
        self._finish()

    def _finish(self) -> None:
        self._done = True
        if self.msgid is not None:
            self._client._waiters.pop(self.msgid, None)

    def __del__(self) -> None:
        if not getattr(self, "_done", True) and self.msgid is not None:
            try:
                self._client._cancel_quietly(self.msgid)
            except RuntimeError:
                pass  # the event loop is already closed: so is the connection
            self._finish()
