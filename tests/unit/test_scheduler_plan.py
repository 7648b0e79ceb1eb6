"""The scheduler's decisions, on a fake runner: no model, no device.

The fake runner does what the plan says to plain counters (a prompt's
position, a row's tokens left) and advances a fake clock by what each kind
of work costs, so the tests see which sequence got which pass, in order,
and what each request was answered.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from prefixd.daemon.cache import KvBudget
from prefixd.daemon.engine import scheduler as scheduler_module
from prefixd.daemon.engine.batch_decoder import StepEvent
from prefixd.daemon.engine.jobs import CHUNK, DONE, FAILED, GenerateJob
from prefixd.daemon.engine.prefill import plan_prefill
from prefixd.daemon.engine.scheduler import KV_GROWTH_STEP_TOKENS, Scheduler
from prefixd.daemon.engine.sequence_state import Phase
from prefixd.daemon.engine.step_plan import Prefilled, StepPlan, StepResult
from prefixd.daemon.models.prompt_encoding import EncodedPrompt
from prefixd.protocol.errors import ErrorCode, RpcError
from prefixd.protocol.methods import parse_generate

CHUNK_SIZE = 256
EOS = 0
ANSWER_TOKEN = 7  # what the fake model always samples
DECODE_STEP_S = 0.01
PASS_S = 0.05


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeDetokenizer:
    last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = "a"

    def finalize(self) -> None:
        self.last_segment = ""


class FakeModel:
    """What SequenceState and the scheduler read of a LoadedModel."""

    name = "fake"
    context_length = 8192
    kv_bytes_per_token = 1
    kv = "float32"
    state_bytes_per_sequence = 0
    batch_step = "padded"
    eos_token_ids = frozenset({EOS})
    layout = SimpleNamespace(is_hybrid=False, shares_forks=False, window_layers=())
    encoder = SimpleNamespace(check_length=lambda num_tokens, generates: None)
    tokenizer = property(lambda self: SimpleNamespace(detokenizer=FakeDetokenizer()))


class FakeRunner:
    """Runs plans on counters. ``stored``: what a lookup finds (prompts stored so far, to their stored depth)."""

    def __init__(self, clock: FakeClock):
        self.clock = clock
        self.plans: list[StepPlan] = []
        self.passes: list[str] = []  # the client of every prefill pass, in order
        self.pass_tokens: list[int] = []  # how many tokens each fed
        self.rows: dict[Any, int] = {}  # decoding sequence -> tokens it may still get
        self.fail_pass_of: set[str] = set()
        self.stored: list[Any] = []

    def run(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        result = StepResult()
        for seq in plan.drops:
            self.rows.pop(seq, None)
        for finish in plan.finishes:
            if finish.leaves_batch:
                self.rows.pop(finish.seq, None)
            result.finished.append(finish)
        for start in plan.starts:
            seq = start.seq
            seq.reused = self._lookup(seq.tokens) if seq.uses_cache else 0
            seq.position = seq.stored_upto = seq.reused
            seq.plan = plan_prefill(seq.reused, len(seq.tokens) - 1, CHUNK_SIZE, seq.prompt)
            self.stored.append(seq)
            result.started.append(start)
        for join in plan.joins:
            self.rows[join.seq] = join.max_new_tokens
        for _ in plan.decode:
            self.clock.now += DECODE_STEP_S
            for seq in list(self.rows):
                self.rows[seq] -= 1
                done = self.rows[seq] == 0
                if done:
                    del self.rows[seq]
                result.tokens.append(StepEvent(seq, ANSWER_TOKEN, done, None))
        for work in plan.prefill:
            seq = work.seq
            if seq.job.request_id in self.fail_pass_of:
                result.failures.append((seq, RpcError(ErrorCode.INTERNAL, "the pass failed")))
                continue
            if work.stops:
                self.clock.now += PASS_S
                self.passes.append(seq.job.client_id)
                self.pass_tokens.append(work.run_to - seq.position)
                while seq.plan and seq.plan[0][0] <= work.stops[-1][0]:
                    seq.plan.pop(0)
                seq.position = work.run_to
                seq.stored_upto = work.stops[-1][0]
            result.prefilled.append(Prefilled(seq, ANSWER_TOKEN if work.samples_first else None))
        return result

    def _lookup(self, tokens: list[int]) -> int:
        best = 0
        for other in self.stored:
            shared = 0
            for a, b in zip(tokens[: min(len(tokens) - 1, other.stored_upto)], other.tokens):
                if a != b:
                    break
                shared += 1
            best = max(best, shared)
        return best

    def forget_model(self, name: str) -> None:
        pass

    def reset(self) -> None:
        self.rows.clear()


class Replies:
    def __init__(self):
        self.events: dict[str, list[tuple[str, Any]]] = {}

    def job(self, name: str, num_tokens: int, max_tokens: int = 4, first_token: int = 1000, lane: str | None = None,
            **params) -> GenerateJob:
        tokens = list(range(first_token, first_token + num_tokens))
        self.events[name] = []
        return GenerateJob(name, 1, parse_generate({"prompt": "unused", "max_tokens": max_tokens, **params}),
                           lambda kind, payload: self.events[name].append((kind, payload)),
                           encoded=EncodedPrompt(tokens), lane=lane)

    def final(self, name: str) -> tuple[str, Any] | None:
        finals = [e for e in self.events[name] if e[0] in (DONE, FAILED)]
        assert len(finals) <= 1, finals
        return finals[0] if finals else None

    def has_first_token(self, name: str) -> bool:
        return any(kind == CHUNK for kind, _ in self.events[name]) or self.final(name) is not None


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(scheduler_module.time, "monotonic", fake)
    return fake


@pytest.fixture
def runner(clock):
    return FakeRunner(clock)


@pytest.fixture
def replies():
    return Replies()


def make_scheduler(runner: FakeRunner, max_active: int = 8, budget: int = 1 << 30, **options) -> Scheduler:
    return Scheduler(None, CHUNK_SIZE, max_active, KvBudget(budget), resolve_model=lambda name: MODEL, runner=runner,
                     **options)


MODEL = FakeModel()


def run_until_idle(scheduler: Scheduler, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not scheduler.has_work:
            return
        scheduler.step()
    raise AssertionError("the scheduler never ran out of work")


def test_a_short_request_arriving_during_a_long_prefill_gets_its_first_token_after_at_most_one_pass(runner, replies):
    scheduler = make_scheduler(runner)
    assert scheduler.admit(replies.job("long", 8 * CHUNK_SIZE))
    scheduler.step()
    assert runner.passes == ["long"]
    assert scheduler.admit(replies.job("short", 150, first_token=50_000, stream=True))
    scheduler.step()
    assert runner.passes == ["long", "short"]  # the least prompt left goes first
    assert replies.has_first_token("short")
    run_until_idle(scheduler)
    assert replies.final("long")[1]["finish_reason"] == "length"
    assert replies.final("short")[1]["finish_reason"] == "length"


def test_a_long_prompt_passed_over_twice_goes_next(runner, replies):
    """A shorter prompt arrives every step; the long one still gets every third pass."""
    scheduler = make_scheduler(runner, max_active=64)
    scheduler.admit(replies.job("long", 6 * CHUNK_SIZE, max_tokens=1))
    for index in range(12):
        scheduler.admit(replies.job(f"short{index}", CHUNK_SIZE - 50, max_tokens=1, first_token=10_000 * (index + 2)))
        scheduler.step()
    assert runner.passes[:9] == ["short0", "short1", "long", "short2", "short3", "long", "short4", "short5", "long"]


def test_decode_and_prefill_share_the_engine_time_evenly(runner, replies, clock):
    """A pass costs five decode steps: while an answer decodes, a long prompt gets about a pass every five steps."""
    scheduler = make_scheduler(runner)
    scheduler.admit(replies.job("answer", 10, max_tokens=200, stream=True))
    scheduler.step()
    assert replies.has_first_token("answer")
    scheduler.admit(replies.job("long", 30 * CHUNK_SIZE, first_token=20_000))
    num_passes_before = len(runner.passes)
    for _ in range(60):
        scheduler.step()
    num_passes = len(runner.passes) - num_passes_before
    decode_s, prefill_s = 60 * DECODE_STEP_S, num_passes * PASS_S
    assert abs(prefill_s - decode_s) <= PASS_S, num_passes
    assert replies.final("answer") is None  # it decoded a token every step


def test_alone_a_prefill_runs_a_pass_every_step(runner, replies):
    scheduler = make_scheduler(runner)
    scheduler.admit(replies.job("long", 6 * CHUNK_SIZE))
    for _ in range(6):
        scheduler.step()
    assert runner.passes == ["long"] * 6


def test_short_tails_go_ahead_of_the_even_split_eight_per_step(runner, replies):
    """Ten cache hits with a few new tokens each, beside a decoding answer: eight first tokens in one step."""
    scheduler = make_scheduler(runner, max_active=16)
    scheduler.admit(replies.job("answer", 10, max_tokens=100))
    scheduler.step()
    prefix = 2 * CHUNK_SIZE
    scheduler.admit(replies.job("prefix", prefix + 1, max_tokens=1, first_token=5000))
    run_until_idle_of(scheduler, "prefix", replies)
    for index in range(10):
        job = replies.job(f"tail{index}", prefix + 20 + index, max_tokens=2, first_token=5000, stream=True)
        scheduler.admit(job)
    assert all(seq.reused >= prefix for seq in scheduler.active if seq.job.client_id.startswith("tail"))
    passes_before = len(runner.passes)
    scheduler.step()
    tail_passes = runner.passes[passes_before:]
    assert tail_passes[:8] == [f"tail{i}" for i in range(8)]  # in the order they came, eight of them
    assert sum(replies.has_first_token(f"tail{i}") for i in range(10)) >= 8


def test_a_stream_of_shorter_tails_does_not_hold_back_a_tail_that_came_first(runner, replies):
    """A cold six-token prompt beside a burst of one-token cache hits: its pass comes in its turn."""
    scheduler = make_scheduler(runner, max_active=16)
    scheduler.admit(replies.job("answer", 10, max_tokens=100))
    scheduler.step()
    scheduler.admit(replies.job("bystander", 40, max_tokens=1, first_token=7000))
    for index in range(12):
        scheduler.admit(replies.job(f"hit{index}", 2 + index % 3, max_tokens=1, first_token=5000))
    scheduler.step()
    assert replies.has_first_token("bystander")


def test_short_tails_take_turns_between_clients_not_connections(runner, replies):
    """Thirty tails of one program's burst were admitted first; another client's tail goes after one of theirs."""
    scheduler = make_scheduler(runner, max_active=64)
    scheduler.admit(replies.job("answer", 10, max_tokens=100))
    scheduler.step()
    for index in range(30):
        scheduler.admit(replies.job(f"http{index}", 3, max_tokens=1, first_token=5000 + index, lane="burst"))
    scheduler.admit(replies.job("bystander", 6, max_tokens=1, first_token=7000))
    before = len(runner.passes)
    scheduler.step()
    assert runner.passes[before : before + 4] == ["http0", "bystander", "http1", "http2"]


def run_until_idle_of(scheduler: Scheduler, name: str, replies: Replies) -> None:
    for _ in range(100):
        if replies.final(name) is not None:
            return
        scheduler.step()
    raise AssertionError(f"{name} never finished")


def test_among_many_tails_a_long_prompt_passed_over_twice_gets_the_next_pass(runner, replies):
    scheduler = make_scheduler(runner, max_active=64)
    scheduler.admit(replies.job("long", 20 * CHUNK_SIZE, first_token=90_000))
    for index in range(40):
        scheduler.admit(replies.job(f"tail{index}", 30, max_tokens=1, first_token=1000 * (index + 2)))
    steps = []
    for _ in range(2):
        before = len(runner.passes)
        scheduler.step()
        steps.append(runner.passes[before:])
    assert steps[0] == [f"tail{i}" for i in range(9)]  # eight tails, then the shortest prompt's pass
    assert steps[1] == [f"tail{i}" for i in range(9, 17)] + ["long"]  # eight tails, then the long one


def test_on_decodes_turn_a_prompt_that_fits_in_one_pass_still_gets_it(runner, replies):
    """Agents' turns: prefill is ahead of its share, yet a prompt one pass from its first token gets that pass."""
    scheduler = make_scheduler(runner)
    scheduler.admit(replies.job("answer", 10, max_tokens=400))
    scheduler.step()
    scheduler.admit(replies.job("long", 12 * CHUNK_SIZE, first_token=20_000))
    while "long" not in runner.passes:
        scheduler.step()
    assert scheduler._prefill_s > scheduler._decode_s  # decode's turn next
    scheduler.admit(replies.job("turn", CHUNK_SIZE - 40, first_token=40_000, stream=True))
    scheduler.step()
    assert runner.passes[-1] == "turn" and replies.has_first_token("turn")


