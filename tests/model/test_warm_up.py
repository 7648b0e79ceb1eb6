"""The load-time warm-up (engine/warm_up.py) runs on every cache layout and leaves the model as it found it.

It forks made-up stored prefixes of 1 to WARM_SEGMENTS segments and runs the
last token's pass on each: an attention-only model, a hybrid one (state
snapshots), sliding-window layers, and a state-only model. The same prompt
answers the same afterwards, token for token.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from prefixd.daemon.engine import batch_decoder, warm_up
from prefixd.daemon.models.loaded_model import load_model


@pytest.fixture(params=["llama", "lfm2", "gemma3", "mamba"])
def loaded(request):
    return load_model(str(request.getfixturevalue(f"tiny_{request.param}_dir")))


def greedy(model, tokens: list[int], count: int) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens)[None], cache=cache)[:, -1, :]
    out = []
    for _ in range(count):
        out.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array(out[-1:])[None], cache=cache)[:, -1, :]
    return out


def test_the_warm_up_forks_every_segment_count_and_changes_no_answer(loaded):
    prompt = [(i * 29) % 900 + 30 for i in range(50)]  # past the tiny gemma3's 32-token window
    before = greedy(loaded.model, prompt, 8)
    steps = warm_up.warm_up_steps(loaded)
    yields = 0
    while True:
        try:
            next(steps)
            yields += 1
        except StopIteration as done:
            seconds = done.value
            break
    if loaded.layout.is_supported:
        assert yields == warm_up.WARM_SEGMENTS + 3  # the prefill, a fork per segment count, the grouped forks, the decode paths
        assert seconds > 0
    else:
        assert yields == 0 and seconds == 0.0
    assert greedy(loaded.model, prompt, 8) == before


def test_the_decode_batch_is_warmed_through_joins_a_row_ending_inside_it_a_removal_and_the_return_to_solo(
        tiny_llama_dir, tiny_lfm2_dir, monkeypatch):
    """What a first burst of concurrent requests would otherwise meet cold on a GPU (bench/probes/decode_batch_probe.py)."""
    seen: list[tuple[str, int]] = []

    class Recording(batch_decoder.BatchDecoder):
        def step(self):
            rows = len(self)
            events = super().step()
            seen.extend(("ended inside the batch", rows) for e in events if e.done_by_batch and rows > 1)
            return events

        def remove(self, seq):
            seen.append(("removed", len(self)))
            return super().remove(seq)

        def _leave_batch_alone(self):
            super()._leave_batch_alone()
            if self._solo is not None:
                seen.append(("back to solo", len(self)))

    monkeypatch.setattr(warm_up, "BatchDecoder", Recording)
    for path, hybrid in ((tiny_llama_dir, False), (tiny_lfm2_dir, True)):
        seen.clear()
        warm_up.run_all(warm_up.warm_up_steps(load_model(str(path))))
        assert ("ended inside the batch", 3) in seen
        assert ("removed", 2) in seen
        assert (("back to solo", 1) in seen) is not hybrid  # a conv state cannot be trimmed: hybrids stay in the batch


@pytest.mark.parametrize("mode, on_gpu, wanted", [
    ("auto", True, True), ("auto", False, False), ("on", False, True), ("off", True, False)])
def test_auto_warms_up_on_a_gpu_only(mode, on_gpu, wanted):
    assert warm_up.resolve_mode(mode, on_gpu) is wanted


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="auto, on, off"):
        warm_up.resolve_mode("always", True)
