"""Running an EngineCore to the end in tests: the loop every engine test needs, with a bound on its steps."""

from __future__ import annotations

from collections.abc import Iterable

MAX_STEPS = 10_000  # far past any test's max_tokens; a request that never finishes fails the test instead of hanging


def finish(core) -> dict:
    """Step `core` until no request is left; the final output of every request that ended, by request id."""
    final = {}
    for _ in range(MAX_STEPS):
        if not core.has_unfinished():
            return final
        final.update({o.request_id: o for o in core.step() if o.finished})
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def run_requests(core, requests: Iterable[tuple[list[int], object]]) -> list:
    """Add each (prompt token ids, SamplingParams) as a new request, run them together; their final outputs in order."""
    ids = []
    for prompt_ids, params in requests:
        ids.append(core.new_request_id())
        core.add_request(ids[-1], prompt_ids, params)
    final = finish(core)
    return [final[i] for i in ids]
