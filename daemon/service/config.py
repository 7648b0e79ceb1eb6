"""The daemon's configuration: flags > environment (``PREFIXD_*``) > TOML file > defaults.

The settings themselves are declared in settings.py. The file is
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

from .settings import SETTINGS

CONFIG_ENV = "PREFIXD_CONFIG"
NOT_CONFIG_KEYS = ("help", "config", "print_config")  # flags that are about the configuration itself


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and its source."""


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
            {
                "file": str(self.path),
                "file_found": self.file_found,
                "settings": {
                    key: {"value": _plain(value), "source": self.sources[key]} for key, value in self.values.items()
                },
            },
            indent=2,
        )

    def to_toml(self) -> str:
        """The effective configuration as a config.toml, each line commented with its source."""
        found = "" if self.file_found else ", not found"
        lines = [
            f"# prefixd configuration: flags > environment (PREFIXD_*) > {self.path} ({self.path_source}{found}) > defaults"
        ]
        rows = []
        for key, value in self.values.items():
            source = self.sources[key]
            if value is None or value == []:
                rows.append((f"# {key} =", f"{source}: {SETTINGS[key].note or 'unset'}"))
            else:
                note = f" ({SETTINGS[key].note})" if source == "default" and SETTINGS[key].note else ""
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
    for key, setting in SETTINGS.items():
        if flags.get(key) is not None:
            raw, source = flags[key], f"flag {setting.flag}"
        elif environ.get(setting.env):
            raw, source = environ[setting.env], f"env {setting.env}"
        elif key in file_values:
            raw, source = file_values[key], f"file {config_path}"
        else:
            values[key], sources[key] = setting.default_for(values), "default"
            continue
        try:
            values[key] = setting.parse(raw)
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
        if key not in SETTINGS:
            close = difflib.get_close_matches(key, SETTINGS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(SETTINGS)}"
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
