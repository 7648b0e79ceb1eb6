"""--kv-bits on SmolLM2 (float32 on this CPU): capacity, quality and speed at full precision, 8 and 4 bits.

In process, on the engine's own pieces (load_model, the inline runner, PrefixStore, fork and capture),
each part its own run (a few minutes at most on 2 cores):

    .venv/bin/python bench/kv_bits.py capacity   # distinct 1,024-token prefixes one store budget holds
    .venv/bin/python bench/kv_bits.py quality    # greedy answers to the verify prompts, vs full precision
    .venv/bin/python bench/kv_bits.py speed      # cold prefill and warm exact hit of a 2,048-token prompt
    .venv/bin/python bench/kv_bits.py shadow     # the shadow check's drift: warm hits vs uncached runs

Capacity inserts copies of one real prefix's stored KV (its segment, captured after a real prefill at
that setting) under distinct token sequences until the store evicts: the store counts the bytes it
holds, so the count is what a daemon with that --cache-bytes keeps. Quality runs the prompts of
`prefixd verify` (client/verify_command.py: an exact repeat, a document with questions at 25/50/75%, a
two-turn chat, an edit near the end), each uncached, greedy, 32 tokens. Speed takes medians of
interleaved rounds, so load from other processes falls on every setting alike. Shadow sends the requests
of `prefixd verify` in order, through the engine's scheduler and shadow checker (CPU pass limits, one
store per setting), and prints each verify reply's top-8 log-probability difference between the warm hit
and its uncached re-run, against the shadow check's tolerance at that setting.
"""

from __future__ import annotations

from prefixd.daemon.models.blas import preload_blas

BLAS = preload_blas()  # before mlx is imported

import argparse  # noqa: E402
import inspect  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from prefixd.client.verify_command import DOCUMENT_SENTENCES, builtin_checks  # noqa: E402
from prefixd.daemon.cache import PrefixStore  # noqa: E402
from prefixd.daemon.engine.inline_runner import run_one_inline  # noqa: E402
from prefixd.daemon.engine.jobs import DONE, FAILED, GenerateJob  # noqa: E402
from prefixd.daemon.engine.model_runner import ModelRunner  # noqa: E402
from prefixd.daemon.engine.scheduler import Scheduler  # noqa: E402
from prefixd.daemon.engine.settings import CPU_PASS_DEPTH_SCALE  # noqa: E402
from prefixd.daemon.engine.shadow_run import logit_tolerance  # noqa: E402
from prefixd.daemon.kv.fork import capture_segment, fork_cache  # noqa: E402
from prefixd.daemon.kv.segments import KVSegment  # noqa: E402
from prefixd.daemon.models.loaded_model import LoadedModel, load_model  # noqa: E402
from prefixd.protocol.methods import CacheOptions, GenerateParams, PromptInput  # noqa: E402

SETTINGS = (0, 8, 4)  # --kv-bits; 0: full precision
CHUNK = 512  # the daemon's prefill chunk on a CPU
DEFAULT_MODEL = Path.home() / ".local/share/prefixd/models/SmolLM2-135M-Instruct"
TEXT = inspect.getsource(argparse)


def name(bits: int) -> str:
    return f"q{bits}" if bits else "full"


def load(model_dir: str, bits: int) -> LoadedModel:
    return load_model(model_dir, dtype="float32", kv_bits=bits)


def generate(loaded: LoadedModel, store: PrefixStore | None, prompt: PromptInput, max_tokens: int, use: bool) -> tuple:
    params = GenerateParams(prompt=prompt, max_tokens=max_tokens, cache=CacheOptions(use=use, store=use))
    job = GenerateJob("bench", 1, params, emit=lambda kind, payload: None)
    result = run_one_inline(job, loaded, store, CHUNK)
    return result, list(job.answer_tokens or [])


# -- capacity -------------------------------------------------------------------------------------


def copied(segment: KVSegment) -> KVSegment:
    def copy(layer):
        return tuple(mx.array(a) for a in layer) if isinstance(layer, tuple) else mx.array(layer)

    keys, values = [copy(k) for k in segment.keys], [copy(v) for v in segment.values]
    mx.eval(keys, values)
    return KVSegment(keys, values, segment.num_tokens, segment.bits)


