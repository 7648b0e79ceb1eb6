"""What the engine is told at start. The defaults live in one place: the declarations in service/settings.py."""

from __future__ import annotations

from dataclasses import dataclass

from ..models.chat_template_file import ChatTemplateFile
from ..models.kv_bits_setting import KvBitsChoice


@dataclass(frozen=True)
class EngineSettings:
    model_specs: tuple[str, ...]
    dtype: str
    prefill_chunk: int | None  # tokens per prefill pass; every chunk end is a cache checkpoint; None: by device
    cache_bytes: int  # the prefix store and the running sequences' KV share this budget
    cache_nodes: int
    pinned_bytes: int
    max_queued: int
    max_queued_per_client: int
    max_active: int  # sequences prefilling or decoding at once
    shadow_rate: float = 0.0  # share of greedy cache hits re-run without the cache when idle (shadow_checker.py)
    shadow_action: str = "log"  # on a mismatch: log, or stop-reuse (that checkpoint kind, for that model)
    attention: str = "auto"  # tails and padded decode steps: auto, fused, matmul, kernel (tail_attention.py)
    linear: str = "auto"  # 2-8 rows through a linear layer: auto, matmul or rows (models/row_linear.py)
    fork: str = "auto"  # a hit's stored KV: auto (share on a CPU), copy, or read in place (models/shared_forks.py)
    batch_step: str = "auto"  # decode rows: auto (ragged on a CPU), padded or ragged (models/batch_step.py)
    warm_up: str = "auto"  # fork and last-token passes run once at load: auto (on a GPU), on, off (engine/warm_up.py)
    keep_alive_s: float = -1.0  # an idle model stays loaded this long (negative: for good); requests may say otherwise
    max_model_bytes: int = 0  # loaded models' weights together; 0: no limit (engine/model_residency.py)
    found_model_specs: tuple[str, ...] = ()  # found in --models-dir: served after model_specs, skipped if unservable
    chat_templates: tuple[ChatTemplateFile, ...] = ()  # --chat-template: read at start, each replacing a model's own
    kv_bits: tuple[KvBitsChoice, ...] = ()  # --kv-bits: the models whose attention KV is quantized (kv/quantized_kv.py)
    mlx_cache_bytes: int | None = (
        None  # freed device memory MLX keeps for reuse; None: engine/device_memory.py's default
    )


CPU_PREFILL_CHUNK = 512
# On a GPU one pass of 2k tokens costs little more than one of 512, and every
# pass carries fixed costs (a store insert, a sync): fewer, larger passes.
GPU_PREFILL_CHUNK = 2048


# On a CPU a prompt token at depth d costs about (1 + d / this) times one at
# depth 0 (SmolLM2, 2 cores, OpenBLAS: 512 tokens 2.0 s at depth 0, 6.3 s at
# 2,048, 10.6 s at 4,096); prefill.pass_limit shortens passes by it.
CPU_PASS_DEPTH_SCALE = 1024


def default_prefill_chunk(on_gpu: bool) -> int:
    return GPU_PREFILL_CHUNK if on_gpu else CPU_PREFILL_CHUNK


# On CUDA an attention-only prompt's chunk stops are stored every this many chunks (8,192 tokens), not
# every chunk; passes stay a chunk long (Scheduler._stores_pass). A fork of more than kv.fork.FORK_GROUP
# stored segments joins them in groups first and so copies the prefix twice: a 32,000-token prompt was 16
# segments. In 4 it forks with one copy, up to 64k tokens. On an H200 (bench/gpu_session.sh hits-raw
# against hits-raw-alt, one call): its exact repeat 20-22 -> 17.5 ms at the client, and a 4,000-token one
# (2 segments -> 1) 8-9 -> 7.3 ms.
CUDA_CHUNKS_PER_STORE = 4


def default_chunks_per_store(on_cuda: bool) -> int:
    return CUDA_CHUNKS_PER_STORE if on_cuda else 1
