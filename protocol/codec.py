"""Encoding and stream decoding of msgpack-RPC messages.

msgpack-RPC has no length prefix: messages are msgpack arrays written back to
back on the stream. The decoder therefore buffers bytes until a whole object is
there, and refuses to buffer more than ``MAX_MESSAGE_BYTES`` for one message.
Strings are UTF-8 (msgpack str type); binary data uses the bin type.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack

from .errors import ErrorCode, RpcError
from .messages import Message, parse_message

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
READ_SLACK_BYTES = 1024 * 1024  # callers feed reads of at most this size


def encode(message: Message) -> bytes:
    """Serialize a Request, Response or Notification to msgpack bytes."""
    return msgpack.packb(message.to_wire(), use_bin_type=True)


def encode_raw(obj: Any) -> bytes:
    """Serialize an already-shaped wire array (for tests and other tools)."""
    return msgpack.packb(obj, use_bin_type=True)


class StreamDecoder:
    """Feed it bytes as they arrive; iterate it for whole messages.

    A framing failure (bytes that are not msgpack, or a message larger than
    ``max_message_bytes``) raises RpcError with PARSE_ERROR or
    MESSAGE_TOO_LARGE: the stream cannot be resynchronised after either, so the
    caller should answer once and close. A well-formed msgpack object that is
    not a msgpack-RPC message yields an RpcError item instead of a message, so
    the caller can answer it and carry on.
    """

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.max_message_bytes = max_message_bytes
        self._unpacker = msgpack.Unpacker(
            raw=False,
            strict_map_key=False,
            # The buffer holds a partial message plus one read, so it gets
            # room beyond the per-message limit, which is checked per message.
            max_buffer_size=max_message_bytes + READ_SLACK_BYTES,
        )
        self._num_fed_bytes = 0
        self._num_consumed_bytes = 0

    def feed(self, data: bytes) -> None:
        """Add bytes from the stream."""
        self._num_fed_bytes += len(data)
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull:
            raise RpcError(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"message larger than the limit of {self.max_message_bytes} bytes",
            ) from None

    def __iter__(self) -> Iterator[Message | RpcError]:
        while True:
            try:
                obj = next(self._unpacker)
            except StopIteration:
                return
            except msgpack.BufferFull:
                raise RpcError(
                    ErrorCode.MESSAGE_TOO_LARGE,
                    f"message larger than the limit of {self.max_message_bytes} bytes",
                ) from None
            except (ValueError, msgpack.UnpackException, UnicodeDecodeError) as exc:
                raise RpcError(ErrorCode.PARSE_ERROR, f"not valid msgpack: {exc}") from None
            message_bytes = self._unpacker.tell() - self._num_consumed_bytes
            self._num_consumed_bytes = self._unpacker.tell()
            if message_bytes > self.max_message_bytes:
                raise RpcError(
                    ErrorCode.MESSAGE_TOO_LARGE,
                    f"message of {message_bytes} bytes is larger than the limit of {self.max_message_bytes} bytes",
                )
            try:
                yield parse_message(obj)
            except RpcError as err:
                yield err

    @property
    def num_buffered_bytes(self) -> int:
        """Bytes received but not yet decoded (a half-sent message)."""
        return self._num_fed_bytes - self._num_consumed_bytes
