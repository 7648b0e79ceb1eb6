"""The engine thread: the only thread that touches MLX, the models and the prefix store.

Since mlx 0.31.2 MLX streams belong to the thread that created them, so the
models are loaded here and every MLX call happens here. The asyncio front
talks to the engine only through the inbox (jobs and control calls in) and
the jobs' emit callbacks (events out).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import structlog

from ..protocol.errors import ErrorCode, RpcError
from .scheduler import Scheduler
from .inbox import Inbox
from .jobs import GenerateJob
from .loaded_model import LoadedModel, load_model

T = TypeVar("T")
log = structlog.get_logger("prefixd.engine")


@dataclass(frozen=True)
class EngineSettings:
    model_specs: tuple[str, ...]
    dtype: str = "auto"
    prefill_chunk: int = 512
    cache_bytes: int = 4 << 30
    cache_nodes: int = 65536
    pinned_bytes: int = 1 << 30
    max_queued: int = 256
    max_queued_per_client: int = 64
    max_active: int = 16  # sequences prefilling or decoding at once


class Engine:
    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.inbox = Inbox(settings.max_queued, settings.max_queued_per_client)
        self.models: dict[str, LoadedModel] = {}
        self.model_names: tuple[str, ...] = ()  # read by the front: plain strings only
        self.default_model: str | None = None
        self.store: Any = None
        self.scheduler: Scheduler | None = None
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

    def cancel_all(self) -> None:
        """Cancel every running sequence (shutdown); they answer at the next step."""
        self.inbox.put_control(lambda: self.scheduler and self.scheduler.cancel_all())

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
        from .prefix_store import PrefixStore

        for spec in self.settings.model_specs:
            loaded = load_model(spec, dtype=self.settings.dtype)
            if loaded.name in self.models:
                loaded.name = f"{loaded.name}-{len(self.models)}"
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
            raise RpcError(ErrorCode.MODEL_NOT_FOUND, f"no model named {name!r} is loaded; loaded: {', '.join(self.models)}")
        return loaded

    # -- control calls (run on the engine thread through call()) -----------------------

    def tokenize(self, prompt: Any, model: str | None) -> dict[str, Any]:
        loaded = self.model_for(model)
        encoded = loaded.encode(prompt)
        return {"tokens": encoded.tokens, "num_tokens": len(encoded.tokens), "model": loaded.name, "text": encoded.text}

    def pin(self, prompt: Any, model: str | None, pinned: bool) -> dict[str, Any]:
        from .prefix_store import NotStored, PinBudgetExceeded

        loaded = self.model_for(model)
        tokens = loaded.encode(prompt).tokens
        # The store keeps a prompt's first len-1 tokens (the last one always runs).
        tokens = tokens[:-1] if len(tokens) > 1 else tokens
        try:
            if pinned:
                result = self.store.pin(loaded.fingerprint, tokens)
            else:
                result = self.store.unpin(loaded.fingerprint, tokens)
        except NotStored as exc:
            hint = "send it with cache.warm first" if pinned else "it is not pinned"
            raise RpcError(ErrorCode.NOT_CACHED, f"{exc}; {hint}") from None
        except PinBudgetExceeded as exc:
            raise RpcError(ErrorCode.PIN_BUDGET_EXCEEDED, str(exc)) from None
        return {"pinned_tokens": result.pinned_tokens, "pinned_bytes": result.pinned_bytes}

    def stats(self) -> dict[str, Any]:
        store_stats = self.store.stats()
        names = {m.fingerprint: name for name, m in self.models.items()}
        return {
            "requests": {**self.scheduler.counters, **self.scheduler.counts(), **self.inbox.counts()},
            "cache": {
                "total": _plain(store_stats.total),
                "per_model": {names.get(ns, ns): _plain(s) for ns, s in store_stats.namespaces.items()},
            },
            "models": {name: {"prefill_tokens_per_s": round(m.prefill_tokens_per_s, 1)} for name, m in self.models.items()},
            "process": {"peak_rss_bytes": peak_rss_bytes()},
        }

    def describe_models(self) -> list[dict[str, Any]]:
        return [m.describe(default=(name == self.default_model)) for name, m in self.models.items()]


def peak_rss_bytes() -> int | None:
    """The daemon process's peak resident memory so far (None where the OS does not say)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def _plain(value: Any) -> Any:
    """NamedTuples and dataclasses as plain maps, for msgpack."""
    if hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if hasattr(value, "__dataclass_fields__"):
        return {k: _plain(getattr(value, k)) for k in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
