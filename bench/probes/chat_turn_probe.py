#!/usr/bin/env python
"""Where a warm chat turn's prefill time goes, on the engine's own path, turn by turn.

    python bench/probes/chat_turn_probe.py MODEL_DIR [--turns 10] [--system-tokens 980] [--json OUT]

On the H200 (bench/results/gpu/2026-12-04-d, run 2, full) each warm turn of
compare.py's 10-turn chat prefilled 20-23 tokens, and the daemon's prefill
time was 50-91 ms against 11.5 ms for an exact repeat, although most of
those tails had a length an earlier turn had run. This runs such a chat in
process through the scheduler (inline_runner, with a prefix store, the
load-time warm-up first), each operation of the prefill evaluated on its own
and timed: the fork of the stored segments (with their count), each forward
pass (with its length and depth), the capture and insert into the store,
the first token. Every turn is run twice: the second is an exact repeat of
the same prompt, the first a real next turn.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

import mlx.core as mx  # noqa: E402

from prefixd.daemon.cache import PrefixStore  # noqa: E402
from prefixd.daemon.engine import model_runner, prefill, warm_up  # noqa: E402
from prefixd.daemon.engine.inline_runner import run_one_inline  # noqa: E402
from prefixd.daemon.engine.jobs import GenerateJob  # noqa: E402
from prefixd.daemon.models.loaded_model import load_model  # noqa: E402
from prefixd.protocol.methods import GenerateParams, PromptInput  # noqa: E402

QUESTIONS = ["What is this project?", "How do I start it as a service?", "What does the cache map say?",
             "Which models work?", "How fast is a warm hit on a GPU, roughly?", "And on a CPU?",
             "Thanks, one more: GGUF?", "And the Neovim plugin?", "Last one: the OpenAI front?",
             "What about Ollama's API?", "And Anthropic's?"]

events: list[tuple[str, float, str]] = []


def timed(name: str, fn, describe=lambda *a, **k: ""):
    def wrapper(*args, **kwargs):
        mx.synchronize()
        started = time.perf_counter()
        result = fn(*args, **kwargs)
        mx.eval(result) if isinstance(result, mx.array) else None
        if isinstance(result, list):
            mx.eval([c.state for c in result if hasattr(c, "state")])
        mx.synchronize()
        events.append((name, (time.perf_counter() - started) * 1000, describe(*args, **kwargs)))
        return result
    return wrapper


class TimedModel:
    """The model, each call evaluated and timed with its length and the cache's depth."""

    def __init__(self, model):
        self._model = model

    def __call__(self, inputs, cache=None, **kwargs):
        depth = next((c.offset for c in cache or [] if hasattr(c, "offset") and isinstance(c.offset, int)), "?")
        mx.synchronize()
        started = time.perf_counter()
        out = self._model(inputs, cache=cache, **kwargs)
        mx.eval(out)
        mx.synchronize()
        events.append(("forward", (time.perf_counter() - started) * 1000, f"{inputs.shape[1]} tokens at {depth}"))
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system-tokens", type=int, default=980)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json")
    args = parser.parse_args()
    loaded = load_model(args.model)
    print(f"device {mx.default_device()}, mlx {mx.__version__}, attention {loaded.attention}")
    print(f"warm-up {warm_up.run_all(warm_up.warm_up_steps(loaded)):.2f} s")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    system_tokens = loaded.tokenizer.encode(readme)[: args.system_tokens]
    chat = [{"role": "system", "content": loaded.tokenizer.decode(system_tokens)}]
    store = PrefixStore(max_bytes=8 << 30, max_nodes=100_000, max_pinned_bytes=1 << 28)

    prefill.fork_cache = timed("fork", prefill.fork_cache,
                               lambda model, layout, segments, snapshot, depth: f"{len(segments)} segments, {depth} tokens")
    prefill.store_progress = timed("store", prefill.store_progress, lambda seq, store, cache, tokens: f"to {len(tokens)}")
    model_runner.sample_first = timed("first token", model_runner.sample_first)
    object.__setattr__(loaded, "model", TimedModel(loaded.model))

    turns = []
    for turn, question in enumerate(QUESTIONS[: args.turns]):
        chat.append({"role": "user", "content": question})
        for kind in ("turn", "repeat"):
            events.clear()
            params = GenerateParams(prompt=PromptInput(messages=tuple(chat)), max_tokens=args.max_tokens)
            reply = run_one_inline(GenerateJob("probe", 1, params, emit=lambda k, p: None), loaded, store, 2048)
            prefill_events = []
            for name, ms, what in events:
                if name == "forward" and what.startswith("1 tokens") and prefill_events and \
                        prefill_events[-1][0] == "first token":
                    break  # the decode steps begin
                prefill_events.append((name, ms, what))
            row = {"turn": turn + 1, "kind": kind, "prompt_tokens": reply["cache"]["prompt_tokens"],
                   "reused": reply["cache"]["reused_tokens"], "prefill_ms": reply["timings"].get("prefill_ms"),
                   "ops": [{"op": n, "ms": round(ms, 2), "what": w} for n, ms, w in prefill_events]}
            turns.append(row)
            print(f"turn {turn + 1:2d} {kind:6s} {row['prompt_tokens']:5d} tokens, reused {row['reused']:5d}, "
                  f"prefill {row['prefill_ms']:.1f} ms: "
                  + "; ".join(f"{n} {ms:.1f} ({w})" if w else f"{n} {ms:.1f}" for n, ms, w in prefill_events))
        chat.append({"role": "assistant", "content": reply["text"]})
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(mx.default_device()), "turns": turns}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
