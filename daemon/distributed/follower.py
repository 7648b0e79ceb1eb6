"""A rank other than 0: no fronts, no socket; its engine follows rank 0's iterations until told to stop.

Its exit status says how the daemon ended: 0 when rank 0 shut down cleanly,
1 when anything else ended it (a lost rank, a divergence, the watchdog, a
failed start). SIGINT and SIGTERM are ignored: a Ctrl-C in the terminal, or a
service manager stopping the whole group, reaches every rank, and rank 0
decides the shutdown (letting running requests finish) and tells the others.
A follower whose rank 0 is gone still ends: its next collective fails, or
the watchdog fires.
"""

from __future__ import annotations

import asyncio
import signal
import threading

import structlog

from ..engine.engine import Engine

log = structlog.get_logger("prefixd.distributed")


def run_follower(engine: Engine, load_timeout_seconds: float) -> int:
    """Run this rank's engine (on the lock-step inputs) until rank 0 stops it or the ranks fail; the exit status."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    ended = threading.Event()
    engine.on_dead = lambda reason: ended.set()
    engine.start()
    try:
        asyncio.run(engine.wait_ready(load_timeout_seconds))
    except BaseException as exc:
        log.critical("rank_start_failed", reason=f"{type(exc).__name__}: {exc}")
        return 1
    while engine.is_alive and not ended.is_set():
        ended.wait(0.5)
    if engine.dead_reason is not None:
        log.critical("rank_stopped", reason=engine.dead_reason)
        return 1
    log.info("rank_stopped", reason=engine.stop_reason)
    return 0 if engine.stop_reason == "stopped" else 1
