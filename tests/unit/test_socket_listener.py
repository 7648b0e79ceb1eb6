"""The socket's directory is checked before bind, and only the socket file we bound is removed."""

from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from prefixd.daemon.front.listener import UnsafeSocketDirectory, bind_unix_socket, check_socket_path

NOBODY = 65534
needs_root = pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs root to chown a directory to another user")


@pytest.fixture
def short_dir():
    """A directory under /tmp, short enough for AF_UNIX paths, mode 0700."""
    directory = Path(tempfile.mkdtemp(prefix="pfx-listen-", dir="/tmp"))
    yield directory
    for root, dirs, files in os.walk(directory, topdown=False):
        for name in files:
            os.unlink(os.path.join(root, name))
        for name in dirs:
            path = os.path.join(root, name)
            os.unlink(path) if os.path.islink(path) else os.rmdir(path)
    os.rmdir(directory)


def test_missing_directories_are_created_0700(short_dir):
    path = short_dir / "a" / "b" / "prefixd.sock"
    old_umask = os.umask(0)  # even a permissive umask must not loosen them
    try:
        sock, bound = bind_unix_socket(path)
    finally:
        os.umask(old_umask)
    with sock:
        assert stat.S_IMODE(os.lstat(short_dir / "a").st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(short_dir / "a" / "b").st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert bound.path == path and bound.is_still_ours()


def test_a_directory_others_may_write_to_is_refused(short_dir):
    loose = short_dir / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    for call in (check_socket_path, bind_unix_socket):
        with pytest.raises(UnsafeSocketDirectory, match=r"refusing to serve in .*loose: its mode 0777 lets other users write"):
            call(loose / "prefixd.sock")
    loose.chmod(0o770)  # group-writable is as bad
    with pytest.raises(UnsafeSocketDirectory, match="mode 0770"):
        bind_unix_socket(loose / "prefixd.sock")
    assert not (loose / "prefixd.sock").exists()


def test_a_sticky_shared_directory_like_tmp_is_allowed(short_dir):
    shared = short_dir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: others may add files, not rename or delete ours
    sock, bound = bind_unix_socket(shared / "prefixd.sock")
    with sock:
        assert bound.is_still_ours()


def test_a_symlinked_directory_is_refused(short_dir):
    real = short_dir / "real"
    real.mkdir(mode=0o700)
    (short_dir / "link").symlink_to(real)
    with pytest.raises(UnsafeSocketDirectory, match="link: it is a symbolic link"):
        bind_unix_socket(short_dir / "link" / "prefixd.sock")
    assert not (real / "prefixd.sock").exists()


@needs_root
def test_a_directory_owned_by_another_user_is_refused_whatever_its_mode(short_dir):
    theirs = short_dir / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(UnsafeSocketDirectory, match=f"it is owned by uid {NOBODY}, not by this daemon's uid 0"):
        bind_unix_socket(theirs / "prefixd.sock")
    assert not (theirs / "prefixd.sock").exists()


def test_remove_leaves_a_socket_bound_in_our_place_alone(short_dir):
    path = short_dir / "prefixd.sock"
    first_sock, first = bind_unix_socket(path)
    os.unlink(path)  # someone deletes our socket file, and another daemon binds the path
    with first_sock, socket.socket(socket.AF_UNIX) as second_sock:
        second_sock.bind(str(path))
        assert not first.is_still_ours()
        assert first.remove() is False
        assert path.exists()
    os.unlink(path)
    sock, ours = bind_unix_socket(path)
    with sock:
        assert ours.remove() is True and not path.exists()
        assert ours.remove() is False  # already gone: nothing to do