def capacity(model_dir: str, budget: int, num_tokens: int = 1024, num_prefixes: int = 80) -> None:
    print(f"capacity: distinct {num_tokens}-token prefixes held in a {budget >> 20} MiB store")
    held = {}
    for bits in SETTINGS:
        loaded = load(model_dir, bits)
        tokens = loaded.tokenizer.encode(TEXT)[:num_tokens]
        cache = fork_cache(loaded.model, loaded.layout, [], None, 0)
        for start in range(0, num_tokens, CHUNK):
            loaded.model(mx.array(tokens[start : start + CHUNK])[None], cache=cache)
            mx.eval([c.state for c in cache])
        segment = capture_segment(cache, loaded.layout, 0, num_tokens)
        store = PrefixStore(max_bytes=budget, max_nodes=100_000, max_pinned_bytes=0)
        vocabulary = loaded.tokenizer.vocab_size
        for i in range(num_prefixes):  # each its own first token: no two share a byte of KV
            store.insert(loaded.fingerprint, [(tokens[0] + 1 + i) % vocabulary] + tokens[1:], 0, copied(segment), {})
        stats = store.stats().total
        held[bits] = stats.num_sequences
        print(
            f"  {loaded.kv:>14}: {segment.nbytes / num_tokens / 1024:6.1f} KiB per token stored, "
            f"{segment.nbytes / (1 << 20):5.1f} MiB per prefix; held {stats.num_sequences} "
            f"({stats.num_bytes >> 20} MiB; {stats.num_evictions} evicted)"
        )
    for bits in SETTINGS[1:]:
        print(f"  {name(bits)} holds {held[bits] / held[0]:.2f}x the prefixes of full precision")


# -- quality --------------------------------------------------------------------------------------


class _RecordingClient:
    """Takes the verify prompts off ``builtin_checks`` without a daemon; the chat's first turn answers ``reply``."""

    def __init__(self, reply: str):
        self.requests: list[dict] = []
        self.reply = reply

    def generate(self, **request):
        self.requests.append(request)
        return {"text": self.reply, "cache": {}, "verify": {"status": "match"}}


def verify_prompts(first_chat_answer: str) -> list[PromptInput]:
    client = _RecordingClient(first_chat_answer)
    list(builtin_checks(client, {"max_tokens": 32}, "bench"))
    prompts = []
    for request in client.requests:
        messages = request.get("messages")
        prompt = PromptInput(text=request.get("prompt"), messages=tuple(messages) if messages else None)
        if prompt not in prompts:  # the repeat is sent twice
            prompts.append(prompt)
    return prompts


def first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def prompt_end_logprobs(loaded: LoadedModel, prompt: PromptInput) -> np.ndarray:
    """Log-probabilities after the prompt, prefilled in the daemon's chunks."""
    tokens = loaded.encode(prompt).tokens
    cache = fork_cache(loaded.model, loaded.layout, [], None, 0)
    for start in range(0, len(tokens), CHUNK):
        logits = loaded.model(mx.array(tokens[start : start + CHUNK])[None], cache=cache)[0, -1]
    return np.array(logits - mx.logsumexp(logits))


def quality(model_dir: str, max_tokens: int = 32) -> None:
    answers: dict[int, list[list[int]]] = {}
    drift_prompt: dict[int, np.ndarray] = {}
    prompts: list[PromptInput] = []
    for bits in SETTINGS:
        loaded = load(model_dir, bits)
        if not prompts:  # the chat's second turn carries full precision's first answer, for every setting
            chat = next(p for p in verify_prompts("") if p.messages and len(p.messages) == 2)
            first, _ = generate(loaded, None, chat, max_tokens, use=False)
            prompts = verify_prompts(first["text"])
        answers[bits] = [generate(loaded, None, p, max_tokens, use=False)[1] for p in prompts]
        drift_prompt[bits] = prompt_end_logprobs(loaded, prompts[1])  # the document, about 1,000 tokens
    print(f"quality: {len(prompts)} verify prompts ({DOCUMENT_SENTENCES}-sentence documents), greedy, {max_tokens} tokens")
    top = np.argsort(-drift_prompt[0])[:8]
    for bits in SETTINGS[1:]:
        firsts = [first_difference(a, b) for a, b in zip(answers[0], answers[bits])]
        differing = [f for f in firsts if f is not None]
        mean = statistics.mean(differing) if differing else None
        drift = float(np.abs(drift_prompt[bits][top] - drift_prompt[0][top]).max())
        print(
            f"  {name(bits)}: {len(differing)}/{len(firsts)} answers differ from full precision"
            + (f"; first difference at token {sorted(differing)} (mean {mean:.1f})" if differing else "")
            + f"; after the document, the top 8 log-probabilities move by up to {drift:.3f} nats"
        )


# -- shadow ---------------------------------------------------------------------------------------


