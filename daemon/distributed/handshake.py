"""Refuse at start a rank that would not run the same engine: another version, settings or model.

Lock-step only works if every rank runs the same code on the same model with
the same settings (the scheduler's decisions and the store's evictions must
come out the same everywhere). Every rank gathers every rank's identity and
compares; any difference stops every rank, with a message naming the field
and each rank's value. Twice: before loading (code, settings, the models'
config files), so a mismatch does not wait for a long load, and after (the
models' fingerprints, which hash the loaded weights' files and tokenizer).
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

from .channel import Channel
from .settings import DistributedStartError

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding daemon/ and protocol/


class RanksDisagree(DistributedStartError):
    """Ranks were started with different code, settings or models; the message names the difference."""


def code_version() -> str:
    """prefixd's version and a digest of its sources: a rank running other code is refused."""
    try:
        version = metadata.version("prefixd")
    except metadata.PackageNotFoundError:
        version = "unknown"
    digest = hashlib.sha256()
    for folder in ("daemon", "protocol"):
        for path in sorted((PACKAGE_ROOT / folder).rglob("*.py")):
            digest.update(path.relative_to(PACKAGE_ROOT).as_posix().encode())
            digest.update(path.read_bytes())
    return f"{version}+{digest.hexdigest()[:12]}"


def config_digest(model_spec: str) -> str:
    """A model's config.json, hashed (a rank with another model is refused before it loads)."""
    path = Path(model_spec).expanduser() / "config.json"
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        return f"unreadable: {model_spec}"  # loading fails later with the real reason


def check_peers(channel: Channel, stage: str, identity: dict[str, Any]) -> None:
    """Raise RanksDisagree on every rank if any rank's ``identity`` differs from rank 0's."""
    mine = json.dumps(identity, sort_keys=True, default=str).encode()
    identities = [json.loads(raw) for raw in channel.gather(mine)]
    differences = []
    for key in sorted(set().union(*identities)):
        values = [ident.get(key) for ident in identities]
        if any(value != values[0] for value in values):
            shown = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            differences.append(f"{key} ({shown})")
    if differences:
        raise RanksDisagree(
            f"the {channel.size} ranks differ {stage}: {'; '.join(differences)}. Start every rank "
            "with the same prefixd, the same model files and the same settings"
        )
