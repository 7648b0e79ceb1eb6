"""Encoding and stream decoding of msgpack-RPC messages.

msgpack-RPC has no length prefix: messages are msgpack arrays written back to
back on the stream. The decoder therefore buffers bytes until a whole object is
there, and refuses to buffer more than ``MAX_MESSAGE_BYTES`` for one message.
Strings are UTF-8 (msgpack str type); binary data uses the bin type.

Two kinds of well-formed msgpack cannot become Python objects the usual way: a
map with an array or a map as a key (no dict can hold it) and nesting deeper
than msgpack's C unpacker allows. Either makes the unpacker lose its place in
the stream, so the decoder works around both: maps are built from key/value
pairs by the decoder itself, and an object too deep to decode is measured by
``ObjectEnd`` (a scanner that reads only the msgpack headers) and skipped
exactly. Both become an INVALID_REQUEST item and the stream stays in sync.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msgpack

from .errors import ErrorCode, RpcError
from .messages import Message, parse_message, request_msgid

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
READ_SLACK_BYTES = 1024 * 1024  # callers feed reads of at most this size
MAX_DECODABLE_DEPTH = 1024  # msgpack's C unpacker refuses deeper nesting (StackError)


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
    not a msgpack-RPC message (including a map keyed by an array or a map, and
    an object nested deeper than ``MAX_DECODABLE_DEPTH``) yields an RpcError
    item instead of a message, so the caller can answer it and carry on.
    """

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.max_message_bytes = max_message_bytes
        self._num_fed_bytes = 0
        self._num_consumed_bytes = 0  # stream offset where the next message starts
        # Our own copy of the bytes from the next message on: the unpacker's
        # buffer is private, and a message too deep for it must be re-read.
        self._pending = bytearray()
        self._pending_start = 0  # stream offset of _pending[0]
        self._too_deep: ObjectEnd | None = None  # set while skipping a message too deep to decode
        self._unhashable_key_seen = False
        self._start_unpacker(b"")

    def _start_unpacker(self, data: bytes) -> None:
        self._unpacker = msgpack.Unpacker(
            raw=False,
            strict_map_key=False,
            # Maps arrive as key/value pairs, so a key that cannot be hashed
            # never raises inside the unpacker (which would lose its place).
            object_pairs_hook=self._map_from_pairs,
            # The buffer holds a partial message plus one read, so it gets
            # room beyond the per-message limit, which is checked per message.
            max_buffer_size=self.max_message_bytes + READ_SLACK_BYTES,
        )
        self._unpacker_start = self._num_consumed_bytes  # stream offset of the unpacker's tell() == 0
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull:
            raise _too_large(f"message larger than the limit of {self.max_message_bytes} bytes") from None

    def _map_from_pairs(self, pairs: list[tuple[Any, Any]]) -> dict[Any, Any] | None:
        try:
            return dict(pairs)
        except TypeError:  # an array or a map as a key; the whole message is refused once it is complete
            self._unhashable_key_seen = True
            return None

    def feed(self, data: bytes) -> None:
        """Add bytes from the stream."""
        self._num_fed_bytes += len(data)
        del self._pending[: self._num_consumed_bytes - self._pending_start]
        self._pending_start = self._num_consumed_bytes
        self._pending += data
        if self._too_deep is not None:
            return  # the unpacker is restarted after the deep message ends
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull:
            raise _too_large(f"message larger than the limit of {self.max_message_bytes} bytes") from None

    def __iter__(self) -> Iterator[Message | RpcError]:
        while True:
            if self._too_deep is not None:
                if not self._skip_too_deep():
                    return
                yield self._too_deep_error()
                continue
            try:
                obj = next(self._unpacker)
            except StopIteration:
                return
            except msgpack.BufferFull:
                raise _too_large(f"message larger than the limit of {self.max_message_bytes} bytes") from None
            except msgpack.StackError:  # before ValueError: StackError is one
                self._begin_skipping_too_deep()
                continue
            except (ValueError, msgpack.UnpackException, UnicodeDecodeError) as exc:
                raise RpcError(ErrorCode.PARSE_ERROR, f"not valid msgpack: {exc}") from None
            message_end = self._unpacker_start + self._unpacker.tell()
            message_bytes = message_end - self._num_consumed_bytes
            self._num_consumed_bytes = message_end
            if message_bytes > self.max_message_bytes:
                raise _too_large(
                    f"message of {message_bytes} bytes is larger than the limit of {self.max_message_bytes} bytes"
                )
            if self._unhashable_key_seen:
                self._unhashable_key_seen = False
                yield _invalid(
                    "map keys must be strings; this message has an array or a map as a key", request_msgid(obj)
                )
                continue
            try:
                yield parse_message(obj)
            except RpcError as err:
                yield err

    # -- a message nested too deep for the unpacker ----------------------------------

    def _begin_skipping_too_deep(self) -> None:
        # The unpacker stopped somewhere inside the message; start over from
        # its first byte with a scanner that keeps no Python objects.
        del self._pending[: self._num_consumed_bytes - self._pending_start]
        self._pending_start = self._num_consumed_bytes
        self._too_deep = ObjectEnd()
        self._unhashable_key_seen = False  # whatever the unpacker saw of this message is moot

    def _skip_too_deep(self) -> bool:
        """Scan on through the deep message; True once its end has arrived."""
        assert self._too_deep is not None
        try:
            end = self._too_deep.scan(self._pending)
        except ValueError as exc:
            raise RpcError(ErrorCode.PARSE_ERROR, f"not valid msgpack: {exc}") from None
        if self._too_deep.min_end > self.max_message_bytes:
            raise _too_large(f"message larger than the limit of {self.max_message_bytes} bytes")
        if end is None:
            return False
        self._num_consumed_bytes += end
        self._start_unpacker(bytes(self._pending[end:]))
        return True

    def _too_deep_error(self) -> RpcError:
        assert self._too_deep is not None
        frame_start = bytes(self._pending[:_MSGID_PEEK_BYTES])
        self._too_deep = None
        return _invalid(
            f"a message may nest arrays and maps at most {MAX_DECODABLE_DEPTH} deep", _peek_request_msgid(frame_start)
        )

    @property
    def num_buffered_bytes(self) -> int:
        """Bytes received but not yet decoded (a half-sent message)."""
        return self._num_fed_bytes - self._num_consumed_bytes


