"""The disk cache's file format: one file per radix-tree edge.

Each file is

    b"PFXDKV\\r\\n"  u32-le header length  header (JSON)  payload (safetensors)

The header names the model fingerprint, the mlx version, the format version,
the edge (its tokens, where it starts, a digest of the tokens before it), the
``kv_bits`` its attention arrays are packed at (--kv-bits; left out at full
precision, so such files are what they always were) and
``sha256``: the digest of the payload followed by the header without that
field, so a flipped bit anywhere (tokens included) is caught and never
becomes a wrong cache. An entry id is derived from what the file holds, so a
file never changes once written.

Pure Python and I/O, no MLX: runs on worker threads.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MAGIC = b"PFXDKV\r\n"
SUFFIX = ".kv"
_LENGTH = struct.Struct("<I")
_MAX_HEADER_BYTES = 64 << 20


def token_bytes(tokens: Any) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def token_digest(tokens: Any) -> "hashlib._Hash":
    """A running sha256 over token ids (u32 little-endian): .copy() and .update() to extend."""
    return hashlib.sha256(token_bytes(tokens))


@dataclass
class EntryHeader:
    """What a file says about itself; ``path`` is filled in when read."""

    fingerprint: str
    mlx: str
    start: int  # depth where the edge starts
    start_sha: str  # digest of the tokens before it
    key: list[int]  # the edge's tokens
    kind: str | None  # checkpoint kind at the edge's end
    snapshot: list[list[bool]] | None  # per state layer: which arrays are present
    nbytes: int  # of the arrays, as the store counts them
    format: int = FORMAT_VERSION
    sha256: str = ""
    path: Path | None = field(default=None, compare=False)
    kv_bits: int = 0  # 8 or 4: the attention arrays are packed (codes, scales, biases); 0: full precision

    @property
    def depth(self) -> int:
        return self.start + len(self.key)

    def fields(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in _HEADER_FIELDS}
        return {**fields, "kv_bits": self.kv_bits} if self.kv_bits else fields


_HEADER_FIELDS = ("format", "fingerprint", "mlx", "start", "start_sha", "key", "kind", "snapshot", "nbytes")


def entry_id(fingerprint: str, depth_sha: str, start: int, kind: str | None, has_snapshot: bool) -> str:
    """Names an edge by content: the tokens up to its end, where it starts, its checkpoint."""
    text = f"{fingerprint}|{depth_sha}|{start}|{kind}|{int(has_snapshot)}"
    return hashlib.sha256(text.encode()).hexdigest()[:40]


def _checksum(fields: dict[str, Any], payload: bytes) -> str:
    digest = hashlib.sha256(payload)
    digest.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    return digest.hexdigest()


def encode_entry(header: EntryHeader, payload: bytes) -> bytes:
    fields = header.fields()
    header_bytes = json.dumps({**fields, "sha256": _checksum(fields, payload)}, separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(header_bytes)) + header_bytes + payload


class BadEntry(ValueError):
    """A file that is not a usable entry (truncated, corrupted, another format)."""


def _parse_header(raw: bytes) -> EntryHeader:
    try:
        data = json.loads(raw)
        header = EntryHeader(
            **{name: data[name] for name in (*_HEADER_FIELDS, "sha256")}, kv_bits=data.get("kv_bits", 0)
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise BadEntry(f"unreadable header ({exc})") from None
    if header.format != FORMAT_VERSION:
        raise BadEntry(f"format version {header.format}, this prefixd reads {FORMAT_VERSION}")
    _check_field_types(header)
    return header


def _check_field_types(header: EntryHeader) -> None:
    """Fields of the wrong type are a bad entry here, not an exception deep inside an import later.

    The checksum catches damage; this catches a header that some other
    writer (or a bug) produced with a valid checksum but unusable fields.
    """

    def whole(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    snapshot = header.snapshot
    usable = (
        whole(header.start)
        and whole(header.nbytes)
        and whole(header.kv_bits)
        and isinstance(header.start_sha, str)
        and isinstance(header.fingerprint, str)
        and isinstance(header.mlx, str)
        and isinstance(header.key, list)
        and len(header.key) > 0
        and (header.kind is None or isinstance(header.kind, str))
        and (
            snapshot is None
            or isinstance(snapshot, list)
            and all(isinstance(flags, list) and all(isinstance(flag, bool) for flag in flags) for flags in snapshot)
        )
    )
    if usable:
        try:
            token_bytes(header.key)  # u32 token ids, checked at C speed
        except struct.error:
            usable = False
    if not usable:
        raise BadEntry("header fields of the wrong type")


def read_header(path: Path) -> EntryHeader:
    with open(path, "rb") as handle:
        head = handle.read(len(MAGIC) + _LENGTH.size)
        if len(head) < len(MAGIC) + _LENGTH.size or not head.startswith(MAGIC):
            raise BadEntry("not a prefixd cache entry (bad magic or truncated)")
        (length,) = _LENGTH.unpack(head[len(MAGIC) :])
        if length > _MAX_HEADER_BYTES:
            raise BadEntry("header length out of range")
        raw = handle.read(length)
    if len(raw) < length:
        raise BadEntry("truncated header")
    header = _parse_header(raw)
    header.path = path
    return header


def read_payload(header: EntryHeader) -> bytes:
    """The payload of a file whose header was read, after checking its checksum."""
    data = header.path.read_bytes()
    (length,) = _LENGTH.unpack(data[len(MAGIC) : len(MAGIC) + _LENGTH.size])
    payload = data[len(MAGIC) + _LENGTH.size + length :]
    if _parse_header(data[len(MAGIC) + _LENGTH.size :][:length]) != header:
        raise BadEntry("changed since it was scanned")
    if _checksum(header.fields(), payload) != header.sha256:
        raise BadEntry("checksum mismatch (truncated or corrupted)")
    return payload
