"""The engine thread: the only thread that touches MLX, the models and the prefix store.

Since mlx 0.31.2 MLX streams belong to the thread that created them, so the
models are loaded here and every MLX call happens here. The asyncio front
talks to the engine only through the inbox (jobs and control calls in) and
the jobs' emit callbacks (events out). The engine takes its inputs from an
input source (inputs.py): one process's inbox, or the lock-step of several
ranks; the loop is the same for both. This module is the thread's lifecycle
and loop; the control calls themselves are control_calls.py's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Generator, TypeVar

import structlog

from ...protocol.errors import ErrorCode, RpcError
from ..cache import KvBudget, PrefixStore
from ..cuda import on_cuda
from ..models.loaded_model import LoadedModel, ModelCard, load_model, mlx_lm_load
from ..models.model_catalog import CatalogEntry, describe_models
from ..models.staged_load import load_in_steps
from ..models.names import model_not_found
from .constrained_sampling import compiler_for
from .device_memory import configure_buffer_cache
from .control_calls import peak_rss_bytes
from .faults import fault_point
from .inputs import InputSource
from .jobs import FAILED, GenerateJob, internal_error
from .model_residency import ModelResidency
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .settings import CPU_PASS_DEPTH_SCALE, EngineSettings, default_chunks_per_store, default_prefill_chunk
from .step_trace import StepTrace
from .warm_up import resolve_mode as warm_up_wanted
from .warm_up import run_all, warm_up_steps

T = TypeVar("T")
log = structlog.get_logger("prefixd.engine")

# Failures in a row, each already answered by failing every running request,
# after which the engine stops trying: something is broken beyond one batch.
MAX_FAILED_ITERATIONS = 3
NUM_GRAMMAR_THREADS = 2
# A pending shadow check starts only after the engine has been idle this long. A
# pass cannot be interrupted (a cold prefill chunk: a fraction of a second on a GPU
# at a new shape, seconds on a CPU), and clients that send their next request as
# soon as an answer ends (a chat, an agent's loop, a benchmark) would otherwise
# find one running (docs/decisions.md).
SHADOW_IDLE_GRACE_S = 0.2
# Tokens per second the store's eviction costs assume before any prefill pass was measured.
DEFAULT_PREFILL_RATE = 200.0
# How long an idle engine waits on its inputs before it looks again (ranks: rank 0's heartbeat).
IDLE_WAIT_S = 0.25


class ControlCall:
    """A call the front wants run on the engine thread; settles the front's future either way."""

    def __init__(self, fn: Callable[[], Any], settle: Callable[[bool, Any], None]):
        self.fn = fn
        self.settle = settle

    def __call__(self) -> None:
        try:
            fault_point("control")
            value, ok = self.fn(), True
        except BaseException as exc:  # handed to the caller, not raised here
            value, ok = exc, False
        self.settle(ok, value)

    def fail(self, err: BaseException) -> None:
        self.settle(False, err)


