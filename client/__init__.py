"""prefixd clients and command line.

``Client`` blocks on a plain socket; ``AsyncClient`` is its asyncio twin with
the same method names. Errors are typed: see ``prefixd.client.errors``.
"""

from .async_client import AsyncClient, AsyncGenerateStream
from .errors import ConnectionLost, DaemonUnavailable, PrefixdError, RequestTimeout
from .sync_client import Client, GenerateStream

__all__ = [
    "AsyncClient",
    "AsyncGenerateStream",
    "Client",
    "ConnectionLost",
    "DaemonUnavailable",
    "GenerateStream",
    "PrefixdError",
    "RequestTimeout",
]
