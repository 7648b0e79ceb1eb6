"""launchd socket activation, exercised on Linux through a ctypes stand-in for libSystem.

The stand-in is a real C-callable function (ctypes.CFUNCTYPE) that fills the
``int **fds`` / ``size_t *cnt`` out-parameters with an array from libc's
malloc, as launch_activate_socket does, so the pointer handling and the free()
are the code that runs on a Mac. What is not covered here: libSystem itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import plistlib
import socket
from pathlib import Path

import pytest

from prefixd.daemon.service import launchd, socket_activation, systemd

REPO = Path(__file__).resolve().parents[2]
LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
LIBC.malloc.restype = ctypes.c_void_p
LIBC.malloc.argtypes = [ctypes.c_size_t]
ACTIVATE_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_int)), ctypes.POINTER(ctypes.c_size_t))
FREE_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class StandIn:
    """launch_activate_socket and free, recording what they were asked."""

    def __init__(self, fds: list[int], error: int = 0):
        self.fds, self.error = fds, error
        self.names: list[bytes] = []
        self.freed: list[int] = []
        self.activate = ACTIVATE_TYPE(self._activate)
        self.free = FREE_TYPE(self._free)

    def _activate(self, name, fds_out, count_out):
        self.names.append(name)
        if self.error:
            return self.error
        array = ctypes.cast(LIBC.malloc(ctypes.sizeof(ctypes.c_int) * max(1, len(self.fds))), ctypes.POINTER(ctypes.c_int))
        for index, fd in enumerate(self.fds):
            array[index] = fd
        fds_out[0] = array
        count_out[0] = len(self.fds)
        return 0

    def _free(self, pointer):
        self.freed.append(pointer)
        LIBC.free(ctypes.c_void_p(pointer))


def test_activate_returns_the_fds_and_frees_the_array():
    stand_in = StandIn([7, 9])
    assert launchd._activate(stand_in.activate, stand_in.free, "Listeners") == [7, 9]
    assert stand_in.names == [b"Listeners"]
    assert len(stand_in.freed) == 1 and stand_in.freed[0]


@pytest.mark.parametrize("error", [errno.ESRCH, errno.ENOENT])
def test_not_started_by_launchd_means_no_socket(error):
    stand_in = StandIn([], error=error)
    assert launchd._activate(stand_in.activate, stand_in.free, "Listeners") == []
    assert stand_in.freed == []


def test_other_errors_are_reported():
    stand_in = StandIn([], error=errno.EALREADY)
    with pytest.raises(launchd.LaunchdError, match="Listeners"):
        launchd._activate(stand_in.activate, stand_in.free, "Listeners")


def test_off_macos_there_is_nothing_to_take():
    assert launchd.activate_socket() == []


def test_the_daemon_serves_the_socket_launchd_passes(tmp_path, monkeypatch):
    """The whole macOS path of take_inherited_socket, with libSystem replaced by the stand-in."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(tmp_path / "s.sock"))
    server.listen()
    stand_in = StandIn([server.detach()])
    monkeypatch.setattr(launchd.sys, "platform", "darwin")
    monkeypatch.setattr(launchd, "_load_libsystem", lambda: (stand_in.activate, stand_in.free))
    monkeypatch.setattr(systemd, "listen_fds_with_names", lambda: [])
    sock, origin = socket_activation.take_inherited_socket()
    with sock:
        assert origin == "launchd"
        assert sock.getsockname() == str(tmp_path / "s.sock")
        assert not sock.get_inheritable()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(tmp_path / "s.sock"))  # it listens
    assert stand_in.names == [launchd.SOCKET_NAME.encode()]


def test_plist_asks_launchd_for_the_socket_the_daemon_takes():
    plist = plistlib.loads((REPO / "contrib" / "launchd" / "com.prefixd.daemon.plist").read_bytes())
    entry = plist["Sockets"][launchd.SOCKET_NAME]
    assert entry["SockPathName"].endswith("/Library/Caches/prefixd/prefixd.sock")  # the clients' default on macOS
    assert entry["SockPathMode"] == 0o600
    assert plist["ProgramArguments"][1:2] == ["serve"]
    assert plist["Label"] == "com.prefixd.daemon"
