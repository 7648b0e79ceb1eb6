"""Binding the daemon's Unix socket safely, and removing only the socket file we bound.

The directory that holds the socket
-----------------------------------
Whoever may write to the socket's directory can rename our socket away, bind
their own in its place and receive our user's prompts. So the directory is
checked, without following links, before the long model load (in
``check_socket_path``) and again at bind time:

- missing directories are created with ``os.mkdir(path, 0o700)``: they never
  exist with a looser mode, not even for a moment;
- the directory must be a real directory (``lstat``), not a symlink, which
  whoever made it could point anywhere;
- its owner must be the daemon's uid or root (root may do anything to us
  anyway, and system directories such as /tmp or /run/user are root's);
- nobody but the owner may write to it, with one exception: a sticky
  directory (mode +t, like /tmp itself), where only a file's owner may
  rename or delete it, so ``--socket /tmp/x.sock`` stays allowed.

So the default per-user directory ``/tmp/prefixd-<uid>`` is created by the
daemon, mode 0700; one that another user created first fails the owner check,
and one with a loose mode fails the mode check. A refusal is an
``UnsafeSocketDirectory`` (a PermissionError) naming the directory and what is
wrong; the daemon exits non-zero with its message.

The socket file
---------------
It gets mode 0600 from a umask set around bind(), so there is no window in
which another user could connect. A socket file left by a dead daemon is
replaced; a live daemon on the path is never displaced. ``bind_unix_socket``
remembers the (device, inode) of the file it bound, and ``SocketFile.remove``
unlinks the path only while it is still that file: if ours was deleted and
another daemon bound the path since, its socket is left alone.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("prefixd.listener")


class SocketInUse(RuntimeError):
    """Another daemon is serving on the path."""


class UnsafeSocketDirectory(PermissionError):
    """The socket's directory could let another user replace the socket; the message says why."""

    def __init__(self, directory: Path, problem: str, remedy: str):
        super().__init__(f"refusing to serve in {directory}: {problem}; {remedy}")
        self.directory = directory


@dataclass(frozen=True, slots=True)
class SocketFile:
    """The socket file this process bound: its path and the inode it had right after bind."""

    path: Path
    device: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> SocketFile:
        info = os.lstat(path)
        return cls(path, info.st_dev, info.st_ino)

    def is_still_ours(self) -> bool:
        """Whether the path still names the file we bound (not a deleted-and-replaced one)."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return stat.S_ISSOCK(info.st_mode) and (info.st_dev, info.st_ino) == (self.device, self.inode)

    def remove(self) -> bool:
        """Unlink the path if it is still our socket; True if it was removed.

        Another process could still swap the file between the lstat and the
        unlink; that window is microseconds, where before it was the daemon's
        whole lifetime.
        """
        if not self.is_still_ours():
            if os.path.lexists(self.path):
                log.warning(
                    "socket_left_in_place",
                    socket=str(self.path),
                    reason="another process bound this path after ours was deleted",
                )
            return False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        return True


def make_private_directories(directory: Path) -> None:
    """Create ``directory`` and its missing parents with mode 0700; existing ones are left as they are."""
    missing = []
    for candidate in (directory, *directory.parents):
        if os.path.lexists(candidate):
            break
        missing.append(candidate)
    for candidate in reversed(missing):
        try:
            os.mkdir(candidate, 0o700)  # the mode is applied by mkdir itself: never looser, even briefly
        except FileExistsError:
            pass  # made meanwhile by someone else: the caller's own check decides


def ensure_socket_directory(directory: Path) -> os.stat_result:
    """Create ``directory`` (and missing parents) with mode 0700 if needed, then check it; its lstat.

    Raises UnsafeSocketDirectory if another user could replace a socket in it.
    """
    make_private_directories(directory)
    return check_socket_directory(directory)


def check_socket_directory(directory: Path) -> os.stat_result:
    """The lstat of ``directory`` if it is safe to serve a socket in; raises UnsafeSocketDirectory otherwise."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        raise UnsafeSocketDirectory(directory, "it does not exist", "create it or pass another --socket") from None
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeSocketDirectory(
            directory, "it is a symbolic link", "use the real directory's path, or remove the link"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeSocketDirectory(directory, "it is not a directory", "remove it or pass another --socket")
    own_uid = os.geteuid()
    if info.st_uid not in (own_uid, 0):
        raise UnsafeSocketDirectory(
            directory,
            f"it is owned by uid {info.st_uid}, not by this daemon's uid {own_uid}",
            "another user may have created it to take over the socket: remove it, or pass another --socket",
        )
    writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and not info.st_mode & stat.S_ISVTX:
        mode = stat.S_IMODE(info.st_mode)
        raise UnsafeSocketDirectory(
            directory,
            f"its mode {mode:04o} lets other users write to it (and so replace the socket)",
            f"chmod 700 {directory}, or pass another --socket",
        )
    return info


def check_socket_path(path: Path) -> None:
    """Refuse an unsafe directory or a live daemon on ``path``; remove a stale socket file.

    Raises UnsafeSocketDirectory (see the module docstring) or SocketInUse. A
    directory that does not exist yet is fine here: bind_unix_socket creates it.
    """
    if os.path.lexists(path.parent):
        check_socket_directory(path.parent)
    if not os.path.lexists(path):
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


def bind_unix_socket(path: Path) -> tuple[socket.socket, SocketFile]:
    """A listening socket at ``path`` with mode 0600, and the SocketFile to remove at shutdown."""
    directory = ensure_socket_directory(path.parent)
    check_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old_umask = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old_umask)
        bound = SocketFile.of(path)
        # The directory was checked before bind; if it was swapped in between,
        # the socket went somewhere we did not check.
        now = os.lstat(path.parent)
        if (now.st_dev, now.st_ino) != (directory.st_dev, directory.st_ino):
            raise UnsafeSocketDirectory(
                path.parent, "it was replaced while the socket was being bound", "check who else writes to its parent"
            )
        os.chmod(path, 0o600)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock, bound
