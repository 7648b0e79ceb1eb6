"""Where the daemon's socket lives by default (shared by daemon and clients).

Order: ``$PREFIXD_SOCKET``; on macOS the user's cache dir
(``~/Library/Caches/prefixd/prefixd.sock``); elsewhere
``$XDG_RUNTIME_DIR/prefixd/prefixd.sock``, or a per-user temp dir
(``/tmp/prefixd-<uid>/prefixd.sock``) when XDG_RUNTIME_DIR is unset.

Anyone may create ``/tmp/prefixd-<uid>`` first, so a path here is only a
name: the daemon creates its directory 0700 and refuses one that is a link,
another user's, or writable by others (daemon/front/listener.py), and the
clients refuse a socket served by another uid (client/daemon_owner.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

SOCKET_ENV = "PREFIXD_SOCKET"
SOCKET_NAME = "prefixd.sock"


def default_socket_path() -> Path:
    """The socket path a client connects to and a daemon binds when none is given."""
    explicit = os.environ.get(SOCKET_ENV)
    if explicit:
        return Path(explicit).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "prefixd" / SOCKET_NAME
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir and os.path.isdir(runtime_dir):
        return Path(runtime_dir) / "prefixd" / SOCKET_NAME
    return Path(tempfile.gettempdir()) / f"prefixd-{os.getuid()}" / SOCKET_NAME
