"""Stop strings over streamed text, holding back what might be the start of one.

Pure Python, no model: the decode loop feeds each new piece of detokenized
text and gets back the text that is safe to send now.
"""

from __future__ import annotations


class StopStringMatcher:
    """Finds the first stop string in a growing text.

    ``feed(piece)`` returns the text that may be emitted; text that could be
    the beginning of a stop string is held back until it is known not to be.
    Once a stop string is found, ``stopped`` is True, ``matched`` is that
    string, and the text before it has all been returned (the stop string
    itself is never emitted). When several start at the same place in the
    text fed so far, the longest is named.
    """

    def __init__(self, stop_strings: tuple[str, ...]):
        self.stop_strings = tuple(s for s in stop_strings if s)
        self._max_len = max((len(s) for s in self.stop_strings), default=0)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        if not self.stop_strings:
            return piece
        self._pending += piece
        hit = self._first_hit(self._pending)
        if hit is not None:
            position, self.matched = hit
            self.stopped = True
            out, self._pending = self._pending[:position], ""
            return out
        keep = self._longest_partial_suffix(self._pending)
        out = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(out) :]
        return out

    def flush(self) -> str:
        """At the end of generation: whatever was held back is plain text after all."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out

    def _first_hit(self, text: str) -> tuple[int, str] | None:
        """Where the first stop string in ``text`` starts, and which one it is (the longest of those starting there)."""
        found = [(position, -len(s), s) for s in self.stop_strings if (position := text.find(s)) >= 0]
        if not found:
            return None
        position, _, stop = min(found)
        return position, stop

    def _longest_partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for length in range(min(self._max_len - 1, len(text)), 0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self.stop_strings):
                return length
        return 0
