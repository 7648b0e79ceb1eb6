"""Configuration: flags > PREFIXD_* environment > config.toml > defaults, and clear errors."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest

from prefixd.daemon.service import main as daemon_main
from prefixd.daemon.service.config import NOT_CONFIG_KEYS, ConfigError, explicit_flags, load_config
from prefixd.daemon.service.settings import SETTINGS


@pytest.fixture
def env(tmp_path, monkeypatch) -> dict[str, str]:
    """An environment without PREFIXD_* variables whose config dir is empty."""
    for name in list(os.environ):
        if name.startswith("PREFIXD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return {"XDG_CONFIG_HOME": str(tmp_path / "config")}


def write_config(env: dict[str, str], body: str) -> Path:
    path = Path(env["XDG_CONFIG_HOME"]) / "prefixd" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


def flags(*argv: str) -> dict:
    return explicit_flags(daemon_main.build_parser, list(argv))


def test_flags_beat_environment_beat_file_beat_defaults(env):
    path = write_config(env, 'model = "/m/file"\nprefill_chunk = 128\ngrace-seconds = 3\ncache_bytes = "2G"\n')
    env |= {"PREFIXD_PREFILL_CHUNK": "256", "PREFIXD_GRACE_SECONDS": "4"}
    config = load_config(flags("--grace-seconds", "5"), env)
    assert config.values["model"] == ["/m/file"] and config.sources["model"] == f"file {path}"
    assert config.values["prefill_chunk"] == 256 and config.sources["prefill_chunk"] == "env PREFIXD_PREFILL_CHUNK"
    assert config.values["grace_seconds"] == 5.0 and config.sources["grace_seconds"] == "flag --grace-seconds"
    assert config.values["max_queued"] == 256 and config.sources["max_queued"] == "default"
    # A derived default follows the value it derives from, wherever that came from.
    assert config.values["cache_bytes"] == 2 << 30
    assert config.values["pinned_bytes"] == (2 << 30) // 4 and config.sources["pinned_bytes"] == "default"
    assert config.file_found and config.path == path


def test_lists_from_each_source(env):
    write_config(env, 'model = ["/a", "/b"]\nallow_uid = [1001]\n')
    assert load_config({}, env).values["model"] == ["/a", "/b"]
    assert load_config({}, env | {"PREFIXD_MODEL": "/c, /d"}).values["model"] == ["/c", "/d"]
    config = load_config(flags("--model", "/e", "--allow-uid", "7"), env | {"PREFIXD_MODEL": "/c"})
    assert config.values["model"] == ["/e"] and config.values["allow_uid"] == [7]


def test_no_file_is_fine_unless_one_was_asked_for(env, tmp_path):
    config = load_config({}, env)
    assert not config.file_found and config.values["model"] == [] and config.values["dtype"] == "auto"
    with pytest.raises(ConfigError, match="missing.toml does not exist"):
        load_config(flags("--config", str(tmp_path / "missing.toml")), env)
    with pytest.raises(ConfigError, match="gone.toml does not exist"):
        load_config({}, env | {"PREFIXD_CONFIG": str(tmp_path / "gone.toml")})


@pytest.mark.parametrize(
    "body, extra_env, argv, message",
    [
        ("prefill_chunk = 8\n", {}, (), r"prefill_chunk = 8 \(from file .*config.toml\): must be at least 16"),
        ("", {"PREFIXD_CACHE_BYTES": "lots"}, (), r"cache_bytes = 'lots' \(from env PREFIXD_CACHE_BYTES\): not a size"),
        ("", {}, ("--max-queued", "0"), r"max_queued = 0 \(from flag --max-queued\): must be at least 1"),
        ('dtype = "float64"\n', {}, (), r"dtype = 'float64' .*must be one of auto, float32"),
        ("cache_entries = true\n", {}, (), r"cache_entries = True .*whole number"),
        ("grace_seconds = -1\n", {}, (), r"grace_seconds = -1 .*at least 0"),
        ("modle = 1\n", {}, (), r"unknown key 'modle' in .*config.toml; did you mean 'model'\?"),
        ("[cache]\nbytes = 1\n", {}, (), r"unknown key 'cache'"),
        ("cache_bytes = \n", {}, (), r"config.toml is not valid TOML: .*line 1"),
    ],
)
def test_a_bad_value_names_the_key_and_its_source(env, body, extra_env, argv, message):
    write_config(env, body)
    with pytest.raises(ConfigError, match=message):
        load_config(flags(*argv), env | extra_env)


def test_printed_configuration_is_a_config_file_that_reads_back(env, tmp_path):
    write_config(env, 'model = "/m"\ncache_bytes = "1G"\n')
    config = load_config(flags("--prefill-chunk", "64"), env | {"PREFIXD_LOG_LEVEL": "debug"})
    printed = config.to_toml()
    assert "cache_bytes = 1073741824" in printed and "# file " in printed
    assert "# env PREFIXD_LOG_LEVEL" in printed and "# flag --prefill-chunk" in printed
    copy = tmp_path / "copy.toml"
    copy.write_text(printed)
    assert tomllib.loads(printed)["prefill_chunk"] == 64
    again = load_config(flags("--config", str(copy)), {"XDG_CONFIG_HOME": "/nonexistent"})
    assert again.values == config.values


def test_every_serve_flag_is_a_setting():
    """A new flag must be declared in settings.SETTINGS, or it cannot be set in the file or environment."""
    dests = {action.dest for action in daemon_main.build_parser()._actions}
    assert dests - set(NOT_CONFIG_KEYS) == set(SETTINGS)
    for key in SETTINGS:
        assert SETTINGS[key].flag in daemon_main.build_parser().format_help()


def test_print_config_main(env, capsys):
    write_config(env, 'model = "/m"\n')
    assert daemon_main.print_config_main(["--json", "--dtype", "float16"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["settings"]["dtype"] == {"value": "float16", "source": "flag --dtype"}
    assert shown["settings"]["model"]["value"] == ["/m"] and shown["file_found"] is True
    assert daemon_main.main(["--print-config"]) == 0
    assert capsys.readouterr().out.startswith("# prefixd configuration: flags > environment (PREFIXD_*) > ")


def test_serve_refuses_bad_or_missing_settings_before_loading_anything(env, capsys):
    write_config(env, "prefill_chunk = 4\n")
    assert daemon_main.main(["--model", "/m"]) == 2
    assert "bad value for prefill_chunk = 4 (from file " in capsys.readouterr().err
    write_config(env, "")
    assert daemon_main.main([]) == 2
    assert "no model to serve: pass --model DIR, set $PREFIXD_MODEL, or add model" in capsys.readouterr().err
