"""Tool calls read out of a streamed answer, piece by piece: text goes on at once, a call once it is whole.

Text that might be the start of a call marker is held back until the next
piece tells; a call is held from its start marker to its end marker (to the
answer's end for formats without one, and for Llama 3's bare JSON, which an
answer starting with ``{``, ``[`` or ``<|python_tag|>`` may be). What a
stream yields is what ``ToolCallFormat.split`` makes of the whole answer,
but for the whitespace around the calls, which split strips.
"""

from __future__ import annotations

from .tool_call_format import PYTHON_TAG, ToolCall, ToolCallFormat

Events = list["str | ToolCall"]  # pieces of text and whole calls, in answer order


class ToolCallStream:
    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self._held = ""  # text not yet given out: a possible marker's start, or a call in progress
        self._in_call = False
        self._bare_json: bool | None = None  # start-less formats: None until the answer's first characters tell
        self.num_calls = 0

    def feed(self, piece: str) -> Events:
        """What can be given out after ``piece``: text pieces and whole ToolCalls, in order."""
        self._held += piece
        if not self.fmt.start:
            return self._feed_bare()
        events: Events = []
        while True:
            if self._in_call:
                if not self.fmt.end or (finish := self._held.find(self.fmt.end, len(self.fmt.start))) < 0:
                    return events
                whole, self._held = self._held[: finish + len(self.fmt.end)], self._held[finish + len(self.fmt.end) :]
                self._in_call = False
                events += self._parsed(whole)
                continue
            begin = self._held.find(self.fmt.start)
            if begin < 0:
                keep = _partial_marker(self._held, self.fmt.start)
                text, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
                return events + ([text] if text else [])
            if begin:
                events.append(self._held[:begin])
            self._held = self._held[begin:]
            self._in_call = True

    def finish(self) -> Events:
        """The rest at the answer's end: a call still open is parsed (or given out as text)."""
        held, self._held = self._held, ""
        if not held:
            return []
        if not self.fmt.start:
            return self._parsed(held) if self._bare_json else [held]
        return self._parsed(held) if self._in_call else [held]

    def _feed_bare(self) -> Events:
        if self._bare_json is None:
            stripped = self._held.lstrip()
            if not stripped or (len(stripped) < len(PYTHON_TAG) and PYTHON_TAG.startswith(stripped)):
                return []
            self._bare_json = stripped[0] in "{[" or stripped.startswith(PYTHON_TAG)
        if self._bare_json:
            return []
        held, self._held = self._held, ""
        return [held]

    def _parsed(self, text: str) -> Events:
        content, calls = self.fmt.split(text)
        self.num_calls += len(calls)
        return ([content] if content and not calls else []) + calls


def _partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
