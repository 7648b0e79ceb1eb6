"""Each rank's shard of a model, through mlx-lm's own ``sharded_load`` (tensor parallel).

mlx-lm's ``shard()`` splits every attention and MLP projection evenly over
the ranks (heads and KV heads per rank = total / ranks), so a model whose
head counts do not divide is refused here, by name, before anything is
loaded: mlx-lm would build wrong shapes. Pipeline parallelism is not offered:
the store's byte counts must be the same on every rank (they decide
eviction), which an even tensor split gives and an uneven layer split does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.utils import sharded_load

from .settings import DistributedStartError

# config.json fields that mlx-lm's shard() divides by the number of ranks.
SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


class NotShardable(DistributedStartError, ValueError):
    """The model cannot be split over this many ranks; the message says why and what would work."""


def check_shardable(path: Path, num_ranks: int) -> None:
    config = json.loads((path / "config.json").read_text())
    config = {**config.get("text_config", {}), **config}
    for key in SPLIT_FIELDS:
        value = config.get(key)
        if isinstance(value, int) and value % num_ranks:
            working = [n for n in range(2, 9) if all(
                not isinstance(config.get(k), int) or config[k] % n == 0 for k in SPLIT_FIELDS)]
            raise NotShardable(
                f"{path.name}: {key} = {value} does not divide over {num_ranks} ranks (mlx-lm's tensor-parallel "
                f"shard() splits it evenly); rank counts that work for this model: "
                f"{', '.join(map(str, working)) or 'none up to 8'}")


def make_sharded_loader(group: mx.distributed.Group) -> Callable[[str], tuple[Any, Any]]:
    """A ``load_weights(path) -> (model, tokenizer)`` for models/loaded_model.load_model."""

    def load(path: str) -> tuple[Any, Any]:
        check_shardable(Path(path), group.size())
        try:
            return sharded_load(path, tensor_group=group)
        except ValueError as exc:  # "does not support tensor parallelism", from mlx-lm
            raise NotShardable(f"{Path(path).name}: {exc}") from None

    return load
