"""The daemon's methods: validate parameters, hand work to the engine, shape replies.

Runs on the event loop. Nothing here touches MLX: model work goes to the
engine thread as a GenerateJob or an ``engine.call``.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import structlog

from ..protocol import methods as m
from ..protocol.codec import MAX_MESSAGE_BYTES
from ..protocol.errors import ErrorCode, RpcError
from ..protocol.messages import Notification, Request
from .connection import Connection
from .engine import Engine
from .jobs import CHUNK, DONE, GenerateJob

log = structlog.get_logger("prefixd.request")
DAEMON_VERSION = "0.1.0"
CAPABILITIES = ("stream", "cancel", "prefix-cache", "messages", "tokens", "cache.warm", "cache.pin")


class Handlers:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.started_at = time.time()
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
            raise RpcError(ErrorCode.METHOD_NOT_FOUND, f"unknown method {request.method!r}; methods: {', '.join(m.METHODS)}")
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
        job.cancel()
        return {"cancelled": True}

    # -- methods answered by the engine thread -----------------------------------------

    async def models(self, conn: Connection, msgid: int, params: dict) -> dict:
        return {"models": await self.engine.call(self.engine.describe_models)}

    async def stats(self, conn: Connection, msgid: int, params: dict) -> dict:
        stats = await self.engine.call(self.engine.stats)
        return {"uptime_s": round(time.time() - self.started_at, 3), **stats}

    async def tokenize(self, conn: Connection, msgid: int, params: dict) -> dict:
        prompt, model = m.parse_prompt_request(params)
        self._check_model(model)
        return await self.engine.call(lambda: self.engine.tokenize(prompt, model))

    async def cache_pin(self, conn: Connection, msgid: int, params: dict) -> dict:
        prompt, model = m.parse_prompt_request(params)
        self._check_model(model)
        return await self.engine.call(lambda: self.engine.pin(prompt, model, pinned=True))

    async def cache_unpin(self, conn: Connection, msgid: int, params: dict) -> dict:
        prompt, model = m.parse_prompt_request(params)
        self._check_model(model)
        return await self.engine.call(lambda: self.engine.pin(prompt, model, pinned=False))

    async def generate(self, conn: Connection, msgid: int, params: dict) -> dict:
        return await self._run_job(conn, msgid, m.parse_generate(params), warm_only=False)

    async def cache_warm(self, conn: Connection, msgid: int, params: dict) -> dict:
        prompt, model = m.parse_prompt_request(params)
        generate = m.GenerateParams(prompt=prompt, model=model, max_tokens=1, session=params.get("session"))
        result = await self._run_job(conn, msgid, generate, warm_only=True)
        return {"model": result["model"], "cache": result["cache"], "timings": result["timings"]}

    async def _run_job(self, conn: Connection, msgid: int, params: m.GenerateParams, warm_only: bool) -> dict:
        self._check_model(params.model)
        if msgid in conn.jobs:
            raise RpcError(ErrorCode.INVALID_REQUEST, f"msgid {msgid} is already in flight on this connection")
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, payload: Any) -> None:  # called on the engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
            except RuntimeError:
                pass  # the loop is gone: the daemon is exiting

        job = GenerateJob(conn.client_id, msgid, params, emit, warm_only=warm_only)
        self.engine.submit(job)
        conn.jobs[msgid] = job
        try:
            while True:
                kind, payload = await events.get()
                if kind == CHUNK:
                    conn.send(Notification(m.GENERATE_CHUNK, [payload]))
                elif kind == DONE:
                    self._log_request(conn, job, payload)
                    return payload
                else:
                    log.info("request_failed", request_id=job.request_id, code=payload.code, error=payload.message)
                    raise payload
        finally:
            conn.jobs.pop(msgid, None)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.engine.model_names:
            raise RpcError(
                ErrorCode.MODEL_NOT_FOUND,
                f"no model named {model!r} is loaded; loaded: {', '.join(self.engine.model_names)}",
            )

    @staticmethod
    def _log_request(conn: Connection, job: GenerateJob, result: dict) -> None:
        cache, timings = result["cache"], result["timings"]
        log.info(
            "cache_warm" if job.warm_only else "generate",
            request_id=job.request_id,
            client=conn.client_id,
            pid=conn.peer_pid,
            session=job.params.session,
            model=result["model"],
            prompt_tokens=result["usage"]["prompt_tokens"],
            completion_tokens=result["usage"]["completion_tokens"],
            finish_reason=result["finish_reason"],
            cache_hit=cache["hit"],
            reused_tokens=cache["reused_tokens"],
            prefilled_tokens=cache["prefilled_tokens"],
            stored_tokens=cache["stored_tokens"],
            checkpoint=cache["checkpoint"],
            miss_reason=cache["miss_reason"],
            diverged_at=cache["diverged_at"],
            **timings,
        )
