"""Tool calls through a generate: the forced call's grammar on the way in, the calls read out of the answer on the way out.

Every front's jobs pass through ``Handlers.run_job``, and a request with
``tools`` through here. Going in, a ``tool_choice`` that forces a call
("required", or a named function) becomes the request's constraint: the
forced-call grammar in the model's own tool-call format
(grammar/tool_call_grammar.py), its markers written as the special tokens
they are in the model's added vocabulary; it compiles on the engine's grammar
threads like any constraint. Coming back, the answer's text is read with the
model's format (models/tool_call_format.py; Hermes for a model on prefixd's
generic tool section, models/generic_tools.py): streamed chunks carry text outside
the calls and each call once it is whole, never the call markup; the reply
gets ``tool_calls`` and finish reason "tool_calls". ``tool_choice`` "none"
leaves the answer as text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import structlog

from ...protocol.errors import ErrorCode, RpcError
from ...protocol.methods import FINISH_STOP, GenerateParams
from ...protocol.tools import FINISH_TOOL_CALLS, NONE
from ..engine.jobs import GenerateJob
from ..grammar import forced_tool_call
from ..models.loaded_model import ModelCard
from ..models.generic_tools import call_format
from ..models.prompt_encoding import EncodedPrompt
from ..models.tool_call_format import ToolCall, ToolCallFormat
from ..models.tool_call_stream import ToolCallStream
from .prompt_intake import PromptIntake

log = structlog.get_logger("prefixd.request")


@dataclass(frozen=True)
class ModelTools:
    """What a model's tokenizer says of tool calls: its format (None: none prefixd reads) and its added tokens."""

    call_format: ToolCallFormat | None
    added_tokens: frozenset[str]


class ToolCalls:
    """The tool-call side of the fronts' jobs; one per Handlers, each model's ModelTools read once."""

    def __init__(self, intake: PromptIntake):
        self._intake = intake
        self._models: dict[str, ModelTools] = {}  # fingerprint -> what its tokenizer says

    async def prepare(
        self, params: GenerateParams, card: ModelCard, msgid: int | None
    ) -> tuple[GenerateParams, "ToolCallReader | None"]:
        """The params to run (with the forced call's constraint when the choice forces one) and the answer's reader.

        No reader when the request has no tools or its ``tool_choice`` is
        "none". INVALID_PARAMS when the model's tool-call format is not one
        prefixd reads, or (forcing a call) has no grammar here.
        """
        tools = params.prompt.tools
        if not tools or params.tool_choice.mode == NONE:
            return params, None
        model = self._models.get(card.fingerprint)
        if model is None:  # the tokenizer is read on the encode threads, never on the loop while they encode
            model = self._models[card.fingerprint] = await self._intake.run(read_model_tools, card)
        if model.call_format is None:
            raise RpcError(
                ErrorCode.INVALID_PARAMS,
                f"model {card.name}'s chat template writes tool calls in no "
                "format prefixd reads, so its calls could not be returned",
            )
        if params.tool_choice.forces_call:
            if params.constraint is not None:
                raise RpcError(
                    ErrorCode.INVALID_PARAMS,
                    "a 'tool_choice' that forces a call constrains the answer "
                    "itself: it cannot go with a constraint of the answer's shape",
                )
            try:
                constraint = forced_tool_call(tools, model.call_format, params.tool_choice.function, model.added_tokens)
            except ValueError as exc:
                raise RpcError(
                    ErrorCode.INVALID_PARAMS,
                    f"'tool_choice' cannot force a call on model {card.name}: {exc}",
                    {"param": "tool_choice"},
                ) from None
            params = dataclasses.replace(params, constraint=constraint)
        return params, ToolCallReader(model.call_format, msgid, params.stream)

    async def remember_answer(self, card: ModelCard, job: GenerateJob, reply: dict[str, Any]) -> None:
        """Before the reply goes out: the next turn, holding this answer, is encoded with the answer's own tokens.

        An agent sends the answer straight back (its calls as the assistant
        message's ``tool_calls``), and the template renders it as the model
        wrote it; tokenized afresh, its tokens could differ from the ones the
        model sampled (under a grammar above all), and the cached turn would
        stop matching there. Awaited so that a client's next turn cannot
        outrun it; a failure costs reuse, never the reply.
        """
        if (
            reply["finish_reason"] not in (FINISH_STOP, FINISH_TOOL_CALLS)
            or not job.answer_tokens
            or job.encoded is None
        ):
            return  # an answer cut short is not sent back whole
        try:
            await self._intake.run(card.encoder.remember_answer, job.encoded, job.answer_tokens)
        except Exception:
            log.exception("remember_answer_failed", request_id=job.request_id)


def read_model_tools(card: ModelCard) -> ModelTools:
    tokenizer = card.encoder.tokenizer
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # an mlx-lm TokenizerWrapper: the Hugging Face tokenizer inside
    decoder = getattr(hf, "added_tokens_decoder", None) or {}
    # llguidance takes every added token as a special one, written <name> in a grammar.
    return ModelTools(call_format(tokenizer), frozenset(added.content for added in decoder.values()))


def with_tools_path(result: dict[str, Any], encoded: EncodedPrompt | None) -> dict[str, Any]:
    """The reply's cache map says how a chat's tools went into the prompt: ``tools`` "template" or "generic"."""
    if encoded is None or encoded.tools is None:
        return result
    return {**result, "cache": {**result["cache"], "tools": encoded.tools}}


class ToolCallReader:
    """One answer read for tool calls: its chunks rewritten as they come, then its reply."""

    def __init__(self, call_format: ToolCallFormat, msgid: int | None, streams: bool):
        self.msgid = msgid  # the request's, for the chunks' ``id``
        self.streams = streams  # the request streams: the rest of the answer goes out as one last chunk
        self._stream = ToolCallStream(call_format)
        self._pieces: list[str] = []  # the answer's text outside the calls
        self._calls: list[ToolCall] = []
        self._num_fed_chars = 0
        self._next_chunk_index = 0

    def chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A stream chunk with its text outside calls only, and ``tool_calls`` for each call it completes."""
        self._num_fed_chars += len(chunk["text"])
        self._next_chunk_index = chunk["index"] + 1
        return self._rewritten(chunk, self._stream.feed(chunk["text"]))

    def finish(self, result: dict[str, Any], on_chunk: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
        """The reply with ``tool_calls``; what the stream still held goes to ``on_chunk`` first, as one last chunk."""
        unseen = result["text"][self._num_fed_chars :]  # all of it when nothing was streamed
        num_calls = len(self._calls)
        tail = self._rewritten(
            {"id": self.msgid, "text": "", "tokens": [], "index": self._next_chunk_index},
            self._stream.feed(unseen) + self._stream.finish(),
        )
        if self.streams and on_chunk is not None and (tail["text"] or len(self._calls) > num_calls):
            on_chunk(tail)
        text = "".join(self._pieces)
        reply = {
            **result,
            "text": text.strip() if self._calls else text,
            "tool_calls": [call.to_openai() for call in self._calls],
        }
        if self._calls and result["finish_reason"] == FINISH_STOP:
            reply["finish_reason"] = FINISH_TOOL_CALLS
        return reply

    def _rewritten(self, chunk: dict[str, Any], events: list) -> dict[str, Any]:
        text = "".join(event for event in events if isinstance(event, str))
        self._pieces.append(text)
        out = {**chunk, "text": text}
        calls = [event for event in events if isinstance(event, ToolCall)]
        if calls:
            out["tool_calls"] = [{"index": len(self._calls) + n, **call.to_openai()} for n, call in enumerate(calls)]
            self._calls += calls
        return out