def _too_large(message: str) -> RpcError:
    return RpcError(ErrorCode.MESSAGE_TOO_LARGE, message)


def _invalid(message: str, msgid: int | None) -> RpcError:
    return RpcError(ErrorCode.INVALID_REQUEST, message, None if msgid is None else {"msgid": msgid})


# A request's header: array of 4, type, msgid (at most 5 + 1 + 9 bytes).
_MSGID_PEEK_BYTES = 16
_ARRAY_OF_FOUR_HEADERS = (b"\x94", b"\xdc\x00\x04", b"\xdd\x00\x00\x00\x04")


def _peek_request_msgid(frame_start: bytes) -> int | None:
    """The msgid of a request [0, msgid, ...] read from the first bytes of a message too deep to decode."""
    for header in _ARRAY_OF_FOUR_HEADERS:
        if frame_start.startswith(header):
            unpacker = msgpack.Unpacker(raw=False, object_pairs_hook=list)  # pairs: no key is ever hashed
            unpacker.feed(frame_start[len(header) :])
            try:
                leading = [next(unpacker), next(unpacker)]
            except (StopIteration, ValueError, msgpack.UnpackException, UnicodeDecodeError):
                return None  # the type or the msgid is not a scalar: no msgid to report
            return request_msgid([*leading, None, None])
    return None


# -- finding where a msgpack object ends, from its headers alone -------------------------


def _msgpack_layout() -> tuple[list[int], dict[int, tuple[int, int]], dict[int, tuple[int, int]]]:
    """Tables of the msgpack format by first byte (https://github.com/msgpack/msgpack/blob/master/spec.md).

    fixed[b]: the whole size of an object whose first byte fixes it, 0 if it does not;
    sized[b]: (length bytes, extra header bytes) of str, bin and ext, whose payload length follows;
    containers[b]: (count bytes, items per count) of array 16/32 and map 16/32.
    """
    fixed = [0] * 256
    for lead in (*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3):
        fixed[lead] = 1  # fixints, nil, false, true
    for lead in range(0xA0, 0xC0):
        fixed[lead] = 1 + (lead & 0x1F)  # fixstr
    for lead, size in {
        0xCA: 5,
        0xCB: 9,
        0xCC: 2,
        0xCD: 3,
        0xCE: 5,
        0xCF: 9,
        0xD0: 2,
        0xD1: 3,
        0xD2: 5,
        0xD3: 9,
        0xD4: 3,
        0xD5: 4,
        0xD6: 6,
        0xD7: 10,
        0xD8: 18,
    }.items():
        fixed[lead] = size  # floats, ints, fixext
    sized = {
        0xC4: (1, 0),
        0xC5: (2, 0),
        0xC6: (4, 0),
        0xD9: (1, 0),
        0xDA: (2, 0),
        0xDB: (4, 0),  # bin, str
        0xC7: (1, 1),
        0xC8: (2, 1),
        0xC9: (4, 1),
    }  # ext: the type byte follows the length
    containers = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}
    return fixed, sized, containers


