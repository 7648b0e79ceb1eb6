"""The engine thread: the only thread that touches MLX, the models and the prefix store.

Since mlx 0.31.2 MLX streams belong to the thread that created them, so the
models are loaded here and every MLX call happens here. The asyncio front
talks to the engine only through the inbox (jobs and control calls in) and
the jobs' emit callbacks (events out). This module is the thread's lifecycle
and loop; the control calls themselves are control_calls.py's.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, TypeVar

import structlog

from ..cache import PrefixStore
from ..models.loaded_model import LoadedModel, load_model
from ..models.names import model_not_found
from .control_calls import ControlCalls, peak_rss_bytes
from .inbox import Inbox
from .jobs import GenerateJob
from .scheduler import Scheduler
from .settings import EngineSettings

T = TypeVar("T")
log = structlog.get_logger("prefixd.engine")


class Engine:
    """The engine thread and what it owns: the loaded models, the prefix store, the scheduler."""

    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.inbox = Inbox(settings.max_queued, settings.max_queued_per_client)
        self.models: dict[str, LoadedModel] = {}
        self.model_names: tuple[str, ...] = ()  # read by the front: plain strings only
        self.default_model: str | None = None
        self.store: PrefixStore | None = None  # set once the models are loaded
        self.scheduler: Scheduler | None = None
        self.controls = ControlCalls(self)
        self._held_job: GenerateJob | None = None  # admitted once memory frees up
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefixd-engine", daemon=True)

    # -- lifecycle (front side) ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    async def wait_ready(self, timeout: float) -> None:
        """Wait for the models to load; raise what went wrong if they did not."""
        ready = await asyncio.to_thread(self._ready.wait, timeout)
        if not ready:
            raise TimeoutError(f"models did not load within {timeout:.0f} s")
        if self._startup_error is not None:
            raise self._startup_error

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self.inbox.put_control(lambda: None)  # wake the thread
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- requests (front side) ----------------------------------------------------

    def submit(self, job: GenerateJob) -> None:
        self.inbox.put_job(job)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread (between decode steps) and await its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(ok: bool, value: Any) -> None:
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        def run() -> None:
            try:
                value, ok = fn(), True
            except BaseException as exc:  # handed to the caller, not raised here
                value, ok = exc, False
            loop.call_soon_threadsafe(settle, ok, value)

        self.inbox.put_control(run)
        return await future

    # -- engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._load_all()
        except BaseException as exc:
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        while not self._stopping.is_set():
            self.poll_controls()
            self._admit_jobs()
            if self.scheduler.has_work:
                self.scheduler.step()
                continue
            item = self.inbox.take(timeout=0.25)  # idle: sleep until something arrives
            if isinstance(item, GenerateJob):
                self._held_job = item
            elif item is not None:
                item()

    def _admit_jobs(self) -> None:
        scheduler = self.scheduler
        while scheduler.can_admit():
            job = self._held_job or self.inbox.take_job()
            self._held_job = None
            if job is None:
                return
            if not scheduler.admit(job):
                self._held_job = job  # its KV does not fit yet: keep it first in line
                return

    def _load_all(self) -> None:
        for spec in self.settings.model_specs:
            loaded = load_model(spec, dtype=self.settings.dtype)
            if loaded.name in self.models:
                loaded.name = loaded.encoder.model_name = f"{loaded.name}-{len(self.models)}"
            self.models[loaded.name] = loaded
            log.info(
                "model_loaded",
                model=loaded.name,
                path=str(loaded.path),
                load_s=round(loaded.load_seconds, 3),
                weight_bytes=loaded.weight_bytes,
                dtype=loaded.dtype,
                hybrid=loaded.layout.is_hybrid,
                cache_layers=loaded.layout.describe(),
                fingerprint=loaded.fingerprint,
                process_peak_rss_bytes=peak_rss_bytes(),
            )
            if not loaded.layout.is_supported:
                log.warning("prefix_cache_unsupported", model=loaded.name, reason="cache layers other than KVCache/ArraysCache")
        self.model_names = tuple(self.models)
        self.default_model = self.model_names[0] if self.model_names else None
        self.store = PrefixStore(
            max_bytes=self.settings.cache_bytes,
            max_nodes=self.settings.cache_nodes,
            max_pinned_bytes=self.settings.pinned_bytes,
            recompute_seconds=self._recompute_seconds,
        )
        self.scheduler = Scheduler(
            self.store,
            chunk_size=self.settings.prefill_chunk,
            max_active=self.settings.max_active,
            kv_budget_bytes=self.settings.cache_bytes,
            resolve_model=self.model_for,
        )

    def _recompute_seconds(self, start_depth: int, num_tokens: int) -> float:
        rates = [m.prefill_tokens_per_s for m in self.models.values() if m.prefill_tokens_per_s]
        rate = min(rates) if rates else 200.0
        # Attention makes later tokens dearer to recompute than early ones.
        return num_tokens / rate * (1.0 + (start_depth + num_tokens / 2) / 4096)

    def poll_controls(self) -> None:
        """Answer control calls (stats, tokenize, pin ...) between decode steps."""
        while (call := self.inbox.take_control()) is not None:
            call()

    def model_for(self, name: str | None) -> LoadedModel:
        name = name or self.default_model
        loaded = self.models.get(name) if name else None
        if loaded is None:
            raise model_not_found(name, self.models)
        return loaded
