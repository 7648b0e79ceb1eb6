"""Nobody else can take over the daemon's socket, and a daemon removes only its own socket file.

Through the real daemon and the real clients: a socket directory another user
made or may write to is refused at start (exit 1, a message naming the
directory); a client refuses a socket served by another uid before sending a
byte; and a daemon whose socket was deleted and replaced leaves the newcomer's
socket alone when it stops. Simulating another user takes root (chown to
nobody, a squatter process running as nobody); those tests skip otherwise.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from prefixd.client import AsyncClient, Client, DaemonUnavailable, RequestTimeout
from tests.e2e.daemon_process import daemon_command, daemon_env

NOBODY = 65534
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # nobody cannot enter /root, where the venv may live
needs_root = pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs root to act as another user")


@pytest.fixture
def short_dir():
    """A private directory under /tmp, short enough for AF_UNIX paths."""
    directory = Path(tempfile.mkdtemp(prefix="pfx-sec-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def run_daemon_until_exit(model_dir: Path, workdir: Path, args: list[str], env: dict[str, str] | None = None,
                          socket_path: Path | None = None) -> subprocess.CompletedProcess:
    """Run a daemon that is expected to refuse to start; its exit status and output."""
    command = daemon_command([model_dir], socket_path, args) if socket_path else _command_without_socket(model_dir, args)
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=workdir,
                          env=daemon_env(workdir) | (env or {}))


def _command_without_socket(model_dir: Path, args: list[str]) -> list[str]:
    command = daemon_command([model_dir], Path("unused"), args)
    index = command.index("--socket")
    return command[:index] + command[index + 2:]


# -- the daemon refuses an unsafe socket directory -------------------------------------------


def test_a_directory_others_may_write_to_is_refused(tiny_llama_dir, short_dir, tmp_path):
    loose = short_dir / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    done = run_daemon_until_exit(tiny_llama_dir, tmp_path / "d", [], socket_path=loose / "prefixd.sock")
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"refusing to serve in {loose}: its mode 0777 lets other users write to it" in done.stderr
    assert not (loose / "prefixd.sock").exists()


def test_a_symlinked_directory_is_refused(tiny_llama_dir, short_dir, tmp_path):
    (short_dir / "real").mkdir(mode=0o700)
    (short_dir / "link").symlink_to(short_dir / "real")
    done = run_daemon_until_exit(tiny_llama_dir, tmp_path / "d", [], env={"PREFIXD_SOCKET": str(short_dir / "link" / "s.sock")})
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"refusing to serve in {short_dir / 'link'}: it is a symbolic link" in done.stderr
    assert not (short_dir / "real" / "s.sock").exists()


@needs_root
def test_a_directory_made_by_another_user_is_refused(tiny_llama_dir, short_dir, tmp_path):
    theirs = short_dir / "theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    os.chown(theirs, NOBODY, NOBODY)
    done = run_daemon_until_exit(tiny_llama_dir, tmp_path / "d", [], env={"PREFIXD_SOCKET": str(theirs / "prefixd.sock")})
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"refusing to serve in {theirs}: it is owned by uid {NOBODY}, not by this daemon's uid 0" in done.stderr
    assert not (theirs / "prefixd.sock").exists()


@needs_root
def test_the_default_tmp_directory_pre_created_by_another_user_is_refused(tiny_llama_dir, short_dir, tmp_path):
    # Without XDG_RUNTIME_DIR the default socket is $TMPDIR/prefixd-<uid>/prefixd.sock.
    env = {"TMPDIR": str(short_dir), "XDG_RUNTIME_DIR": ""}
    squatted = short_dir / f"prefixd-{os.getuid()}"
    squatted.mkdir()
    squatted.chmod(0o777)
    os.chown(squatted, NOBODY, NOBODY)
    done = run_daemon_until_exit(tiny_llama_dir, tmp_path / "d", [], env=env)
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"refusing to serve in {squatted}: it is owned by uid {NOBODY}" in done.stderr


def test_the_default_tmp_directory_is_created_0700(tiny_llama_dir, short_dir, tmp_path):
    env = daemon_env(tmp_path) | {"TMPDIR": str(short_dir), "XDG_RUNTIME_DIR": ""}
    proc = subprocess.Popen(_command_without_socket(tiny_llama_dir, []), env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    socket_path = short_dir / f"prefixd-{os.getuid()}" / "prefixd.sock"
    try:
        deadline = time.monotonic() + 60
        while not socket_path.exists():
            assert proc.poll() is None, f"the daemon exited with {proc.returncode}: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "the daemon did not bind in time"
            time.sleep(0.05)
        with Client(socket_path, timeout=60) as client:
            assert client.ping()["pong"] is True
        assert stat.S_IMODE(os.lstat(socket_path.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(socket_path).st_mode) == 0o600
    finally:
        proc.terminate()
        assert proc.wait(60) == 0, proc.stderr.read()[-2000:]
    assert not socket_path.exists()


# -- the clients refuse a socket served by another uid ----------------------------------------


SQUATTER = """
import socket, sys
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen(1)
print("listening", flush=True)
conn, _ = server.accept()
conn.settimeout(10)
received = b""
try:
    while data := conn.recv(65536):
        received += data
