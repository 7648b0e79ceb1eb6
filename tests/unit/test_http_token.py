"""--http always has a bearer token unless told --http-no-token: the default token file and its checks."""

from __future__ import annotations

import os
import stat

import pytest

from prefixd.daemon.front.http_options import http_settings, read_or_create_token
from prefixd.daemon.service.main import build_parser


def settings(environ: dict[str, str], *argv: str):
    return http_settings(build_parser().parse_args(argv), environ)


@pytest.fixture
def environ(tmp_path) -> dict[str, str]:
    return {"XDG_CONFIG_HOME": str(tmp_path / "config")}


def test_tcp_gets_a_default_token_made_once_0600_and_read_again(environ, tmp_path):
    old_umask = os.umask(0)  # the file is private whatever the umask
    try:
        first = settings(environ, "--http", "127.0.0.1:8080")
    finally:
        os.umask(old_umask)
    token_file = tmp_path / "config" / "prefixd" / "http-token"
    assert first.token and len(first.token) >= 32
    assert stat.S_IMODE(os.lstat(token_file).st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(token_file.parent).st_mode) == 0o700
    assert token_file.read_text() == first.token + "\n"
    assert settings(environ, "--http", "127.0.0.1:8080").token == first.token  # a restart reuses it
    assert [p.name for p in token_file.parent.iterdir()] == ["http-token"]  # no temporary left behind


def test_a_given_token_wins_and_the_unix_socket_alone_needs_none(environ, tmp_path):
    token_file = tmp_path / "mine"
    token_file.write_text("my-token\n")
    assert settings(environ, "--http", "8080", "--http-token-file", str(token_file)).token == "my-token"
    assert settings(environ | {"PREFIXD_HTTP_TOKEN": "env-token"}, "--http", "8080").token == "env-token"
    assert settings(environ, "--http-socket", str(tmp_path / "h.sock")).token is None
    assert not (tmp_path / "config").exists()  # no default file was made for any of these


def test_the_opt_out(environ, tmp_path):
    assert settings(environ, "--http", "127.0.0.1:8080", "--http-no-token").token is None
    assert not (tmp_path / "config").exists()
    with pytest.raises(ValueError, match="not a loopback address"):
        settings(environ, "--http", "0.0.0.0:8080", "--http-no-token")
    with pytest.raises(ValueError, match="--http-no-token contradicts the token given in \\$PREFIXD_HTTP_TOKEN"):
        settings(environ | {"PREFIXD_HTTP_TOKEN": "t"}, "--http", "8080", "--http-no-token")


def test_a_token_file_others_may_read_is_refused(tmp_path):
    token_file = tmp_path / "http-token"
    token_file.write_text("t0ken\n")
    token_file.chmod(0o644)
    with pytest.raises(ValueError, match="mode 0644: other users may read the HTTP token; chmod 600"):
        read_or_create_token(token_file)
    token_file.chmod(0o600)
    assert read_or_create_token(token_file) == ("t0ken", False)


def test_a_symlink_is_never_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("planted\n")
    target.chmod(0o600)
    (tmp_path / "http-token").symlink_to(target)
    with pytest.raises(ValueError, match="is a symbolic link"):
        read_or_create_token(tmp_path / "http-token")
    (tmp_path / "http-token").unlink()
    (tmp_path / "http-token").symlink_to(tmp_path / "missing")  # a dangling link: not created through either
    with pytest.raises(ValueError, match="is a symbolic link"):
        read_or_create_token(tmp_path / "http-token")
    assert not (tmp_path / "missing").exists()
