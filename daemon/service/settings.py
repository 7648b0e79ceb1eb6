"""Every setting of ``prefixd serve``, declared once.

One declaration per setting (its key, kind of value, default, help and
group) makes its flag and help line (``add_flags``), what the config file
and the environment accept (config.py), what ``prefixd config`` prints and
the table in docs/settings.md (settings_docs.py). The key is spelled three
ways: ``cache_bytes`` in the file (``cache-bytes`` too), ``PREFIXD_CACHE_BYTES``
in the environment, ``--cache-bytes`` on the command line. Help text never
states a default: the declaration's default is added to it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ...protocol.methods import MAX_TOKENS_LIMIT
from ..engine.settings import CPU_PREFILL_CHUNK, GPU_PREFILL_CHUNK
from ..front.http_options import DEFAULT_MAX_OUTPUT_TOKENS, TOKEN_ENV, TOKEN_FILE_NAME
from ..models.kv_bits_setting import parse_kv_bits_entry
from .setting_values import (
    ValueKind,
    default_cache_bytes,
    duration,
    list_of,
    one_of,
    path,
    seconds,
    share,
    size,
    switch,
    text,
    whole,
)

ENV_PREFIX = "PREFIXD_"

MODELS = "models"
MEMORY = "memory and the prefix cache"
SCHEDULING = "scheduling"
CHECKS = "the shadow check"
SERVICE = "socket, logs and service"
FRONTS = "editor fronts (HTTP)"
RANKS = "several ranks"
GROUPS = (MODELS, MEMORY, SCHEDULING, CHECKS, SERVICE, FRONTS, RANKS)


@dataclass(frozen=True)
class Setting:
    """One setting: its key, the kind of value it takes, its default and what it does."""

    key: str
    kind: ValueKind
    group: str
    help: str
    default: Any = None  # None (or []): unset unless computed_default gives one
    computed_default: Callable[[Mapping[str, Any]], Any] | None = None  # from the settings declared before it
    note: str = ""  # what the default means, or how a computed one is chosen
    per_model: bool = False  # NAME=VALUE applies to the model of that name, a bare VALUE to the default model

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def parse(self) -> Callable[[Any], Any]:
        return self.kind.parse

    @property
    def metavar(self) -> str | None:
        if self.kind.metavar is None:
            return None
        return f"[NAME=]{self.kind.metavar}" if self.per_model else self.kind.metavar

    def default_for(self, resolved: Mapping[str, Any]) -> Any:
        """The default, given the settings resolved before this one."""
        return self.computed_default(resolved) if self.computed_default else self.default

    @property
    def has_literal_default(self) -> bool:
        return self.computed_default is None and self.default is not None and self.default != []

    def default_text(self) -> str:
        """The default as help and docs show it: the value and what it means, or how it is chosen."""
        if not self.has_literal_default:
            return self.note
        shown = show_value(self.default)
        return f"{shown}: {self.note}" if self.note else shown


def show_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _socket_path(_: Mapping[str, Any]) -> Any:
    from ...protocol.paths import default_socket_path

    return default_socket_path()


def _cache_dir(_: Mapping[str, Any]) -> Any:
    from ..persist.cache_dir import default_cache_dir

    return default_cache_dir()


SETTINGS: dict[str, Setting] = {
    setting.key: setting
    for setting in (
        Setting(
            "model",
            list_of(text("DIR")),
            MODELS,
            "an MLX model directory, or a Hugging Face id already in the "
            "local cache; repeat to serve several: the first is the default model and loads at start, the others "
            "on first use",
            default=[],
            note="none; required here, in $PREFIXD_MODEL or in the config file",
        ),
        Setting(
            "models_dir",
            path("DIR"),
            MODELS,
            "serve every model directory in this folder too (e.g. "
            "~/.local/share/prefixd/models, where prefixd setup and import-gguf put them), after the --model ones, "
            "each loaded on first use; the first --model, else the folder's first by name, is the default model; "
            "one that cannot be served is logged (model_skipped) and passed over",
            note="off",
        ),
        Setting(
            "chat_template",
            list_of(text("FILE")),
            MODELS,
            "a Jinja chat template file replacing a model's own: "
            "FILE for the default model, NAME=FILE for the model of that name (as prefixd models lists it); repeat "
            "for several models. A template that reads tools takes them natively; a model whose template does "
            "not gets prefixd's generic tool section",
            default=[],
            note="each model's own",
            per_model=True,
        ),
        Setting(
            "socket",
            path("PATH"),
            SERVICE,
            "the daemon's Unix socket, made with mode 0600; a stale socket is "
            "replaced, a live daemon is never displaced",
            computed_default=_socket_path,
            note="$XDG_RUNTIME_DIR/prefixd/prefixd.sock, else /tmp/prefixd-$UID/prefixd.sock; "
            "macOS: ~/Library/Caches/prefixd/prefixd.sock",
        ),
        Setting(
            "dtype",
            one_of("auto", "float32", "float16", "bfloat16"),
            MODELS,
            "cast unquantized weights to this type",
            default="auto",
            note="float32 on a Linux CPU, where it is the fast path; else the model's own",
        ),
        Setting(
            "cache_bytes",
            size(),
            MEMORY,
            "the KV memory budget: the prefix store and the running sequences' KV together stay within it",
            computed_default=lambda _: default_cache_bytes(),
            note="a quarter of RAM, at most 8G",
        ),
        Setting(
            "kv_bits",
            list_of(ValueKind(parse_kv_bits_entry, "8 or 4", "BITS")),
            MEMORY,
            "quantize a model's attention KV to 8 or 4 bits, in the prefix store and in every pass, so the same "
            "cache_bytes stores about 3.5x (8) or 6.4x (4) the prefixes of float32 KV, 1.9x / 3.6x of bfloat16; "
            "answers change a little (docs/prefix-cache.md: how much, and where cached and uncached runs can "
            "differ). BITS for the default model, NAME=BITS for the model of that name; repeat for several",
            default=[],
            note="off: full precision",
            per_model=True,
        ),
        Setting("cache_entries", whole(1), MEMORY, "the prefix store's node limit", default=65536),
        Setting(
            "pinned_bytes",
            size(),
            MEMORY,
            "the budget for pinned prefixes, within the store's",
            computed_default=lambda resolved: resolved["cache_bytes"] // 4,
            note="a quarter of cache_bytes",
        ),
        Setting(
            "mlx_cache_bytes",
            size(),
            MEMORY,
            "freed device memory MLX keeps for reuse; MLX's own default keeps "
            "up to nearly the whole device, and a daemon's ever-changing shapes fill it",
            note="on a GPU a quarter of cache_bytes, at least 256M; on a CPU MLX's own",
        ),
        Setting(
            "disk_cache_bytes",
            size(),
            MEMORY,
            "keep the prefix cache on disk within this budget (e.g. 8G), so that a restart starts warm",
            default=0,
            note="off",
        ),
        Setting(
            "cache_dir",
            path("DIR"),
            MEMORY,
            "where the disk cache lives",
            computed_default=_cache_dir,
            note="$XDG_CACHE_HOME/prefixd/kv; macOS: ~/Library/Caches/prefixd/kv",
        ),
        Setting(
            "disk_save_interval",
            seconds(1),
            MEMORY,
            "seconds between saves of what changed in the disk cache; it is saved at shutdown too",
            default=60.0,
        ),
        Setting(
            "prefill_chunk",
            whole(16),
            SCHEDULING,
            "prefill chunk size in tokens; every chunk end is a cache checkpoint "
            "(stored every 4 chunks for an attention-only prompt on CUDA)",
            note=f"{CPU_PREFILL_CHUNK} on a CPU, {GPU_PREFILL_CHUNK} on a GPU, where one pass of "
            f"{GPU_PREFILL_CHUNK} tokens costs little more than one of {CPU_PREFILL_CHUNK}",
        ),
        Setting(
            "max_active",
            whole(1),
            SCHEDULING,
            "sequences prefilling or decoding at once (one decode batch per model); the rest queue",
            default=32,
        ),
        Setting(
            "keep_alive",
            duration(),
            MODELS,
            "how long a model stays loaded once idle, unless a request's "
            "keep_alive says otherwise: seconds or a duration such as 5m, 1h; 0 unloads it after each request, "
            "a negative one keeps it",
            default=-1.0,
            note="for good; 5m is Ollama's default",
        ),
        Setting(
            "max_model_memory",
            size(),
            MODELS,
            "the loaded models' weights together; loading one more unloads the least recently used idle ones first",
            default=0,
            note="no limit",
        ),
        Setting(
            "shadow_rate",
            share(),
            CHECKS,
            "share of greedy cache hits that the shadow check re-runs without the "
            "cache while the engine is idle, to prove the cache gives the same output; 0 turns it off",
            default=0.05,
        ),
        Setting(
            "shadow_action",
            one_of("log", "stop-reuse"),
            CHECKS,
            "when a shadow check finds a difference: log "
            "it, or also stop reusing that checkpoint kind for that model until restart",
            default="log",
        ),
        Setting(
            "attention",
            one_of("auto", "fused", "matmul", "kernel"),
            SCHEDULING,
            "attention for short multi-token passes "
            "(a cache hit's tail): matmul avoids MLX's per-shape cuDNN graph build on CUDA; kernel also "
            "runs a decode batch's steps over its left-padded rows through prefixd's own CUDA kernel, where "
            "MLX has no fused kernel for the padding mask (matmul where the kernel does not build)",
            default="auto",
            note="kernel on a CUDA GPU, fused elsewhere",
        ),
        Setting(
            "linear",
            one_of("auto", "matmul", "rows"),
            SCHEDULING,
            "how 2-8 rows (a decode batch, a short tail) pass through a model's linear layers: rows asks MLX "
            "for one matrix-vector product per row in one kernel, in place of its CUDA matmul of a few rows",
            default="auto",
            note="rows on a CUDA GPU, matmul elsewhere",
        ),
        Setting(
            "fork",
            one_of("auto", "copy", "share"),
            SCHEDULING,
            "how a cache hit of 1,024 tokens or more reaches its passes: share reads the stored segments in place "
            "(float32 models without --kv-bits, checked at load): a running request then holds and reserves only "
            "its own tokens, and when the store is short of room a prompt computed here reads its stored copy "
            "in place once stored; copy copies them into a fresh cache first",
            default="auto",
            note="share on a CPU, copy on a GPU",
        ),
        Setting(
            "batch_step",
            one_of("auto", "padded", "ragged"),
            SCHEDULING,
            "the decode batch a model's rows run in: ragged keeps each row's own cache (a row joins and leaves "
            "without a copy, attention skips other rows' lengths, a row reserves only its own tokens; checked at "
            "load, attention-only models); padded merges the rows into mlx-lm's left-padded batch",
            default="auto",
            note="ragged on a CPU, padded on a GPU",
        ),
        Setting(
            "warm_up",
            one_of("auto", "on", "off"),
            SCHEDULING,
            "run a loaded model's cache-hit passes (forks "
            "of 1-8 stored segments, the last token's pass) once before it serves, so that the first hits do not "
            "build MLX's CUDA graphs or compile its kernels while a client waits; nothing is stored. Compiled "
            "kernels are kept in $XDG_CACHE_HOME/prefixd/mlx-kernels/<mlx version> (unless MLX_PTX_CACHE_DIR "
            "is set)",
            default="auto",
            note="on with a GPU, off on a CPU",
        ),
        Setting(
            "max_queued",
            whole(1),
            SCHEDULING,
            "queued requests in total; beyond them a request gets OVERLOADED at once",
            default=256,
        ),
        Setting(
            "max_queued_per_client",
            whole(1),
            SCHEDULING,
            "queued requests per connection; beyond them a request gets OVERLOADED at once",
            default=64,
        ),
        Setting(
            "grace_seconds",
            seconds(0),
            SERVICE,
            "on SIGTERM or SIGINT, how long running requests may finish before they are cancelled",
            default=10.0,
        ),
        Setting(
            "log_format",
            one_of("auto", "json", "console"),
            SERVICE,
            "the form of the log on stderr",
            default="auto",
            note="console on a terminal, else JSON lines",
        ),
        Setting(
            "log_level",
            one_of("debug", "info", "warning", "error"),
            SERVICE,
            "the least severe log lines written",
            default="info",
        ),
        Setting(
            "status_interval",
            seconds(0.1),
            SERVICE,
            "seconds between systemd STATUS= updates, only under systemd's Type=notify",
            default=5.0,
        ),
        Setting(
            "http",
            text("HOST:PORT"),
            FRONTS,
            "also serve the HTTP APIs (OpenAI, Anthropic, Ollama, infill, "
            "Responses) on this TCP address, e.g. 127.0.0.1:8080; loopback only unless a token is set; every "
            "request must carry the bearer token",
            note="off",
        ),
        Setting(
            "http_socket",
            path("PATH"),
            FRONTS,
            "also serve the HTTP APIs on this Unix socket (mode 0600; the peer's uid is checked, no token needed)",
            note="off",
        ),
        Setting(
            "http_token_file",
            path("FILE"),
            FRONTS,
            "the file whose first line is the bearer token every HTTP request over TCP must carry",
            note=f"none: the token itself from ${TOKEN_ENV} (a token, not a "
            f"path), else the file $XDG_CONFIG_HOME/prefixd/{TOKEN_FILE_NAME}, made once with mode 0600",
        ),
        Setting(
            "http_no_token",
            switch(),
            FRONTS,
            "serve --http without a bearer token: any local user may then use the daemon over TCP (loopback only)",
            default=False,
        ),
        Setting(
            "max_output_tokens",
            whole(1, MAX_TOKENS_LIMIT),
            FRONTS,
            "the answer length of a /v1/responses "
            "request that gives no max_output_tokens, as agent clients do; cut to the room the context leaves",
            default=DEFAULT_MAX_OUTPUT_TOKENS,
        ),
        Setting(
            "keep_billing_header",
            switch(),
            FRONTS,
            "leave Claude Code's x-anthropic-billing-header line in the "
            "prompt; otherwise it is removed: it changes from task to task and tells the model nothing, and kept "
            "it stops the prefix cache a few tokens in",
            default=False,
        ),
        Setting(
            "allow_uid",
            list_of(whole(0).named("UID")),
            SERVICE,
            "also accept socket clients running as this "
            "uid, on the daemon's socket and on --http-socket; repeat for several",
            default=[],
            note="only the daemon's own uid",
        ),
        Setting(
            "ranks",
            whole(1),
            RANKS,
            "run N ranks on this machine, each with its shard of the model (over the "
            "ring backend prefixd starts them, others through mlx.launch); see docs/scaling.md",
            default=1,
        ),
        Setting(
            "distributed_backend",
            one_of("any", "ring", "nccl", "jaccl", "mpi"),
            RANKS,
            "MLX's backend between ranks",
            default="any",
            note="what the launcher set up",
        ),
        Setting(
            "rank_timeout",
            seconds(1),
            RANKS,
            "seconds an engine iteration may take before the ranks are declared stuck",
            default=60.0,
        ),
        Setting(
            "parallel",
            one_of("tensor", "pipeline"),
            RANKS,
            "how each model is split over the ranks: tensor "
            "(mlx-lm's shard(): every layer's heads) or pipeline (its pipeline(): whole layers per rank)",
            default="tensor",
        ),
    )
}


def flag_help(setting: Setting) -> str:
    """The help line: what the setting does, then its default."""
    default = (
        f"default {setting.default_text()}" if setting.has_literal_default else f"default: {setting.default_text()}"
    )
    return f"{setting.help} ({default})".replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, in its group. A flag left out is None: load_config then looks further."""
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    for setting in SETTINGS.values():
        group, kind = groups[setting.group], setting.kind
        if kind.is_switch:
            group.add_argument(setting.flag, action="store_true", default=None, help=flag_help(setting))
            continue
        group.add_argument(
            setting.flag,
            action="append" if kind.repeatable else "store",
            type=kind.flag_type,
            choices=kind.choices,
            metavar=setting.metavar,
            default=None,
            help=flag_help(setting),
        )