class _InProcessClient:
    """Answers builtin_checks' requests as a daemon on this CPU would: its scheduler, runner and shadow checker."""

    def __init__(self, loaded: LoadedModel, store: PrefixStore):
        self.scheduler = Scheduler(
            store,
            CHUNK,
            max_active=1,
            kv_budget=store.kv_budget,
            resolve_model=lambda _: loaded,
            runner=ModelRunner(store, CHUNK),
            pass_depth_scale=CPU_PASS_DEPTH_SCALE,
        )

    def generate(self, *, max_tokens: int, cache: dict | None = None, prompt=None, messages=None, **_) -> dict:
        params = GenerateParams(
            prompt=PromptInput(text=prompt, messages=tuple(messages) if messages else None),
            max_tokens=max_tokens,
            cache=CacheOptions(verify=bool(cache and cache.get("verify"))),
        )
        finals: list = []
        job = GenerateJob("bench", 1, params, emit=lambda kind, payload: kind in (DONE, FAILED) and finals.append(payload))
        assert self.scheduler.admit(job)
        while not finals:  # the engine's loop: a verify reply waits for its shadow run
            if self.scheduler.has_work:
                self.scheduler.step()
            if self.scheduler.shadow.has_work:
                self.scheduler.shadow.step()
        if isinstance(finals[0], Exception):
            raise finals[0]
        return finals[0]


def shadow(model_dir: str, bits_settings: tuple[int, ...], max_tokens: int = 16) -> None:
    print(f"shadow: the verify requests, greedy, {max_tokens} tokens; top-8 log-probability drift, warm hit vs uncached")
    for bits in bits_settings:
        loaded = load(model_dir, bits)
        store = PrefixStore(max_bytes=2 << 30, max_nodes=100_000, max_pinned_bytes=0)
        options = {"max_tokens": max_tokens, "temperature": 0.0}
        checks = list(builtin_checks(_InProcessClient(loaded, store), options, "bench"))
        worst = max(check.verify.get("max_logprob_difference") or 0.0 for check in checks)
        tolerance = logit_tolerance(loaded.dtype, bits)
        print(f"  {loaded.kv:>14}: max drift {worst:.3g} nats (tolerance {tolerance}); per check:")
        for check in checks:
            differs = check.verify.get("first_difference")
            print(
                f"    {check.scenario:<18} {check.status:<9} reused {check.reused_tokens:>4}, "
                f"drift {check.verify.get('max_logprob_difference')}"
                + (f", answers differ from token {differs}" if differs is not None else "")
            )


# -- speed ----------------------------------------------------------------------------------------


def speed(model_dir: str, num_tokens: int = 2048, rounds: int = 2, hits: int = 5) -> None:
    models = {bits: load(model_dir, bits) for bits in SETTINGS}
    tokens = models[0].tokenizer.encode(TEXT)[:num_tokens]
    prompt = PromptInput(tokens=tuple(tokens))
    stores = {bits: PrefixStore(max_bytes=2 << 30, max_nodes=100_000, max_pinned_bytes=0) for bits in SETTINGS}
    cold: dict[int, list[float]] = {bits: [] for bits in SETTINGS}
    warm: dict[int, list[float]] = {bits: [] for bits in SETTINGS}
    for _ in range(rounds):  # 0 (--cold-rounds 0): warm hits only
        for bits, loaded in models.items():
            started = time.perf_counter()
            generate(loaded, None, prompt, 1, use=False)
            cold[bits].append(time.perf_counter() - started)
    for bits, loaded in models.items():
        generate(loaded, stores[bits], prompt, 1, use=True)  # stores the prompt
    for _ in range(hits):
        for bits, loaded in models.items():
            started = time.perf_counter()
            result, _ = generate(loaded, stores[bits], prompt, 1, use=True)
            warm[bits].append(time.perf_counter() - started)
            assert result["cache"]["hit"] == "exact", result["cache"]
    print(f"speed: a {num_tokens}-token prompt, one answer token, medians ({rounds} cold rounds, {hits} warm)")
    for bits in SETTINGS:
        cold_part = (
            f"cold {statistics.median(cold[bits]):6.2f} s ({statistics.median(cold[bits]) / statistics.median(cold[0]):.2f}x full), "
            if rounds
            else ""
        )
        print(
            f"  {name(bits):>4}: {cold_part}"
            f"warm exact hit {statistics.median(warm[bits]) * 1000:6.1f} ms "
            f"({statistics.median(warm[bits]) / statistics.median(warm[0]):.2f}x full)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("capacity", "quality", "speed", "shadow"))
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--budget", default="256M", help="capacity: the store's budget (default 256M)")
    parser.add_argument("--cold-rounds", type=int, default=2, help="speed: cold prefills per setting (default 2)")
    parser.add_argument("--bits", default="8,4", help="shadow: the settings, 0 for full precision (default 8,4)")
    args = parser.parse_args()
    print(f"mlx {mx.__version__}, BLAS: {BLAS or 'MLX bundled'}, model {Path(args.model).name}")
    if args.part == "capacity":
        capacity(args.model, int(args.budget.rstrip("M")) << 20)
    elif args.part == "quality":
        quality(args.model)
    elif args.part == "shadow":
        shadow(args.model, tuple(int(b) for b in args.bits.split(",")))
    else:
        speed(args.model, rounds=args.cold_rounds)


if __name__ == "__main__":
    main()
