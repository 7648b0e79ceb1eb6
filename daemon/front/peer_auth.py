"""Who is on the other end of a Unix socket, and whether they may talk to us.

The kernel vouches for a Unix-socket peer's uid (and, on Linux and macOS,
its pid): ``SO_PEERCRED`` on Linux, ``getpeereid`` plus ``LOCAL_PEERPID`` on
macOS and the BSDs. The socket file is already mode 0600, but a daemon
started by root or with a loosened mode should still only serve its own
user: ``PeerPolicy`` refuses every other uid unless it was told to allow it
(``--allow-uid``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Iterable

# macOS <sys/un.h>: SOL_LOCAL level and its LOCAL_PEERPID option.
_SOL_LOCAL = 0
_LOCAL_PEERPID = 0x002


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """A peer as the kernel reports it; None where the platform cannot tell."""

    pid: int | None = None
    uid: int | None = None
    gid: int | None = None


UNKNOWN = PeerCredentials()


def peer_credentials(sock: socket.socket | None) -> PeerCredentials:
    """The credentials of a connected Unix socket's peer (UNKNOWN for TCP or on failure)."""
    if sock is None or sock.family != socket.AF_UNIX:
        return UNKNOWN
    try:
        if hasattr(socket, "SO_PEERCRED"):
            return _linux_peercred(sock)
        if sys.platform == "darwin" or "bsd" in sys.platform:
            return _bsd_peercred(sock)
    except OSError:
        pass
    return UNKNOWN


def _linux_peercred(sock: socket.socket) -> PeerCredentials:
    # struct ucred { pid_t pid; uid_t uid; gid_t gid; }
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    pid, uid, gid = struct.unpack("iII", raw)
    return PeerCredentials(pid=pid or None, uid=uid, gid=gid)


def _bsd_peercred(sock: socket.socket) -> PeerCredentials:
    uid, gid = _getpeereid(sock.fileno())
    pid = None
    if sys.platform == "darwin":
        try:
            raw = sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERPID, struct.calcsize("i"))
            pid = struct.unpack("i", raw)[0] or None
        except OSError:
            pass  # older kernels: the uid is what matters
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


def _getpeereid(fd: int) -> tuple[int, int]:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    uid, gid = ctypes.c_uint32(), ctypes.c_uint32()
    if libc.getpeereid(fd, ctypes.byref(uid), ctypes.byref(gid)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return uid.value, gid.value


class PeerPolicy:
    """Which uids may use the daemon: the daemon's own uid plus ``allowed_uids``."""

    def __init__(self, allowed_uids: Iterable[int] = (), own_uid: int | None = None):
        self.own_uid = os.getuid() if own_uid is None else own_uid
        self.allowed_uids = frozenset({self.own_uid, *allowed_uids})

    def refusal(self, peer: PeerCredentials) -> str | None:
        """Why ``peer`` is refused, or None if it may connect.

        A peer whose uid the platform cannot report is let through: the
        socket's 0600 mode is then the only guard, as before this check.
        """
        if peer.uid is None or peer.uid in self.allowed_uids:
            return None
        allowed = ", ".join(str(uid) for uid in sorted(self.allowed_uids))
        return f"uid {peer.uid} is not allowed (allowed: {allowed}; see --allow-uid)"
