"""A decode batch's attention over its left-padded cache, as one CUDA kernel of prefixd's own.

Why: the rows of mlx-lm's batch cache (BatchKVCache) are left-padded to the
longest, so each decode step hands attention an array mask that hides every
row's padding. MLX's CUDA backend has no fused kernel for a one-token query
with an array mask: its vector kernel and cuDNN's decode path both refuse a
mask (mlx/backend/cuda/scaled_dot_product_attention.cpp,
``supports_sdpa_vector``, ``use_cudnn_for_decoding``), so every layer of every
step falls back to a matmul, the mask, a softmax and a second matmul. On an
H100 a step of 4 padded rows cost 5.4-5.7 ms against 4.5 ms for 4 equal rows
without a mask (bench/probes/daemon_profile.py, row_linear_probe.py).

Here each row reads its own keys from its first real position: the kernel
takes the cache's keys and values where they lie (no copy of the slice), the
query, and each row's left padding, and computes the softmax online (one warp
per key stride, the warps merged at the end), in float32 as MLX's kernels do.
One block serves one key-value head of one row and every query head that
shares it (grouped-query attention). Long rows are split into key ranges, a
block each, whose partial softmaxes a second kernel merges (split-K, as
flash-decoding does): with a few rows thousands of keys deep, one block per
row and head would leave most of the GPU idle (splits_for).

It is used only where it applies exactly: a one-token query, a plain batch
cache with left padding alone (no right padding: that exists only inside
mlx-lm's batched prefill, which prefixd does not use), no attention sinks,
head sizes 64 or 128. At install (tail_attention.py) it is checked against
MLX's masked attention on random rows; a kernel that fails to build or
disagrees is not used.
"""

from __future__ import annotations

import hashlib
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

WARPS = 8  # warps per block: each takes every WARPS-th run of KEYS_PER_STEP keys of the block's range
KEYS_PER_STEP = 1  # keys a warp has in flight at once (4 is written, not yet measured on a GPU: the probe compares)
HEAD_DIMS = (64, 128)
MAX_GROUP = 8  # query heads per key-value head the kernel's registers are sized for
# Split-K (flash-decoding): with few rows and long rows, one block per row and head leaves most of a
# GPU idle and walks thousands of keys one after another; the keys are split into ranges, one block
# each, and a second kernel merges the ranges' partial softmaxes. Splits are powers of two, so the
# kernels' shapes change only when a row crosses a threshold, not every step.
# Chosen on an H200 (bench/probes/padded_decode_probe.py, part call, 1,000-32,000 keys, 1-8 rows): these
# came within 10% of the fastest range count at every size measured, and one range was 1.8-7x slower
# than them from 8,000 keys on (bench/results/2026-12-07-h200-split-k).
MIN_KEYS_PER_SPLIT = 128
TARGET_BLOCKS = 1024  # about eight blocks per streaming multiprocessor of an H100 / H200 (132)
MAX_SPLITS = 64
# A sequence decoding alone (a plain KVCache, no mask) would take the kernel from this many keys on.
# None: never. On the H200 MLX's own vector kernel, unmasked, was faster at every depth from 1,000 to
# 32,000 keys (the probe's part solo: the kernel's steps 1.03-1.10x MLX's), so the solo path keeps it.
SOLO_MIN_KEYS: int | None = None

