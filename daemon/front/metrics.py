"""prefixd's Prometheus metrics: what replies report, plus gauges from the engine's ``stats`` call.

Nothing here runs on the engine thread or slows it: counters and histograms
are fed on the event loop from each job's end (its reply's ``cache`` map and
``timings``, through ``Handlers.observers``, so socket and HTTP requests both
count); gauges come from one ``stats`` control call per scrape, which reads
counters the engine keeps anyway.
"""

from __future__ import annotations

from typing import Any, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ...protocol.errors import ErrorCode, RpcError
from ..engine.jobs import GenerateJob
from .handlers import Handlers

# Seconds: a warm repeat takes milliseconds, a cold long prompt on a CPU tens of seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def add_routes(router: web.UrlDispatcher, handlers: Handlers) -> None:
    """GET /metrics, Prometheus's text format (behind the bearer token over TCP, like every endpoint)."""
    metrics = DaemonMetrics(handlers)

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=await metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    router.add_get("/metrics", page)


class DaemonMetrics:
    """The metrics of one daemon; ``render()`` is the /metrics page."""

    def __init__(self, handlers: Handlers):
        self.handlers = handlers
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "prefixd_requests",
            "Generate and warm-up requests that ended, by outcome (a finish reason, or the error code's name)",
            ["model", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "prefixd_prompt_tokens", "Prompt tokens of finished requests", ["model"], registry=r
        )
        self.reused_tokens = Counter(
            "prefixd_reused_tokens", "Prompt tokens taken from the prefix store", ["model"], registry=r
        )
        self.prefilled_tokens = Counter(
            "prefixd_prefilled_tokens", "Prompt tokens computed (not found in the store)", ["model"], registry=r
        )
        self.completion_tokens = Counter("prefixd_completion_tokens", "Tokens generated", ["model"], registry=r)
        self.lookups = Counter(
            "prefixd_cache_lookups",
            "Prefix store lookups by result (exact, partial, miss, off)",
            ["model", "hit"],
            registry=r,
        )
        self.ttft = Histogram(
            "prefixd_time_to_first_token_seconds",
            "From the request's arrival to its first token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "prefixd_queue_seconds",
            "From the request's arrival to its admission (encoding included)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._reused: dict[str, float] = {}  # per model, for the hit ratio gauge
        self._prompt: dict[str, float] = {}
        self._stats: dict[str, Any] = {}  # the last stats call's answer, read by the collector
        r.register(_EngineGauges(self))
        handlers.observers.append(self.observe)

    def observe(self, job: GenerateJob, outcome: "dict | RpcError") -> None:
        if isinstance(outcome, RpcError):
            model = job.params.model or self.handlers.engine.default_model or ""
            name = (
                ErrorCode(outcome.code).name.lower()
                if outcome.code in ErrorCode._value2member_map_
                else str(outcome.code)
            )
            self.requests.labels(model, name).inc()
            return
        model, cache, timings, usage = outcome["model"], outcome["cache"], outcome["timings"], outcome["usage"]
        self.requests.labels(model, "warmed" if job.warm_only else outcome["finish_reason"]).inc()
        self.prompt_tokens.labels(model).inc(cache["prompt_tokens"])
        self.reused_tokens.labels(model).inc(cache["reused_tokens"])
        self.prefilled_tokens.labels(model).inc(cache["prefilled_tokens"])
        self.completion_tokens.labels(model).inc(usage["completion_tokens"])
        self.lookups.labels(model, cache["hit"]).inc()
        self.queue.labels(model).observe(timings["queue_ms"] / 1000)
        if not job.warm_only and usage["completion_tokens"] > 0:
            self.ttft.labels(model).observe(timings["ttft_ms"] / 1000)
        self._reused[model] = self._reused.get(model, 0) + cache["reused_tokens"]
        self._prompt[model] = self._prompt.get(model, 0) + cache["prompt_tokens"]

    async def render(self) -> bytes:
        engine = self.handlers.engine
        self._stats = await engine.call(engine.controls.stats)
        return generate_latest(self.registry)


class _EngineGauges(Collector):
    """Gauges read at scrape time: sequences, the store's size and evictions, the reuse ratio."""

    def __init__(self, metrics: DaemonMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        stats, metrics = self.metrics._stats, self.metrics
        ratio = GaugeMetricFamily(
            "prefixd_prompt_reuse_ratio", "Prompt tokens reused / prompt tokens, since the start", labels=["model"]
        )
        for model, prompt in metrics._prompt.items():
            ratio.add_metric([model], metrics._reused.get(model, 0) / prompt if prompt else 0.0)
        yield ratio
        normalized = CounterMetricFamily(
            "prefixd_prompts_normalized",
            "Prompts whose volatile parts were taken out "
            "before templating, by what (anthropic_billing_header: Claude Code's billing line)",
            labels=["what"],
        )
        for what, count in metrics.handlers.prompts_normalized.items():
            normalized.add_metric([what], count)
        yield normalized
        if not stats:
            return
        requests = stats["requests"]
        for name, key, help_text in (
            ("running", "active", "Sequences admitted and not done (prefilling, decoding or waiting)"),
            ("prefilling", "prefilling", "Sequences prefilling their prompt"),
            ("decoding", "decoding", "Sequences generating"),
            ("queued", "queued", "Requests waiting for admission"),
        ):
            yield GaugeMetricFamily(f"prefixd_sequences_{name}", help_text, value=requests.get(key, 0))
        per_model = stats["cache"]["per_model"]
        gauges = {
            name: GaugeMetricFamily(f"prefixd_store_{name}", help_text, labels=["model"])
            for name, help_text in (
                ("bytes", "Bytes the prefix store holds"),
                ("pinned_bytes", "Bytes pinned in the prefix store"),
                ("sequences", "Stored sequences (leaves of the radix tree)"),
                ("recent_reuse_ratio", "Reused / looked-up tokens over the store's last 256 lookups"),
            )
        }
        evictions = CounterMetricFamily(
            "prefixd_store_evictions", "Entries evicted from the prefix store", labels=["model"]
        )
        for model, s in per_model.items():
            gauges["bytes"].add_metric([model], s["num_bytes"])
            gauges["pinned_bytes"].add_metric([model], s["pinned_bytes"])
            gauges["sequences"].add_metric([model], s["num_sequences"])
            gauges["recent_reuse_ratio"].add_metric([model], s["recent_reuse_ratio"])
            evictions.add_metric([model], s["num_evictions"])
        yield from gauges.values()
        yield evictions
        yield GaugeMetricFamily(
            "prefixd_store_max_bytes",
            "The prefix store's capacity now (the budget less running sequences' KV)",
            value=stats["cache"]["total"]["max_bytes"],
        )
        process = stats["process"]
        if process.get("peak_rss_bytes") is not None:
            yield GaugeMetricFamily(
                "prefixd_process_peak_rss_bytes", "Peak resident memory", value=process["peak_rss_bytes"]
            )
        yield GaugeMetricFamily("prefixd_mlx_active_bytes", "Memory MLX holds now", value=process["mlx_active_bytes"])
        shadow = stats.get("shadow", {})
        runs = CounterMetricFamily(
            "prefixd_shadow_checks",
            "Shadow checks of cache hits (re-run without the cache) by result: match, mismatch, dropped, failed",
            labels=["model", "result"],
        )
        for model, counts in shadow.get("per_model", {}).items():
            for result, count in counts.items():
                runs.add_metric([model, result], count)
        yield runs
        yield GaugeMetricFamily(
            "prefixd_shadow_pending", "Cache hits waiting for their shadow check", value=shadow.get("pending", 0)
        )