_FIXED_SIZE, _SIZED, _CONTAINERS = _msgpack_layout()
# Runs the scanner takes in one step (hostile input is made of little else):
_ONE_BYTE_RUN = re.compile(rb"[\x00-\x7f\xa0\xc0\xc2\xc3\xe0-\xff]+")  # fixints, "", nil, booleans
_SINGLETON_ARRAY_RUN = re.compile(rb"\x91+")  # [[[[...]]]]: as many levels, the same bookkeeping as one


class ObjectEnd:
    """Where one msgpack object ends, found by reading headers only, resumable as bytes arrive.

    Call ``scan(buffer)`` with the bytes from the object's first byte on,
    again with more bytes each time it returns None. It keeps one count per
    open array or map (never the objects); an array or map that is the last
    item of its parent takes the parent's place, so a chain of last items
    (``[1, [1, [1, ...]]]``) of any depth costs one count. Runs of one-byte
    items and of ``[[[...]]]`` headers are taken by a regex in one step; any
    other item costs a turn of a Python loop (about a microsecond), which only
    messages too deep for msgpack's own unpacker ever pay. Raises ValueError
    on the one byte msgpack never uses (0xc1).
    """

    def __init__(self) -> None:
        self.min_end = 0  # the object is at least this long (its length, once complete)
        self._open_items = [1]  # items still to read, per open container; the bottom one is the object itself
        self._all_headers_read = False  # only the last item's payload may still be arriving

    def scan(self, buffer: bytes | bytearray) -> int | None:
        """The object's length once all of it is in ``buffer``, else None."""
        size, pos = len(buffer), self.min_end
        if self._all_headers_read:
            return pos if pos <= size else None
        open_items = self._open_items
        fixed_size = _FIXED_SIZE
        left = open_items.pop()  # items left in the innermost open container, kept in a local for speed
        while pos < size:
            lead = buffer[pos]
            step = fixed_size[lead]
            if step == 1 and left > 1:
                pos_after = _ONE_BYTE_RUN.match(buffer, pos, min(size, pos + left)).end()
                left -= pos_after - pos
                pos = pos_after
                children = 0
            elif step:
                pos += step  # may pass the end of the buffer: the rest is on its way
                left -= 1
                children = 0
            elif lead == 0x91:
                pos = _SINGLETON_ARRAY_RUN.match(buffer, pos).end()
                left -= 1
                children = 1
            elif 0x80 <= lead <= 0x9F:  # fixmap, fixarray
                pos += 1
                left -= 1
                children = (lead & 0x0F) * (2 if lead < 0x90 else 1)  # a map counts pairs
            elif lead in _CONTAINERS:
                count_bytes, items_per_count = _CONTAINERS[lead]
                if pos + 1 + count_bytes > size:
                    break  # the header itself is incomplete
                children = int.from_bytes(buffer[pos + 1 : pos + 1 + count_bytes], "big") * items_per_count
                pos += 1 + count_bytes
                left -= 1
            elif lead in _SIZED:
                length_bytes, extra_bytes = _SIZED[lead]
                if pos + 1 + length_bytes > size:
                    break
                payload = int.from_bytes(buffer[pos + 1 : pos + 1 + length_bytes], "big")
                pos += 1 + length_bytes + extra_bytes + payload
                left -= 1
                children = 0
            else:
                raise ValueError(f"byte 0x{lead:02x} at offset {pos} is not msgpack")
            if children:
                if left:
                    open_items.append(left)
                left = children
            while not left:
                if not open_items:
                    self._all_headers_read = True
                    self.min_end = pos
                    return pos if pos <= size else None
                left = open_items.pop()
        open_items.append(left)
        self.min_end = pos
        return None
