"""Each rank's shard of a model, through mlx-lm's own ``sharded_load``: tensor or pipeline parallel.

Tensor (``shard()``): every attention and MLP projection is split evenly over
the ranks (heads and KV heads per rank = total / ranks), so a model whose head
counts do not divide is refused here, by name, before anything is loaded:
mlx-lm would build wrong shapes. Every rank holds every layer's cache, a slice
of its heads.

Pipeline (``model.model.pipeline(group)``): each rank runs a run of whole
layers and holds only those layers' caches; the hidden state goes from rank to
rank inside the model's forward (send/recv) and the last stage's output is
all-gathered, so every rank computes the same logits. The layers must divide
evenly: the store's byte counts decide eviction and must be the same on every
rank, which an uneven split (mlx-lm gives the low ranks the extra layers)
would break. The handshake after loading compares the measured KV bytes per
token as well (a model mixing layer kinds could still differ).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.pipeline import PipelineMixin
from mlx_lm.utils import sharded_load

from .settings import DistributedStartError

# config.json fields that mlx-lm's shard() divides by the number of ranks.
SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


class NotShardable(DistributedStartError, ValueError):
    """The model cannot be split over this many ranks; the message says why and what would work."""


def read_config(path: Path) -> dict[str, Any]:
    config = json.loads((path / "config.json").read_text())
    return {**config.get("text_config", {}), **config}


def supported_modes(config: dict[str, Any]) -> tuple[str, ...] | None:
    """The parallel modes mlx-lm's code for this model type offers ("tensor": shard(); "pipeline": pipeline()).

    None when mlx-lm does not know the type (loading then says so in its own words).
    """
    from mlx_lm.utils import _get_classes  # how mlx_lm.load picks the module for a model_type

    try:
        model_class, _ = _get_classes(config)
    except (ValueError, KeyError):
        return None
    module = importlib.import_module(model_class.__module__)
    modes = []
    if hasattr(model_class, "shard"):
        modes.append("tensor")
    if any(isinstance(c, type) and issubclass(c, PipelineMixin) for c in vars(module).values()):
        modes.append("pipeline")
    return tuple(modes)


def check_shardable(path: Path, num_ranks: int, parallel: str = "tensor") -> None:
    config = read_config(path)
    modes = supported_modes(config)
    if modes is None:
        return
    if parallel not in modes:
        offers = f"offers {' and '.join(modes)} only (--parallel {modes[0]})" if modes else "splits it neither way"
        raise NotShardable(
            f"{path.name} ({config.get('model_type')}) cannot run {parallel}-parallel over ranks: "
            f"mlx-lm's code for it {offers}"
        )
    if parallel == "pipeline":
        layers = config.get("num_hidden_layers")
        if isinstance(layers, int) and layers % num_ranks:
            working = [n for n in range(2, 9) if layers % n == 0]
            raise NotShardable(
                f"{path.name}: num_hidden_layers = {layers} does not divide over {num_ranks} ranks (every rank must "
                f"hold as many layers, so that the ranks' prefix stores count the same bytes); rank counts that "
                f"work for this model in pipeline mode: {', '.join(map(str, working)) or 'none up to 8'}"
            )
        return
    for key in SPLIT_FIELDS:
        value = config.get(key)
        if isinstance(value, int) and value % num_ranks:
            working = [
                n
                for n in range(2, 9)
                if all(not isinstance(config.get(k), int) or config[k] % n == 0 for k in SPLIT_FIELDS)
            ]
            raise NotShardable(
                f"{path.name}: {key} = {value} does not divide over {num_ranks} ranks (mlx-lm's tensor-parallel "
                f"shard() splits it evenly); rank counts that work for this model: "
                f"{', '.join(map(str, working)) or 'none up to 8'}"
            )


def make_sharded_loader(group: mx.distributed.Group, parallel: str = "tensor") -> Callable[[str], tuple[Any, Any]]:
    """A ``load_weights(path) -> (model, tokenizer)`` for models/loaded_model.load_model."""

    def load(path: str) -> tuple[Any, Any]:
        check_shardable(Path(path), group.size(), parallel)
        groups = {"pipeline_group": group} if parallel == "pipeline" else {"tensor_group": group}
        try:
            return sharded_load(path, **groups)
        except ValueError as exc:  # "does not support tensor parallelism", a missing weight index, from mlx-lm
            raise NotShardable(f"{Path(path).name}: {exc}") from None

    return load
