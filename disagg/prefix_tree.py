"""Cache-aware picking, shared by the router (a prefill server and its DP rank) and a server's own DP
controller (one of its workers): an approximate radix tree per tenant of the prompts it was sent,
with LRU eviction to a size bound, and sgl-model-gateway's decision given the loads and the trees.
Pure: no I/O, no clock; recency is a tick.

A prompt is a sequence of symbols: the characters of a string, or the ids of a token-id list (a
string and an id list never share a prefix, since a character never equals an int). Size counts
symbols. The tree only records what the router routed, so it approximates the server's KV cache;
`insert` and `evict_to` are the whole write surface, so a later KV-event feed can drive the same
tree.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

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


class CacheOutcome(str, enum.Enum):
    HIT = "hit"  # the longest match is above the threshold
    MISS = "miss"  # the smallest tree got it
    IMBALANCED = "imbalanced"  # the least loaded got it; the trees were not asked

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CacheRule:
    """sgl-model-gateway's thresholds (its defaults but max_tree_size); what a load counts is the
    caller's (the router: requests in flight; the DP controller: outstanding estimated tokens)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: float = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**22


@dataclass(frozen=True)
class CachePick:
    """The chosen group (position in the loads given), its tenant, how, and the matched share of the prompt."""

    group: int
    tenant: Hashable
    outcome: CacheOutcome
    match_ratio: float


def is_imbalanced(loads: Sequence[float], rule: CacheRule) -> bool:
    """sgl-model-gateway's test: both the absolute and the relative gap exceed their thresholds."""
    most, fewest = max(loads), min(loads)
    return most - fewest > rule.balance_abs_threshold and most > fewest * rule.balance_rel_threshold


class PrefixTrees:
    """One RadixTree per tenant, and the clock of their recency."""

    def __init__(self, max_tree_size: int):
        self.max_tree_size = max_tree_size
        self._trees: dict[Hashable, RadixTree] = {}
        self._tick = 0

    def size(self, tenant: Hashable) -> int:
        """Symbols held for `tenant` (0 when it has no tree yet)."""
        tree = self._trees.get(tenant)
        return tree.size if tree is not None else 0

    def match_length(self, tenant: Hashable, text: Prompt) -> int:
        """The longest prefix of `text` held for `tenant`."""
        tree = self._trees.get(tenant)
        return tree.match_length(text) if tree is not None else 0

    def insert(self, tenant: Hashable, text: Prompt) -> None:
        """Record `text` as the newest prompt of `tenant`, then evict its tree to the bound."""
        self._tick += 1
        tree = self._trees.setdefault(tenant, RadixTree())
        tree.insert(text, self._tick)
        if tree.size > self.max_tree_size:  # down to 90%: a full tree is walked once per 10% of it, not per insert
            tree.evict_to(self.max_tree_size * 9 // 10)

    def tenants(self) -> list[Hashable]:
        """The tenants that have a tree."""
        return list(self._trees)

    def forget(self, tenant: Hashable) -> None:
        """Drop `tenant`'s tree (its cache is gone: a server left, a worker died)."""
        self._trees.pop(tenant, None)


def pick_by_cache(trees: PrefixTrees, groups: Sequence[Sequence[Hashable]], loads: Sequence[float], text: Prompt,
                  rule: CacheRule) -> CachePick:
    """The pick among `groups` (each a load and its tenants: a server and its DP ranks, or one DP worker):
    1. imbalanced `loads`: the least loaded group (ties: the first), its tenant with the smallest tree;
    2. else the tenant whose tree holds the longest prefix of `text` (ties: the first), a hit when it
       matches more than `cache_threshold` of it;
    3. else a miss: the tenant with the smallest tree (ties: the first).
    `text` is then inserted into the chosen tree (an empty prompt is a miss that inserts nothing)."""
    assert groups and len(groups) == len(loads), "one load per group, at least one group"
    ratio = 0.0
    if is_imbalanced(loads, rule):
        group = min(range(len(groups)), key=lambda g: loads[g])
        tenant = min(groups[group], key=trees.size)
        outcome = CacheOutcome.IMBALANCED
    else:
        flat = [(g, t) for g, tenants in enumerate(groups) for t in tenants]
        lengths = [trees.match_length(t, text) for _, t in flat]
        best = max(range(len(flat)), key=lambda k: (lengths[k], -k))
        ratio = lengths[best] / len(text) if text else 0.0
        outcome = CacheOutcome.HIT if ratio > rule.cache_threshold else CacheOutcome.MISS
        group, tenant = flat[best] if outcome is CacheOutcome.HIT else min(flat, key=lambda f: trees.size(f[1]))
    if text:
        trees.insert(tenant, text)
    return CachePick(group, tenant, outcome, ratio)
