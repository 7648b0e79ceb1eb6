"""A models directory: every model directory in it, served beside the --model ones (loaded on first use).

A model directory is one holding a config.json and safetensors weights (what
``prefixd setup`` and ``prefixd import-gguf`` write, one per model, in
``$PREFIXD_MODELS_DIR``). Anything else in the folder (notes, a half-written
import, which the importer never leaves under the final name anyway) is not
a model and is passed over. Pure file listing: no MLX.
"""

from __future__ import annotations

from pathlib import Path


def find_model_dirs(root: Path) -> list[str]:
    """The model directories directly inside ``root``, by name; FileNotFoundError if ``root`` is not a directory."""
    if not root.is_dir():
        raise FileNotFoundError(f"models directory {root} does not exist")
    found = []
    for child in sorted(root.iterdir(), key=lambda p: p.name):
        if child.is_dir() and (child / "config.json").is_file() and any(child.glob("*.safetensors")):
            found.append(str(child))
    return found
