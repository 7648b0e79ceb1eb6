"""The scanned entries as the tree they form, to find those along one prompt without reading the rest.

An entry names its parent by where it starts: ``start`` (a depth) and
``start_sha`` (the digest of the tokens before it), which are its parent's
end. So entries hang off (fingerprint, depth, digest) nodes, and a prompt's
tokens spell out one path from the root: at each node the prompt's next
token picks the children worth comparing.

Pure Python, no MLX: built and walked on worker threads.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import defaultdict
from typing import Iterable, Sequence

from ..common_prefix import common_prefix_length
from .format import EntryHeader, token_bytes

_NodeKey = tuple[str, int, str, int]  # fingerprint, depth, digest of the tokens before, the next token


class DiskIndex:
    """Entries by the node they start at and their first token."""

    def __init__(self, headers: Iterable[EntryHeader]):
        self._children: dict[_NodeKey, list[tuple[tuple[int, ...], EntryHeader]]] = defaultdict(list)
        for header in headers:
            key = tuple(header.key)  # tuples: compared with the prompt's tokens slice by slice
            self._children[(header.fingerprint, header.start, header.start_sha, key[0])].append((key, header))

    def along(self, fingerprint: str, tokens: Sequence[int], partial_edges: bool) -> list[EntryHeader]:
        """The entries whose tokens the prompt starts with, parents before children.

        ``partial_edges``: also an entry the prompt leaves midway (it shares
        at least its first token), which attention-only models can use in part;
        hybrid models resume only where a snapshot was taken, so for them the
        path ends at its last entry with a snapshot.

        Time is linear in the prompt: the digest runs forward over the tokens
        once, and each node visited is one depth of the prompt. Two entries
        can start at one node with the same token (a file from before an edge
        was split, not pruned because the daemon was killed); both are
        followed, each to a depth of its own.
        """
        tokens = tuple(tokens)
        found: list[EntryHeader] = []
        digest, digested = hashlib.sha256(), 0  # of tokens[:digested]
        depths, seen = [0], set()
        while depths:
            depth = heapq.heappop(depths)
            if depth in seen or depth >= len(tokens):
                continue
            seen.add(depth)
            digest.update(token_bytes(tokens[digested:depth]))
            digested = depth
            for key, header in self._children.get((fingerprint, depth, digest.hexdigest(), tokens[depth]), ()):
                if common_prefix_length(key, tokens, depth) == len(key):
                    found.append(header)
                    heapq.heappush(depths, header.depth)
                elif partial_edges:
                    found.append(header)
        if not partial_edges:
            while found and found[-1].snapshot is None:
                found.pop()  # a hybrid model cannot resume past its last snapshot
        return found
