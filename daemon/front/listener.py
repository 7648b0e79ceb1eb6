"""Binding the daemon's Unix socket safely.

The parent directory is created private (0700) and the socket itself gets
mode 0600 from a umask set around bind(), so there is no window in which
another user could connect. A socket file left by a dead daemon is replaced;
a live daemon on the path is never displaced.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from pathlib import Path


class SocketInUse(RuntimeError):
    """Another daemon is serving on the path."""


def check_socket_path(path: Path) -> None:
    """Raise SocketInUse if a live daemon answers on ``path``; remove a stale socket file."""
    if not path.exists() and not path.is_symlink():
        return
    mode = path.lstat().st_mode
    if not stat.S_ISSOCK(mode):
        raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            path.unlink(missing_ok=True)  # stale: its daemon is gone
            return
        raise
    else:
        raise SocketInUse(f"another prefixd is already serving on {path}; stop it or pass a different --socket")
    finally:
        probe.close()


def bind_unix_socket(path: Path) -> socket.socket:
    """A listening socket at ``path`` with mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock
