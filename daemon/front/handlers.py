"""The daemon's methods: validate parameters, hand work to the engine, shape replies.

Runs on the event loop. Nothing here touches MLX: model work goes to the
engine thread as a GenerateJob or an ``engine.call``.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from typing import Any, Awaitable, Callable

import structlog

from ...protocol import methods as m
from ...protocol.codec import MAX_MESSAGE_BYTES
from ...protocol.errors import ErrorCode, RpcError
from ...protocol.messages import Notification, Request
from ..engine.engine import Engine
from ..engine.jobs import DONE, GenerateJob
from ..models.loaded_model import ModelCard
from ..models.names import model_not_found
from .chunk_relay import RELAY_FAILED, ChunkRelay
from .connection import Connection
from .event_mailbox import EventMailbox
from .prompt_intake import PromptIntake
from .tool_calls import ToolCallReader, ToolCalls, with_tools_path

# (model fingerprint, prompt tokens) -> returns once what the disk cache holds of that prompt is in memory
Prefetch = Callable[[str, list[int]], Awaitable[None]]
# (the job, its result map or the RpcError it ended with) -> None; called on the loop as each job ends (metrics)
JobObserver = Callable[[GenerateJob, "dict | RpcError"], None]

log = structlog.get_logger("prefixd.request")
DAEMON_VERSION = "0.1.0"
CAPABILITIES = (
    "stream",
    "cancel",
    "prefix-cache",
    "messages",
    "tokens",
    "cache.warm",
    "cache.pin",
    "cache.verify",
    "constraint",
    "tools",
)


class Handlers:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.intake = PromptIntake(engine)
        self.tool_calls = ToolCalls(self.intake)
        self.prefetch: Prefetch | None = None  # set by the server while the disk cache loads
        self.observers: list[JobObserver] = []  # told of every job's end, whichever front sent it
        # Prompts the fronts normalised before templating, by what they took out (agent_prompts)
        self.prompts_normalized: Counter[str] = Counter()
        self.started_at = time.time()
        self._draining: set[asyncio.Task] = set()  # log the end of jobs nobody waits for
        self._mailbox: EventMailbox | None = None  # engine events onto the loop, batched
        self._table = {
            m.HELLO: self.hello,
            m.PING: self.ping,
            m.MODELS: self.models,
            m.STATS: self.stats,
            m.TOKENIZE: self.tokenize,
            m.GENERATE: self.generate,
            m.CANCEL: self.cancel,
            m.CACHE_WARM: self.cache_warm,
            m.CACHE_PIN: self.cache_pin,
            m.CACHE_UNPIN: self.cache_unpin,
        }

    async def __call__(self, conn: Connection, request: Request) -> Any:
        handler = self._table.get(request.method)
        if handler is None:
            raise RpcError(
                ErrorCode.METHOD_NOT_FOUND, f"unknown method {request.method!r}; methods: {', '.join(m.METHODS)}"
            )
        return await handler(conn, request.msgid, m.single_map_param(request.params))

    # -- cheap methods, answered on the event loop -----------------------------------

    async def hello(self, conn: Connection, msgid: int, params: dict) -> dict:
        return {
            "protocol_version": m.PROTOCOL_VERSION,
            "daemon_version": DAEMON_VERSION,
            "models": list(self.engine.model_names),
            "default_model": self.engine.default_model,
            "capabilities": list(CAPABILITIES),
            "pid": os.getpid(),
            "max_message_bytes": MAX_MESSAGE_BYTES,
        }

    async def ping(self, conn: Connection, msgid: int, params: dict) -> dict:
        return {"pong": True, "time": time.time()}

    async def cancel(self, conn: Connection, msgid: int, params: dict) -> dict:
        target = m.parse_cancel(params)
        job = conn.jobs.get(target)
        if job is None:
            return {"cancelled": False}
        self.engine.cancel(job)
        return {"cancelled": True}

    # -- methods answered by the engine thread -----------------------------------------

    async def models(self, conn: Connection, msgid: int, params: dict) -> dict:
        return {"models": await self.engine.call(self.engine.controls.describe_models)}

    async def stats(self, conn: Connection, msgid: int, params: dict) -> dict:
        stats = await self.engine.call(self.engine.controls.stats)
        return {
            "uptime_s": round(time.time() - self.started_at, 3),
            **stats,
            "prompts_normalized": dict(self.prompts_normalized),
        }

    async def tokenize(self, conn: Connection, msgid: int, params: dict) -> dict:
        prompt, model = m.parse_prompt_request(params)
        card, encoded = await self.intake.encode(model, prompt, generates=None)
        return {"tokens": encoded.tokens, "num_tokens": len(encoded.tokens), "model": card.name, "text": encoded.text}

    async def cache_pin(self, conn: Connection, msgid: int, params: dict) -> dict:
        return await self._pin(params, pinned=True)

    async def cache_unpin(self, conn: Connection, msgid: int, params: dict) -> dict:
        return await self._pin(params, pinned=False)

    async def _pin(self, params: dict, pinned: bool) -> dict:
        prompt, model = m.parse_prompt_request(params)
        card, encoded = await self.intake.encode(model, prompt, generates=None)
        tokens = encoded.tokens
        return await self.engine.call(lambda: self.engine.controls.pin_tokens(card.name, tokens, pinned))

    async def generate(self, conn: Connection, msgid: int, params: dict) -> dict:
        return await self._run_job(conn, msgid, m.parse_generate(params), warm_only=False)

    async def cache_warm(self, conn: Connection, msgid: int, params: dict) -> dict:
        prompt, model = m.parse_prompt_request(params)
        generate = m.GenerateParams(prompt=prompt, model=model, max_tokens=1, session=params.get("session"))
        result = await self._run_job(conn, msgid, generate, warm_only=True)
        return {"model": result["model"], "cache": result["cache"], "timings": result["timings"]}

    async def _run_job(self, conn: Connection, msgid: int, params: m.GenerateParams, warm_only: bool) -> dict:
        if msgid in conn.jobs:
            raise RpcError(ErrorCode.INVALID_REQUEST, f"msgid {msgid} is already in flight on this connection")
        return await self.run_job(
            conn.client_id,
            msgid,
            params,
            warm_only=warm_only,
            on_chunk=lambda chunk: conn.send(Notification(m.GENERATE_CHUNK, [chunk])),
            jobs=conn.jobs,
        )

    async def run_job(
        self,
        client_id: str,
        msgid: int | None,
        params: m.GenerateParams,
        *,
        warm_only: bool = False,
        on_chunk: Callable[[dict], None] | None = None,
        jobs: dict[Any, GenerateJob] | None = None,
        lane: str | None = None,
    ) -> dict:
        """Run one generate (or cache.warm) job on the engine and return its result map.

        The core both fronts share: ``on_chunk`` receives stream chunks on the
        event loop; ``jobs`` (if given) holds the job under ``msgid`` while it
        runs; ``lane`` is who it shares admissions with (GenerateJob.lane). Cancelling the
        awaiting task cancels the job on the engine.
        """
        self._check_model(params.model)
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = EventMailbox(loop)
        mailbox = self._mailbox
        relay = ChunkRelay(on_chunk)

        def emit(kind: str, payload: Any) -> None:  # called on the engine thread
            mailbox.post(relay.deliver, (kind, payload))

        job = GenerateJob(client_id, msgid, params, emit, warm_only=warm_only, lane=lane)
        if jobs is not None:
            jobs[msgid] = job  # cancellable from here on, encoding included
        try:
            # A place in line before encoding: a flood is refused first.
            self.engine.inbox.reserve(job.client_id, job.fair_lane)
            try:
                card, reader = await self._prepare(job)
                relay.reader = reader
            except BaseException:
                self.engine.inbox.release(job.client_id, job.fair_lane)
                raise
            self.engine.submit(job, reserved=True)
        except BaseException as exc:
            if jobs is not None:
                jobs.pop(msgid, None)
            if isinstance(exc, RpcError):
                self._observe(job, exc)
            raise
        try:
            while True:
                kind, payload = await relay.ends.get()  # the chunks went out on their own (chunk_relay.py)
                if kind == RELAY_FAILED:
                    self._abandon(client_id, job, relay)  # its text cannot reach the client: stop the job
                    raise payload
                if kind == DONE:
                    if reader is not None:
                        payload = reader.finish(payload, on_chunk)
                        await self.tool_calls.remember_answer(card, job, payload)
                    payload = with_tools_path(payload, job.encoded)
                    if job.stopped_by_front and payload["finish_reason"] == m.FINISH_CANCELLED:
                        payload = {**payload, "finish_reason": m.FINISH_STOP}  # the front cut the answer: it is whole
                    self._log_request(client_id, job, payload)
                    self._observe(job, payload)
                    return payload
                else:
                    log.info("request_failed", request_id=job.request_id, code=payload.code, error=payload.message)
                    self._observe(job, payload)
                    raise payload
        except asyncio.CancelledError:
            self._abandon(client_id, job, relay)
            raise
        finally:
            if jobs is not None:
                jobs.pop(msgid, None)

    def _abandon(self, client_id: str, job: GenerateJob, relay: ChunkRelay) -> None:
        """Nobody waits for the job any more: free the engine, drop its text, log how it ends."""
        relay.stop()
        self.engine.cancel(job)
        task = asyncio.create_task(self._log_abandoned(client_id, job, relay.ends))
        self._draining.add(task)  # keep a reference until it is done
        task.add_done_callback(self._draining.discard)

    async def _prepare(self, job: GenerateJob) -> tuple[ModelCard, ToolCallReader | None]:
        """Encode the prompt off the engine thread and bring in what the disk cache holds of it.

        Returns the request's model and the reader of the answer's tool calls
        when the request has tools (a forced call's grammar is then the job's
        constraint).
        """
        card, job.encoded = await self.intake.encode(job.params.model, job.params.prompt, generates=not job.warm_only)
        reader = None
        if not job.warm_only:
            job.params, reader = await self.tool_calls.prepare(job.params, card, job.msgid)
        if self.prefetch is not None:
            await self.prefetch(card.fingerprint, job.encoded.tokens)
        if job.cancelled.is_set():
            raise RpcError(ErrorCode.CANCELLED, "cancelled before it started")
        return card, reader

    async def _log_abandoned(self, client_id: str, job: GenerateJob, ends: asyncio.Queue) -> None:
        """Log how a job whose requester went away ended (finish_reason "cancelled", usually)."""
        while True:
            kind, payload = await ends.get()
            if kind == DONE:
                self._log_request(client_id, job, payload)
                self._observe(job, payload)
                return
            if kind != RELAY_FAILED:  # FAILED (a relay failure was the request's own error)
                self._observe(job, payload)
                return

    def _observe(self, job: GenerateJob, outcome: "dict | RpcError") -> None:
        for observer in self.observers:
            try:
                observer(job, outcome)
            except Exception:  # an observer's bug must not fail the request it watches
                log.exception("job_observer_failed", request_id=job.request_id)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.engine.model_names:
            raise model_not_found(model, self.engine.model_names)

    @staticmethod
    def _log_request(client_id: str, job: GenerateJob, result: dict) -> None:
        # The peer's pid and uid come from the context the front bound.
        cache, timings = result["cache"], result["timings"]
        log.info(
            "cache_warm" if job.warm_only else "generate",
            request_id=job.request_id,
            client=client_id,
            session=job.params.session,
            model=result["model"],
            prompt_tokens=result["usage"]["prompt_tokens"],
            completion_tokens=result["usage"]["completion_tokens"],
            finish_reason=result["finish_reason"],
            stopped_by_front=job.stopped_by_front,
            cache_hit=cache["hit"],
            reused_tokens=cache["reused_tokens"],
            prefilled_tokens=cache["prefilled_tokens"],
            stored_tokens=cache["stored_tokens"],
            checkpoint=cache["checkpoint"],
            miss_reason=cache["miss_reason"],
            diverged_at=cache["diverged_at"],
            **timings,
        )
