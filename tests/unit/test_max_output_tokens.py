"""--max-output-tokens: the answer length of a /v1/responses request that names none (agent clients name none)."""

from __future__ import annotations

import pytest

from prefixd.daemon.front.http_options import http_settings
from prefixd.protocol.errors import RpcError
from prefixd.daemon.front.responses_shapes import responses_request
from prefixd.daemon.service import main as daemon_main
from prefixd.daemon.service.config import ConfigError, explicit_flags, load_config


def settings_from(argv: list[str], environ: dict[str, str]):
    config = load_config(explicit_flags(daemon_main.build_parser, argv), environ)
    return http_settings(config.namespace(daemon_main.build_parser().parse_args(argv)), environ)


@pytest.fixture
def environ(tmp_path) -> dict[str, str]:
    return {"XDG_CONFIG_HOME": str(tmp_path / "config")}


def test_the_default_is_4096_and_a_flag_or_the_environment_sets_it(environ):
    serve = ["--model", "/m", "--http-socket", "/tmp/p.sock"]
    assert settings_from(serve, environ).max_output_tokens == 4096
    assert settings_from(serve + ["--max-output-tokens", "24"], environ).max_output_tokens == 24
    assert settings_from(serve, environ | {"PREFIXD_MAX_OUTPUT_TOKENS": "99"}).max_output_tokens == 99


def test_a_bad_value_names_the_setting(environ):
    with pytest.raises(ConfigError, match="max_output_tokens"):
        settings_from(["--model", "/m", "--http-socket", "/tmp/p.sock", "--max-output-tokens", "0"], environ)
    with pytest.raises(ValueError, match="--max-output-tokens"):
        settings_from(["--model", "/m", "--http-socket", "/tmp/p.sock", "--max-output-tokens", str(1 << 21)], environ)


def test_it_applies_only_where_the_request_names_no_length():
    silent = responses_request({"model": "m", "input": "hi"}, [], 24)
    named = responses_request({"model": "m", "input": "hi", "max_output_tokens": 7}, [], 24)
    assert silent.params.max_tokens == 24 and named.params.max_tokens == 7
    with pytest.raises(RpcError, match="max_output_tokens"):
        responses_request({"model": "m", "input": "hi", "max_output_tokens": 0}, [], 24)
