"""Prefill passes shorten as the context deepens (CPU), and cut the same prompt the same way every time."""

from __future__ import annotations

from prefixd.daemon.engine.prefill import MIN_SHORTENED_PASS_TOKENS, next_stops, pass_limit


def test_a_pass_shortens_with_depth_and_never_below_the_floor():
    limits = [pass_limit(depth, 512, 1024) for depth in (0, 1024, 4096, 1 << 20)]
    assert limits[0] == 512 and limits[1] == 256 and limits[2] < 128
    assert limits == sorted(limits, reverse=True) and limits[-1] == MIN_SHORTENED_PASS_TOKENS
    assert pass_limit(1 << 20, 512, None) == 512  # a GPU: the chunk at every depth


def test_a_shortened_pass_ends_at_a_chunk_checkpoint_of_its_own():
    plan = [(512 * k, "chunk") for k in range(1, 12)] + [(6000, "prompt-end")]
    position, passes = 0, []
    while plan:
        stops = next_stops(plan, position, 512, is_hybrid=False, depth_scale=1024)
        passes.append(stops[-1][0] - position)
        position = stops[-1][0]
    assert position == 6000 and passes[0] == 512 and max(passes[-3:]) < 128
    replanned = [(512 * k, "chunk") for k in range(1, 12)] + [(6000, "prompt-end")]
    position, again = 0, []
    while replanned:
        position_before = position
        position = next_stops(replanned, position, 512, is_hybrid=False, depth_scale=1024)[-1][0]
        again.append(position - position_before)
    assert again == passes


def test_message_ends_inside_a_short_pass_are_taken_along():
    plan = [(2050, "message"), (2060, "message"), (2500, "message"), (3000, "prompt-end")]
    stops = next_stops(plan, 2048, 512, is_hybrid=False, depth_scale=1024)
    assert pass_limit(2048, 512, 1024) == 170  # reach 2218: the end at 2500 waits for the next pass
    assert stops == [(2050, "message"), (2060, "message")] and plan[0] == (2500, "message")