class Engine:
    """The engine thread and what it owns: the loaded models, the prefix store, the scheduler.

    ``inputs``: where jobs, control calls and the clock come from (inputs.py).
    ``load_weights``: path -> (model, tokenizer) for a whole load (ranks: each its shard).
    ``loads_on_demand``: only the default model loads at start, the others at their first
    request, in steps between decode steps; otherwise every model loads at start, whole.
    ``unloads_idle``: a model unloads once idle for its keep_alive.
    ``warms_up``: a model's load ends with its warm-up where ``settings.warm_up`` asks for one.
    """

    def __init__(
        self,
        inputs: InputSource,
        settings: EngineSettings,
        *,
        load_weights: Callable[[str], tuple[Any, Any]] = mlx_lm_load,
        loads_on_demand: bool = True,
        unloads_idle: bool = True,
        warms_up: bool = True,
    ):
        self.settings = settings
        self.inputs = inputs
        self.inbox = inputs.inbox
        self._load_weights = load_weights
        self._loads_on_demand = loads_on_demand
        self._unloads_idle = unloads_idle
        self._may_warm_up = warms_up
        self.models: dict[str, LoadedModel] = {}  # the loaded ones (model_residency.py loads and unloads them)
        self.catalog: dict[str, CatalogEntry] = {}  # every configured model, loaded or not
        self.residency: ModelResidency | None = None  # set once the default model is loaded
        self.model_names: tuple[str, ...] = ()  # read by the front: plain strings only; every configured model
        self.cards: dict[str, ModelCard] = {}  # read by the front: names, fingerprints, encoders
        self.default_model: str | None = None
        self.store: PrefixStore | None = None  # set once the models are loaded
        self.prefill_chunk: int | None = settings.prefill_chunk  # None until the device is known
        self.scheduler: Scheduler | None = None
        self.controls = inputs.control_calls(self)
        self._held_job: GenerateJob | None = None  # admitted once memory frees up
        self._busy_at = 0.0  # monotonic: the last iteration that served a request (SHADOW_IDLE_GRACE_S)
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._stopping = threading.Event()
        self.dead_reason: str | None = None  # set once, when the engine gives up
        self.stop_reason: str | None = None  # set when the inputs stopped the engine (ranks: rank 0 did), why
        self.on_dead: Callable[[str], None] | None = None  # called on the engine thread; must be thread-safe
        self._thread = threading.Thread(target=self._run, name="prefixd-engine", daemon=True)
        # Constraints compile here, off the engine thread and off the event loop (see submit).
        self._grammar_pool = ThreadPoolExecutor(NUM_GRAMMAR_THREADS, thread_name_prefix="prefixd-grammar")
        # A model loading on demand reads its tokenizer here, off the engine thread (models/staged_load.py).
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="prefixd-tokenizer")

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
        try:
            self.inbox.put_control(lambda: None)  # wake the thread
        except RpcError:
            pass  # it is gone already
        # A dead engine's thread has ended, or (abandoned) never will.
        self._thread.join(1.0 if self.dead_reason is not None else timeout)
        self._grammar_pool.shutdown(wait=False)  # a compile still running queues its job into a closed inbox: it fails
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self.inputs.close()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # -- requests (front side) ----------------------------------------------------

    def submit(self, job: GenerateJob, reserved: bool = False) -> None:
        """Queue a job; raises OVERLOADED, SHUTTING_DOWN or ENGINE_DEAD at once when it cannot be.

        ``reserved``: the job fills a place taken with ``inbox.reserve`` before it was encoded.
        A job with a constraint keeps (or takes) its place while the constraint
        compiles on a grammar thread, then is queued; one whose constraint does
        not compile fails with INVALID_PARAMS through its ``emit``.
        """
        unpin = self.residency.pin(
            job, self.entry_for(job.params.model).name
        )  # until its reply: never unloaded under it
        try:
            if job.params.constraint is not None and job.grammar is None and not job.warm_only:
                if not reserved:
                    self.inbox.reserve(job.client_id, job.fair_lane)
                try:
                    self._grammar_pool.submit(self._compile_then_queue, job)
                except RuntimeError:  # stopped: the pool takes no more work
                    self.inbox.release(job.client_id, job.fair_lane)
                    raise RpcError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down") from None
                return
            self.inbox.put_job(job, reserved)
        except BaseException:
            unpin()  # never queued: it will emit nothing
            raise

    def _compile_then_queue(self, job: GenerateJob) -> None:
        """On a grammar thread: the job's matcher, then its place in the queue (it holds a reserved one)."""
        try:
            if job.cancelled.is_set():
                raise RpcError(ErrorCode.CANCELLED, "cancelled before it started")
            entry = self.entry_for(job.params.model)  # its tokenizer, whether the weights are loaded or not
            job.grammar = compiler_for(entry).start(job.params.constraint)
        except BaseException as exc:
            self.inbox.release(job.client_id, job.fair_lane)
            if not isinstance(exc, RpcError):
                log.exception("constraint_compile_failed", request_id=job.request_id)
                exc = internal_error(exc, "the constraint could not be compiled")
            job.emit(FAILED, exc)
            return
        try:
            self.inbox.put_job(job, reserved=True)
        except RpcError as err:  # closed meanwhile (shutting down, engine dead): the place is given back
            job.emit(FAILED, err)

    def cancel(self, job: GenerateJob) -> None:
        """Cancel a job: a queued one is answered CANCELLED at once and gives its place in line back."""
        job.cancel()
        self.inbox.drop_cancelled(job.client_id)

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread (between decode steps) and await its result."""
        if self.dead_reason is not None:
            raise self.dead_error()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def resolve(ok: bool, value: Any) -> None:
            if not future.done():
                future.set_result(value) if ok else future.set_exception(value)

        def settle(ok: bool, value: Any) -> None:  # on the engine thread
            try:
                loop.call_soon_threadsafe(resolve, ok, value)
            except RuntimeError:
                pass  # the loop is gone: the daemon is exiting

        self.inbox.put_control(ControlCall(fn, settle))
        return await future

    def dead_error(self) -> RpcError:
        return RpcError(
            ErrorCode.ENGINE_DEAD,
            f"the engine has stopped ({self.dead_reason}); the daemon is exiting and its service manager restarts it",
        )

    # -- engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            configure_buffer_cache(self.settings.mlx_cache_bytes, self.settings.cache_bytes)
            self._load_all()
        except BaseException as exc:
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        reason = "the engine thread ended"
        try:
            reason = self._serve()
            self.inputs.end(self, reason)
        except BaseException as exc:  # a bug in the supervision itself: still nobody may wait forever
            log.critical("engine_thread_failed", exc_info=True)
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            if self.scheduler.trace is not None:
                self.scheduler.trace.close()
            if not self._stopping.is_set():
                self._die(reason)

    def _serve(self) -> str:
        """The loop, supervised: a failure fails the requests it touched and the engine goes on.

        Failures inside a request's own steps are the scheduler's to answer
        (that request fails, the rest carry on). What escapes to here fails
        every running request and starts from a clean scheduler; after
        MAX_FAILED_ITERATIONS in a row the engine gives up: returns why.
        """
        num_failed_in_a_row = 0
        while not self._stopping.is_set():
            try:
                self._iterate()
                num_failed_in_a_row = 0
            except Exception as exc:
                num_failed_in_a_row += 1
                log.error(
                    "engine_step_failed",
                    failures_in_a_row=num_failed_in_a_row,
                    active=len(self.scheduler.active),
                    exc_info=True,
                )
                self._fail_running(internal_error(exc, "the engine failed while running this request"))
                if num_failed_in_a_row >= MAX_FAILED_ITERATIONS:
                    return f"{num_failed_in_a_row} failures in a row, the last {type(exc).__name__}: {exc}"
        return "stopped"

    def _iterate(self) -> None:
        if self._held_job is not None or self.scheduler.has_work or self.inputs.has_jobs or self.residency.num_parked:
            fault_point("loop")  # while there is work: an idle engine has nothing to fail on
        self.residency.unload_expired()
        # One step of a model loading on demand per iteration: running requests wait a step, not the load.
        loading = self.residency.step_loading()
        with self.inputs.iteration():
            stop = self.inputs.receive(self)
            if stop is not None:
                self.stop_reason = stop
                self._stopping.set()
                return
            self._admit_jobs()
            self._step_or_wait(loading)

    def _step_or_wait(self, loading: bool) -> None:
        shadow = self.scheduler.shadow
        if self.scheduler.has_work:
            self.scheduler.step()
            if shadow.has_urgent_work:  # verify requests' checks share the engine's time: a pass per iteration
                shadow.step()
            self._busy_at = time.monotonic()
            return
        if self.residency.waits_for_room:
            # Nothing runs, so the room frees up as the last replies go out (they
            # unpin their models); queued jobs stay behind the parked one till then.
            time.sleep(0.005)
            return
        # Idle. A pending shadow check runs one pass at a time, only while
        # nothing is queued, and once the engine has been idle for the grace:
        # a request arriving now waits one pass at most.
        grace_left = SHADOW_IDLE_GRACE_S - (time.monotonic() - self._busy_at)
        if loading:
            timeout = 0.0
        elif shadow.has_urgent_work:  # a verify request waits for its check: no grace
            timeout = 0.0
        elif shadow.has_work:
            timeout = max(0.0, grace_left)
        else:
            timeout = IDLE_WAIT_S
        arrived = self.inputs.wait(timeout)  # what arrived is taken next iteration
        if (
            not arrived
            and shadow.has_work
            and (shadow.has_urgent_work or time.monotonic() - self._busy_at >= SHADOW_IDLE_GRACE_S)
        ):
            shadow.step()

    def _fail_running(self, err: RpcError) -> None:
        """Fail what was running; a job still waiting for admission was not touched and keeps its turn."""
        self.scheduler.fail_all(err)

    def _die(self, reason: str) -> None:
        """Give up: every waiting and later request gets ENGINE_DEAD at once; the owner is told."""
        self.dead_reason = reason
        log.critical("engine_dead", reason=reason, action="failing every request; the daemon exits")
        err = self.dead_error()
        self._close_inbox(err)
        if self._held_job is not None:
            job, self._held_job = self._held_job, None
            job.emit(FAILED, self.dead_error())
        if self.residency is not None:
            self.residency.fail_parked(self.dead_error)
        try:
            if self.scheduler is not None:
                self._fail_running(err)
        except Exception:
            log.exception("engine_dead_cleanup_failed")
        try:
            self.inputs.fail_taken(self.dead_error)
        except Exception:
            log.exception("engine_dead_cleanup_failed")
        if self.on_dead is not None:
            self.on_dead(reason)

    def abandon(self, reason: str) -> None:
        """Give up from another thread: the engine thread is stuck for good (ranks: inside a collective).

        Every request the front is waiting on fails now (emit is thread-safe),
        and the owner is told, which ends the process; the stuck thread is left behind.
        """
        self.dead_reason = reason
        self._close_inbox(self.dead_error())
        self.inputs.fail_taken(self.dead_error)
        if self.on_dead is not None:
            self.on_dead(reason)

    def _close_inbox(self, err: RpcError) -> None:
        """Queued jobs and control calls fail with ``err``, and so does every later one."""
        for job in self.inbox.close(err):
            job.emit(FAILED, self.dead_error())  # one exception object per request
        for call in self.inbox.drain_controls(err):
            if isinstance(call, ControlCall):
                call.fail(err)

    def _serving_models(self) -> set[str]:
        """The models of the jobs taken in: running, or held until their KV fits. Engine thread."""
        serving = {seq.loaded.name for seq in self.scheduler.active} if self.scheduler is not None else set()
        if self._held_job is not None:
            serving.add(self.entry_for(self._held_job.params.model).name)
        return serving

    @property
    def holds_job(self) -> bool:
        """A job taken in waits first in line for its KV to fit (admission tries it before any other)."""
        return self._held_job is not None

    def _admit_jobs(self) -> None:
        scheduler = self.scheduler
        for job in self.inputs.cancelled_before_admission():
            scheduler.admit(job)  # answers CANCELLED and counts it
        while scheduler.can_admit():
            job = self._held_job or self.residency.next_parked()
            if job is None and not self.residency.waits_for_room:  # first come, first served across models
                job = self.inputs.take_job()
            self._held_job = None
            if job is None:
                return
            if not self.residency.make_resident(job, self.entry_for(job.params.model).name):
                continue  # it waits for pinned models to make room, or its model failed to load (answered)
            if not scheduler.admit(job):
                self._held_job = job  # its KV does not fit yet: keep it first in line
                scheduler.shadow.drop_current("a request needed its memory")
                return

    def _load_all(self) -> None:
        with self.inputs.loading(self):
            self._load_models()

    def _load_models(self) -> None:
        import mlx.core as mx  # the engine thread is the one MLX thread

        on_gpu = mx.default_device().type == mx.gpu
        self.prefill_chunk = self.settings.prefill_chunk or default_prefill_chunk(on_gpu)
        self._warms_up = warm_up_wanted(self.settings.warm_up, on_gpu) and self._may_warm_up
        log.info("prefill_chunk", tokens=self.prefill_chunk, device=str(mx.default_device()))
        # Every model is described (tokenizer, layout, size: no weights read) before any loads.
        self.catalog = describe_models(
            self.settings.model_specs,
            self.settings.dtype,
            self.settings.found_model_specs,
            self.settings.chat_templates,
            self.settings.kv_bits,
        )
        self.cards = {name: entry.card for name, entry in self.catalog.items()}
        self.model_names = tuple(self.catalog)
        self.default_model = self.model_names[0] if self.model_names else None
        kv_budget = KvBudget(self.settings.cache_bytes)  # the store's and the running sequences', together
        self.store = PrefixStore(
            max_bytes=kv_budget,
            max_nodes=self.settings.cache_nodes,
            max_pinned_bytes=self.settings.pinned_bytes,
            clock=self.inputs.store_clock,
            recompute_seconds=self._recompute_seconds,
        )
        self.scheduler = Scheduler(
            self.store,
            chunk_size=self.prefill_chunk,
            max_active=self.settings.max_active,
            kv_budget=kv_budget,
            resolve_model=self.model_for,
            runner=ModelRunner(
                self.store,
                self.prefill_chunk,
                decode_stream=(
                    mx.default_stream(mx.default_device()) if self.inputs.passes_on_default_stream else None
                ),
            ),
            shadow_rate=self.settings.shadow_rate,
            shadow_action=self.settings.shadow_action,
            pass_depth_scale=None if on_gpu else CPU_PASS_DEPTH_SCALE,
            chunks_per_store=default_chunks_per_store(on_cuda()),
            agree=self.inputs.agree,
            trace=StepTrace.from_environment(),
        )
        self.residency = ModelResidency(
            self.catalog,
            load=self._load_entry,
            on_unload=self._forget_model,
            keep_alive=self.settings.keep_alive_s,
            max_bytes=self.settings.max_model_bytes,
            load_steps=self._load_entry_in_steps if self._loads_on_demand else None,
            serving=self._serving_models,
            unloads_idle=self._unloads_idle,
        )
        # On demand, only the default model loads now; otherwise every model does, to stay.
        for name in self.model_names[:1] if self._loads_on_demand else self.model_names:
            self.residency.ensure_loaded(name, None)

    def _load_entry(self, entry: CatalogEntry) -> LoadedModel:
        """Load a configured model's weights whole (at start, or when asked to). Engine thread."""
        loaded = load_model(
            entry.spec,
            dtype=self.settings.dtype,
            attention=self.settings.attention,
            load_weights=self._load_weights,
            chat_template=entry.chat_template,
            kv_bits=entry.layout.kv_bits,
            fork=self.settings.fork,
            linear=self.settings.linear,
            batch_step=self.settings.batch_step,
        )
        warm_up_seconds = run_all(self._warm_up(loaded, entry)) if self._warms_up else None
        return self._adopt(loaded, entry, warm_up_seconds)

    def _load_entry_in_steps(self, entry: CatalogEntry) -> Generator[None, None, LoadedModel]:
        """Load a request's model a step per engine iteration (models/staged_load.py). Engine thread."""
        started = time.perf_counter()
        loaded = yield from load_in_steps(
            entry.spec,
            entry.path,
            self.settings.dtype,
            self.settings.attention,
            self._tokenizer_pool,
            chat_template=entry.chat_template,
            kv_bits=entry.layout.kv_bits,
            fork=self.settings.fork,
            linear=self.settings.linear,
            batch_step=self.settings.batch_step,
        )
        warm_up_seconds = (yield from self._warm_up(loaded, entry)) if self._warms_up else None
        loaded.load_seconds = time.perf_counter() - started  # its steps and the engine iterations between them
        return self._adopt(loaded, entry, warm_up_seconds)

    def _warm_up(self, loaded: LoadedModel, entry: CatalogEntry) -> Generator[None, None, float | None]:
        """The warm-up's steps (engine/warm_up.py). It only saves the first requests time: one that fails
        is logged and the model serves without it (its requests then pay the first-use costs)."""
        try:
            return (yield from warm_up_steps(loaded))
        except Exception as exc:
            log.warning(
                "warm_up_failed", model=entry.name, error=f"{type(exc).__name__}: {exc}", action="serving without it"
            )
            return None

    def _adopt(self, loaded: LoadedModel, entry: CatalogEntry, warm_up_seconds: float | None = None) -> LoadedModel:
        loaded.name = loaded.encoder.model_name = entry.name
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
            kv=loaded.kv,
            fork=loaded.fork,
            batch_step=loaded.batch_step,
            attention=loaded.attention,
            short_conv=loaded.short_conv,
            linear=loaded.linear,
            warm_up_s=None if warm_up_seconds is None else round(warm_up_seconds, 3),
            fingerprint=loaded.fingerprint,
            process_peak_rss_bytes=peak_rss_bytes(),
        )
        if not loaded.layout.is_supported:
            log.warning(
                "prefix_cache_unsupported", model=loaded.name, reason="cache layers other than KVCache/ArraysCache"
            )
        return loaded

    def _forget_model(self, loaded: LoadedModel) -> None:
        """An unloaded model's last references go (its weights' memory with them); its store entries stay."""
        import mlx.core as mx

        self.models.pop(loaded.name, None)
        self.scheduler.forget_model(loaded.name)
        self.scheduler.shadow.drop_model(loaded, "its model was unloaded")
        mx.clear_cache()  # hand the freed buffers back rather than keep them for reuse

    def measured_prefill_rate(self) -> float:
        """Tokens per second this process's loaded models prefilled at, the slowest one's."""
        rates = [m.prefill_tokens_per_s for m in self.models.values() if m.prefill_tokens_per_s]
        return min(rates) if rates else DEFAULT_PREFILL_RATE

    def _recompute_seconds(self, start_depth: int, num_tokens: int) -> float:
        agreed = self.inputs.agreed_prefill_rate  # ranks: rank 0's, the same on every rank
        rate = self.measured_prefill_rate() if agreed is None else agreed
        # Attention makes later tokens dearer to recompute than early ones.
        return num_tokens / rate * (1.0 + (start_depth + num_tokens / 2) / 4096)

    def entry_for(self, name: str | None) -> CatalogEntry:
        """A configured model (the default one for None), loaded or not; MODEL_NOT_FOUND otherwise. Any thread."""
        name = name or self.default_model
        entry = self.catalog.get(name) if name else None
        if entry is None:
            raise model_not_found(name, self.model_names)
        return entry

    def model_for(self, name: str | None) -> LoadedModel:
        name = name or self.default_model
        loaded = self.models.get(name) if name else None
        if loaded is None:
            raise model_not_found(name, self.models)
        return loaded
