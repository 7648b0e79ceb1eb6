"""The model runner: the engine loop's only MLX code. It runs a StepPlan and says what happened.

Lookups and forks (prefill.start_prefill), prefill passes (prefill.prefill_step),
the first answer token (sampled from the prompt's last logits, under the
request's grammar mask), every model's decode batch (batch_decoder.py), rows
leaving it, and answers stored for the next turn. It decides nothing: which
sequence runs, and what a token means for it, are the scheduler's. Work that
raises is reported in the result (logged here, with its traceback) and the
rest of the plan still runs. Engine thread only.
"""

from __future__ import annotations

from typing import Any, Callable

import structlog

from ...protocol.errors import RpcError
from ..cache import PrefixStore
from ..kv.fork import capture_snapshot, start_fork_copy
from .batch_decoder import BatchDecoder, sample_first
from .faults import fault_point
from .jobs import internal_error
from .prefill import (
    last_token_logits,
    prefill_step,
    read_prompt_in_place,
    start_prefill,
    store_progress,
    store_prompt_end,
)
from .sequence_state import SequenceState
from .ssm_answers import store_replayed_answer
from .step_plan import Finish, Join, Prefilled, PrefillPass, StartPrefill, StepPlan, StepResult

log = structlog.get_logger("prefixd.runner")


class ModelRunner:
    def __init__(self, store: PrefixStore | None, chunk_size: int, decode_stream: Any = None):
        """``decode_stream``: the stream every decode batch runs on; None: each gets one of its own (batch_decoder.py)."""
        self.store = store
        self.chunk_size = chunk_size
        self.decode_stream = decode_stream
        self._decoders: dict[str, BatchDecoder] = {}

    def run(self, plan: StepPlan) -> StepResult:
        result = StepResult()
        for seq in plan.drops:
            self._leave_batch(seq, result)
        for finish in plan.finishes:
            self._guard(finish.seq, result, lambda f=finish: self._finish(f, result))
        for start in plan.starts:
            self._guard(start.seq, result, lambda s=start: self._start(s, result))
        for join in plan.joins:
            self._guard(join.seq, result, lambda j=join: self._join(j))
        for name in plan.decode:
            self._decode(name, result)
        for work in plan.prefill:
            self._guard(work.seq, result, lambda w=work: self._prefill(w, result))
        return result

    # -- prompts -----------------------------------------------------------------------------

    def _start(self, start: StartPrefill, result: StepResult) -> None:
        start_prefill(start.seq, self.store, self.chunk_size)
        result.started.append(start)

    def _prefill(self, work: PrefillPass, result: StepResult) -> None:
        """The pass; then, for a prompt that is done, its first token (no second pass on an attention model).

        An exact repeat whose stored prompt kept its logits runs nothing: its
        first token comes from them (prefill.store_prompt_end).
        """
        seq = work.seq
        logits = prefill_step(seq, self.store, work) if work.stops else None
        token = None
        if work.samples_first:
            fault_point("first_token")
            if logits is None:
                logits = seq.stored_logits if seq.stored_logits is not None else last_token_logits(seq)
            token = sample_first(seq, logits)
            if seq.stored_logits is not None and seq.reused:
                start_fork_copy(seq.cache)  # not before sampling: the token would wait for the copy
            store_prompt_end(seq, self.store, logits)
            if work.reads_prompt_in_place:
                read_prompt_in_place(seq, self.store)
        elif work.stores_last_logits:  # a warm-only request: the request that follows will sample from them
            store_prompt_end(seq, self.store, last_token_logits(seq))
        result.prefilled.append(Prefilled(seq, token, logits))

    # -- decode batches ------------------------------------------------------------------------

    def _join(self, join: Join) -> None:
        seq = join.seq
        decoder = self._decoders.get(seq.loaded.name)
        if decoder is None:
            decoder = self._decoders[seq.loaded.name] = BatchDecoder(
                seq.loaded.model,
                seq.loaded.eos_token_ids,
                stream=self.decode_stream,
                ragged=seq.loaded.batch_step == "ragged",
            )
        decoder.add(seq, [join.token], join.max_new_tokens)

    def _decode(self, name: str, result: StepResult) -> None:
        decoder = self._decoders.get(name)
        if decoder is None or not len(decoder):
            return
        try:
            result.tokens.extend(decoder.step())
        except Exception as exc:
            log.exception("decode_step_failed", num_rows=len(decoder))
            self._drop_decoder(name, internal_error(exc, "the decode step failed"), result)

    def _leave_batch(self, seq: SequenceState, result: StepResult) -> None:
        """Take a failed sequence's row out of its batch; a batch that cannot let go of it is dropped."""
        decoder = self._decoders.get(seq.loaded.name)
        if decoder is None or not decoder.holds(seq):
            return
        try:
            decoder.remove(seq)
        except Exception as exc:
            log.exception("batch_remove_failed", request_id=seq.job.request_id)
            self._drop_decoder(seq.loaded.name, internal_error(exc), result)

    def _drop_decoder(self, name: str, err: RpcError, result: StepResult) -> None:
        """Forget a broken batch: its rows fail (the scheduler's part); the next joiner starts a new one."""
        self._decoders.pop(name, None)
        result.dropped_models.append((name, err))

    def forget_model(self, name: str) -> None:
        """Drop an unloaded model's decode batch (empty: its jobs pinned it), so a reload gets one for its new weights."""
        decoder = self._decoders.pop(name, None)
        if decoder is not None and len(decoder):
            raise RuntimeError(f"model {name} was unloaded with {len(decoder)} rows decoding")

    def reset(self) -> None:
        """Forget every batch (the engine failed every running sequence)."""
        self._decoders.clear()

    # -- the end of a sequence -------------------------------------------------------------------

    def _finish(self, finish: Finish, result: StepResult) -> None:
        fault_point("finish")
        cache = finish.cache
        if finish.leaves_batch:
            decoder = self._decoders.get(finish.seq.loaded.name)
            cache = decoder.remove(finish.seq) if decoder is not None else None
        if cache is not None:
            try:
                self._store_answer(finish.seq, cache)
            except Exception:  # the answer is done: a cache that could not keep it costs reuse, not the reply
                log.exception("store_answer_failed", request_id=finish.seq.job.request_id)
        result.finished.append(finish)

    def _store_answer(self, seq: SequenceState, cache: list[Any]) -> None:
        """Keep prompt + answer, so the next turn of a chat reuses the answer it just got.

        A prompt cancelled before its answer keeps what its prefill computed: labelled a chunk there.
        """
        fault_point("store_answer")
        layout = seq.loaded.layout
        if not layout.attention_layers:
            if layout.state_layers:  # pure SSM: no offset to read the depth from, so the answer is run again
                store_replayed_answer(seq, self.store, self.chunk_size)
            return
        depth = cache[layout.attention_layers[0]].offset
        tokens = seq.all_tokens()[:depth]
        if len(tokens) != depth:
            return
        seq.checkpoints[depth] = ("answer-end" if seq.generated else "chunk", capture_snapshot(cache, layout))
        store_progress(seq, self.store, cache, tokens)

    @staticmethod
    def _guard(seq: SequenceState, result: StepResult, action: Callable[[], None]) -> None:
        try:
            action()
        except RpcError as err:
            result.failures.append((seq, err))
        except Exception as exc:
            log.exception("sequence_failed", request_id=seq.job.request_id, phase=seq.phase.value)
            result.failures.append((seq, internal_error(exc)))