except (socket.timeout, ConnectionError):
    pass
print(len(received), flush=True)
"""


class Squatter:
    """A process of another user listening on ``path``; ``bytes_received()`` is what one client sent it."""

    def __init__(self, path: Path):
        self.proc = subprocess.Popen([SYSTEM_PYTHON, "-c", SQUATTER, str(path)], stdout=subprocess.PIPE, text=True,
                                     user=NOBODY, group=NOBODY, cwd="/")
        assert self.proc.stdout.readline().strip() == "listening"
        os.chmod(path, 0o666)  # the owner's client could connect only if the squatter let it

    def bytes_received(self) -> int:
        out, _ = self.proc.communicate(timeout=30)
        return int(out.strip())


@pytest.fixture
def squatted_socket(short_dir) -> Path:
    """A socket path in a directory nobody owns, where a squatter will listen."""
    directory = short_dir / "shared"
    directory.mkdir()
    directory.chmod(0o777)
    os.chown(directory, NOBODY, NOBODY)
    short_dir.chmod(0o755)
    return directory / "prefixd.sock"


@needs_root
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs a python3 in /usr/bin that another user may run")
def test_the_blocking_client_sends_nothing_to_another_users_socket(squatted_socket):
    squatter = Squatter(squatted_socket)
    with pytest.raises(DaemonUnavailable, match=f"it is served by uid {NOBODY}, not by you \\(uid 0\\) or root") as refused:
        Client(squatted_socket, timeout=10).ping()
    assert refused.value.data == {"peer_uid": NOBODY}
    assert squatter.bytes_received() == 0


@needs_root
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs a python3 in /usr/bin that another user may run")
def test_the_async_client_sends_nothing_to_another_users_socket(squatted_socket):
    squatter = Squatter(squatted_socket)

    async def ping() -> None:
        client = AsyncClient(squatted_socket, timeout=10)
        try:
            await client.ping()
        finally:
            await client.close()

    with pytest.raises(DaemonUnavailable, match=f"served by uid {NOBODY}"):
        asyncio.run(ping())
    assert squatter.bytes_received() == 0


@needs_root
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs a python3 in /usr/bin that another user may run")
def test_a_trusted_uid_is_talked_to(squatted_socket):
    squatter = Squatter(squatted_socket)
    with Client(squatted_socket, timeout=1, trusted_uids=[NOBODY]) as client:
        with pytest.raises(RequestTimeout):
            client.ping()  # sent; the squatter never answers
    assert squatter.bytes_received() > 0


# -- a daemon removes only the socket file it bound --------------------------------------------


def test_stopping_a_daemon_whose_socket_was_replaced_leaves_the_new_socket(start_daemon, short_dir):
    http_socket = short_dir / "http.sock"
    first = start_daemon(extra_args=["--http-socket", str(http_socket)], socket_path=short_dir / "prefixd.sock")
    os.unlink(first.socket_path)  # someone deletes the live daemon's sockets...
    os.unlink(http_socket)
    # ...and a second daemon starts on the same paths.
    second = start_daemon(extra_args=["--http-socket", str(http_socket)], socket_path=first.socket_path)
    first.stop()  # SIGTERM: exits 0
    assert first.events("socket_left_in_place")
    assert first.socket_path.exists() and http_socket.exists()
    assert second.answers_ping()
    with Client(second.socket_path, timeout=30) as client:
        assert client.ping()["pong"] is True
    second.stop()
    assert not first.socket_path.exists() and not http_socket.exists()  # the second one removes its own
