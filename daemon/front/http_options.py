"""Command-line options of the editor-facing fronts: the HTTP API and who may connect.

Kept apart from ``http_front`` so that ``prefixd serve`` can parse its
arguments before anything imports MLX (the BLAS preload must come first).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

TOKEN_ENV = "PREFIXD_HTTP_TOKEN"


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Where the OpenAI-compatible front listens, and its bearer token (None: no token)."""

    host: str | None = None
    port: int | None = None
    unix_path: Path | None = None
    token: str | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("editor fronts")
    group.add_argument("--http", metavar="HOST:PORT", default=None, help="also serve the OpenAI-compatible HTTP API here (e.g. 127.0.0.1:8080; loopback only unless a token is set)")
    group.add_argument("--http-socket", metavar="PATH", type=Path, default=None, help="also serve the OpenAI-compatible HTTP API on this Unix socket (mode 0600)")
    group.add_argument("--http-token-file", metavar="FILE", type=Path, default=None, help=f"bearer token required on every HTTP request (first line of FILE; or ${TOKEN_ENV}); needed for a non-loopback --http")
    group.add_argument("--allow-uid", metavar="UID", type=int, action="append", default=[], help="also accept socket clients running as this uid (repeatable; default: only the daemon's own uid)")


def http_settings(args: argparse.Namespace) -> HttpSettings | None:
    """The HTTP front's settings from parsed arguments; None when it is off. Raises ValueError on bad values."""
    if args.http is None and args.http_socket is None:
        return None
    token = os.environ.get(TOKEN_ENV) or None
    if args.http_token_file is not None:
        lines = args.http_token_file.expanduser().read_text().splitlines()
        token = lines[0].strip() if lines else ""
        if not token:
            raise ValueError(f"{args.http_token_file} holds no token")
    host, port = parse_http_address(args.http) if args.http is not None else (None, None)
    if host is not None and not is_loopback(host) and not token:
        raise ValueError(f"--http {args.http} is not a loopback address: set a bearer token (--http-token-file or ${TOKEN_ENV})")
    unix_path = args.http_socket.expanduser() if args.http_socket is not None else None
    return HttpSettings(host=host, port=port, unix_path=unix_path, token=token)


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
