#!/usr/bin/env python
"""Warm chat-turn prefill on a hybrid model: short stops merged into one pass, against a pass per stop.

    python bench/hybrid_chat_tail.py MODEL_DIR [--turns 7]

A hybrid (conv/SSM + attention) model snapshots its state only where a
forward pass ends, so prefill.next_stops used to end a pass at every stop of a
chat turn's tail: the previous answer's closing tokens, the new message and
the assistant header, three short passes. Since 71e8090 stops closer than
HYBRID_MIN_PASS_TOKENS apart share a pass. This runs two identical chats in one
process through the engine's own scheduler (inline_runner), turn by turn
alternating which goes first, one with the merge (16) and one without (0),
and prints each warm turn's prefill time (reply timings) and the medians.
Build an LFM2-350M-shaped model with the GPU kit's mkmodel.py
(`DTYPE=float32 python mkmodel.py /tmp/lfm2cpu <SmolLM2 dir> lfm2`) or use any hybrid model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

from prefixd.daemon.cache import PrefixStore  # noqa: E402
from prefixd.daemon.engine import prefill  # noqa: E402
from prefixd.daemon.engine.inline_runner import run_one_inline  # noqa: E402
from prefixd.daemon.engine.jobs import GenerateJob  # noqa: E402
from prefixd.daemon.models.loaded_model import load_model  # noqa: E402
from prefixd.protocol.methods import GenerateParams, PromptInput  # noqa: E402

QUESTIONS = ["What is this project?", "How do I start it as a service?", "What does the cache map say?",
             "Which models work?", "How fast is a warm hit on a GPU, roughly?", "And on a CPU?",
             "Thanks, one more: GGUF?", "And the Neovim plugin?", "Last one: the OpenAI front?"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--turns", type=int, default=7)
    args = parser.parse_args()
    loaded = load_model(args.model, dtype="float32")
    if not loaded.layout.is_hybrid:
        print(f"{args.model} is not a hybrid model: every stop is a label in one pass there already")
        return 2
    system = (Path(__file__).resolve().parent.parent / "README.md").read_text()[:2400]
    gaps = (prefill.HYBRID_MIN_PASS_TOKENS, 0)
    chats = {gap: [{"role": "system", "content": system}] for gap in gaps}
    stores = {gap: PrefixStore(max_bytes=4 << 30, max_nodes=100_000, max_pinned_bytes=1 << 28) for gap in gaps}
    warm: dict[int, list[float]] = {gap: [] for gap in gaps}
    for turn, question in enumerate(QUESTIONS[: args.turns]):
        for gap in (gaps if turn % 2 else gaps[::-1]):
            prefill.HYBRID_MIN_PASS_TOKENS = gap
            chats[gap].append({"role": "user", "content": question})
            params = GenerateParams(prompt=PromptInput(messages=list(chats[gap])), max_tokens=8)
            result = run_one_inline(GenerateJob("bench", 1, params, lambda kind, payload: None), loaded, stores[gap])
            chats[gap].append({"role": "assistant", "content": result["text"]})
            prefill_ms = result["timings"]["prefill_ms"]
            if turn:
                warm[gap].append(prefill_ms)
            print(f"turn {turn} min gap {gap:2d}: prefill {prefill_ms:8.1f} ms, reused {result['cache']['reused_tokens']}"
                  f" of {result['usage']['prompt_tokens']} ({result['cache'].get('checkpoint')})", flush=True)
    prefill.HYBRID_MIN_PASS_TOKENS = gaps[0]
    merged, per_stop = (statistics.median(warm[gap]) for gap in gaps)
    print(f"warm turns, median prefill: stops merged {merged:.1f} ms, a pass per stop {per_stop:.1f} ms "
          f"(ratio {merged / per_stop:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
