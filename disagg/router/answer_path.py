"""Each answer's path through our router, told to the client (`X-Disagg-Path`, and where it was not
`pd`, why: `X-Disagg-Path-Reason`), logged (`request answered`) and counted
(`disagg_router_answers_total{path, reason}`). Pure.

- `pd`: a prefill computed the prompt and its KV moved to the decode, at the first try.
- `decode-local`: the decode prefilled the prompt itself, no KV moved (`short_uncached_rest`: the
  rest its cache lacks is within its --max-local-prefill-tokens while every prefill is busy;
  `no_prefill_server`: no prefill serves, e.g. the planner moved the last one to decode, so the decode
  prefilled the whole prompt).
- `retried`: the answer came from another pair than the first the router tried; the reason is the
  first try's failure (`local_prefill_refused`, a refusal code such as `draining`, `role_switching`
  or `stale_role_epoch`, `upstream_unreachable`, or `<role>_<status>` for a server's 429 or 503).
"""

from __future__ import annotations

import enum

from disagg.http_edge import HttpError
from disagg.router.errors import ServerDraining, ServerError, ServerUnreachable

SHORT_UNCACHED_REST = "short_uncached_rest"
NO_PREFILL_SERVER = "no_prefill_server"
LOCAL_PREFILL_REFUSED = "local_prefill_refused"


class AnswerPath(str, enum.Enum):
    PD = "pd"
    DECODE_LOCAL = "decode-local"
    RETRIED = "retried"


def failure_reason(exc: HttpError) -> str:
    """Why a try failed, in the words of X-Disagg-Path-Reason."""
    if isinstance(exc, ServerDraining):
        return exc.code.value
    if isinstance(exc, ServerUnreachable):
        return "upstream_unreachable"
    if isinstance(exc, ServerError):
        return f"{exc.role}_{exc.status}"
    return exc.code or f"status_{exc.status}"


def answer_path(local: bool, first_failure: str | None, whole: bool = False) -> tuple[AnswerPath, str | None]:
    """The path of an answer served by a plan with no prefill leg (`local`; `whole`: because no prefill
    serves) or with one, after a first try that failed for `first_failure` (None: this is the first try)."""
    if first_failure is not None:
        return AnswerPath.RETRIED, first_failure
    if local:
        return AnswerPath.DECODE_LOCAL, NO_PREFILL_SERVER if whole else SHORT_UNCACHED_REST
    return AnswerPath.PD, None
