"""launchd socket activation on macOS: ``launch_activate_socket`` from libSystem, through ctypes.

A LaunchAgent whose plist has a ``Sockets`` entry (see
contrib/launchd/com.prefixd.daemon.plist) has launchd create and listen on
the socket and start the daemon at the first connection; the daemon then asks
launchd for the listening descriptors by the entry's name. Outside launchd (or
off macOS) there is nothing to take and ``activate_socket`` returns [].
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import sys
from typing import Any

SOCKET_NAME = "Listeners"  # the key under <Sockets> in the plist

_ActivateFn = Any  # int launch_activate_socket(const char *name, int **fds, size_t *cnt)


class LaunchdError(OSError):
    """launchd knows us but would not hand over the socket."""


def activate_socket(name: str = SOCKET_NAME) -> list[int]:
    """The listening fds launchd holds for ``name``; [] when not started by launchd or not on macOS."""
    if sys.platform != "darwin":
        return []
    activate, free = _load_libsystem()
    return _activate(activate, free, name)


def _load_libsystem() -> tuple[_ActivateFn, Any]:
    libsystem = ctypes.CDLL(ctypes.util.find_library("System") or "/usr/lib/libSystem.B.dylib", use_errno=True)
    activate = libsystem.launch_activate_socket
    activate.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_int)), ctypes.POINTER(ctypes.c_size_t)]
    activate.restype = ctypes.c_int
    free = libsystem.free
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    return activate, free


def _activate(activate: _ActivateFn, free: Any, name: str) -> list[int]:
    fds = ctypes.POINTER(ctypes.c_int)()
    count = ctypes.c_size_t(0)
    error = activate(name.encode(), ctypes.byref(fds), ctypes.byref(count))
    # ESRCH: this process is not managed by launchd; ENOENT: its plist has no such socket.
    if error in (errno.ESRCH, errno.ENOENT):
        return []
    if error:
        raise LaunchdError(error, f"launch_activate_socket({name!r}) failed: {os.strerror(error)}")
    try:
        return [fds[index] for index in range(count.value)]
    finally:
        free(fds)  # the array is malloc'ed by libSystem; the fds themselves are ours