def test_a_prompt_sharing_a_long_prefix_with_one_being_prefilled_waits_then_reuses_it(runner, replies):
    scheduler = make_scheduler(runner)
    scheduler.admit(replies.job("leader", 4 * CHUNK_SIZE, max_tokens=2))
    scheduler.admit(replies.job("follower", 4 * CHUNK_SIZE + 30, max_tokens=2))
    follower = next(s for s in scheduler.active if s.job.client_id == "follower")
    assert follower.phase is Phase.WAITING
    run_until_idle(scheduler)
    assert "follower" not in runner.passes[: runner.passes.index("leader") + 1]
    assert follower.reused >= 3 * CHUNK_SIZE  # it resumed on what the leader stored
    assert runner.passes.count("follower") == 1
    assert replies.final("follower")[0] == DONE


def test_finished_and_cancelled_sequences_are_answered_and_release_their_memory(runner, replies):
    budget = KvBudget(1 << 30)
    scheduler = Scheduler(None, CHUNK_SIZE, 8, budget, resolve_model=lambda name: MODEL, runner=runner)
    scheduler.admit(replies.job("done", 10, max_tokens=3))
    cancelled = replies.job("cancelled", 12, max_tokens=100, first_token=3000)
    scheduler.admit(cancelled)
    for _ in range(2):
        scheduler.step()
    assert budget.running_bytes > 0
    cancelled.cancel()
    run_until_idle(scheduler)
    assert replies.final("done")[1]["finish_reason"] == "length"
    assert replies.final("done")[1]["usage"]["completion_tokens"] == 3
    assert replies.final("cancelled")[1]["finish_reason"] == "cancelled"
    assert any(f.seq.job is not None and f.leaves_batch for p in runner.plans for f in p.finishes)
    assert not runner.rows and not scheduler.active and budget.running_bytes == 0
    assert scheduler.counters == {"completed": 1, "cancelled": 1, "failed": 0}


