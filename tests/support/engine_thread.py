"""An engine without models for persistence tests: one thread that runs every ``call``, timed.

``Persistence`` needs of the engine only ``catalog`` (every configured model's
fingerprint and layout, loaded or not), ``store`` and ``call``; this gives it those, with the calls run one at a
time on a thread of their own as the real engine runs them between steps.
``call_seconds`` records how long each call held that thread, which is
what a save or a load costs decoding; ``refuse`` lets a test make a call
fail the way a dead engine's does.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, Callable, TypeVar

from prefixd.daemon.cache import PrefixStore
from prefixd.daemon.kv.layout import CacheLayout

T = TypeVar("T")


class EngineThread:
    def __init__(self, store: PrefixStore, layouts: dict[str, CacheLayout]):
        self.store = store
        self.catalog = {fp: SimpleNamespace(fingerprint=fp, layout=layout) for fp, layout in layouts.items()}
        self.call_seconds: list[float] = []
        self.refuse: Callable[[], bool] | None = None  # True: this call fails before it runs
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="fake-engine")
        self.thread: threading.Thread = self._executor.submit(threading.current_thread).result()

    async def call(self, fn: Callable[[], T]) -> T:
        if self.refuse is not None and self.refuse():
            raise RuntimeError("the engine refused this call")
        return await asyncio.wrap_future(self._executor.submit(self._timed, fn))

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread from synchronous code (building a store, checking it)."""
        return self._executor.submit(fn).result()

    def _timed(self, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return fn()
        finally:
            self.call_seconds.append(time.perf_counter() - started)

    def close(self) -> None:
        self._executor.shutdown()
