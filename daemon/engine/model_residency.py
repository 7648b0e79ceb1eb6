"""Models on demand: load a configured model on first use, unload it when idle or when room is needed.

Every configured model has a slot; a slot holds its ``LoadedModel`` while it
is resident. Rules:

* A job pins its model from ``Engine.submit`` until its reply (done or failed)
  is emitted: a pinned model never unloads for its keep_alive.
* An unpinned model stays for its ``keep_alive`` (the last request's, or the
  daemon's ``--keep-alive`` when that request gave none, as Ollama does;
  negative: for good; 0: unloaded as soon as its last job ends), then the
  engine unloads it between steps.
* Before a load, if ``--max-model-memory`` would be passed, models that serve
  no request the engine has taken in are unloaded least recently used first
  (one whose jobs are all still queued reloads when their turn comes); if
  serving ones stand in the way, the job waits (parked here), retried each
  iteration, and the engine takes no new job meanwhile (``waits_for_room``),
  so the serving ones drain. A model larger than the limit on its own fails
  its requests.
* A load that fails fails that request with MODEL_LOAD_FAILED; the next
  request for the model tries again.

Loads and unloads run on the engine thread (MLX arrays belong to the thread
that made them). A request's model loads in steps (``load_steps``, advanced
once per engine iteration by ``step_loading``; its jobs stay parked until the
last step), so running requests decode between the steps; a whole load
(``load``: at start, Ollama's load request) blocks the engine for as long as
it reads the weights. The prefix store is untouched by an unload: its
entries are namespaced by the model's fingerprint, which a reload computes
again identically, so a reloaded model finds them.

``pin`` and the unpinning run on any thread (the event loop submits, the
engine, a grammar thread or the loop may emit the end), under one lock.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generator

import structlog

from ...protocol.errors import ErrorCode, RpcError
from ...protocol.keep_alive import describe_keep_alive
from ..models.loaded_model import LoadedModel
from ..models.model_catalog import CatalogEntry
from .jobs import DONE, FAILED, GenerateJob

log = structlog.get_logger("prefixd.models")


@dataclass
class _Slot:
    entry: CatalogEntry
    keep_alive: float  # seconds an idle model stays; negative: for good
    loaded: LoadedModel | None = None
    loaded_at: float | None = None  # wall clock, for listings
    last_used: int = 0  # a use count, not a time: the least recently used goes first, ties impossible
    idle_since: float | None = None  # monotonic; None while a job pins it
    num_jobs: int = 0  # queued or running jobs naming this model
    loading: Generator[None, None, LoadedModel] | None = None  # a load in steps, advanced once per engine iteration
    load_started: float = 0.0  # perf_counter

    def expires_at(self) -> float | None:
        """Monotonic time it unloads at; None: never (pinned, or kept for good)."""
        if self.loaded is None or self.num_jobs or self.idle_since is None or self.keep_alive < 0:
            return None
        return self.idle_since + self.keep_alive


class ModelResidency:
    """Which configured models are loaded; loads, unloads and the jobs waiting for room."""

    def __init__(
        self,
        catalog: dict[str, CatalogEntry],
        load: Callable[[CatalogEntry], LoadedModel],
        on_unload: Callable[[LoadedModel], None],
        keep_alive: float,
        max_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
        load_steps: Callable[[CatalogEntry], Generator[None, None, LoadedModel]] | None = None,
        serving: Callable[[], set[str]] | None = None,
        unloads_idle: bool = True,
    ):
        """``load``: a whole load (at start, Ollama's load request); ``load_steps``: a load in steps, one per
        engine iteration, for a request's model (None: requests load whole too); ``serving``: the models
        whose jobs the engine has taken in (running, or held for KV room), which room is never made from;
        None: every job, queued ones too, keeps its model from being unloaded for room; ``unloads_idle``:
        False keeps a model loaded past its keep_alive (ranks: an unload on one rank alone would split them)."""
        self._load_steps = load_steps
        self._unloads_idle = unloads_idle
        self._serving = serving
        self.default_keep_alive = keep_alive
        self._slots = {name: _Slot(entry, keep_alive) for name, entry in catalog.items()}
        self._load = load
        self._on_unload = on_unload
        self.max_bytes = max_bytes  # 0: no limit
        self._clock = clock
        self._lock = threading.Lock()
        self._uses = itertools.count(1)
        self._parked: deque[tuple[GenerateJob, str]] = (
            deque()
        )  # (job, its model): waiting for pinned models to make room

    # -- any thread ------------------------------------------------------------------------

    def pin(self, job: GenerateJob, name: str) -> Callable[[], None]:
        """Pin ``name`` until the job's reply is emitted; returns the unpin (idempotent), for a job never queued."""
        slot = self._slots[name]
        with self._lock:
            slot.num_jobs += 1
            slot.idle_since = None
        released = threading.Event()
        # Ollama's rule: each request sets how long its model stays, the daemon's default when it says nothing.
        keep_alive = self.default_keep_alive if job.params.keep_alive is None else job.params.keep_alive

        def unpin() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                slot.num_jobs -= 1
                slot.keep_alive = keep_alive
                slot.last_used = next(self._uses)  # a request that just ended counts as the latest use
                if not slot.num_jobs:
                    slot.idle_since = self._clock()

        emit = job.emit

        def emit_then_unpin(kind: str, payload: Any) -> None:
            if kind in (DONE, FAILED):
                unpin()  # first: a client told "done" then asking `models` sees the model idle
            emit(kind, payload)

        job.emit = emit_then_unpin
        return unpin

    # -- engine thread ---------------------------------------------------------------------

    def make_resident(self, job: GenerateJob, name: str) -> bool:
        """True: the job may go to the scheduler (its model is loaded, or it was cancelled).

        False: the job is taken care of here: parked until room frees up or its
        model has loaded (in steps, see step_loading), or failed (the model is
        too large or did not load).
        """
        slot = self._slots[name]
        if job.cancelled.is_set():
            return True  # the scheduler answers it
        if slot.loaded is not None:
            slot.last_used = next(self._uses)
            return True
        if slot.loading is None:
            try:
                if not self._make_room(slot):
                    self._parked.append((job, name))
                    return False
                if self._load_steps is None:
                    self._load_slot(slot)
                    return True
                self._start_loading(slot)
            except RpcError as err:
                job.emit(FAILED, err)
                return False
            if slot.loaded is not None:
                return True
        self._parked.append((job, name))  # goes once its model has loaded
        return False

    def step_loading(self) -> bool:
        """Advance every load in progress by one step; True while any goes on. A failed one fails its waiting jobs."""
        for name, slot in self._slots.items():
            if slot.loading is None:
                continue
            try:
                self._advance(slot)
            except RpcError as err:
                self._fail_parked_for(name, err)
        return self.is_loading

    @property
    def is_loading(self) -> bool:
        return any(slot.loading is not None for slot in self._slots.values())

    def next_parked(self) -> GenerateJob | None:
        """The first parked job that can go now (room freed up, or cancelled), taken out of the queue."""
        for item in self._parked:
            job, name = item
            slot = self._slots[name]
            if (
                job.cancelled.is_set()
                or slot.loaded is not None
                or (slot.loading is None and self._fits_after_evictions(slot))
            ):
                self._parked.remove(item)
                return job
        return None

    @property
    def waits_for_room(self) -> bool:
        """A parked job waits for models that serve requests to go idle (not for a load in steps).

        The engine then takes no new jobs from the inbox: a steady stream of
        requests for the loaded models would otherwise keep them pinned, and
        the parked job would wait for as long as that stream lasts. Requests
        behind it wait for what is running now to finish, as in Ollama.
        """
        return any(
            not job.cancelled.is_set() and self._slots[name].loaded is None and self._slots[name].loading is None
            for job, name in self._parked
        )

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def fail_parked(self, err_factory: Callable[[], RpcError]) -> None:
        """The engine gives up: loads in progress are abandoned, waiting jobs fail."""
        for slot in self._slots.values():
            if slot.loading is not None:
                loading, slot.loading = slot.loading, None
                loading.close()
        while self._parked:
            job, _ = self._parked.popleft()
            job.emit(FAILED, err_factory())

    def _fail_parked_for(self, name: str, err: RpcError) -> None:
        waiting = [item for item in self._parked if item[1] == name]
        for item in waiting:
            self._parked.remove(item)
            item[0].emit(FAILED, RpcError(err.code, err.message))  # one error object per request

    def ensure_loaded(self, name: str, keep_alive: float | None) -> LoadedModel:
        """Load a model now (Ollama's load request); raises MODEL_LOAD_FAILED, or OVERLOADED while pinned models fill the room."""
        slot = self._slots[name]
        with self._lock:
            slot.keep_alive = self.default_keep_alive if keep_alive is None else keep_alive
        if slot.loading is not None:  # a request's load in steps is under way: finish it now
            try:
                while slot.loading is not None:
                    self._advance(slot)
            except RpcError as err:
                self._fail_parked_for(name, err)
                raise
        if slot.loaded is None:
            if not self._make_room(slot):
                raise RpcError(
                    ErrorCode.OVERLOADED,
                    f"model {name} does not fit beside the models serving requests "
                    f"now (--max-model-memory {self.max_bytes} bytes); retry later",
                )
            self._load_slot(slot)
        slot.last_used = next(self._uses)
        with self._lock:
            if not slot.num_jobs:
                slot.idle_since = self._clock()
        return slot.loaded

    def unload(self, name: str) -> bool:
        """Unload now if no job pins it (True); else it unloads as soon as its last job ends (keep_alive 0)."""
        slot = self._slots[name]
        with self._lock:
            slot.keep_alive = 0.0
            busy = slot.num_jobs > 0
        if slot.loaded is None or busy:
            return slot.loaded is None
        self._unload_slot(slot, "asked")
        return True

    def unload_expired(self) -> None:
        if not self._unloads_idle:
            return
        now = self._clock()
        for slot in self._slots.values():
            with self._lock:
                expires_at = slot.expires_at()
            if expires_at is not None and now >= expires_at:
                self._unload_slot(slot, "idle")

    def loaded_models(self) -> dict[str, LoadedModel]:
        return {name: slot.loaded for name, slot in self._slots.items() if slot.loaded is not None}

    @property
    def resident_bytes(self) -> int:
        """The loaded models' weights, and those of models loading now (their memory is being filled)."""
        return sum(
            slot.loaded.weight_bytes if slot.loaded is not None else slot.entry.weight_bytes
            for slot in self._slots.values()
            if slot.loaded is not None or slot.loading is not None
        )

    def describe(self, name: str) -> dict[str, Any]:
        """What ``models`` says of its residency: loaded or not, its memory, since when and until when."""
        slot = self._slots[name]
        with self._lock:
            expires_at, num_jobs, keep_alive = slot.expires_at(), slot.num_jobs, slot.keep_alive
        loaded = slot.loaded
        return {
            "loaded": loaded is not None,
            "loading": slot.loading is not None,
            "resident_bytes": loaded.weight_bytes if loaded is not None else 0,
            "weight_bytes": loaded.weight_bytes if loaded is not None else slot.entry.weight_bytes,
            "loaded_at": slot.loaded_at if loaded is not None else None,
            # Wall-clock unload time; None while loaded for good or pinned by a job (and when not loaded).
            "expires_at": time.time() + max(0.0, expires_at - self._clock()) if expires_at is not None else None,
            "keep_alive": describe_keep_alive(keep_alive),
            "active_jobs": num_jobs,
        }

    # -- loading and unloading -------------------------------------------------------------

    def _fits_after_evictions(self, slot: _Slot) -> bool:
        if not self.max_bytes:
            return True
        idle = sum(s.loaded.weight_bytes for s in self._evictable(slot))
        return self.resident_bytes - idle + slot.entry.weight_bytes <= self.max_bytes

    def _evictable(self, wanted: _Slot) -> list[_Slot]:
        """Loaded models other than ``wanted`` that serve no request now, least recently used first.

        A job still queued behind the one that needs the room does not keep
        its model: jobs are taken first come, first served across models
        (``waits_for_room``), and it reloads its model when its turn comes.
        """
        serving = self._serving() if self._serving is not None else None
        with self._lock:
            idle = [
                s
                for s in self._slots.values()
                if s is not wanted
                and s.loaded is not None
                and (not s.num_jobs if serving is None else s.entry.name not in serving)
            ]
        return sorted(idle, key=lambda s: s.last_used)

    def _make_room(self, slot: _Slot) -> bool:
        """Unload idle models (LRU first) until ``slot`` fits; False if pinned models leave too little room."""
        if not self.max_bytes:
            return True
        need = slot.entry.weight_bytes
        if need > self.max_bytes:
            raise RpcError(
                ErrorCode.MODEL_LOAD_FAILED,
                f"model {slot.entry.name} needs {need} bytes of weights, more than --max-model-memory "
                f"({self.max_bytes} bytes) allows for all models together",
            )
        if not self._fits_after_evictions(slot):
            return False
        for victim in self._evictable(slot):
            if self.resident_bytes + need <= self.max_bytes:
                break
            self._unload_slot(victim, "room", for_model=slot.entry.name)
        return True

    def _load_slot(self, slot: _Slot) -> None:
        """A whole load, now."""
        slot.load_started = time.perf_counter()
        try:
            loaded = self._load(slot.entry)
        except Exception as exc:  # the request fails, the daemon serves on; the next request tries again
            raise self._load_error(slot, exc) from None
        self._resident(slot, loaded)

    def _start_loading(self, slot: _Slot) -> None:
        """A load in steps: its first step runs now (a missing file fails here, at once)."""
        slot.load_started = time.perf_counter()
        slot.loading = self._load_steps(slot.entry)
        self._advance(slot)

    def _advance(self, slot: _Slot) -> None:
        """One step of a load in progress; raises MODEL_LOAD_FAILED (the load is over) if it fails."""
        try:
            next(slot.loading)
        except StopIteration as done:
            slot.loading = None
            self._resident(slot, done.value)
        except Exception as exc:
            slot.loading = None
            raise self._load_error(slot, exc) from None

    def _load_error(self, slot: _Slot, exc: Exception) -> RpcError:
        entry = slot.entry
        log.error("model_load_failed", model=entry.name, path=str(entry.path), error=f"{type(exc).__name__}: {exc}")
        return RpcError(
            ErrorCode.MODEL_LOAD_FAILED,
            f"model {entry.name} could not be loaded from {entry.path}: {type(exc).__name__}: {exc}",
        )

    def _resident(self, slot: _Slot, loaded: LoadedModel) -> None:
        entry = slot.entry
        if loaded.fingerprint != entry.fingerprint:
            log.warning(
                "model_changed_on_disk",
                model=entry.name,
                fingerprint_at_start=entry.fingerprint,
                fingerprint_now=loaded.fingerprint,
            )
        slot.loaded, slot.loaded_at = loaded, time.time()
        slot.last_used = next(self._uses)
        with self._lock:
            if not slot.num_jobs:
                slot.idle_since = self._clock()
        log.info(
            "model_resident",
            model=entry.name,
            load_s=round(time.perf_counter() - slot.load_started, 3),
            weight_bytes=loaded.weight_bytes,
            resident_bytes=self.resident_bytes,
            keep_alive=describe_keep_alive(slot.keep_alive),
        )

    def _unload_slot(self, slot: _Slot, reason: str, for_model: str | None = None) -> None:
        loaded, slot.loaded, slot.loaded_at = slot.loaded, None, None
        if loaded is None:
            return
        self._on_unload(loaded)
        log.info(
            "model_unloaded",
            model=slot.entry.name,
            reason=reason,
            for_model=for_model,
            weight_bytes=loaded.weight_bytes,
            resident_bytes=self.resident_bytes,
        )
