"""``--kv-bits`` checked where the models are described at start: what cannot apply stops the daemon or is logged."""

from __future__ import annotations

import json
import shutil

import pytest
from structlog.testing import capture_logs

from prefixd.daemon.models.kv_bits_setting import KvBitsError, read_kv_bits
from prefixd.daemon.models.model_catalog import describe_models


@pytest.fixture
def narrow_heads_dir(tiny_llama_dir, tmp_path):
    """The tiny llama's weights read as 16 heads of 16 (8 KV heads): the same shapes, a head dimension of 16."""
    directory = tmp_path / "narrow"
    shutil.copytree(tiny_llama_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (256, 4, 2)
    config.update(head_dim=16, num_attention_heads=16, num_key_value_heads=8)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_head_dimension_no_group_divides_stops_the_start_naming_the_model_and_the_dimension(narrow_heads_dir):
    assert describe_models([str(narrow_heads_dir)], "float32")["narrow"].layout.kv_bits == 0  # servable as it is
    with pytest.raises(KvBitsError, match=r"--kv-bits 8 for model narrow: its attention head dimension is 16 "):
        describe_models([str(narrow_heads_dir)], "float32", kv_bits=read_kv_bits(["8"]))


def test_a_model_found_in_the_models_dir_reports_its_kv_bits_conflict_rather_than_being_skipped(
    narrow_heads_dir, tiny_llama_dir
):
    with pytest.raises(KvBitsError, match="--kv-bits 4 for model narrow: its attention head dimension is 16 "):
        describe_models([], "float32", [str(narrow_heads_dir)], kv_bits=read_kv_bits(["narrow=4"]))
    with pytest.raises(KvBitsError, match=r"two --kv-bits for model llama: 8 \(the default model's\) and 4"):
        describe_models([], "float32", [str(tiny_llama_dir)], kv_bits=read_kv_bits(["8", "llama=4"]))


def test_bits_asked_for_a_model_without_attention_are_dropped_with_one_warning(tiny_mamba_dir, tiny_llama_dir):
    with capture_logs() as logs:
        entries = describe_models([str(tiny_mamba_dir), str(tiny_llama_dir)], "float32", kv_bits=read_kv_bits(["8", "llama=4"]))
    assert entries["mamba"].layout.kv_bits == 0 and entries["mamba"].kv == "float32"
    assert entries["llama"].layout.kv_bits == 4
    ignored = [event for event in logs if event["event"] == "kv_bits_ignored"]
    assert ignored == [
        {"event": "kv_bits_ignored", "log_level": "warning", "model": "mamba", "kv_bits": 8,
         "reason": "no attention layers: no KV to quantize"}
    ]