@pytest.mark.parametrize("batch_step", ["padded", "ragged"])
def test_running_rows_reserve_the_longest_row_each_when_padded_and_their_own_when_ragged(runner, replies, batch_step):
    model = FakeModel()
    model.batch_step = batch_step
    budget = KvBudget(1 << 30)
    scheduler = Scheduler(None, CHUNK_SIZE, 8, budget, resolve_model=lambda name: model, runner=runner)
    scheduler.admit(replies.job("deep", 3 * CHUNK_SIZE, max_tokens=50))
    scheduler.admit(replies.job("shallow", 10, max_tokens=50, first_token=90_000))
    scheduler.step()
    deep, shallow = (3 * CHUNK_SIZE + 50 + KV_GROWTH_STEP_TOKENS), (10 + 50 + KV_GROWTH_STEP_TOKENS)
    expected = deep + shallow if batch_step == "ragged" else 2 * deep
    assert budget.running_bytes == expected * model.kv_bytes_per_token


def test_a_failed_pass_fails_its_request_alone(runner, replies):
    scheduler = make_scheduler(runner)
    scheduler.admit(replies.job("victim", 40))
    scheduler.admit(replies.job("bystander", 50, first_token=7000))
    runner.fail_pass_of.add("victim:1")
    run_until_idle(scheduler)
    assert replies.final("victim")[0] == FAILED
    assert replies.final("bystander")[0] == DONE
    assert scheduler.counters["failed"] == 1 and not scheduler.active


