"""The daemon's configuration: flags > environment (``PREFIXD_*``) > TOML file > defaults.

Every setting has one key, spelled three ways: ``cache_bytes`` in the file
(``cache-bytes`` is accepted too), ``PREFIXD_CACHE_BYTES`` in the environment,
``--cache-bytes`` on the command line. The file is
``$XDG_CONFIG_HOME/prefixd/config.toml`` (``~/.config/prefixd/config.toml``),
or ``--config PATH`` / ``$PREFIXD_CONFIG``. Values are checked where they are
read, and a bad one is an error naming the key and where it came from.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

CONFIG_ENV = "PREFIXD_CONFIG"
ENV_PREFIX = "PREFIXD_"
NOT_CONFIG_KEYS = ("help", "config", "print_config")  # flags that are about the configuration itself


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and its source."""


# -- value parsers: each takes a TOML value, a flag's parsed value or an environment string ----------


def default_cache_bytes() -> int:
    """A quarter of physical memory, at most 8 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 << 30
    return min(total // 4, 8 << 30)


def parse_size(value: Any) -> int:
    """'512M', '4G', '1.5GiB' or plain bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError("must not be negative")
        return value
    if not isinstance(value, str):
        raise ValueError("must be a size such as 512M or 4G")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    cleaned = value.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        size = int(float(cleaned[:-1]) * units[cleaned[-1]]) if cleaned and cleaned[-1] in units else int(cleaned)
    except ValueError:
        raise ValueError(f"not a size: {value!r} (use e.g. 512M or 4G)") from None
    return parse_size(size)


