"""``--kv-bits``: read like every setting, per model as NAME=BITS, refused at start when it cannot apply."""

from __future__ import annotations

import pytest

from prefixd.daemon.models.kv_bits_setting import KvBitsChoice, KvBitsError, check_all_named, kv_bits_for, read_kv_bits
from prefixd.daemon.service.config import ConfigError, explicit_flags, load_config
from prefixd.daemon.service.main import build_parser


def test_flags_the_environment_and_the_file_give_the_same_choices(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    from_flags = load_config(explicit_flags(build_parser, ["--kv-bits", "8", "--kv-bits", "qwen=4"]), env).values
    from_env = load_config({}, env | {"PREFIXD_KV_BITS": "8,qwen=4"}).values
    config_file = tmp_path / "prefixd" / "config.toml"
    config_file.parent.mkdir()
    config_file.write_text('kv_bits = [8, "qwen=4"]\n')
    from_file = load_config({}, env).values
    assert from_flags["kv_bits"] == from_env["kv_bits"] == ["8", "qwen=4"]
    assert [str(entry) for entry in from_file["kv_bits"]] == ["8", "qwen=4"]
    assert read_kv_bits(from_flags["kv_bits"]) == (KvBitsChoice("", 8), KvBitsChoice("qwen", 4))


@pytest.mark.parametrize("value", ["6", "qwen=16", "eight"])
def test_bits_other_than_8_or_4_stop_the_daemon_naming_the_setting(tmp_path, value):
    with pytest.raises(ConfigError, match=r"kv_bits .*\(from flag --kv-bits\): .*the bits must be 8 or 4"):
        load_config(explicit_flags(build_parser, ["--kv-bits", value]), {"XDG_CONFIG_HOME": str(tmp_path)})


def test_each_model_gets_its_own_choice_and_a_name_that_names_no_model_is_refused():
    choices = {c.model: c for c in read_kv_bits(["4", "qwen=8"])}
    assert kv_bits_for(choices, "smol", is_default=True) == 4
    assert kv_bits_for(choices, "qwen", is_default=False) == 8
    assert kv_bits_for(choices, "other", is_default=False) == 0
    with pytest.raises(KvBitsError, match="--kv-bits qwen=8: no model is named 'qwen'"):
        check_all_named(choices, ["smol", "other"])
    with pytest.raises(KvBitsError, match="two --kv-bits for model qwen"):
        read_kv_bits(["qwen=8", "qwen=4"])
