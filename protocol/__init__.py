"""prefixd's wire protocol: pure data and a codec, no sockets and no asyncio.

Read docs/protocol.md for the prose; this package is the executable form of it.
"""

from .codec import MAX_MESSAGE_BYTES, StreamDecoder, encode, encode_raw
from .errors import ErrorCode, RpcError
from .messages import Message, MessageType, Notification, Request, Response, parse_message
from .methods import PROTOCOL_VERSION

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "ErrorCode",
    "Message",
    "MessageType",
    "Notification",
    "Request",
    "Response",
    "RpcError",
    "StreamDecoder",
    "encode",
    "encode_raw",
    "parse_message",
]
