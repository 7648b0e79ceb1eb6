"""Loading a model in steps, so that the engine decodes other requests between them.

A whole load blocks the engine thread for as long as the weights take to read
(SmolLM2-135M: 0.6-0.9 s, Gemma 3 270M: 10 s on a 2-core CPU), and every
running request of every other model waits that long for its next token.
Here the load is a generator the engine advances once per iteration:

1. mlx-lm builds the model *lazily* (arrays that read their file only when
   evaluated: milliseconds), with ``--dtype`` applied; the tokenizer loads on
   a worker thread meanwhile (no MLX in it: files and the tokenizers library);
2. each later step evaluates about ``STEP_BYTES`` of parameters (an array
   larger than that alone), so a running request waits about one step's read
   per token, not the whole load: the longest wait is the largest array's read;
3. the last step hands the evaluated model and the tokenizer to ``load_model``,
   which measures the cache and computes the fingerprint as for any load.

The weights are the very arrays ``mlx_lm.load`` would give (it builds the same
lazy model and evaluates it at once). Engine thread only (but the tokenizer).
"""

from __future__ import annotations

from concurrent.futures import Executor, wait
from pathlib import Path
from typing import Any, Generator

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm.utils import load_tokenizer

from .loaded_model import LoadedModel, load_model, tokenizer_extra

STEP_BYTES = 16 << 20  # weights evaluated per engine iteration (one array larger than this is a step of its own)
TOKENIZER_WAIT_S = 0.01  # per step, once the weights are in: a short wait instead of a busy loop beside its thread


def load_in_steps(
    spec: str,
    path: Path,
    dtype: str,
    attention: str,
    tokenizer_threads: Executor,
    step_bytes: int = STEP_BYTES,
    chat_template: str | None = None,
    kv_bits: int = 0,
    fork: str = "auto",
    linear: str = "auto",
    batch_step: str = "auto",
) -> Generator[None, None, LoadedModel]:
    """Yields between steps; returns the loaded model (raises what a load raises, at the step it happens).

    ``chat_template``: --chat-template's, replacing the model's own. ``kv_bits``, ``fork``, ``linear``, ``batch_step``:
    --kv-bits's, --fork's, --linear's and --batch-step's, as load_model's.
    """
    model, config = mlx_lm_load_model(path, lazy=True)
    tokenizer = tokenizer_threads.submit(
        load_tokenizer, path, tokenizer_extra(chat_template), config.get("eos_token_id")
    )
    try:
        if dtype != "auto":
            model.set_dtype(getattr(mx, dtype))  # lazily: each array is read and cast in its own step
        group: list[Any] = []
        group_bytes = 0
        for _, value in tree_flatten(model.parameters()):
            group.append(value)
            group_bytes += value.nbytes
            if group_bytes >= step_bytes:
                yield
                mx.eval(group)
                group, group_bytes = [], 0
        yield
        mx.eval(group)
        while not wait([tokenizer], timeout=TOKENIZER_WAIT_S).done:
            yield
    finally:
        tokenizer.cancel()  # an abandoned load leaves no work queued behind it
    # The weights are evaluated and cast already: "auto" keeps them as they are.
    return load_model(
        spec,
        dtype="auto",
        attention=attention,
        load_weights=lambda _: (model, tokenizer.result()),
        chat_template=chat_template,
        kv_bits=kv_bits,
        fork=fork,
        linear=linear,
        batch_step=batch_step,
    )