def test_a_request_cut_to_the_context_keeps_its_own_parameters(runner, replies):
    scheduler = make_scheduler(runner)
    job = replies.job("long answer", MODEL.context_length - 10, max_tokens=100)
    scheduler.admit(job)
    (seq,) = scheduler.active
    assert seq.max_new_tokens == 10 and job.params.max_tokens == 100
    run_until_idle(scheduler)
    assert replies.final("long answer")[1]["usage"]["completion_tokens"] == 10


def test_on_a_cpu_the_planned_passes_shorten_as_the_prompt_deepens(runner, replies):
    scheduler = make_scheduler(runner, pass_depth_scale=1024)
    scheduler.admit(replies.job("long", 12 * CHUNK_SIZE, max_tokens=1))
    run_until_idle(scheduler)
    assert runner.pass_tokens[0] == CHUNK_SIZE
    assert runner.pass_tokens[-2] < runner.pass_tokens[1] < CHUNK_SIZE
    assert sum(runner.pass_tokens) == 12 * CHUNK_SIZE  # every prompt token fed once, the last one included
    assert replies.final("long")[0] == DONE


def test_the_step_trace_has_a_line_per_plan_run_with_each_pass_range(runner, replies, tmp_path):
    from prefixd.daemon.engine.step_trace import StepTrace

    trace = StepTrace(str(tmp_path / "steps.jsonl"))
    scheduler = make_scheduler(runner, trace=trace)
    assert scheduler.admit(replies.job("long", 2 * CHUNK_SIZE + 10, max_tokens=3))
    run_until_idle(scheduler)
    trace.close()
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(lines) == len(runner.plans)
    passes = [(start, end) for line in lines for _, start, end in line["prefill"] if end > start]
    assert passes[0][0] == 0 and passes[-1][1] == 2 * CHUNK_SIZE + 10  # the whole prompt
    assert all(a[1] == b[0] for a, b in zip(passes, passes[1:]))  # one pass starts where the previous ended
    assert sum(1 for line in lines if line["decode"]) >= 2 and all(line["ms"] >= 0 for line in lines)
    assert {rid for line in lines for rid, *_ in line["prefill"]} == {rid for line in lines for rid in line["starts"]}