def integer(minimum: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError("must be a whole number")
        if value < minimum:
            raise ValueError(f"must be at least {minimum}")
        return value

    return parse


def number(minimum: float) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ValueError("must be a number") from None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError("must be a number")
        if value < minimum:
            raise ValueError(f"must be at least {minimum:g}")
        return float(value)

    return parse


def fraction(value: Any) -> float:
    """A share between 0 and 1."""
    share = number(0)(value)
    if share > 1:
        raise ValueError("must be between 0 and 1")
    return share


def keep_alive(value: Any) -> float:
    """How long an idle model stays loaded, as Ollama spells it ("5m", seconds; negative: for good)."""
    from ...protocol.keep_alive import parse_keep_alive

    return parse_keep_alive(value)


def choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return value

    return parse


def switch(value: Any) -> bool:
    """On or off: a flag given (True), true/false in the file, 1/0, yes/no, on/off, true/false in the environment."""
    if isinstance(value, bool):
        return value
    words = {"1": True, "yes": True, "on": True, "true": True, "0": False, "no": False, "off": False, "false": False}
    if isinstance(value, str) and value.strip().lower() in words:
        return words[value.strip().lower()]
    raise ValueError("must be true or false")


def text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    return value


def path(value: Any) -> Path:
    if isinstance(value, Path):
        return value.expanduser()
    return Path(text(value)).expanduser()


def list_of(item: Callable[[Any], Any]) -> Callable[[Any], list]:
    """A list; a single value or, from the environment, a comma-separated string is accepted too."""

    def parse(value: Any) -> list:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        elif not isinstance(value, (list, tuple)):
            value = [value]
        return [item(entry) for entry in value]

    return parse


# -- the settings ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    key: str
    parse: Callable[[Any], Any]
    default: Any = None  # None: unset, or computed from the others (see _derived_default)
    note: str = ""  # how a computed default is chosen

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


OPTIONS: dict[str, Option] = {
    option.key: option
    for option in (
        Option("model", list_of(text), [], "required: model directories or cached Hugging Face ids"),
        Option("models_dir", path, None, "off; every model directory in it is served too, loaded on first use"),
        Option("chat_template", list_of(text), [], "each model's own; FILE replaces the default model's, NAME=FILE model NAME's"),
        Option("socket", path, None, "$XDG_RUNTIME_DIR/prefixd/prefixd.sock, else /tmp/prefixd-$UID/ (macOS: ~/Library/Caches/prefixd/)"),
        Option("dtype", choice("auto", "float32", "float16", "bfloat16"), "auto"),
        Option("cache_bytes", parse_size, None, "a quarter of RAM, at most 8G"),
        Option("cache_entries", integer(1), 65536),
        Option("pinned_bytes", parse_size, None, "a quarter of cache_bytes"),
        Option("mlx_cache_bytes", parse_size, None, "on a GPU a quarter of cache_bytes, at least 256M; on a CPU MLX's own"),
        Option("disk_cache_bytes", parse_size, 0, "0: off; e.g. 8G keeps the prefix cache across restarts"),
        Option("cache_dir", path, None, "$XDG_CACHE_HOME/prefixd/kv (macOS: ~/Library/Caches/prefixd/kv)"),
        Option("disk_save_interval", number(1), 60.0),
        Option("prefill_chunk", integer(16), None, "512 on a CPU, 2048 on a GPU (where one pass of 2k tokens costs little more than one of 512)"),
        Option("max_active", integer(1), 16),
        Option("keep_alive", keep_alive, -1.0, "negative: every model stays loaded once used; e.g. 5m (Ollama's default) unloads one idle that long"),
        Option("max_model_memory", parse_size, 0, "0: no limit; otherwise the least recently used idle model unloads to make room"),
        Option("shadow_rate", fraction, 0.05),
        Option("shadow_action", choice("log", "stop-reuse"), "log"),
        Option("attention", choice("auto", "fused", "matmul"), "auto", "auto: matmul for short multi-token passes on a CUDA GPU, fused elsewhere"),
        Option("warm_up", choice("auto", "on", "off"), "auto", "auto: on a GPU, a loaded model runs its cache-hit passes once before serving"),
        Option("max_queued", integer(1), 256),
        Option("max_queued_per_client", integer(1), 64),
        Option("grace_seconds", number(0), 10.0),
        Option("log_format", choice("auto", "json", "console"), "auto"),
        Option("log_level", choice("debug", "info", "warning", "error"), "info"),
        Option("status_interval", number(0.1), 5.0),
        Option("http", text, None, "off"),
        Option("http_socket", path, None, "off"),
        Option("http_token_file", path, None, "none: the token itself from $PREFIXD_HTTP_TOKEN (a token, not a path), else the file $XDG_CONFIG_HOME/prefixd/http-token (made once, mode 0600)"),
        Option("http_no_token", switch, False, "true: no bearer token on --http, so any local user may connect"),
        Option("max_output_tokens", integer(1), 4096, "the answer length of a /v1/responses request that names none"),
        Option("keep_billing_header", switch, False, "true: Claude Code's x-anthropic-billing-header line stays in the prompt "
               "(it changes from task to task, so the prefix cache then stops a few tokens in)"),
        Option("allow_uid", list_of(integer(0)), []),
        Option("ranks", integer(1), 1, "N > 1: run N local ranks through mlx.launch (see README, Several processes)"),
        Option("distributed_backend", choice("any", "ring", "nccl", "jaccl", "mpi"), "any", "what mlx.launch set up"),
        Option("rank_timeout", number(1), 60.0, "an engine iteration taking longer means a rank stopped answering"),
        Option("parallel", choice("tensor", "pipeline"), "tensor", "how a model is split over the ranks"),
    )
}


def _derived_default(key: str, values: dict[str, Any]) -> Any:
    if key == "socket":
        from ...protocol.paths import default_socket_path

        return default_socket_path()
    if key == "cache_bytes":
        return default_cache_bytes()
    if key == "pinned_bytes":
        return values["cache_bytes"] // 4
    if key == "cache_dir":
        from ..persist.cache_dir import default_cache_dir

        return default_cache_dir()
    return OPTIONS[key].default


# -- resolution ----------------------------------------------------------------------------------------


def default_config_path(environ: Mapping[str, str]) -> Path:
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "prefixd" / "config.toml"


@dataclass
class Config:
    """The effective values, where each came from, and which file was read."""

    values: dict[str, Any]
    sources: dict[str, str]  # "flag --x", "env PREFIXD_X", "file PATH", "default"
    path: Path
    path_source: str  # "flag --config", "env PREFIXD_CONFIG" or "default"
    file_found: bool

    def namespace(self, parsed: argparse.Namespace | None = None) -> argparse.Namespace:
        """``parsed`` (for flags that are not settings) with every setting set to its effective value."""
        merged = argparse.Namespace(**vars(parsed or argparse.Namespace()))
        for key, value in self.values.items():
            setattr(merged, key, value)
        return merged

    def to_json(self) -> str:
        return json.dumps(
            {"file": str(self.path), "file_found": self.file_found,
             "settings": {key: {"value": _plain(value), "source": self.sources[key]} for key, value in self.values.items()}},
            indent=2,
        )

    def to_toml(self) -> str:
        """The effective configuration as a config.toml, each line commented with its source."""
        found = "" if self.file_found else ", not found"
        lines = [f"# prefixd configuration: flags > environment (PREFIXD_*) > {self.path} ({self.path_source}{found}) > defaults"]
        rows = []
        for key, value in self.values.items():
            source = self.sources[key]
            if value is None or value == []:
                rows.append((f"# {key} =", f"{source}: {OPTIONS[key].note or 'unset'}"))
            else:
                note = f" ({OPTIONS[key].note})" if source == "default" and OPTIONS[key].note else ""
                rows.append((f"{key} = {_toml_value(value)}", source + note))
        width = max(len(left) for left, _ in rows)
        lines += [f"{left.ljust(width)}  # {right}" for left, right in rows]
        return "\n".join(lines) + "\n"


def load_config(flags: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Config:
    """Resolve every setting. ``flags`` holds only the flags given on the command line (see explicit_flags)."""
    environ = os.environ if environ is None else environ
    if flags.get("config") is not None:
        config_path, path_source = Path(flags["config"]).expanduser(), "flag --config"
    elif environ.get(CONFIG_ENV):
        config_path, path_source = Path(environ[CONFIG_ENV]).expanduser(), f"env {CONFIG_ENV}"
    else:
        config_path, path_source = default_config_path(environ), "default"
    file_values = read_config_file(config_path, required=path_source != "default")
    found = file_values is not None
    file_values = file_values or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, option in OPTIONS.items():
        if flags.get(key) is not None:
            raw, source = flags[key], f"flag {option.flag}"
        elif environ.get(option.env):
            raw, source = environ[option.env], f"env {option.env}"
        elif key in file_values:
            raw, source = file_values[key], f"file {config_path}"
        else:
            values[key], sources[key] = _derived_default(key, values), "default"
            continue
        try:
            values[key] = option.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"bad value for {key} = {raw!r} (from {source}): {exc}") from None
        sources[key] = source
    return Config(values, sources, config_path, path_source, file_found=found)


def read_config_file(config_path: Path, required: bool) -> dict[str, Any] | None:
    """The file's settings with keys normalised to snake_case; None when there is no file."""
    try:
        with open(config_path, "rb") as handle:
            document = tomllib.load(handle)
    except FileNotFoundError:
        if required:
            raise ConfigError(f"config file {config_path} does not exist") from None
        return None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {config_path} is not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {config_path}: {exc.strerror}") from None
    settings = {}
    for raw_key, value in document.items():
        key = raw_key.replace("-", "_")
        if key not in OPTIONS:
            close = difflib.get_close_matches(key, OPTIONS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(OPTIONS)}"
            raise ConfigError(f"unknown key {raw_key!r} in {config_path}{hint}")
        settings[key] = value
    return settings


def explicit_flags(make_parser: Callable[[], argparse.ArgumentParser], argv: list[str]) -> dict[str, Any]:
    """The flags actually given in ``argv`` (a flag left out is absent, not its default)."""
    parser = make_parser()
    for action in parser._actions:  # argparse offers no public way to drop every default
        action.default = argparse.SUPPRESS
    return vars(parser.parse_args(argv))


def _toml_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, (bool, int, float)):
        return json.dumps(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return str(value) if isinstance(value, Path) else value
