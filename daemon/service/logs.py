"""Structured logging: JSON lines on stderr by default, a console format for a terminal.

In JSON mode every line on stderr must be one JSON object, whoever writes
it, so a log shipper never has to guess where a traceback ends. Four other
writers besides our own structlog calls would print plain text, and each is
routed through the same formatter:

- the standard library's ``logging`` (aiohttp's "Error handling request",
  asyncio's "Task exception was never retrieved" and the event loop's
  exception handler, uvloop's too, all log through it): one root handler
  renders their records with structlog's ProcessorFormatter; libraries that
  brought their own stderr handler (transformers) are made to propagate to it;
- ``warnings``: captured into logging (the ``py.warnings`` logger);
- an exception nobody caught, in the main thread (``sys.excepthook``) or in
  any other (``threading.excepthook``): one ``unhandled_exception`` line;
- an exception Python could only ignore (in ``__del__``, a finalizer, a
  callback; ``sys.unraisablehook``): one ``unraisable_exception`` line.

Output a C library writes to file descriptor 2 itself bypasses all of this.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from types import TracebackType
from typing import Any

import structlog

_HANDLER_NAME = "prefixd-stderr"  # our root handler, found again when logging is configured twice


def configure_logging(fmt: str = "auto", level: str = "info") -> None:
    """``fmt``: json, console, or auto (console when stderr is a terminal)."""
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = structlog.dev.ConsoleRenderer() if fmt == "console" else structlog.processors.JSONRenderer()
    level_number = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *([_add_rank] if "MLX_RANK" in os.environ else []),  # one daemon across ranks: mlx.launch merges their logs
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,  # rendered by the one handler below
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_number),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
    _route_stdlib_logging(renderer, level_number)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught_exception
    threading.excepthook = _log_uncaught_thread_exception
    sys.unraisablehook = _log_unraisable_exception


def _add_rank(_logger: Any, _method: str, event_dict: dict) -> dict:
    """Which rank wrote the line (the launcher interleaves every rank's stderr)."""
    event_dict.setdefault("rank", int(os.environ["MLX_RANK"]))
    return event_dict


def _route_stdlib_logging(renderer: Any, level_number: int) -> None:
    formatter = structlog.stdlib.ProcessorFormatter(
        # Records from the standard library get what our own lines have.
        foreign_pre_chain=[
            structlog.stdlib.add_logger_name,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,  # a foreign record's exc_info -> "exception" text
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)  # one write per line, under the handler's lock
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_number)
    _adopt_stderr_handlers(handler)


def _adopt_stderr_handlers(ours: logging.Handler) -> None:
    """Loggers that print to stderr on their own handler (transformers does) propagate to ours instead.

    Their levels stay as their libraries set them. A library imported after
    this runs and doing the same is not caught; the daemon imports its model
    libraries before it configures logging.
    """
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):
            continue  # a placeholder for a logger never created
        for handler in list(logger.handlers):
            if (
                handler is not ours
                and isinstance(handler, logging.StreamHandler)
                and handler.stream in (sys.stderr, sys.__stderr__)
            ):
                logger.removeHandler(handler)
                logger.propagate = True


def _exception_fields(
    exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None
) -> dict[str, Any]:
    return {
        "exc_type": exc_type.__name__,
        "message": str(exc) if exc is not None else "",
        "traceback": "".join(traceback.format_exception(exc_type, exc, tb)),
    }


def _log_uncaught_exception(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    _log_or_fall_back("unhandled_exception", threading.current_thread().name, exc_type, exc, tb)


def _log_uncaught_thread_exception(args: threading.ExceptHookArgs) -> None:
    if issubclass(args.exc_type, SystemExit):
        return  # what a thread's sys.exit() means; the default hook is silent about it too
    name = args.thread.name if args.thread is not None else "unknown"
    _log_or_fall_back("unhandled_exception", name, args.exc_type, args.exc_value, args.exc_traceback)


def _log_unraisable_exception(unraisable: Any) -> None:
    fields = _exception_fields(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)
    where = unraisable.err_msg or "Exception ignored in"
    try:
        where = f"{where}: {unraisable.object!r}" if unraisable.object is not None else where
    except Exception:  # the object's own repr may be what is broken
        pass
    try:
        structlog.get_logger("prefixd").error(
            "unraisable_exception", thread=threading.current_thread().name, where=where, **fields
        )
    except Exception:
        sys.__unraisablehook__(unraisable)


def _log_or_fall_back(
    event: str, thread_name: str, exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None
) -> None:
    try:
        structlog.get_logger("prefixd").critical(event, thread=thread_name, **_exception_fields(exc_type, exc, tb))
    except Exception:  # logging itself is broken: plain text beats losing the traceback
        sys.__excepthook__(exc_type, exc if exc is not None else exc_type(), tb)
