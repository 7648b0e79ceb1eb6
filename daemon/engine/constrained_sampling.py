"""Constrained decoding on the engine thread: a request's grammar masks its logits before every sample.

Every sampling path goes through ``mask_logits``: the first answer token
(batch_decoder.sample_first, from the prompt's last logits), the solo path
(solo_decoder.py) and the batch, where each constrained row gets a logits
processor of mlx-lm's BatchGenerator (``batch_processor``): one masked row per
constrained sequence, unconstrained rows untouched. Disallowed tokens get
-inf, so greedy and temperature/top-p sampling alike pick only what the
grammar allows; the end tokens are allowed only where the grammar accepts.
After each token the scheduler calls ``after_token``: a grammar that is
complete ends the answer (finish_reason "stop"), one that failed fails that
request only (ConstraintError), never the batch or the engine thread.

Constraints compile off the engine thread (Engine.submit, on its grammar
threads, into ``job.grammar``); the inline runner, with no such threads,
compiles at admission (``start_grammar``).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

import mlx.core as mx

from ..grammar import ConstraintError, GrammarCompiler, GrammarState
from ..models.loaded_model import LoadedModel
from .jobs import GenerateJob

_compilers: dict[tuple[str, str], GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(loaded: LoadedModel) -> GrammarCompiler:
    """The model's grammar compiler (its LLTokenizer and compiled grammars), made once; any thread."""
    key = (loaded.name, loaded.fingerprint)
    with _compilers_lock:
        compiler = _compilers.get(key)
        if compiler is None:
            compiler = _compilers[key] = GrammarCompiler(loaded.tokenizer, loaded.eos_token_ids, loaded.name)
        return compiler


def start_grammar(job: GenerateJob, loaded: LoadedModel) -> None:
    """Give a constrained job its answer's matcher (``job.grammar``) unless it has one; raises ConstraintError."""
    if job.params.constraint is None or job.grammar is not None or job.warm_only:
        return
    job.grammar = compiler_for(loaded).start(job.params.constraint)


def mask_logits(state: GrammarState, logits: mx.array, index: int | None = None, token: int | None = None) -> mx.array:
    """``logits`` (1 x vocab) with what the grammar forbids next at -inf.

    ``index``/``token``: the answer token just fed to the model (index -1 or
    None: none, e.g. the prompt's last token), fed to the matcher first.
    """
    if index is not None and token is not None:
        state.consume(index, token)
    allowed = mx.array(state.allowed(logits.shape[-1]))
    return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))


def batch_processor(state: GrammarState, last_input_index: int) -> Callable[[mx.array, mx.array], mx.array]:
    """A BatchGenerator logits processor for one constrained row.

    The generator calls it once per step with the row's tokens so far (its
    last one the step's input) and the row's logits. ``last_input_index`` is
    the answer index of the row's first input (-1: a prompt token), so call
    ``n`` feeds answer token ``last_input_index + n``.
    """
    calls = itertools.count()

    def process(context: mx.array, logits: mx.array) -> mx.array:
        index = last_input_index + next(calls)
        mx.async_eval(logits)  # the forward pass runs while the mask is computed
        token = int(context[-1].item()) if index >= 0 else None
        return mask_logits(state, logits, index, token)

    return process


def after_token(seq: Any) -> bool:
    """Feed the sequence's newest token to its grammar; True when the grammar is complete.

    Raises ConstraintError when the grammar failed on this answer (a parser
    limit, a token it refused): that request fails, the rest go on.
    """
    state: GrammarState | None = seq.grammar
    if state is None or not seq.generated:
        return False
    index = len(seq.generated) - 1
    state.consume(index, seq.generated[index])
    if state.error is not None:
        raise ConstraintError(f"'constraint' failed at answer token {index}: {state.error}", "constraint")
    return state.is_finished
