"""A tiny model that can fill in the middle: the tiny llama plus Qwen2.5-Coder's FIM tokens.

The tiny models' tokenizer has only ChatML's special tokens. This copies the
tiny llama, adds ``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>``,
``<|fim_pad|>``, ``<|repo_name|>`` and ``<|file_sep|>`` as special tokens (ids
after the trained vocabulary), and grows the embedding (tied with the output
layer) by as many rows, drawn under a fixed seed. The weights are random, so
the middle it fills is gibberish; what the tests check is the prompt, the
reuse and the shapes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

FIM_TOKENS = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
EMBEDDING = "model.embed_tokens.weight"


def ensure_fim_model(tiny_llama_dir: Path, root: Path) -> Path:
    """root/llama-fim, built from the tiny llama unless it is there (built aside, then renamed into place)."""
    target = Path(root) / "llama-fim"
    if (target / "fim.json").is_file():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=".llama-fim-", dir=root))
    try:
        build = tmp / "llama-fim"
        shutil.copytree(tiny_llama_dir, build)
        _add_fim_tokens(build)
        (build / "fim.json").write_text(json.dumps({"tokens": FIM_TOKENS}) + "\n")
        try:
            os.rename(build, target)
        except OSError:
            if not (target / "fim.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _add_fim_tokens(model_dir: Path) -> None:
    import mlx.core as mx
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in FIM_TOKENS], special_tokens=True)
    tokenizer.save_pretrained(str(model_dir))
    config = json.loads((model_dir / "config.json").read_text())
    weights = mx.load(str(model_dir / "model.safetensors"))
    embedding = weights[EMBEDDING]
    grown = len(tokenizer) - embedding.shape[0]
    mx.random.seed(1)
    weights[EMBEDDING] = mx.concatenate([embedding, 0.02 * mx.random.normal((grown, embedding.shape[1]), dtype=embedding.dtype)])
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    config["vocab_size"] = len(tokenizer)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
