"""Sockets a service manager opened for us: systemd's LISTEN_FDS or launchd's activation.

The service manager owns the socket file: the daemon neither checks,
replaces nor removes it.
"""

from __future__ import annotations

import socket

from . import launchd, systemd


class InheritedSocketError(OSError):
    """A service manager passed us something we cannot serve on."""


def take_inherited_socket() -> tuple[socket.socket, str] | None:
    """The listening socket systemd or launchd opened for us, and which one did; None otherwise.

    The service manager owns the socket file: the daemon neither checks,
    replaces nor removes it.
    """
    passed = [(fd, f"systemd:{name}") for fd, name in systemd.listen_fds_with_names()]
    if not passed:
        passed = [(fd, "launchd") for fd in launchd.activate_socket()]
    if not passed:
        return None
    if len(passed) > 1:
        raise InheritedSocketError(
            f"{len(passed)} sockets were passed ({', '.join(origin for _, origin in passed)}); prefixd serves exactly one: "
            "give the service's socket unit a single ListenStream="
        )
    fd, origin = passed[0]
    return adopt_listening_socket(fd, origin), origin.split(":")[0]


def adopt_listening_socket(fd: int, origin: str = "inherited") -> socket.socket:
    """Wrap a passed fd as a non-blocking listening Unix stream socket, checking that it is one."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise InheritedSocketError(f"fd {fd} passed by {origin} is not a socket ({exc.strerror})") from None
    accept_conn = getattr(socket, "SO_ACCEPTCONN", None)
    listening = accept_conn is None or sock.getsockopt(socket.SOL_SOCKET, accept_conn)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not listening:
        kind = f"{getattr(sock.family, 'name', sock.family)}/{getattr(sock.type, 'name', sock.type)}{'' if listening else ', not listening'}"
        sock.detach()  # not ours to close
        raise InheritedSocketError(
            f"fd {fd} passed by {origin} is {kind}; prefixd needs a listening Unix stream socket (ListenStream=/path)"
        )
    sock.set_inheritable(False)
    sock.setblocking(False)
    return sock
