"""Aggregation of utility calls fanned out to every DP worker. Pure Python."""

from __future__ import annotations

from disagg.dp.protocol import InconsistentUtilityResults, UtilityFailed


def check_results(method: str, results: list) -> list[object]:
    """Values per dp_rank from UtilityResultMsgs; any error raises UtilityFailed naming the workers."""
    if not results:
        raise UtilityFailed(method, {})
    failures = {rank: r.error for rank, r in enumerate(results) if r.error is not None}
    if failures:
        raise UtilityFailed(method, failures)
    return [r.result for r in results]


def all_agree(method: str, values: list[object]) -> object:
    """The common value; workers that disagree raise InconsistentUtilityResults listing every value."""
    if not values:
        raise UtilityFailed(method, {})
    if any(v != values[0] for v in values):
        raise InconsistentUtilityResults(method, values)
    return values[0]


def all_true(method: str, values: list[object]) -> bool:
    """AND over workers; the ranks that answered False are named in UtilityFailed."""
    if not values:
        raise UtilityFailed(method, {})
    failed = {rank: "returned False" for rank, v in enumerate(values) if v is not True}
    if failed:
        raise UtilityFailed(method, failed)
    return True
