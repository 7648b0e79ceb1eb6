"""systemd's socket activation and notify protocols, without libsystemd.

``listen_fds()`` is ``sd_listen_fds()``: the sockets systemd opened for us
(fd 3 on), and only when ``LISTEN_PID`` names this process. ``Notifier`` is
``sd_notify()``: ``KEY=value`` lines in one datagram to ``$NOTIFY_SOCKET``.
Outside systemd both do nothing, so the daemon calls them unconditionally.
"""

from __future__ import annotations

import fcntl
import os
import socket
from typing import NamedTuple

import structlog

log = structlog.get_logger("prefixd.systemd")

SD_LISTEN_FDS_START = 3
_LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


class ListenFd(NamedTuple):
    fd: int
    name: str  # FileDescriptorName= of the socket unit; "unknown" when unnamed


def listen_fds_with_names(unset_environment: bool = True) -> list[ListenFd]:
    """The passed file descriptors with their names; [] when none were passed to us.

    Like ``sd_listen_fds_with_names``: the variables are honoured only when
    LISTEN_PID is our pid (a child we spawn must not take them), and are
    removed afterwards unless ``unset_environment`` is false.
    """
    env = os.environ
    try:
        listen_pid = int(env.get("LISTEN_PID", ""))
        num_fds = int(env.get("LISTEN_FDS", ""))
    except ValueError:
        listen_pid, num_fds = 0, 0
    names = env.get("LISTEN_FDNAMES", "").split(":")
    if unset_environment:
        for name in _LISTEN_VARS:
            env.pop(name, None)
    if listen_pid != os.getpid() or num_fds <= 0:
        return []
    fds = []
    for index in range(num_fds):
        fd = SD_LISTEN_FDS_START + index
        # Inherited fds are not close-on-exec; ours must not leak into children.
        fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
        name = names[index] if index < len(names) and names[index] else "unknown"
        fds.append(ListenFd(fd, name))
    return fds


def listen_fds(unset_environment: bool = True) -> list[int]:
    """``sd_listen_fds``: the passed file descriptors (3, 4, ...); [] outside socket activation."""
    return [item.fd for item in listen_fds_with_names(unset_environment)]


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WATCHDOG_USEC), or None when not asked for."""
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    watchdog_pid = os.environ.get("WATCHDOG_PID")
    if usec <= 0 or (watchdog_pid and watchdog_pid != str(os.getpid())):
        return None
    return usec / 2 / 1e6


class Notifier:
    """Sends ``sd_notify`` messages; every call is a no-op when NOTIFY_SOCKET is unset.

    ``notify(READY=1, STATUS="serving")`` sends ``READY=1\\nSTATUS=serving``.
    Send errors are logged once and otherwise ignored: a service manager that
    went away must not take the daemon down.
    """

    def __init__(self, address: str | None = None):
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self.address = address or None
        self._sock: socket.socket | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: object) -> bool:
        """Send one message; True when it was delivered."""
        if self.address is None:
            return False
        message = "\n".join(f"{key}={_one_line(value)}" for key, value in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message.encode(), self.address)
        except OSError as exc:
            if not self._failed:
                log.warning("sd_notify_failed", address=self.address.replace("\0", "@"), error=str(exc))
                self._failed = True
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def notify(**fields: object) -> bool:
    """One-shot ``sd_notify`` with the environment's NOTIFY_SOCKET (see Notifier)."""
    notifier = Notifier()
    try:
        return notifier.notify(**fields)
    finally:
        notifier.close()


def _one_line(value: object) -> str:
    # A newline would start a new KEY=value assignment.
    return str(value).replace("\n", " ")