# One block: a key-value head of a row, over keys [begin, end) of that row (set by the prologue).
_PROLOGUE = """
    constexpr int PER_LANE = D / 32;
    const float NEG_INF = -__int_as_float(0x7f800000);
    const int num_kv_heads = k_shape[1];
    const int num_q_heads = q_shape[1];
    const int length = k_shape[2];
    const int row = blockIdx.x / num_kv_heads;
    const int kv_head = blockIdx.x % num_kv_heads;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const float qk_scale = scale[0];
    int first = starts[row];
    first = first < 0 ? 0 : first;
"""
_WHOLE_ROW = """
    const int begin = first;
    const int end = length;
"""
_ROW_RANGE = """
    const int split = blockIdx.y;
    const int splits = gridDim.y;
    const int chunk = (length - first + splits - 1) / splits;
    const int begin = first + split * chunk;
    const int end = begin + chunk < length ? begin + chunk : length;
"""
_ATTEND = """
    float query[R][PER_LANE];
    for (int r = 0; r < R; ++r) {
        const int64_t base = row * q_strides[0] + (kv_head * R + r) * q_strides[1];
        for (int i = 0; i < PER_LANE; ++i) {
            query[r][i] = static_cast<float>(q[base + (lane * PER_LANE + i) * q_strides[3]]) * qk_scale;
        }
    }
    float running_max[R], running_sum[R], acc[R][PER_LANE];
    for (int r = 0; r < R; ++r) {
        running_max[r] = NEG_INF;
        running_sum[r] = 0.0f;
        for (int i = 0; i < PER_LANE; ++i) acc[r][i] = 0.0f;
    }
    const int64_t k_base = row * k_strides[0] + kv_head * k_strides[1];
    const int64_t v_base = row * v_strides[0] + kv_head * v_strides[1];
    // U keys a warp at a time: their loads, dot products and shuffle reductions are independent, so the
    // warp has U in flight instead of waiting on each in turn, and the running sums are rescaled once per U.
    for (int t0 = begin + warp * U; t0 < end; t0 += W * U) {
        float key[U][PER_LANE], value[U][PER_LANE];
        for (int u = 0; u < U; ++u) {
            const int t = t0 + u < end ? t0 + u : t0;  // past the range: a repeat of key t0, weighed 0 below
            for (int i = 0; i < PER_LANE; ++i) {
                key[u][i] = static_cast<float>(k[k_base + t * k_strides[2] + (lane * PER_LANE + i) * k_strides[3]]);
                value[u][i] = static_cast<float>(v[v_base + t * v_strides[2] + (lane * PER_LANE + i) * v_strides[3]]);
            }
        }
        for (int r = 0; r < R; ++r) {
            float score[U];
            for (int u = 0; u < U; ++u) {
                score[u] = 0.0f;
                for (int i = 0; i < PER_LANE; ++i) score[u] += query[r][i] * key[u][i];
            }
            for (int offset = 16; offset > 0; offset >>= 1) {
                for (int u = 0; u < U; ++u) score[u] += __shfl_xor_sync(0xffffffff, score[u], offset);
            }
            float new_max = running_max[r];
            for (int u = 0; u < U; ++u) {
                if (t0 + u < end) new_max = fmaxf(new_max, score[u]);
            }
            const float rescale = expf(running_max[r] - new_max);
            running_sum[r] *= rescale;
            for (int i = 0; i < PER_LANE; ++i) acc[r][i] *= rescale;
            for (int u = 0; u < U; ++u) {
                if (t0 + u >= end) continue;
                const float weight = expf(score[u] - new_max);
                running_sum[r] += weight;
                for (int i = 0; i < PER_LANE; ++i) acc[r][i] += weight * value[u][i];
            }
            running_max[r] = new_max;
        }
    }

    __shared__ float warp_max[W][R];
    __shared__ float warp_sum[W][R];
    __shared__ float warp_acc[W][R][D];
    for (int r = 0; r < R; ++r) {
        if (lane == 0) {
            warp_max[warp][r] = running_max[r];
            warp_sum[warp][r] = running_sum[r];
        }
        for (int i = 0; i < PER_LANE; ++i) warp_acc[warp][r][lane * PER_LANE + i] = acc[r][i];
    }
    __syncthreads();
    for (int index = threadIdx.x; index < R * D; index += W * 32) {
        const int r = index / D;
        const int d = index % D;
        float overall_max = NEG_INF;
        for (int w = 0; w < W; ++w) overall_max = fmaxf(overall_max, warp_max[w][r]);
        float total = 0.0f, weighted = 0.0f;
        for (int w = 0; w < W; ++w) {
            if (warp_max[w][r] == NEG_INF) continue;  // this warp saw no key of the range
            const float factor = expf(warp_max[w][r] - overall_max);
            total += warp_sum[w][r] * factor;
            weighted += warp_acc[w][r][d] * factor;
        }
"""
_WRITE_OUT = """
        const int64_t at = ((int64_t)row * num_q_heads + kv_head * R + r) * D + d;
        out[at] = static_cast<T>(total > 0.0f ? weighted / total : 0.0f);
    }
"""
# A range's partial softmax: its largest score, the sum of exp(score - largest), and the weighted values.
_WRITE_PARTIAL = """
        const int64_t slot = ((int64_t)row * num_q_heads + kv_head * R + r) * splits + split;
        part_acc[slot * D + d] = weighted;
        if (d == 0) {
            part_max[slot] = overall_max;
            part_sum[slot] = total;
        }
    }
"""
_SOURCE = _PROLOGUE + _WHOLE_ROW + _ATTEND + _WRITE_OUT
_SPLIT_SOURCE = _PROLOGUE + _ROW_RANGE + _ATTEND + _WRITE_PARTIAL
# One block per row and query head, one thread per dimension: the ranges merged in order.
_MERGE_SOURCE = """
    const float NEG_INF = -__int_as_float(0x7f800000);
    const int splits = part_max_shape[2];
    const int64_t head = blockIdx.x;  // row * query heads + query head
    const int d = threadIdx.x;
    float overall_max = NEG_INF;
    for (int s = 0; s < splits; ++s) overall_max = fmaxf(overall_max, part_max[head * splits + s]);
    float total = 0.0f, weighted = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float range_max = part_max[head * splits + s];
        if (range_max == NEG_INF) continue;  // a range past the row's end, or all padding
        const float factor = expf(range_max - overall_max);
        total += part_sum[head * splits + s] * factor;
        weighted += part_acc[(head * splits + s) * D + d] * factor;
    }
    out[head * D + d] = static_cast<T>(total > 0.0f ? weighted / total : 0.0f);
"""

