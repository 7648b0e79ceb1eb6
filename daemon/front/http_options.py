"""The HTTP fronts' settings, from the daemon's resolved configuration, and the bearer token.

The flags themselves are declared with every other setting in
service/settings.py. Kept apart from ``http_front`` so that ``prefixd serve``
can read them before anything imports MLX (the BLAS preload must come first).

The bearer token: over TCP the kernel names no peer, so without a token any
local user could use the daemon, past ``--allow-uid``. So ``--http`` always
has one: ``--http-token-file``, else ``$PREFIXD_HTTP_TOKEN``, else the default
file ``$XDG_CONFIG_HOME/prefixd/http-token`` (``~/.config/prefixd/http-token``),
made once with a random token, mode 0600, and read again at every start.
``--http-no-token`` is the explicit opt-out, for a user who accepts that any
local user may connect (loopback only). The Unix-socket front
(``--http-socket``) checks the peer's uid instead, and needs no token.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import structlog

from .listener import make_private_directories

TOKEN_ENV = "PREFIXD_HTTP_TOKEN"
TOKEN_FILE_NAME = "http-token"
# The answer length of a /v1/responses request that names none. Agent clients (Codex, the Agents SDK) send
# no max_output_tokens, and a tool call that writes a file must not be cut off by prefixd's usual 256.
DEFAULT_MAX_OUTPUT_TOKENS = 4096

log = structlog.get_logger("prefixd.http")


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Where the OpenAI-compatible front listens, and its bearer token (None: no token)."""

    host: str | None = None
    port: int | None = None
    unix_path: Path | None = None
    token: str | None = None
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS  # /v1/responses without max_output_tokens
    keep_billing_header: bool = False  # Claude Code's billing line stays in the prompt (agent_prompts)


def http_settings(args: argparse.Namespace, environ: dict[str, str] | None = None) -> HttpSettings | None:
    """The HTTP front's settings from parsed arguments; None when it is off. Raises ValueError on bad values.

    With ``--http`` and no token given, the default token file is read, or
    made first (see the module docstring); the log says where it is.
    """
    environ = os.environ if environ is None else environ
    if args.http is None and args.http_socket is None:
        return None
    token = environ.get(TOKEN_ENV) or None
    if args.http_token_file is not None:
        lines = args.http_token_file.expanduser().read_text().splitlines()
        token = lines[0].strip() if lines else ""
        if not token:
            raise ValueError(f"{args.http_token_file} holds no token")
    no_token = bool(getattr(args, "http_no_token", False))
    if no_token and token:
        given = args.http_token_file if args.http_token_file is not None else f"${TOKEN_ENV}"
        raise ValueError(f"--http-no-token contradicts the token given in {given}: drop one of them")
    host, port = parse_http_address(args.http) if args.http is not None else (None, None)
    if host is not None and not is_loopback(host) and not token:
        raise ValueError(
            f"--http {args.http} is not a loopback address: set a bearer token (--http-token-file or ${TOKEN_ENV})"
        )
    if host is not None and token is None and not no_token:
        token_file = default_token_path(environ)
        token, created = read_or_create_token(token_file)
        log.info("http_token", file=str(token_file), created=created, hint="OpenAI clients send it as their API key")
    elif host is not None and no_token:
        log.warning(
            "http_without_token",
            address=args.http,
            reason="--http-no-token: any local user may use the daemon over TCP",
        )
    unix_path = args.http_socket.expanduser() if args.http_socket is not None else None
    max_output_tokens = getattr(args, "max_output_tokens", None) or DEFAULT_MAX_OUTPUT_TOKENS
    return HttpSettings(
        host=host,
        port=port,
        unix_path=unix_path,
        token=token,
        max_output_tokens=max_output_tokens,
        keep_billing_header=bool(getattr(args, "keep_billing_header", False)),
    )


# -- the default token file ------------------------------------------------------------------


def default_token_path(environ: dict[str, str]) -> Path:
    """``$XDG_CONFIG_HOME/prefixd/http-token``, else ``~/.config/prefixd/http-token`` (on macOS too, like config.toml)."""
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "prefixd" / TOKEN_FILE_NAME


def read_or_create_token(path: Path) -> tuple[str, bool]:
    """The token in ``path``, made first if there is none: (token, whether it was made now).

    Made atomically: written in full to a private temporary file (mode 0600,
    O_EXCL, O_NOFOLLOW), then linked to its name, which never replaces a file
    and never follows a link there; a daemon that races us to it wins, and
    both read its token. Raises ValueError for a file that is a link, not
    ours, or readable by others.
    """
    make_private_directories(path.parent)
    try:
        return read_token_file(path), False
    except FileNotFoundError:
        pass
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temporary, path)
            created = True
        except FileExistsError:
            created = False  # another daemon made it meanwhile: use theirs
    finally:
        os.unlink(temporary)
    return read_token_file(path), created


def read_token_file(path: Path) -> str:
    """The first line of a private token file; ValueError if it is a link, not ours, readable by others, or empty."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        if os.path.islink(path):
            raise ValueError(f"{path} is a symbolic link; refusing to read the HTTP token through it") from None
        raise
    with os.fdopen(fd) as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file; it cannot hold the HTTP token")
        if info.st_uid != os.geteuid():
            raise ValueError(
                f"{path} is owned by uid {info.st_uid}, not by this daemon's uid {os.geteuid()}; remove it to get a new token"
            )
        if info.st_mode & 0o077:
            raise ValueError(
                f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: other users may read the HTTP token; "
                f"chmod 600 {path}, or remove it to get a new token"
            )
        lines = handle.read().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"{path} holds no token; remove it to get a new one")
    return token


def parse_http_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[V6]:PORT`` or a bare ``PORT`` (on 127.0.0.1)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or int(port) > 65535:
        raise ValueError(f"not a HOST:PORT address: {text!r} (e.g. 127.0.0.1:8080)")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name could resolve anywhere
