"""Which user serves the socket we connected to, and whether we may talk to it.

A socket path proves nothing: if another user could replace the socket (a
socket directory they made or may write to), connecting to the path would
hand them our prompts. The kernel knows who listens on the other end, so
right after connecting, before a byte is sent, the clients check it: the
daemon must run as our own uid or as root, or as a uid the caller says it
trusts (``trusted_uids``, for a daemon shared through ``--allow-uid``).

Re-implemented here rather than imported from the daemon's peer_auth, because
the clients depend on nothing but prefixd.protocol.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import struct
import sys
from typing import Any, Iterable

from .errors import DaemonUnavailable


def peer_uid(sock: Any) -> int | None:
    """The uid of the process on the other end of a connected Unix socket; None where the platform cannot tell.

    ``sock`` is a socket.socket or asyncio's stand-in for one (get_extra_info("socket")).
    """
    try:
        if hasattr(socket, "SO_PEERCRED"):  # Linux: struct ucred { pid_t pid; uid_t uid; gid_t gid; }
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
            return struct.unpack("iII", raw)[1]
        if sys.platform == "darwin" or "bsd" in sys.platform:
            return _getpeereid_uid(sock.fileno())
    except OSError:
        pass
    return None


def _getpeereid_uid(fd: int) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    uid, gid = ctypes.c_uint32(), ctypes.c_uint32()
    if libc.getpeereid(fd, ctypes.byref(uid), ctypes.byref(gid)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return uid.value


def refuse_foreign_daemon(sock: Any, socket_path: Any, trusted_uids: Iterable[int] = ()) -> None:
    """Raise DaemonUnavailable unless the peer of ``sock`` runs as us, as root, or as a trusted uid.

    A peer whose uid the platform cannot report is accepted: the socket's
    directory and mode are then the only guard, as they were before.
    """
    uid = peer_uid(sock)
    own_uid = os.geteuid()
    if uid is None or uid in (own_uid, 0) or uid in set(trusted_uids):
        return
    raise DaemonUnavailable(
        f"refusing to talk to {socket_path}: it is served by uid {uid}, not by you (uid {own_uid}) or root; "
        f"another user may have put their socket there. Nothing was sent. If you meant to use uid {uid}'s daemon, "
        f"pass trusted_uids=[{uid}] to the client",
        {"peer_uid": uid},
    )
