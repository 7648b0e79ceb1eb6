"""``prefixd serve``: parse the command line, set up BLAS and logging, run the daemon."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from .blas import preload_blas


def default_cache_bytes() -> int:
    """A quarter of physical memory, at most 8 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return min(total // 4, 8 << 30)


def parse_size(text: str) -> int:
    """'512M', '4G', '1.5GiB' or plain bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    cleaned = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if cleaned and cleaned[-1] in units:
            return int(float(cleaned[:-1]) * units[cleaned[-1]])
        return int(cleaned)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 4G)") from None


def build_parser() -> argparse.ArgumentParser:
    from ..protocol.paths import default_socket_path

    parser = argparse.ArgumentParser(prog="prefixd serve", description="Run the prefixd daemon.")
    parser.add_argument("--model", action="append", required=True, help="MLX model directory or a locally cached Hugging Face id; repeat to load several (the first is the default)")
    parser.add_argument("--socket", type=Path, default=None, help=f"Unix socket path (default: $PREFIXD_SOCKET or {default_socket_path()})")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"], help="cast unquantized weights (auto: float32 on a Linux CPU, where it is the fast path)")
    parser.add_argument("--cache-bytes", type=parse_size, default=None, help="prefix-cache budget (default: a quarter of RAM, at most 8G)")
    parser.add_argument("--cache-entries", type=int, default=65536, help="prefix-cache node limit")
    parser.add_argument("--pinned-bytes", type=parse_size, default=None, help="budget for pinned prefixes (default: a quarter of --cache-bytes)")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="prefill chunk size in tokens; every chunk end is a cache checkpoint")
    parser.add_argument("--max-queued", type=int, default=256, help="queued requests in total before OVERLOADED")
    parser.add_argument("--max-queued-per-client", type=int, default=64, help="queued requests per connection before OVERLOADED")
    parser.add_argument("--grace-seconds", type=float, default=10.0, help="on SIGTERM, how long running requests may finish")
    parser.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def resolve_dtype(requested: str) -> str:
    if requested != "auto":
        return requested
    if sys.platform.startswith("linux"):
        import mlx.core as mx

        if mx.default_device() == mx.cpu:
            return "float32"
    return "auto"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    blas = preload_blas()  # before anything imports mlx
    from ..protocol.paths import default_socket_path
    from .engine import EngineSettings
    from .listener import SocketInUse
    from .logs import configure_logging
    from .server import DaemonServer, ServerSettings

    configure_logging(args.log_format, args.log_level)
    import structlog

    log = structlog.get_logger("prefixd")
    if args.prefill_chunk < 16:
        print("prefixd: --prefill-chunk must be at least 16", file=sys.stderr)
        return 2
    cache_bytes = args.cache_bytes if args.cache_bytes is not None else default_cache_bytes()
    engine = EngineSettings(
        model_specs=tuple(args.model),
        dtype=resolve_dtype(args.dtype),
        prefill_chunk=args.prefill_chunk,
        cache_bytes=cache_bytes,
        cache_nodes=args.cache_entries,
        pinned_bytes=args.pinned_bytes if args.pinned_bytes is not None else cache_bytes // 4,
        max_queued=args.max_queued,
        max_queued_per_client=args.max_queued_per_client,
    )
    settings = ServerSettings(socket_path=(args.socket or default_socket_path()).expanduser(), engine=engine, grace_seconds=args.grace_seconds)
    log.info("daemon_starting", blas=blas or "bundled", dtype=engine.dtype, cache_bytes=cache_bytes, prefill_chunk=engine.prefill_chunk)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        return runner(DaemonServer(settings).run())
    except SocketInUse as exc:
        print(f"prefixd: {exc}", file=sys.stderr)
        return 1
    except (FileNotFoundError, TimeoutError) as exc:
        print(f"prefixd: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
