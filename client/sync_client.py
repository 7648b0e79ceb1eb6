"""The blocking client: a plain socket, no event loop, no threads.

One ``Client`` belongs to one thread. Its calls block and run one at a time;
an open ``GenerateStream`` does not block other calls (chunks that arrive for
it meanwhile wait in its inbox), so ``client.stats()`` inside a stream loop
works. For many requests in flight at once, use ``AsyncClient``.
"""

from __future__ import annotations

import os
import socket
import time
from collections import deque
from typing import Any, Iterable, Iterator, Unpack

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


class Client:
    """Blocking prefixd client. ``timeout`` (seconds, None = forever) bounds each wait for a reply or chunk.

    The daemon must run as this process's uid or root, else DaemonUnavailable is
    raised before anything is sent; ``trusted_uids`` names other uids whose
    daemon may be used (one shared through ``--allow-uid``).
    """

    def __init__(
        self,
        socket_path: str | os.PathLike | None = None,
        timeout: float | None = None,
        trusted_uids: Iterable[int] = (),
    ):
        self.socket_path = resolve_socket_path(socket_path)
        self.timeout = timeout
        self._msgids = MsgidCounter()
        self._decoder = StreamDecoder()
        self._inboxes: dict[int, deque[Response | dict[str, Any]]] = {}  # msgid -> chunks, then the reply
        self._lost: str | None = None  # why the connection is unusable, once it is
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(self.socket_path))
        except TimeoutError:
            self._sock.close()
            raise DaemonUnavailable(f"the daemon at {self.socket_path} did not accept within {timeout} s") from None
        except OSError as exc:
            self._sock.close()
            raise unavailable(self.socket_path, exc) from None
        try:
            refuse_foreign_daemon(self._sock, self.socket_path, trusted_uids)
        except DaemonUnavailable:
            self._sock.close()
            raise

    # -- methods -------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        """Protocol version, daemon version, models, capabilities."""
        return self._call(methods.HELLO, {})

    def ping(self) -> dict[str, Any]:
        return self._call(methods.PING, {})

    def models(self) -> dict[str, Any]:
        return self._call(methods.MODELS, {})

    def stats(self) -> dict[str, Any]:
        return self._call(methods.STATS, {})

    def tokenize(self, prompt=None, messages=None, tokens=None, model=None) -> dict[str, Any]:
        return self._call(methods.TOKENIZE, prompt_params(prompt, messages=messages, tokens=tokens, model=model))

    def generate(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> dict[str, Any]:
        """Run a generation to its end and return the final result map."""
        return self._call(methods.GENERATE, generate_params(prompt, **options), cancel_on_abandon=True)

    def stream(self, prompt: str | None = None, **options: Unpack[GenerateOptions]) -> GenerateStream:
        """Start a streamed generation; iterate the returned stream for chunk maps."""
        msgid = self._start(methods.GENERATE, generate_params(prompt, stream=True, **options))
        return GenerateStream(self, msgid)

    def cancel(self, msgid: int) -> dict[str, Any]:
        """Cancel a request of this connection by msgid: {cancelled: bool}."""
        return self._call(methods.CANCEL, cancel_params(msgid))

    def cache_warm(self, prompt: str | None = None, **options: Unpack[PromptOptions]) -> dict[str, Any]:
        """Prefill a prompt into the cache without generating."""
        return self._call(methods.CACHE_WARM, prompt_params(prompt, **options), cancel_on_abandon=True)

    def cache_pin(self, prompt: str | None = None, **options: Unpack[PromptOptions]) -> dict[str, Any]:
        """Keep a cached prompt from eviction."""
        return self._call(methods.CACHE_PIN, prompt_params(prompt, **options))

    def cache_unpin(self, prompt: str | None = None, **options: Unpack[PromptOptions]) -> dict[str, Any]:
        return self._call(methods.CACHE_UNPIN, prompt_params(prompt, **options))

    def close(self) -> None:
        """Close the connection; the daemon cancels whatever was still running for it."""
        self._lost = self._lost or "the client was closed"
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------

    def _call(self, method: str, params: dict[str, Any], cancel_on_abandon: bool = False) -> Any:
        msgid = self._start(method, params)
        try:
            while not isinstance(item := self._next_item(msgid), Response):
                pass  # chunks of a request that did not ask to stream: nothing to do with them
        except (RequestTimeout, KeyboardInterrupt):
            if cancel_on_abandon:
                self._cancel_quietly(msgid)  # the daemon would otherwise keep computing for nobody
            raise
        finally:
            self._inboxes.pop(msgid, None)  # a late reply then finds no inbox and is dropped
        return result_of(item)

    def _start(self, method: str, params: dict[str, Any]) -> int:
        msgid = self._msgids.take()
        self._inboxes[msgid] = deque()
        try:
            self._send(encode_request(msgid, method, params))
        except BaseException:
            del self._inboxes[msgid]
            raise
        return msgid

    def _send(self, data: bytes) -> None:
        if self._lost:
            raise ConnectionLost(self._lost)
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise self._lose(f"the daemon closed the connection ({exc.strerror or exc})") from None

    def _cancel_quietly(self, msgid: int) -> None:
        """Send a cancel without waiting: its reply has no inbox and is dropped."""
        try:
            self._send(encode_request(self._msgids.take(), methods.CANCEL, cancel_params(msgid)))
        except PrefixdError:
            pass  # the connection is gone, which cancels the request anyway

    def _next_item(self, msgid: int) -> Response | dict[str, Any]:
        """Block until a chunk map or the final Response for msgid is there."""
        inbox = self._inboxes[msgid]
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while not inbox:
            self._read(deadline)
        return inbox.popleft()

    def _read(self, deadline: float | None) -> None:
        if self._lost:
            raise ConnectionLost(self._lost)
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(f"no reply from the daemon within {self.timeout} s")
            self._sock.settimeout(remaining)
        try:
            data = self._sock.recv(READ_CHUNK_BYTES)
        except TimeoutError:
            raise RequestTimeout(f"no reply from the daemon within {self.timeout} s") from None
        except OSError as exc:
            raise self._lose(f"the connection to the daemon broke ({exc.strerror or exc})") from None
        if not data:
            raise self._lose("the daemon closed the connection")
        try:
            self._decoder.feed(data)
            messages = list(self._decoder)
        except RpcError as err:  # the stream cannot be resynchronised after bad framing
            raise self._lose(f"the daemon sent an unreadable message: {err.message}") from None
        fatal = None
        for message in messages:
            fatal = fatal or self._route(message)
        if fatal is not None:
            self._lose(fatal.message)
            raise fatal

    def _route(self, message: Any) -> PrefixdError | None:
        """File a message in the inbox of its msgid; unknown ones are dropped."""
        if isinstance(message, Response):
            if (fatal := connection_level_error(message)) is not None:
                return fatal
            inbox = self._inboxes.get(message.msgid)
        elif isinstance(message, Notification) and (target := chunk_target(message)):
            message = target[1]
            inbox = self._inboxes.get(target[0])
        else:
            inbox = None  # other notifications, requests, undecodable items
        if inbox is not None:
            inbox.append(message)
        return None

    def _lose(self, reason: str) -> ConnectionLost:
        self._lost = reason
        self._sock.close()
        return ConnectionLost(reason)


class GenerateStream:
    """Chunk maps ({id, text, tokens, index}) of one streamed generate, in order.

    After iteration ends, ``result`` holds the final result. ``close()`` (or
    leaving a ``with`` block) before the end cancels the request and waits for
    its final result, whose finish_reason is then "cancelled". A plain
    ``break`` out of a for loop does not close the stream; dropping the last
    reference to it sends the cancel without waiting.
    """

    def __init__(self, client: Client, msgid: int):
        self.msgid = msgid
        self.result: dict[str, Any] | None = None
        self._client = client
        self._done = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._done:
            raise StopIteration
        try:
            item = self._client._next_item(self.msgid)
            if isinstance(item, Response):
                self._finish()
                self.result = result_of(item)
                raise StopIteration
        except BaseException:
            self._finish()
            raise
        return item

    def text(self) -> str:
        """Read the stream to its end and return the whole generated text."""
        return "".join(chunk.get("text", "") for chunk in self)

    def close(self) -> None:
        """Cancel the request if it is still running, and wait for its final result."""
        if self._done:
            return
        try:
            self._client.cancel(self.msgid)
            for _ in self:
                pass
        except Cancelled:
            pass  # a request cancelled before it produced anything may answer with an error
        finally:
            self._finish()

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except PrefixdError:
            pass  # keep the exception that ended the block, not one about cleaning up

    def _finish(self) -> None:
        self._done = True
        self._client._inboxes.pop(self.msgid, None)

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self._client._cancel_quietly(self.msgid)
            self._finish()
