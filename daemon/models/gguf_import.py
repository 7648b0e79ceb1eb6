"""Convert a GGUF file into a directory that mlx_lm.load() reads.

The steps live in gguf_conversion/ (read, map per architecture, tokenizer, weights); this module
runs them, records what was imported (prefixd_import.json) and makes the directory appear
atomically. Architectures: llama (incl. Llama 3's rope scaling and tokenizer), qwen2, qwen3,
gemma3, phi3, lfm2. Tensor types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .blas import preload_blas

preload_blas()  # must run before mlx.core is imported anywhere in the process

from .gguf_conversion.architectures import architecture_of  # noqa: E402
from .gguf_conversion.configs import Hyper  # noqa: E402
from .gguf_conversion.errors import GGUFImportError  # noqa: E402
from .gguf_conversion.reader import GGUFFile  # noqa: E402
from .gguf_conversion.tokenizer import check_tokenizer, save_tokenizer  # noqa: E402
from .gguf_conversion.weights import (  # noqa: E402
    DTYPES,
    ShardWriter,
    convert_tensor,
    quantization_config,
    resolve_dtype,
)

__all__ = ["DTYPES", "GGUFImportError", "import_gguf", "read_import_record", "resolve_dtype"]

RECORD_FILE = "prefixd_import.json"
# Bump when the output changes, so old imports are redone. 2: the gguf-package importer
# (un-permuted llama Q/K with rope_traditional false, more architectures and types).
_RECORD_FORMAT = 2


def _fingerprint(path: Path, dtype: str) -> dict:
    with open(path, "rb") as f:
        head = f.read(1 << 20)  # hashing all of a multi-GB file on every start would be slow
    return {
        "format": _RECORD_FORMAT,
        "source_name": path.name,
        "source_size": path.stat().st_size,
        "source_sha256_first_mib": hashlib.sha256(head).hexdigest(),
        "dtype": dtype,
    }


def read_import_record(out_dir: str | os.PathLike) -> dict | None:
    """The prefixd_import.json of a finished import in out_dir, or None."""
    try:
        return json.loads((Path(out_dir) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_current_import(out_dir: str | os.PathLike, source_name: str, dtype: str) -> bool:
    """Whether out_dir holds an import of a file so named, with this dtype, by this importer."""
    record = read_import_record(out_dir)
    return (
        record is not None
        and record.get("format") == _RECORD_FORMAT
        and record.get("source_name") == source_name
        and record.get("dtype") == resolve_dtype(dtype)
        and (Path(out_dir) / "config.json").is_file()
    )


def import_gguf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "auto", progress: bool | None = None
) -> Path:
    """Convert a GGUF into an mlx-lm model directory at out_dir; return out_dir.

    dtype: one of DTYPES (see gguf_conversion/weights.py; "auto" is float32 on a CPU, q8 on a
    GPU). progress: show a progress bar (None: only on a terminal). Skipped when out_dir already
    holds an import of the same file with the same dtype. The directory appears atomically,
    complete or not at all. Raises GGUFImportError for files this importer cannot convert.
    """
    dtype = resolve_dtype(dtype)
    src, out = Path(gguf_path), Path(out_dir)
    record = _fingerprint(src, dtype)
    if read_import_record(out) == record:
        return out
    show = sys.stderr.isatty() if progress is None else progress
    _say(show, f"reading {src.name}")  # a large vocabulary takes the reader tens of seconds
    source = GGUFFile(src)
    arch = architecture_of(source.metadata, src.name)  # fail before the slow part
    source.check_types()
    names = arch.weight_names(source.tensors)
    check_tokenizer(source.metadata, arch.name, src.name)
    config = arch.make_config(Hyper(source.metadata, arch.name, set(source.tensors), source.dequantize))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the model dir should be readable
        _say(show, f"rebuilding the {arch.name} tokenizer")
        eos_ids = save_tokenizer(source.metadata, arch.name, arch.end_tokens, tmp)
        if eos_ids:
            config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
        writer = ShardWriter(tmp)
        for gguf_name, mlx_name in _with_progress(source, names, show):
            writer.add(convert_tensor(source, gguf_name, mlx_name, arch.transform, config, dtype))
        writer.finish()
        if quantization := quantization_config(dtype, writer.shapes):
            config["quantization"] = quantization
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n")
        try:
            _replace_dir(tmp, out)
        except OSError:
            if read_import_record(out) != record:  # else a concurrent import won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _say(show: bool, message: str) -> None:
    if show:
        print(f"prefixd import-gguf: {message} ...", file=sys.stderr, flush=True)


def _with_progress(source: GGUFFile, names: dict[str, str], show: bool):
    """Yield (gguf name, mlx name), advancing a bar by each tensor's bytes in the file."""
    from tqdm import tqdm

    total = sum(source.num_bytes(n) for n in names)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"converting {source.name}", disable=not show) as bar:
        for gguf_name, mlx_name in names.items():
            yield gguf_name, mlx_name
            bar.update(source.num_bytes(gguf_name))


def _replace_dir(new: Path, out: Path) -> None:
    """Move new to out. rename() cannot overwrite a non-empty directory, so an existing
    out is first renamed onto an empty scratch dir. Readers never see a partial model."""
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    try:
        if out.exists():
            os.rename(out, old)
        try:
            os.rename(new, out)
        except OSError:
            if not out.exists() and any(old.iterdir()):
                os.rename(old, out)  # put the previous import back
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
