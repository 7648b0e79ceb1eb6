"""What a cache-aware router asks of each worker behind it: readiness, server and model info, load.

The router is Shepherd Model Gateway (``smg``, the gateway SGLang's router became;
docs/scaling.md, *Many daemons behind a router*). It registers an HTTP worker from
``GET /v1/models`` (the first model's id is the model its requests are routed by;
``http_front`` answers that), probes ``GET /health`` until the worker is ready and
then every ``--health-check-interval-secs``, reads ``/server_info`` and
``/model_info`` once for labels, and polls ``GET /v1/loads`` (SGLang's load
schema) for its load-aware policies and overload protection. The router sends the
daemon's bearer token as its ``--api-key``, except on its first ``/health``
probe, which smg 1.13 sends with no key (``detect_connection_mode``): that one
route answers without the token, as ``HEAD /`` does, since "alive or not" is
all it tells. The rest stay behind the token.

``/health`` is cheap on purpose (the router's probe times out after 5 s, and a
prefill pass of a large model on a CPU can take longer): it says whether the
engine thread is alive and has not given up. ``/health_generate`` (SGLang's
name for the deep probe) goes through the engine: it answers once the engine
thread has run a control call between two of its steps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from .handlers import DAEMON_VERSION, Handlers
from .http_jobs import HANDLERS_KEY

ENGINE_ROUND_TRIP_TIMEOUT_S = 20.0  # SGLang's /health_generate waits as long for its one-token generation


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/health", health)
    router.add_get("/health_generate", health_generate)
    router.add_get("/v1/loads", loads)
    router.add_get("/server_info", server_info)
    router.add_get("/model_info", model_info)


def is_open_probe(request: web.Request) -> bool:
    """The readiness probe, answered without the bearer token (see the module's docstring)."""
    return request.method == "GET" and request.path == "/health"


def engine_failure(handlers: Handlers) -> str | None:
    """Why the engine cannot serve (None: it can). The front listens only once the models have loaded."""
    engine = handlers.engine
    if engine.dead_reason is not None:
        return f"the engine has stopped ({engine.dead_reason})"
    if not engine.is_alive:
        return "the engine thread is not running"
    return None


async def health(request: web.Request) -> web.Response:
    """200 while the engine can serve; 503 naming why not, so the router takes the worker out."""
    failure = engine_failure(request.app[HANDLERS_KEY])
    if failure is not None:
        return web.json_response({"status": "unavailable", "error": failure}, status=503)
    return web.json_response({"status": "ok"})


async def health_generate(request: web.Request) -> web.Response:
    """200 once the engine thread answers a control call; 503 if it is dead or does not answer in time."""
    handlers = request.app[HANDLERS_KEY]
    if (failure := engine_failure(handlers)) is None:
        try:
            await asyncio.wait_for(handlers.engine.call(handlers.engine.controls.stats), ENGINE_ROUND_TRIP_TIMEOUT_S)
        except asyncio.TimeoutError:
            failure = f"the engine did not answer within {ENGINE_ROUND_TRIP_TIMEOUT_S:.0f} s"
        # An RpcError (ENGINE_DEAD) goes to the middleware, which answers it as an error status.
    if failure is not None:
        return web.json_response({"status": "unavailable", "error": failure}, status=503)
    return web.json_response({"status": "ok"})


async def loads(request: web.Request) -> web.Response:
    """The engine's queue and KV figures in SGLang's ``/v1/loads`` schema (one rank), plus the prefix store's."""
    handlers = request.app[HANDLERS_KEY]
    stats = await handlers.engine.call(handlers.engine.controls.stats)
    return web.json_response(
        load_report(stats, handlers.engine.settings.cache_bytes, handlers.engine.settings.max_active)
    )


def load_report(stats: dict[str, Any], cache_bytes: int, max_active: int) -> dict[str, Any]:
    """``stats`` (the engine's stats call) as SGLang's load response.

    ``token_usage`` is the share of ``--cache-bytes`` the running requests hold
    (their KV as it can grow): that part cannot be evicted, unlike the prefix
    store, which fills the rest and gives way to new requests. Figures prefixd
    does not keep in tokens (``num_used_tokens``, ``max_total_num_tokens``) are
    left out; the router reads an absent field as unknown.
    """
    requests = stats["requests"]
    cache = stats["cache"]["total"]
    running = requests["prefilling"] + requests["decoding"]
    waiting = requests["waiting"] + requests["queued"]
    usage = requests["kv_reserved_bytes"] / cache_bytes if cache_bytes else 0.0
    return {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dp_rank_count": 1,
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": running,
                "num_waiting_reqs": waiting,
                "num_total_reqs": running + waiting,
                "token_usage": round(usage, 4),
                "utilization": round(usage, 4),
                "cache_hit_rate": round(cache["recent_reuse_ratio"], 4),
                "max_running_requests": max_active,
            }
        ],
        "prefixd_cache": {
            key: cache[key]
            for key in (
                "num_bytes",
                "max_bytes",
                "num_sequences",
                "recent_hit_rate",
                "recent_reuse_ratio",
                "num_evictions",
            )
        },
    }


async def server_info(request: web.Request) -> web.Response:
    """SGLang's server info, the fields a router reads: served model, context, concurrency, version."""
    handlers = request.app[HANDLERS_KEY]
    engine = handlers.engine
    default = engine.default_model
    card = engine.cards.get(default) if default is not None else None
    return web.json_response(
        {
            "served_model_name": default,
            "context_length": card.context_length if card is not None else None,
            "max_running_requests": engine.settings.max_active,
            "dp_size": 1,
            "is_embedding": False,
            "version": f"prefixd {DAEMON_VERSION}",
            "prefixd_models": list(engine.model_names),
        }
    )


async def model_info(request: web.Request) -> web.Response:
    """SGLang's model info. No model or tokenizer path: a router elsewhere cannot read this machine's files,
    and a router on HTTP routes by request text, so it needs no tokenizer."""
    return web.json_response(
        {"is_generation": True, "has_image_understanding": False, "has_audio_understanding": False}
    )
