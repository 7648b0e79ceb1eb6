#!/usr/bin/env python
"""In-process mlx-lm for bench/compare.py: a subprocess that runs plain ``stream_generate``.

    python bench/inproc_worker.py MODEL_DIR     (JSON lines: requests on stdin, answers on stdout)

This is the floor for server overhead: no socket, no HTTP, no scheduler, and no cache
across requests (each request is a cold prefill). All timings are taken here, around the
mlx-lm call itself, so the pipe to the bench process costs nothing in the figures. It is a
subprocess rather than the bench process itself so that its peak memory (VmHWM) is its own
and so that MLX keeps to the single thread that loaded it.

Requests: {"op": "generate", "messages": [...], "max_tokens": N}, {"op": "floor", "messages": [...], "repeats": N}
or {"op": "info"}.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

BLAS = preload_blas()  # must precede `import mlx.core` (the BLAS trap)

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

PREFILL_STEP = 2048  # stream_generate's default prefill_step_size


def vmhwm_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def chat_tokens(tokenizer, messages: list[dict]) -> list[int]:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(prompt, "keys"):  # transformers 5 BatchEncoding
        prompt = prompt["input_ids"]
    return list(prompt)


def generate(model, tokenizer, messages: list[dict], max_tokens: int) -> dict:
    """One cold request, timed like a server would be: template + tokenize + prefill + decode."""
    started = time.perf_counter()
    prompt = chat_tokens(tokenizer, messages)
    first_at, first_text_at, last_at, num_chunks, text, count, finish = None, None, None, 0, "", 0, None
    for response in stream_generate(model, tokenizer, list(prompt), max_tokens=max_tokens):
        if first_at is None:
            first_at = time.perf_counter()
        if response.text:  # counted like the servers' streams: a chunk per token that adds text
            last_at = time.perf_counter()
            first_text_at = first_text_at or last_at
            num_chunks += 1
        text += response.text
        count = response.generation_tokens
        finish = response.finish_reason
    done = time.perf_counter()
    return {"ttft_ms": ((first_at or done) - started) * 1000, "total_ms": (done - started) * 1000,
            "prompt_tokens": len(prompt), "prefilled_tokens": len(prompt), "completion_tokens": count,
            "text": text, "finish_reason": finish,
            "decode_window": {"steps": num_chunks - 1, "seconds": last_at - first_text_at}
            if num_chunks >= 2 and last_at > first_text_at else None}


def warm_hit_floor(model, tokenizer, messages: list[dict], repeats: int) -> dict:
    """The least a warm exact hit can cost in process (the floor compare.py's targets use): a copy of a ready cache of every
    prompt token but the last, that last token's forward pass, and its argmax; the median of ``repeats``
    after one untimed run. No template, no tokenizing, no socket: what a server adds shows against it."""
    prompt = chat_tokens(tokenizer, messages)
    ready = make_prompt_cache(model)
    for start in range(0, len(prompt) - 1, PREFILL_STEP):
        model(mx.array(prompt[start : min(start + PREFILL_STEP, len(prompt) - 1)])[None], cache=ready)
        mx.eval([c.state for c in ready])
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        cache = copy.deepcopy(ready)
        token = mx.argmax(model(mx.array(prompt[-1:])[None], cache=cache)[0, -1])
        mx.eval(token)
        times.append((time.perf_counter() - started) * 1000)
    return {"floor_ms": statistics.median(times[1:]), "all_ms": times[1:], "prompt_tokens": len(prompt),
            "device": str(mx.default_device())}


def main() -> int:
    model, tokenizer = load(sys.argv[1])
    dtype = str(tree_flatten(model.parameters())[0][1].dtype)  # float32: the fast path with OpenBLAS
    # Untimed warm-up: the first forward pass pays one-time setup (kernels, allocator).
    generate(model, tokenizer, [{"role": "user", "content": "Hello"}], 2)
    print(json.dumps({"ready": True, "dtype": dtype, "blas": BLAS, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "generate":
                answer = generate(model, tokenizer, request["messages"], request["max_tokens"])
            elif request["op"] == "floor":
                answer = warm_hit_floor(model, tokenizer, request["messages"], request["repeats"])
            else:
                answer = {"vmhwm_kb": vmhwm_kb(), "dtype": dtype, "blas": BLAS, "peak_mlx_gb": mx.get_peak_memory() / 1e9}
        except Exception as exc:  # noqa: BLE001 - reported to the bench, which records it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
