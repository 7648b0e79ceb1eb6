"""One declaration per setting: its flag, help, file key, default and docs row all come from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixd.daemon.service.config import ConfigError, explicit_flags, load_config
from prefixd.daemon.service.main import build_parser
from prefixd.daemon.service.settings import SETTINGS, flag_help
from prefixd.daemon.service.settings_docs import settings_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "settings.md"

# What a user who sets nothing gets; a change here changes every daemon started without that setting.
PLAIN_DEFAULTS = {
    "model": [], "models_dir": None, "chat_template": [], "kv_bits": [], "dtype": "auto", "cache_entries": 65536,
    "mlx_cache_bytes": None, "disk_cache_bytes": 0, "disk_save_interval": 60.0, "prefill_chunk": None,
    "max_active": 32, "keep_alive": -1.0, "max_model_memory": 0, "shadow_rate": 0.05, "shadow_action": "log",
    "attention": "auto", "linear": "auto", "fork": "auto", "batch_step": "auto", "warm_up": "auto", "max_queued": 256,
    "max_queued_per_client": 64, "grace_seconds": 10.0,
    "log_format": "auto", "log_level": "info", "status_interval": 5.0, "http": None, "http_socket": None,
    "http_token_file": None, "http_no_token": False, "max_output_tokens": 4096, "keep_billing_header": False,
    "allow_uid": [], "ranks": 1, "distributed_backend": "any", "rank_timeout": 60.0, "parallel": "tensor",
}


def test_docs_settings_md_is_made_from_the_declarations():
    assert DOCS.read_text() == settings_markdown(), (
        "docs/settings.md is stale: .venv/bin/python -m prefixd.daemon.service.settings_docs > docs/settings.md")


def test_defaults_are_the_declared_ones(tmp_path):
    config = load_config({}, {"XDG_CONFIG_HOME": str(tmp_path)})
    plain = {key: value for key, value in config.values.items() if key in PLAIN_DEFAULTS}
    assert plain == PLAIN_DEFAULTS
    computed = set(config.values) - set(PLAIN_DEFAULTS)
    assert computed == {"socket", "cache_bytes", "pinned_bytes", "cache_dir"}
    assert config.values["pinned_bytes"] == config.values["cache_bytes"] // 4


@pytest.mark.parametrize("setting", SETTINGS.values(), ids=list(SETTINGS))
def test_each_help_line_says_its_default_from_the_declaration_only(setting):
    assert "(default" not in setting.help and "default:" not in setting.help, "help text must not state the default"
    assert setting.default_text(), f"{setting.key}: a default that is unset or computed needs a note saying what it is"
    assert flag_help(setting).endswith(f"{setting.default_text()})".replace("%", "%%"))
    if setting.has_literal_default:
        assert setting.parse(setting.default) == setting.default  # the default is a value the setting accepts


def test_a_flag_reads_like_the_file_and_the_environment(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    argv = ["--cache-bytes", "1.5G", "--allow-uid", "5", "--allow-uid", "6", "--http-no-token", "--keep-alive", "5m",
            "--chat-template", "qwen=/t.jinja", "--models-dir", "~/models"]
    from_flags = load_config(explicit_flags(build_parser, argv), env).values
    from_env = load_config({}, env | {"PREFIXD_CACHE_BYTES": "1.5G", "PREFIXD_ALLOW_UID": "5,6", "PREFIXD_HTTP_NO_TOKEN": "yes",
                                      "PREFIXD_KEEP_ALIVE": "5m", "PREFIXD_CHAT_TEMPLATE": "qwen=/t.jinja",
                                      "PREFIXD_MODELS_DIR": "~/models"}).values
    assert from_flags == from_env
    assert from_flags["cache_bytes"] == 3 << 29 and from_flags["allow_uid"] == [5, 6] and from_flags["keep_alive"] == 300.0
    assert from_flags["http_no_token"] is True and from_flags["models_dir"] == Path.home() / "models"


def test_a_flag_out_of_range_names_the_setting_and_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"max_output_tokens = 2097152 \(from flag --max-output-tokens\): must be at most"):
        load_config(explicit_flags(build_parser, ["--max-output-tokens", str(1 << 21)]), {"XDG_CONFIG_HOME": str(tmp_path)})


def test_a_per_model_setting_shows_name_equals_in_its_flag():
    assert "--chat-template [NAME=]FILE" in build_parser().format_help()
