"""Where a prefill stops: checkpoints for the store, and how many forward passes run.

Pure planning, no model: the passes a plan costs are what a user feels as
time-to-first-token on a warm chat turn.
"""

from __future__ import annotations

from prefixd.daemon.models.prompt_encoding import EncodedPrompt, MessageSpan
from prefixd.daemon.engine.prefill import next_stops, plan_prefill, system_prompt_ends


def chat_prompt(num_tokens: int, message_ends: list[int]) -> EncodedPrompt:
    spans = tuple(MessageSpan(i, "user" if i % 2 else "system", end) for i, end in enumerate(message_ends))
    return EncodedPrompt(list(range(num_tokens)), None, spans)


def passes(plan: list[tuple[int, str]], start: int, chunk: int, hybrid: bool,
           pinned: frozenset[int] = frozenset()) -> list[list[tuple[int, str]]]:
    plan, position, out = list(plan), start, []
    while plan:
        stops = next_stops(plan, position, chunk, hybrid, pinned)
        out.append(stops)
        position = stops[-1][0]
    return out


def test_plan_has_absolute_chunks_message_ends_and_the_prompt_end():
    plan = plan_prefill(0, 1299, 512, chat_prompt(1300, [600, 1100]))
    assert plan == [(512, "chunk"), (600, "message"), (1024, "chunk"), (1100, "message"), (1299, "prompt-end")]
    assert plan_prefill(1000, 1299, 512, chat_prompt(1300, [600, 1100]))[0] == (1024, "chunk")  # absolute multiples


def test_a_warm_chat_tail_is_one_pass_on_an_attention_model_and_keeps_its_labels():
    prompt = chat_prompt(1300, [600, 1100, 1200])
    plan = plan_prefill(1050, 1299, 512, prompt)
    (only,) = passes(plan, 1050, 512, hybrid=False)
    assert only == [(1100, "message"), (1200, "message"), (1299, "prompt-end")]


def test_a_hybrid_model_ends_a_pass_at_every_stop_for_its_snapshots():
    prompt = chat_prompt(1300, [600, 1100, 1200])
    assert [p[-1][0] for p in passes(plan_prefill(1050, 1299, 512, prompt), 1050, 512, hybrid=True)] == [1100, 1200, 1299]


def test_a_hybrid_chat_tail_of_stops_a_few_tokens_apart_is_one_pass_ending_at_the_prompt_end():
    # From the previous answer's end (1050): its closing tokens end at 1052, the new message at 1090,
    # the assistant header at 1093 (prompt-end): one pass, the snapshot where it ends.
    prompt = chat_prompt(1094, [600, 1052, 1090])
    (only,) = passes(plan_prefill(1050, 1093, 512, prompt), 1050, 512, hybrid=True)
    assert only == [(1052, "message"), (1090, "message"), (1093, "prompt-end")]


def test_a_hybrid_pass_still_ends_at_stops_far_enough_apart():
    prompt = chat_prompt(1300, [600, 1052, 1100, 1200])
    ends = [p[-1][0] for p in passes(plan_prefill(1050, 1299, 512, prompt), 1050, 512, hybrid=True)]
    assert ends == [1100, 1200, 1299]  # 1052 is 2 tokens into the pass: a label only


def test_no_pass_is_longer_than_a_chunk():
    prompt = chat_prompt(3000, [100, 700, 2500])
    for hybrid in (False, True):
        position = 0
        for stops in passes(plan_prefill(0, 2999, 512, prompt), 0, 512, hybrid):
            assert 0 < stops[-1][0] - position <= 512
            position = stops[-1][0]
        assert position == 2999


def test_a_hybrid_pass_ends_at_the_system_prompt_even_when_the_question_after_it_is_short():
    # Sessions sharing a system prompt (ends at 584) ask short questions: the prompt ends 11 tokens later.
    # The snapshot at 584 is what the next session reuses, so that stop is not merged into the prompt's end.
    prompt = chat_prompt(596, [584, 592])
    ends = [p[-1][0] for p in passes(plan_prefill(0, 595, 2048, prompt), 0, 2048, hybrid=True,
                                     pinned=system_prompt_ends(prompt))]
    assert ends == [584, 595]
    assert [p[-1][0] for p in passes(plan_prefill(0, 595, 2048, prompt), 0, 2048, hybrid=True)] == [595]


def test_only_the_leading_system_messages_are_the_shared_prefix():
    prompt = EncodedPrompt(list(range(100)), None, (MessageSpan(0, "system", 20), MessageSpan(1, "developer", 30),
                                                    MessageSpan(2, "user", 60), MessageSpan(3, "system", 80)))
    assert system_prompt_ends(prompt) == frozenset({20, 30})
    assert system_prompt_ends(chat_prompt(50, [])) == frozenset()
