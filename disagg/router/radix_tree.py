"""An approximate radix tree of the prompts one server (or one of its DP ranks) was sent, with LRU
eviction to a size bound. Pure: no I/O, no clock; recency is a tick the caller passes.

A prompt is a sequence of symbols: the characters of a string, or the ids of a token-id list (a
string and an id list never share a prefix, since a character never equals an int). Size counts
symbols. The tree only records what the router routed, so it approximates the server's KV cache;
`insert` and `evict_to` are the whole write surface, so a later KV-event feed can drive the same
tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

Prompt = str | tuple[int, ...]


class _Node:
    __slots__ = ("label", "children", "parent", "last_used")

    def __init__(self, label: Prompt, parent: _Node | None, last_used: int):
        self.label = label
        self.children: dict[object, _Node] = {}
        self.parent = parent
        self.last_used = last_used


def as_prompt(symbols: str | Sequence[int]) -> Prompt:
    """A string as it is; a token-id list as a tuple (hashable slices)."""
    return symbols if isinstance(symbols, str) else tuple(symbols)


def _common_length(label: Prompt, text: Prompt, start: int) -> int:
    """How many leading symbols of `label` equal `text[start:]`'s."""
    if text[start:start + len(label)] == label:
        return len(label)
    limit = min(len(label), len(text) - start)
    n = 0
    while n < limit and label[n] == text[start + n]:
        n += 1
    return n


class RadixTree:
    """One tenant's tree: `insert` a prompt, `match_length` of a prompt's longest stored prefix,
    `evict_to` a size bound (least recently used leaves first)."""

    def __init__(self):
        self._root = _Node("", None, 0)
        self.size = 0  # symbols stored on all edges

    def match_length(self, text: Prompt) -> int:
        """The length of the longest prefix of `text` that the tree holds."""
        node, i = self._root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            n = _common_length(child.label, text, i)
            i += n
            if n < len(child.label):
                break
            node = child
        return i

    def insert(self, text: Prompt, tick: int) -> None:
        """Store `text`; every node on its path is marked used at `tick`."""
        node, i = self._root, 0
        node.last_used = tick
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                node.children[text[i]] = _Node(text[i:], node, tick)
                self.size += len(text) - i
                return
            n = _common_length(child.label, text, i)
            if n < len(child.label):
                child = self._split(node, child, n)
            child.last_used = tick
            node, i = child, i + n

    def _split(self, parent: _Node, child: _Node, n: int) -> _Node:
        """Put a node holding `child.label[:n]` between `parent` and `child`; returns it."""
        middle = _Node(child.label[:n], parent, child.last_used)
        parent.children[child.label[0]] = middle
        child.label, child.parent = child.label[n:], middle
        middle.children[child.label[0]] = child
        return middle

    def evict_to(self, max_size: int) -> int:
        """Drop least recently used leaves until `size <= max_size`; returns the symbols dropped.
        A parent is used whenever a child is, so leaves go before the prefixes they extend."""
        if self.size <= max_size:
            return 0
        before = self.size
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n is not self._root]
        heapq.heapify(leaves)
        while self.size > max_size and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None, "the root is never a leaf to evict"
            del parent.children[leaf.label[0]]
            self.size -= len(leaf.label)
            if not parent.children and parent is not self._root:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        return before - self.size

    def _nodes(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
