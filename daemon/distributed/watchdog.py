"""A rank that stops answering: the one failure a collective does not report.

A rank that exits makes the others' collectives fail within about a second
(channel.RankLost). A rank that hangs (stopped, swapping, a wedged device)
makes them wait in a collective forever, inside MLX, where no Python code can
interrupt them. So the engine arms this watchdog around every lock-step
iteration (and, with a longer limit, around loading and the handshake); if
one runs past its limit, the watchdog thread calls ``on_expired`` once, which
fails every request and ends the process (engine/engine.py: Engine.abandon).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import structlog

log = structlog.get_logger("prefixd.distributed")


class IterationWatchdog:
    def __init__(self, on_expired: Callable[[str], None]):
        self._on_expired = on_expired
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._what = ""
        self._limit = 0.0
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="prefixd-rank-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def arm(self, seconds: float, what: str) -> None:
        with self._lock:
            self._deadline, self._what, self._limit = time.monotonic() + seconds, what, seconds

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def stop(self) -> None:
        self.disarm()
        self._wake.set()

    def _watch(self) -> None:
        while not self._wake.wait(0.2):
            with self._lock:
                expired = self._deadline is not None and time.monotonic() > self._deadline
                what, limit = self._what, self._limit
            if expired:
                reason = f"{what} took longer than {limit:.0f} s: another rank stopped answering (--rank-timeout)"
                log.critical("rank_watchdog_expired", reason=reason)
                try:
                    self._on_expired(reason)
                except Exception:  # the process must still end: the owner's callback exits it
                    log.exception("rank_watchdog_callback_failed")
                return
