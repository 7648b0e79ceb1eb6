"""The engine's stop-string matcher: what it holds back, where it cuts, and which stop string it names."""

from __future__ import annotations

from prefixd.daemon.engine.stop_strings import StopStringMatcher


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    stops = StopStringMatcher(("END",))
    assert stops.feed("abc E") == "abc "
    assert stops.feed("x") == "Ex" and not stops.stopped and stops.matched is None
    assert stops.feed("EN") == "" and stops.flush() == "EN"  # the answer ended first: it was plain text


def test_the_first_stop_string_in_the_text_is_named_even_when_split_across_pieces():
    stops = StopStringMatcher(("END", "ND"))
    assert stops.feed("abc E") == "abc "
    assert stops.feed("ND more") == "" and stops.stopped and stops.matched == "END"
    assert stops.feed("later") == "" and stops.flush() == ""


def test_of_stop_strings_starting_at_the_same_place_the_longest_is_named():
    stops = StopStringMatcher(("a", "ab"))
    assert stops.feed("xaby") == "x" and stops.matched == "ab"


def test_the_earliest_stop_string_wins_over_one_listed_first():
    stops = StopStringMatcher(("world", "o"))
    assert stops.feed("hello world") == "hell" and stops.matched == "o"


def test_without_stop_strings_every_piece_passes_and_none_is_named():
    stops = StopStringMatcher(())
    assert stops.feed("anything END") == "anything END" and stops.matched is None and not stops.stopped
