"""Prompts become token ids here, on worker threads, before a job reaches the engine.

Templating a chat and tokenizing a long text take time linear in their size
(seconds for megabytes); done on the engine thread they would stall every
other client's decoding. A small thread pool owned by the front does it
instead, through each model's thread-safe ``PromptEncoder``; the engine gets
ready token ids. A prompt that cannot fit the context is refused here, before
the expensive part (see PromptEncoder.min_tokens).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ...protocol.methods import PromptInput
from ..engine.engine import Engine
from ..models.loaded_model import ModelCard
from ..models.names import model_not_found
from ..models.prompt_encoding import EncodedPrompt

NUM_ENCODE_THREADS = 2
T = TypeVar("T")


class PromptIntake:
    def __init__(self, engine: Engine, num_threads: int = NUM_ENCODE_THREADS):
        self.engine = engine
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="prefixd-encode")

    def card(self, model: str | None) -> ModelCard:
        """The loaded model a request names (the default one when it names none)."""
        name = model or self.engine.default_model
        card = self.engine.cards.get(name) if name else None
        if card is None:
            raise model_not_found(name, self.engine.model_names)
        return card

    async def encode(
        self, model: str | None, prompt: PromptInput, generates: bool | None = True
    ) -> tuple[ModelCard, EncodedPrompt]:
        """The model's card and the encoded prompt (``generates``: see PromptEncoder.encode)."""
        card = self.card(model)
        loop = asyncio.get_running_loop()
        encoded = await loop.run_in_executor(self._pool, card.encoder.encode, prompt, generates)
        return card, encoded

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Other tokenizer work (a model's FIM tokens, a count) on the same threads, off the loop and the engine."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
