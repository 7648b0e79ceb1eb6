"""``prefixd serve``: parse the command line, set up BLAS and logging, run the daemon.

Settings come from flags, ``PREFIXD_*`` environment variables and the config
file, in that order (see config.py); ``--print-config`` (``prefixd config``)
shows the result and where each value came from.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from ..front import http_options
from ..models.blas import preload_blas
from ..models.chat_template_file import ChatTemplateError, read_chat_templates
from ..models.kv_bits_setting import KvBitsError, read_kv_bits
from ..models.model_dirs import find_model_dirs
from ..models.mlx_runtime_env import apply_daemon_defaults
from .config import ConfigError, explicit_flags, load_config
from .settings import add_flags


def build_parser() -> argparse.ArgumentParser:
    # Each setting's flag comes from its declaration (settings.py). A flag left out
    # leaves the setting to the environment, the config file, then the default.
    parser = argparse.ArgumentParser(
        prog="prefixd serve",
        description="Run the prefixd daemon. Every flag can also "
        "be set as PREFIXD_<NAME> or in the config file (see prefixd config); "
        "docs/settings.md lists them all.",
    )
    parser.add_argument(
        "--config", type=Path, help="config file (default: $PREFIXD_CONFIG or $XDG_CONFIG_HOME/prefixd/config.toml)"
    )
    parser.add_argument(
        "--print-config",
        nargs="?",
        const="toml",
        choices=["toml", "json"],
        help="print the effective configuration and where each value came from, then exit",
    )
    add_flags(parser)
    return parser


def print_config_main(argv: list[str] | None = None) -> int:
    """``prefixd config [--json] [serve flags...]``: the effective configuration, with sources."""
    argv = list(sys.argv[1:] if argv is None else argv)
    fmt = "json" if "--json" in argv else "toml"
    return main(["--print-config", fmt, *(arg for arg in argv if arg != "--json")])


def resolve_dtype(requested: str) -> str:
    if requested != "auto":
        return requested
    if sys.platform.startswith("linux"):
        import mlx.core as mx

        if mx.default_device() == mx.cpu:
            return "float32"
    return "auto"


GIL_SWITCH_INTERVAL_S = 0.0005


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parsed = build_parser().parse_args(argv)
    try:
        config = load_config(explicit_flags(build_parser, argv))
    except ConfigError as exc:
        print(f"prefixd: {exc}", file=sys.stderr)
        return 2
    if parsed.print_config:
        print(config.to_json() if parsed.print_config == "json" else config.to_toml(), end="")
        return 0
    args = config.namespace(parsed)
    try:
        found_models = find_model_dirs(args.models_dir) if args.models_dir is not None else []
    except FileNotFoundError as exc:
        print(f"prefixd: {exc} (models_dir, from {config.sources['models_dir']})", file=sys.stderr)
        return 2
    if not args.model and not found_models:
        where = f"no model directory in {args.models_dir}; " if args.models_dir is not None else ""
        print(
            f'prefixd: no model to serve: {where}pass --model DIR, set $PREFIXD_MODEL, or add model = ["DIR"] to {config.path}',
            file=sys.stderr,
        )
        return 2
    try:
        chat_templates = read_chat_templates(args.chat_template)
    except ChatTemplateError as exc:
        print(f"prefixd: {exc} (chat_template, from {config.sources['chat_template']})", file=sys.stderr)
        return 2
    try:
        kv_bits = read_kv_bits(args.kv_bits)
    except KvBitsError as exc:
        print(f"prefixd: {exc} (kv_bits, from {config.sources['kv_bits']})", file=sys.stderr)
        return 2
    from ..distributed.settings import DistributedStartError, launcher_rank, started_by_launcher

    if args.ranks > 1 and not started_by_launcher():
        from .logs import configure_logging
        from .rank_launcher import launch_ranks

        configure_logging(args.log_format, args.log_level)
        return launch_ranks(args.ranks, args.distributed_backend, argv)
    if started_by_launcher():  # ranks sharing a host share its cores: before the BLAS starts its threads
        from ..distributed.cpu_threads import share_cpu_threads

        share_cpu_threads()
    blas = preload_blas()  # before anything imports mlx
    mlx_defaults = apply_daemon_defaults()  # before MLX builds its CUDA caches (models/mlx_runtime_env.py)
    from ..engine.settings import EngineSettings
    from ..front.listener import SocketInUse
    from ..persist.persistence import DiskCacheSettings
    from .logs import configure_logging
    from .server import DaemonServer, ServerSettings

    configure_logging(args.log_format, args.log_level)
    import structlog

    log = structlog.get_logger("prefixd")
    try:
        http = http_options.http_settings(args)
    except (ValueError, OSError) as exc:
        print(f"prefixd: {exc}", file=sys.stderr)
        return 2
    cache_bytes = args.cache_bytes
    engine = EngineSettings(
        model_specs=tuple(args.model),
        found_model_specs=tuple(found_models),
        chat_templates=chat_templates,
        kv_bits=kv_bits,
        dtype=resolve_dtype(args.dtype),
        prefill_chunk=args.prefill_chunk,
        cache_bytes=cache_bytes,
        cache_nodes=args.cache_entries,
        pinned_bytes=args.pinned_bytes,
        mlx_cache_bytes=args.mlx_cache_bytes,
        max_active=args.max_active,
        keep_alive_s=args.keep_alive,
        max_model_bytes=args.max_model_memory,
        shadow_rate=args.shadow_rate,
        shadow_action=args.shadow_action,
        attention=args.attention,
        linear=args.linear,
        fork=args.fork,
        batch_step=args.batch_step,
        warm_up=args.warm_up,
        max_queued=args.max_queued,
        max_queued_per_client=args.max_queued_per_client,
    )
    disk_cache = (
        DiskCacheSettings(args.cache_dir, args.disk_cache_bytes, args.disk_save_interval)
        if args.disk_cache_bytes
        else None
    )
    settings = ServerSettings(
        socket_path=args.socket,
        engine=engine,
        grace_seconds=args.grace_seconds,
        http=http,
        allowed_uids=tuple(args.allow_uid),
        status_interval_seconds=args.status_interval,
        disk_cache=disk_cache,
    )
    log.info(
        "daemon_starting",
        blas=blas or "bundled",
        mlx_env=mlx_defaults,
        dtype=engine.dtype,
        cache_bytes=cache_bytes,
        prefill_chunk=engine.prefill_chunk or "auto",
        config_file=str(config.path) if config.file_found else None,
    )
    # The engine thread builds each forward pass in Python and holds the GIL
    # meanwhile; with CPython's default 5 ms switch interval a token the engine
    # has handed out could wait that long for the event loop to write it.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    rank_engine = None
    if started_by_launcher():  # one rank of several (daemon/distributed/)
        from ..distributed.follower import run_follower
        from .ranks import distributed_engine

        try:
            rank_engine = distributed_engine(settings, args)
        except ValueError as exc:
            print(f"prefixd: {exc}", file=sys.stderr)
            return 2
        if launcher_rank() != 0:
            exit_now(run_follower(rank_engine, settings.load_timeout_seconds))
    try:
        code = runner(DaemonServer(settings, rank_engine).run())
    except SocketInUse as exc:
        print(f"prefixd: {exc}", file=sys.stderr)
        exit_now(1)
    # A missing model, a busy --http port, a slow load, a --chat-template that does not render, a --kv-bits
    # NAME that names no model.
    except (OSError, TimeoutError, DistributedStartError, ChatTemplateError, KvBitsError) as exc:
        print(f"prefixd: {exc}", file=sys.stderr)
        exit_now(1)  # the engine thread may have started: the same teardown abort as after a clean stop
    exit_now(code)


def exit_now(code: int) -> None:
    """Exit without the interpreter's teardown, after a clean shutdown.

    The daemon has stopped its engine and said everything it had to say. What
    is left is the C++ static teardown, which sometimes aborts after the engine
    thread has exited ("terminate called without an active exception", exit
    134; about one clean stop in ten, seen with mlx 0.32.4 on Linux), and
    systemd would record that clean stop as a failure.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
