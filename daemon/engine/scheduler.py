"""The engine's policy: admit requests, then each step decide who decodes and who prefills.

Order of service, every iteration:
1. admit queued jobs (the inbox hands them out round-robin across clients)
   while fewer than ``max_active`` sequences run and their KV fits the budget;
2. one decode step for every model's decode batch;
3. one prefill chunk for one prefilling sequence, shortest first; short
   tails (a cache hit's few new tokens) one after another before the next step.
So a long prompt is prefilled a chunk at a time between decode steps, and a
short request arriving meanwhile gets its first token after at most a chunk
or two. A prompt that shares a few hundred tokens or more with one being
prefilled right now waits (WAITING) until that part is stored and then reuses
it, instead of computing it twice.

The scheduler runs nothing itself: each decision is a StepPlan
(step_plan.py) that the model runner (model_runner.py, the only MLX code in
the loop) runs, and the StepResult comes back through ``apply``.
Engine thread only.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Any, Callable

import structlog

from ...protocol.errors import ErrorCode, RpcError
from ...protocol.methods import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP
from ..cache import CacheReport, KvBudget, PrefixStore
from ..common_prefix import common_prefix_length
from .constrained_sampling import after_token, start_grammar
from .faults import fault_point
from .jobs import DONE, FAILED, GenerateJob, internal_error
from .prefill import make_sequence, next_stops, system_prompt_ends, uses_store
from .sequence_state import Phase, SequenceState
from .shadow_checker import ShadowChecker
from .shadow_run import ShadowOutcome
from .step_plan import Finish, Join, Prefilled, PrefillPass, Runner, StartPrefill, StepPlan, StepResult

if TYPE_CHECKING:
    from ..models.loaded_model import LoadedModel
    from .batch_decoder import StepEvent
    from .step_trace import StepTrace

log = structlog.get_logger("prefixd.scheduler")

# A prompt tail this short is prefilled ahead of the decode steps' turn (see step).
SHORT_TAIL_TOKENS = 64
# At most this many short tails go between two decode steps, so that a crowd of
# new requests delays the running answers by a bounded amount.
MAX_SHORT_TAILS_PER_STEP = 8
# A prompt sharing at least this many not-yet-stored tokens with one being
# prefilled waits for them to be stored (at most half a chunk: see _prefilling_leader).
MIN_SHARED_TOKENS_TO_WAIT = 256
# A long prompt passed over this many times in a row by short tails gets its chunk before more tails.
MAX_SKIPS_FOR_SHORT_TAILS = 4


class Scheduler:
    """Decides every step and keeps the books; the model runner (model_runner.py) does the device work.

    Each decision is a StepPlan handed to ``runner.run``; its StepResult
    comes back through ``apply``, which moves the sequences on (phases,
    prefill turns, replies, the KV budget) and queues the work that result
    calls for (``_followups``: rows that leave, answers to store, first
    tokens joining the batch), run before the next decision is taken.
    """

    def __init__(
        self,
        store: PrefixStore | None,
        chunk_size: int,
        max_active: int,
        kv_budget: KvBudget,
        resolve_model: Callable[[str | None], LoadedModel],
        runner: Runner,
        shadow_rate: float = 0.0,
        shadow_action: str = "log",
        pass_depth_scale: int | None = None,
        chunks_per_store: int = 1,
        agree: Callable[[bool], bool] = lambda decision: decision,
        trace: StepTrace | None = None,
    ):
        self.store = store
        self.chunk_size = chunk_size
        self.pass_depth_scale = pass_depth_scale  # prefill.pass_limit: passes shorten at long contexts (CPU)
        self.chunks_per_store = chunks_per_store  # _stores_pass: how often a plain chunk stop is stored
        self.max_active = max_active
        self.kv_budget = kv_budget  # shared with the store: it holds what running sequences leave
        self.resolve_model = resolve_model
        self.runner = runner
        self.trace = trace  # PREFIXD_TRACE_STEPS: one line per plan run (step_trace.py)
        self.active: list[SequenceState] = []
        self._prefill_turns: deque[SequenceState] = deque()
        self._tail_round: set[str] = set()  # the clients whose short tails ran in this round (_next_tail)
        self._followups = StepPlan()
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0}
        # Seconds spent prefilling and decoding since both last had work (see step).
        self._prefill_s = self._decode_s = 0.0
        self.shadow = ShadowChecker(
            shadow_rate, shadow_action, chunk_size, reserve=kv_budget.reserve_side, depth_scale=pass_depth_scale
        )
        # A decision taken from this process's clock; ranks in lock-step all take rank 0's (engine/inputs.py).
        self._agree = agree

    # -- admission --------------------------------------------------------------------

    def can_admit(self) -> bool:
        return len(self.active) < self.max_active

    def admit(self, job: GenerateJob) -> bool:
        """Start a job; False if its KV does not fit beside the running ones yet (retry later)."""
        if job.cancelled.is_set():
            self.counters["cancelled"] += 1
            job.emit(FAILED, RpcError(ErrorCode.CANCELLED, "cancelled before it started"))
            return True
        seq = None
        try:
            fault_point("admit")
            loaded = self.resolve_model(job.params.model)
            start_grammar(job, loaded)  # compiled already, unless the job came without Engine.submit
            seq = make_sequence(job, loaded)
            if not self._reserve_memory(seq):
                return False
            self.active.append(seq)
            self._run(StepPlan(starts=[StartPrefill(seq)]))  # then _started: its prefill turn, or a wait
        except RpcError as err:
            self._fail_admission(job, seq, err)
        except Exception as exc:  # one bad request must not take the engine down
            log.exception("admission_failed", request_id=job.request_id)
            self._fail_admission(job, seq, internal_error(exc))
        return True

    def _fail_admission(self, job: GenerateJob, seq: SequenceState | None, err: RpcError) -> None:
        """A job that failed on its way in gives back what it took: its slot, its lease."""
        if seq is not None:
            self._fail(seq, err)
            return
        self.counters["failed"] += 1
        job.emit(FAILED, err)

    def _reserve_memory(self, seq: SequenceState) -> bool:
        """Running sequences and the prefix store share one budget, and it holds at every moment.

        Each sequence reserves what its KV can grow to before it runs; the
        store holds at most the rest of the KV budget and evicts down to it
        (cache/kv_budget.py), so inserts during prefill and answer stores
        cannot push the sum past ``--cache-bytes``.
        """
        seq.kv_bytes_estimate = _sequence_bytes(seq)
        if seq.kv_bytes_estimate > self.kv_budget.total_bytes:
            raise RpcError(
                ErrorCode.OVERLOADED,
                f"this request needs about {seq.kv_bytes_estimate >> 20} MiB of KV cache; the budget is "
                f"{self.kv_budget.total_bytes >> 20} MiB (--cache-bytes); lower max_tokens or shorten the prompt",
            )
        running = self._running_bytes(extra=seq)
        if not self.kv_budget.fits_running(running):
            return False  # the engine gives it the shadow run's room, or it waits for a running one to end
        self.kv_budget.reserve_running(running)
        return True

    def _running_bytes(self, extra: SequenceState | None = None) -> int:
        """What the running sequences' KV may grow to, batch padding included.

        A padded decode batch (mlx-lm's) pads every row to its longest, so its
        rows are counted at the longest row's size each; a ragged one
        (ragged_batch.py) holds each row's own. Plus each row's state layers.
        """
        by_model: dict[str, list[SequenceState]] = {}
        for seq in self.active + ([extra] if extra is not None else []):
            by_model.setdefault(seq.loaded.name, []).append(seq)
        total = 0
        for rows in by_model.values():
            loaded = rows[0].loaded
            if loaded.batch_step == "ragged":
                total += sum(_sequence_bytes(seq) for seq in rows)
                continue
            longest = max(_reserved_tokens(seq) for seq in rows)
            total += len(rows) * (longest * loaded.kv_bytes_per_token + loaded.state_bytes_per_sequence)
        return total

    def _started(self, start: StartPrefill) -> None:
        """Its lookup is done: a waiter resumes its turn; a new sequence takes one, or waits on a leader."""
        seq = start.seq
        # What it reserves follows what its fork reads from the store (_reserved_tokens), on every lookup:
        # a second one (after waiting, or a distrusted checkpoint run cold) may share less than the first.
        self.kv_budget.reserve_running(self._running_bytes())
        if start.distrusted is not None:
            seq.report.turn_off("distrusted")
            seq.report.checkpoint = start.distrusted  # the kind it would have reused
        if seq.phase is Phase.WAITING:  # it now reuses what the leader stored
            seq.phase = Phase.PREFILL
            self._prefill_turns.append(seq)
            return
        if seq.reused and self.shadow.distrusts(seq.loaded.name, seq.report.checkpoint):
            # The shadow check caught this checkpoint kind giving wrong output (--shadow-action stop-reuse).
            kind = seq.report.checkpoint
            seq.uses_cache = False
            seq.report = CacheReport(prompt_tokens=len(seq.tokens), kv=seq.loaded.kv)
            self._followups.starts.append(StartPrefill(seq, distrusted=kind))
            return
        leader, shared = self._prefilling_leader(seq)
        if leader is not None:
            seq.phase, seq.waiting_on, seq.waiting_for = Phase.WAITING, leader, shared
        else:
            self._prefill_turns.append(seq)

    def _prefilling_leader(self, seq: SequenceState) -> tuple[SequenceState | None, int]:
        """Another sequence now prefilling a prefix this one shares beyond its own reuse, and how much they share.

        Waiting pays when the shared part costs more than the tail left after
        it: a few hundred tokens, on a CPU or a GPU alike. (On a GPU the chunk
        is 2,048 tokens; the old threshold of half a chunk let four sessions
        on a 580-token system prompt each prefill it themselves.)
        """
        if not seq.uses_cache:
            return None, 0
        threshold = min(MIN_SHARED_TOKENS_TO_WAIT, self.chunk_size // 2)
        for other in self.active:
            if other is seq or other.phase is not Phase.PREFILL or other.loaded is not seq.loaded:
                continue
            shared = common_prefix_length(seq.tokens, other.tokens[: len(other.tokens) - 1])
            if shared >= seq.reused + threshold and shared > other.stored_upto and other.params.cache.store:
                return other, shared
        return None, 0

    # -- one iteration ------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.active)

    def step(self) -> None:
        """One decode step for every batch, short tails, then (unless decoding is behind) one prefill pass.

        Prefill and decode share the engine's time evenly while both have
        work: a prefill pass runs only when the time spent prefilling since
        both had work is not ahead of the time spent decoding. On a CPU a
        512-token pass at a long context costs ~0.5 s against a few ms per
        decode step, so one step per pass made a running answer wait a whole
        pass per token; now a long prompt delays the others' answers by about
        a pass, and goes at least half speed itself. Alone, either runs flat out.
        Short tails are outside this account (_prefill_short_tails): each costs
        about a step and ends in a first token.
        """
        self._wake_waiters()
        decoding = any(seq.phase is Phase.DECODE for seq in self.active)
        prefilling = any(seq.phase is Phase.PREFILL for seq in self._prefill_turns)
        if not decoding or not prefilling:
            self._prefill_s = self._decode_s = 0.0  # nothing to share with: no credit builds up
        started = time.monotonic()
        self._run(StepPlan(decode=self._decoding_models()))
        self._decode_s += time.monotonic() - started
        started = time.monotonic()
        self._prefill_short_tails()
        self._prefill_s += time.monotonic() - started
        started = time.monotonic()
        if decoding and self._agreed(self._prefill_s > self._decode_s):
            seq = self._pick_last_pass()
        else:
            seq = self._pick_one()
        if seq is not None:
            self._run(self._plan_pass(seq))
        self._prefill_s += time.monotonic() - started

    def _agreed(self, may_prefill: bool) -> bool:
        """May a prefill pass run beside decoding? This process's answer, or the one every rank takes.

        Asked only while a sequence is prefilling: otherwise the prefill turn finds
        nothing whatever the answer, and ranks in lock-step would pay a collective
        (a synchronous all_sum, and a wait for the step computed ahead) on every
        decoded token for it.
        """
        if not any(seq.phase is Phase.PREFILL for seq in self.active):
            return False
        return self._agree(may_prefill)

    def _run(self, plan: StepPlan) -> None:
        """Run ``plan`` and apply its result, then the follow-ups that result called for, until none is left."""
        while plan:
            if self.trace is None:
                self.apply(self.runner.run(plan))
            else:
                line = self.trace.describe(plan, self._decode_rows())
                started_at, started = time.time(), time.perf_counter()
                result = self.runner.run(plan)
                self.trace.write(line, started_at, time.perf_counter() - started)
                self.apply(result)
            plan, self._followups = self._followups, StepPlan()

    def _decode_rows(self) -> dict[str, int]:
        rows: dict[str, int] = {}
        for seq in self.active:
            if seq.phase is Phase.DECODE:
                rows[seq.loaded.name] = rows.get(seq.loaded.name, 0) + 1
        return rows

    def _decoding_models(self) -> list[str]:
        return list(dict.fromkeys(seq.loaded.name for seq in self.active if seq.phase is Phase.DECODE))

    def _wake_waiters(self) -> None:
        plan = StepPlan()
        for seq in self.active:
            leader = seq.waiting_on
            if seq.phase is Phase.WAITING and (
                leader.phase is not Phase.PREFILL or seq.is_cancelled or leader.stored_upto >= seq.waiting_for
            ):
                seq.waiting_on = None
                if seq.is_cancelled:
                    plan.finishes.append(Finish(seq, FINISH_CANCELLED))
                else:
                    plan.starts.append(StartPrefill(seq))  # a second lookup finds what the leader stored
        self._run(plan)

    def _pick_one(self) -> SequenceState | None:
        """The prefilling sequence with the least prompt left goes next.

        Shortest-remaining-first gets a short request to its first token
        after at most one chunk of a long one; a sequence passed over twice
        in a row goes next, so a long prompt is never starved.
        """
        turns = [s for s in self._prefill_turns if s.phase is Phase.PREFILL]
        self._prefill_turns = deque(turns)
        if not turns:
            return None
        starved = [s for s in turns if s.num_prefill_skips >= 2]
        seq = starved[0] if starved else min(turns, key=lambda s: len(s.tokens) - s.position)
        self._prefill_turns.remove(seq)
        for other in self._prefill_turns:
            other.num_prefill_skips += 1
        seq.num_prefill_skips = 0
        return seq

    def _pick_last_pass(self) -> SequenceState | None:
        """On decode's turn, still one pass for a prompt whose rest fits in one chunk (it ends in a first token).

        Agents send their turns together: each a few hundred new tokens on a
        warm prefix, one pass each. Under the even split alone, the second
        agent's pass waited for the first agent's whole answer, the third for
        the second's, and so on (on this CPU the fourth of four agents got its
        first token ~40 s after the first; mlx-lm's server, prefilling them
        together, beat prefixd's warm TTFT). One such pass per step keeps the
        running answers going (a token per pass) while every waiting prompt
        reaches its first token; a prompt that needs more passes keeps the even
        split, so a long one still cannot slow the answers to a pass per token
        for long. bench/agent_workload.py measures it.
        """
        last = [
            s for s in self._prefill_turns if s.phase is Phase.PREFILL and len(s.tokens) - s.position <= self.chunk_size
        ]
        if not last:
            return None
        seq = min(last, key=lambda s: len(s.tokens) - s.position)
        self._prefill_turns.remove(seq)
        for other in self._prefill_turns:
            other.num_prefill_skips += 1
        return seq

    def _prefill_short_tails(self) -> int:
        """Prefill waiting short tails one after another, ahead of the decode steps' turn; how many ran.

        When requests arrive together on a warm prefix (sessions sharing a
        system prompt, an agent's parallel calls), each has a few new tokens
        left. Their passes cost about a decode step each, and each ends in a
        first token, so they go first, up to MAX_SHORT_TAILS_PER_STEP between
        two steps. One pass per tail, not one batched pass: in mlx-lm's
        BatchGenerator seven 8-14-token tails on a 2,000-token prefix took
        152-158 ms against 121-126 ms one by one on an H200, and the first
        such batch 10 s against 0.7 s (the issue's follower stall); on this
        project's CPU 3.1 s against 1.7 s (bench/batch_step_probe.py, part tails).
        Tails go in the order they became ready, not shortest first: all cost
        about a step, and a stream of shorter ones (a burst of cache hits a token
        or two long) would otherwise hold a six-token cold prompt back until the
        stream ended (bench/fairness.py, the HTTP burst). And clients take
        turns, as in the inbox (GenerateJob.fair_lane): a burst's thirty admitted
        tails ran ahead of another client's one, 11 ms each on an H100 (the
        fairness benchmark's step trace); now it goes after at most one of theirs.
        """

        def is_short(seq: SequenceState) -> bool:
            return len(seq.tokens) - seq.position <= SHORT_TAIL_TOKENS

        passed_over = [s for s in self._prefill_turns if s.phase is Phase.PREFILL and not is_short(s)]
        if any(s.num_prefill_skips >= MAX_SKIPS_FOR_SHORT_TAILS for s in passed_over):
            return 0  # a long prompt waited long enough: its chunk comes first (_pick_one)
        ran = 0
        while ran < MAX_SHORT_TAILS_PER_STEP:
            tails = [s for s in self._prefill_turns if s.phase is Phase.PREFILL and is_short(s)]
            if not tails:
                break
            seq = self._next_tail(tails)
            self._prefill_turns.remove(seq)
            self._run(self._plan_pass(seq))
            ran += 1
        if ran:
            for seq in passed_over:
                seq.num_prefill_skips += 1
        return ran

    def _next_tail(self, tails: list[SequenceState]) -> SequenceState:
        """The oldest ready tail of a client not yet served in this round of tails; a new round when all were."""
        for seq in tails:
            if seq.job.fair_lane not in self._tail_round:
                break
        else:
            self._tail_round.clear()
            seq = tails[0]
        self._tail_round.add(seq.job.fair_lane)
        return seq

    def _plan_pass(self, seq: SequenceState) -> StepPlan:
        """The next pass of a prompt whose turn it is: up to its next stops (prefill.next_stops)."""
        if seq.is_cancelled:
            # What its passes computed since the last store (_stores_pass, a pass the CPU's limit cut short)
            # is kept: the request sent again, or the next one on this prefix, starts from there.
            unstored = seq.position > seq.stored_upto and not seq.loaded.layout.is_hybrid
            return StepPlan(finishes=[Finish(seq, FINISH_CANCELLED, seq.cache if unstored else None)])
        generates = not seq.job.warm_only
        if not seq.plan:  # the store held all but the last token, or all of it with its logits
            in_place = generates and self._reads_prompt_in_place(seq)
            return StepPlan(
                prefill=[
                    PrefillPass(
                        seq,
                        (),
                        seq.position,
                        samples_first=generates,
                        reads_prompt_in_place=in_place,
                        stores_last_logits=self._warm_stores_last_logits(seq, True),
                    )
                ]
            )
        hybrid = seq.loaded.layout.is_hybrid
        left = list(seq.plan)  # next_stops takes the pass's stops off this copy; the runner's pass, off seq.plan
        stops = next_stops(
            left, seq.position, self.chunk_size, hybrid, system_prompt_ends(seq.prompt), self.pass_depth_scale
        )
        is_last = not left
        depth = stops[-1][0]
        # An attention model's last pass takes the prompt's last token along: its logits give the first token.
        takes_last = is_last and generates and not hybrid and depth == len(seq.tokens) - 1
        run_to = depth + 1 if takes_last else depth
        samples_first = is_last and generates
        return StepPlan(
            prefill=[
                PrefillPass(
                    seq,
                    tuple(stops),
                    run_to,
                    samples_first=samples_first,
                    stores=self._stores_pass(seq, stops),
                    reads_prompt_in_place=samples_first and self._reads_prompt_in_place(seq),
                    stores_last_logits=self._warm_stores_last_logits(seq, is_last),
                )
            ]
        )

    def _warm_stores_last_logits(self, seq: SequenceState, is_last: bool) -> bool:
        """Whether a warm-only request's last pass also runs the prompt's last token and stores its logits.

        A warm (an editor preparing a file's prompt while the user looks at
        it) samples nothing, so it stopped one token short; the completion that
        followed ran that token over the whole context. Now the warm runs it,
        in a pass of its own (the stored KV is cut where it always was), and the
        completion samples its first token from the stored logits
        (prefill.store_prompt_end) without a pass.
        """
        return (
            is_last
            and seq.job.warm_only
            and uses_store(self.store, seq)  # not a model whose cache cannot be stored: the pass would be for nothing
            and seq.params.cache.store
            and seq.stored_logits is None  # the store has them already
        )

    def _reads_prompt_in_place(self, seq: SequenceState) -> bool:
        """Whether a prompt's last pass ends with its live cache reading the stored prompt in place.

        Once stored, a prompt computed here is leased while its request runs,
        so the live cache may read it from the store and give its own copy
        back (prefill.read_prompt_in_place): the reservation falls to what
        follows the prompt. Only on a layout that shares forks, and only when
        the store will be short of room, with less free once this pass and the
        prompt's last token are stored than that copy: rows reading distinct
        prompts in place attend per row in the decode batch, 1.35x a step's
        time at 4 rows and 1.46x at 8 on this CPU
        (bench/probes/read_in_place_probe.py), so with room to spare the copy stays.
        """
        depth = len(seq.tokens) - 1  # what is read in place: the last token is the sequence's own
        if self.store is None or not seq.loaded.layout.shares_forks or depth <= seq.reads_in_store:
            return False
        per_token = seq.loaded.kv_bytes_per_token
        still_to_store = max(0, len(seq.tokens) - seq.stored_upto) * per_token
        return self.store.free_bytes - still_to_store < (depth - seq.reads_in_store) * per_token

    def _stores_pass(self, seq: SequenceState, stops: list[tuple[int, str]]) -> bool:
        """Whether the pass hands its KV to the store when it is done (settings.CUDA_CHUNKS_PER_STORE).

        Every pass does, except one of an attention-only model without windows
        whose stops are all plain chunk stops off the ``chunks_per_store``
        stride: fewer, longer segments fork with fewer copies. A message's or
        the prompt's end is always stored (the next turn and other sessions
        start there), and so is any pass another sequence waits on
        (_prefilling_leader), so that no one waits longer for a shared prefix.
        A hybrid's snapshot or a window must be taken where its pass ends.
        """
        layout = seq.loaded.layout
        if self.chunks_per_store <= 1 or layout.is_hybrid or layout.window_layers:
            return True
        depth = stops[-1][0]
        if any(kind != "chunk" for _, kind in stops) or depth % (self.chunk_size * self.chunks_per_store) == 0:
            return True
        return any(other.waiting_on is seq for other in self.active)

    # -- what the runner did --------------------------------------------------------------

    def apply(self, result: StepResult) -> None:
        """The bookkeeping after a plan ran: failures, ends, lookups, decoded tokens, prefill passes."""
        for seq, err in result.failures:
            self._fail(seq, err)
        for name, err in result.dropped_models:
            for seq in [s for s in self.active if s.phase is Phase.DECODE and s.loaded.name == name]:
                self._fail(seq, err)
        for finish in result.finished:
            self._guard(finish.seq, lambda f=finish: self._finished(f))
        for start in result.started:
            self._guard(start.seq, lambda s=start: self._started(s))
        for event in result.tokens:
            self._take_token(event)
        for done in result.prefilled:
            self._guard(done.seq, lambda d=done: self._prefilled(d))

    def _prefilled(self, done: Prefilled) -> None:
        seq = done.seq
        if seq.phase is Phase.DONE:
            return
        if seq.plan:
            self._prefill_turns.append(seq)
            return
        if seq.reads_in_store != seq.reused_in_store:
            # Its stored prompt is now read in place (prefill.read_prompt_in_place): the store gets the room back.
            self.kv_budget.reserve_running(self._running_bytes())
        if seq.job.warm_only:
            self._finish(seq, None, FINISH_STOP)
        else:
            self._start_answer(seq, done.token, done.logits)

    def _start_answer(self, seq: SequenceState, token: int, logits: Any) -> None:
        """The first token, sampled from the prompt's last logits: out at once, then the rest in the batch.

        No wait for the next batch step, and no second pass at a long context
        (on an attention model the last prefill pass already gave these logits).
        """
        if seq.grammar is None:
            self.shadow.keep(seq, logits)
        stopped = seq.on_token(token)  # True on an end token or a stop string
        stopped = after_token(seq) or stopped  # True when the constraint's grammar is complete
        if stopped or seq.max_new_tokens <= 1:
            self._finish(seq, seq.cache, FINISH_STOP if stopped else FINISH_LENGTH)
            return
        seq.phase = Phase.DECODE
        self._followups.joins.append(Join(seq, token, seq.max_new_tokens - 1))

    def _take_token(self, event: StepEvent) -> None:
        seq = event.seq
        if seq.phase is Phase.DONE:
            return  # failed with a dropped batch: already answered
        try:
            fault_point("token")
            stopped = seq.on_token(event.token)
            stopped = after_token(seq) or stopped  # a complete grammar ends the answer; a failed one raises
            if event.done_by_batch:
                reason = FINISH_STOP if event.token in seq.loaded.eos_token_ids else FINISH_LENGTH
                self._finish(seq, event.cache, FINISH_STOP if stopped else reason)
            elif stopped or seq.is_cancelled:
                self._finish(seq, None, FINISH_STOP if stopped else FINISH_CANCELLED, leaves_batch=True)
        except RpcError as err:  # this request's own failure (its constraint): it alone ends
            self._fail(seq, err)
        except Exception as exc:
            log.exception("sequence_failed", request_id=seq.job.request_id, phase="decode")
            self._fail(seq, internal_error(exc))

    def forget_model(self, name: str) -> None:
        """An unloaded model's decode batch goes (empty: its jobs pinned it), so a reload gets one for its new weights."""
        self.runner.forget_model(name)

    # -- the end of a sequence ------------------------------------------------------------

    def _finish(self, seq: SequenceState, cache: list[Any] | None, reason: str, leaves_batch: bool = False) -> None:
        """It ends: the runner takes it out of its batch and stores its answer (from ``cache``), then _finished."""
        self._followups.finishes.append(Finish(seq, reason, cache, leaves_batch))

    def _finished(self, finish: Finish) -> None:
        seq = finish.seq
        if seq.phase is Phase.DONE:
            return  # failed meanwhile: already answered
        if seq.phase is not Phase.WAITING and seq.first_token_at is not None:
            seq.flush_text()
        self._release(seq)
        self.counters["cancelled" if seq.is_cancelled else "completed"] += 1
        verify = seq.params.cache.verify
        result = seq.finish(finish.reason, send=not verify)
        try:
            self.shadow.take_finished(seq, lambda outcome: _send_verified(seq, result, outcome))
        except Exception:  # the answer is done: a check that could not be queued costs the check only
            log.exception("shadow_sample_failed", request_id=seq.job.request_id)
            if verify:
                _send_verified(seq, result, None, "the check could not be queued")

    def _fail(self, seq: SequenceState, err: RpcError) -> None:
        if seq.phase is Phase.DONE:
            return  # already answered
        in_batch = seq.phase is Phase.DECODE
        seq.phase = Phase.DONE
        self._followups.forget(seq)
        try:
            if in_batch:
                self._followups.drops.append(seq)  # its row leaves the batch (or the batch goes)
            self._release(seq)
        finally:  # the reply goes out whatever the cleanup met
            self.counters["failed"] += 1
            seq.job.emit(FAILED, err)

    def _release(self, seq: SequenceState) -> None:
        if seq in self.active:
            self.active.remove(seq)
            self.kv_budget.reserve_running(self._running_bytes())  # the store gets the room back
        if seq in self._prefill_turns:
            self._prefill_turns.remove(seq)
        if seq.lease is not None:
            lease, seq.lease = seq.lease, None
            self.store.release(lease)
        seq.cache = None

    def fail_all(self, err: RpcError) -> None:
        """After a failure the engine could not pin on one request: fail every running one, drop all batches.

        What the engine thread keeps afterwards is a clean scheduler: no
        sequence, no batch, no planned work, every lease released.
        """
        self.runner.reset()
        self.shadow.fail_all(err.message)
        for seq in list(self.active):
            try:
                self._fail(seq, err)
            except Exception:  # a broken lease must not keep the others from their answer
                log.exception("fail_all_release_failed", request_id=seq.job.request_id)
                seq.job.emit(FAILED, err)
        self.active.clear()
        self._prefill_turns.clear()
        self._followups = StepPlan()
        self.kv_budget.reserve_running(0)

    def _guard(self, seq: SequenceState, action: Callable[[], None]) -> None:
        try:
            action()
        except RpcError as err:
            self._fail(seq, err)
        except Exception as exc:
            log.exception("sequence_failed", request_id=seq.job.request_id, phase=seq.phase.value)
            self._fail(seq, internal_error(exc))

    # -- reporting -------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        phases = [s.phase for s in self.active]
        return {
            "active": len(self.active),
            "waiting": phases.count(Phase.WAITING),
            "prefilling": phases.count(Phase.PREFILL),
            "decoding": phases.count(Phase.DECODE),
            "kv_reserved_bytes": self.kv_budget.reserved_bytes,
            "active_per_client": dict(Counter(s.job.client_id for s in self.active)),
        }


def _send_verified(
    seq: SequenceState,
    result: dict[str, Any],
    outcome: ShadowOutcome | None,
    why_not: str = "nothing was reused: there is no cached run to compare",
) -> None:
    """A verify request's reply: its answer, with the comparison (or why there is none) as ``verify``."""
    verify = outcome.to_wire() if outcome is not None else {"status": "not-checked", "reason": why_not}
    seq.job.emit(DONE, {**result, "verify": verify})


# KV buffers grow in steps of this many tokens (mlx-lm's KVCache.step), so a
# sequence may hold up to one step more than it has tokens.
KV_GROWTH_STEP_TOKENS = 256


def _reserved_tokens(seq: SequenceState) -> int:
    """What its cache can grow to; what it reads in place (a shared fork's hit, its stored prompt) is the store's.

    That part is leased while it runs, and counted once, in the store.
    """
    new_tokens = 0 if seq.job.warm_only else seq.max_new_tokens
    # A model with window layers copies their windows in every fork: it reserves the whole prefix.
    in_store = 0 if seq.loaded.layout.window_layers else seq.reads_in_store
    return len(seq.tokens) - in_store + new_tokens + KV_GROWTH_STEP_TOKENS


def _sequence_bytes(seq: SequenceState) -> int:
    """What one sequence's live cache can grow to on its own."""
    return _reserved_tokens(seq) * seq.loaded.kv_bytes_per_token + seq.loaded.state_bytes_per_sequence