_kernels: dict[str, Any] = {}  # built once per process, by name
# The scale as the kernel's input, one array per value: made once, not per layer and step.
_scales: dict[float, mx.array] = {}
_no_padding: dict[int, mx.array] = {}  # rows -> zeros: made once
# (head size, query heads per key-value head, dtype) variants checked against MLX in this process.
_checked: set[tuple[int, int, Any]] = set()


def applies(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, sinks: Any, mask: Any = None) -> bool:
    """Whether this attention call is a decode step the kernel serves: over a plain left-padded batch
    cache (or a sequence's own cache at least SOLO_MIN_KEYS deep, where that is set).

    Only variants checked at load (agrees) qualify, so a live step never builds one.
    """
    if sinks is not None or queries.shape[2] != 1:
        return False
    if isinstance(cache, BatchKVCache):
        if getattr(cache, "_right_padding", None) is not None or hasattr(cache, "bits"):
            return False
    elif SOLO_MIN_KEYS is None or type(cache) is not KVCache or mask is not None or keys.shape[2] < SOLO_MIN_KEYS:
        return False
    head_dim, num_heads, num_kv_heads = queries.shape[-1], queries.shape[1], keys.shape[1]
    if keys.shape[-1] != head_dim or values.shape[-1] != head_dim or num_heads % num_kv_heads:
        return False
    return (head_dim, num_heads // num_kv_heads, queries.dtype) in _checked


def row_starts(cache: Any, rows: int) -> mx.array:
    """Each row's first real key: a batch cache's left padding, or 0 for a sequence's own cache."""
    padding = getattr(cache, "left_padding", None)
    if padding is not None:
        return padding
    starts = _no_padding.get(rows)
    if starts is None:
        starts = _no_padding[rows] = mx.zeros((rows,), dtype=mx.int32)
    return starts


def variant(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel is written for this attention shape (head size, query heads per key-value head)."""
    return head_dim in HEAD_DIMS and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP


def splits_for(length: int, rows: int, kv_heads: int) -> int:
    """How many key ranges a step over ``length`` keys takes: enough blocks to fill the GPU, ranges
    of at least MIN_KEYS_PER_SPLIT keys, a power of two (1: the single kernel)."""
    by_keys = length // MIN_KEYS_PER_SPLIT
    by_blocks = -(-TARGET_BLOCKS // max(1, rows * kv_heads))
    most = max(1, min(by_keys, by_blocks, MAX_SPLITS))
    return 1 << (most.bit_length() - 1)


def _built(name: str, source: str, inputs: list[str], outputs: list[str]) -> Any:
    """The kernel ``name``, made once per process. MLX keeps compiled kernels on disk by name and
    template arguments alone (MLX_PTX_CACHE_DIR, which prefixd sets), not by source: the name carries
    a digest of the source, so a daemon upgraded to a changed kernel never loads the old one's PTX."""
    kernel = _kernels.get(name)
    if kernel is None:
        digest = hashlib.sha256(source.encode()).hexdigest()[:12]
        kernel = _kernels[name] = mx.fast.cuda_kernel(
            name=f"{name}_{digest}",
            input_names=inputs,
            output_names=outputs,
            source=source,
            ensure_row_contiguous=False,  # the cache's keys are a slice of its buffer: read where they lie
        )
    return kernel


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    left_padding: mx.array,
    scale: float,
    warps: int = WARPS,
    splits: int | None = None,
    keys_per_step: int | None = None,
) -> mx.array:
    """softmax(q k^T * scale) v for each row over its keys from ``left_padding[row]`` on; q is (B, H, 1, D).

    ``splits``: key ranges per row (default splits_for the call's shape); 1 is one kernel, more
    are two (the ranges, then their merge). ``keys_per_step``: default KEYS_PER_STEP.
    """
    batch, num_heads, _, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    if splits is None:
        splits = splits_for(keys.shape[2], batch, num_kv_heads)
    # mlx-lm's batch cache keeps its padding as int32 already: no conversion per layer and step.
    starts = left_padding if left_padding.dtype == mx.int32 else left_padding.astype(mx.int32)
    scale_input = _scales.get(scale)
    if scale_input is None:
        scale_input = _scales[scale] = mx.array([scale], dtype=mx.float32)
    inputs = [queries, keys, values, starts, scale_input]
    template = [
        ("T", queries.dtype),
        ("D", head_dim),
        ("R", group),
        ("W", warps),
        ("U", keys_per_step or KEYS_PER_STEP),
    ]
    if splits == 1:
        kernel = _built("prefixd_padded_decode_attention", _SOURCE, ["q", "k", "v", "starts", "scale"], ["out"])
        (out,) = kernel(
            inputs=inputs,
            template=template,
            grid=(batch * num_kv_heads * warps * 32, 1, 1),
            threadgroup=(warps * 32, 1, 1),
            output_shapes=[(batch, num_heads, 1, head_dim)],
            output_dtypes=[queries.dtype],
        )
        return out
    ranges = _built(
        "prefixd_padded_decode_ranges",
        _SPLIT_SOURCE,
        ["q", "k", "v", "starts", "scale"],
        ["part_max", "part_sum", "part_acc"],
    )
    part_max, part_sum, part_acc = ranges(
        inputs=inputs,
        template=template,
        grid=(batch * num_kv_heads * warps * 32, splits, 1),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(batch, num_heads, splits), (batch, num_heads, splits), (batch, num_heads, splits, head_dim)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    merge = _built("prefixd_padded_decode_merge", _MERGE_SOURCE, ["part_max", "part_sum", "part_acc"], ["out"])
    (out,) = merge(
        inputs=[part_max, part_sum, part_acc],
        template=[("T", queries.dtype), ("D", head_dim)],
        grid=(batch * num_heads * head_dim, 1, 1),
        threadgroup=(head_dim, 1, 1),
        output_shapes=[(batch, num_heads, 1, head_dim)],
        output_dtypes=[queries.dtype],
    )
    return out


def reference(queries: mx.array, keys: mx.array, values: mx.array, left_padding: mx.array, scale: float) -> mx.array:
    """What MLX computes for the same call: its attention with the padding masked out."""
    positions = mx.arange(keys.shape[2])
    mask = (positions[None, :] >= left_padding[:, None])[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def agrees(shapes: list[tuple[int, int, int]] | None = None, dtype: mx.Dtype = mx.bfloat16) -> tuple[bool, str]:
    """Whether the kernel builds here and matches MLX's masked attention on random rows: (ok, why not).

    ``shapes``: the model's (query heads, key-value heads, head size), each
    built and checked now in ``dtype`` (the model's), so that no decode step
    builds one; by default two shapes of the benchmark models. A shape the
    kernel is not written for is left to MLX (applies() turns it down).
    """
    shapes = [s for s in (shapes or [(16, 8, 128), (9, 3, 64)]) if variant(*s)]
    if not shapes:
        return False, "no attention shape of the model is one the kernel is written for"
    try:
        for heads, kv_heads, head_dim in shapes:
            # A cache buffer longer than its filled part, so keys and values are strided slices as in a batch.
            shape = (3, kv_heads, 320, head_dim)
            keys = mx.random.normal(shape, key=mx.random.key(1)).astype(dtype)[:, :, :301, :]
            values = mx.random.normal(shape, key=mx.random.key(2)).astype(dtype)[:, :, :301, :]
            queries = mx.random.normal((3, 1, heads, head_dim), key=mx.random.key(3)).astype(dtype).swapaxes(1, 2)
            left_padding = mx.array([0, 17, 290])
            scale = head_dim**-0.5
            wanted = reference(queries, keys, values, left_padding, scale).astype(mx.float32)
            # One kernel, and key ranges with some past a short row's end (11 keys in 8 ranges).
            for splits in (1, 8):
                got = attention(queries, keys, values, left_padding, scale, splits=splits).astype(mx.float32)
                worst = mx.max(mx.abs(got - wanted)).item()
                if not worst <= 2e-2:
                    return False, (
                        f"differs from MLX's masked attention by {worst:.3g} (head size {head_dim}, {splits} key ranges)"
                    )
            _checked.add((head_dim, heads // kv_heads, dtype))
        return True, ""
    except Exception as exc:  # no CUDA, NVRTC missing, a changed kernel API: MLX's own attention serves
        return False, f"{type(exc).__name__}: {exc}"


def attention_shapes(model: Any) -> list[tuple[int, int, int]]:
    """(query heads, key-value heads, head size) of the model's attention layers, as far as they tell."""
    shapes = set()
    for module in model.modules():
        heads, kv_heads = getattr(module, "n_heads", None), getattr(module, "n_kv_heads", None)
        if not isinstance(heads, int) or not isinstance(kv_heads, int) or not kv_heads:
            continue
        head_dim = getattr(module, "head_dim", None)
        scale = getattr(module, "scale", None)
        if not isinstance(head_dim, int) and isinstance(scale, float) and scale > 0:
            head_dim = round(scale**-2)
        if isinstance(head_dim, int):
            shapes.add((heads, kv_heads, head_dim))
    return sorted(shapes)
