"""Whether a prefill and a decode server may pair: their /server_info `kv_compatibility` records (the
engine's weights fingerprint, dtypes and KV layout; the role's transfer backend and KV protocol) must
agree on every field below. The TP size may differ: the heads and head size decide. Pure.

A pair that differs is never picked: the router picks a compatible pair instead, or, when there is
none, answers 503 `incompatible_servers` naming each differing field, once, before any leg is sent
(the alternative was a 500 from the decode's handshake on every request). A server without a record
(another project's, or not read yet) pairs with anything, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from disagg.http_edge import HttpError
from disagg.router.workers import Role, WorkerPool

CHECKED = ("weights", "dtype", "kv_cache_dtype", "block_size", "num_layers", "num_kv_heads", "head_dim",
           "transfer_backend", "kv_protocol", "kv_checksum")
Record = Mapping[str, object] | None


class IncompatibleServers(HttpError):
    """503: no prefill and decode server the router may use can pair (their records differ)."""

    def __init__(self, message: str):
        super().__init__(503, message, code="incompatible_servers")


def differences(prefill: Record, decode: Record) -> str | None:
    """Each field on which the two records differ, with both values; None when they may pair."""
    if not prefill or not decode:
        return None
    diffs = [f"{name} {prefill.get(name)!r} on the prefill, {decode.get(name)!r} on the decode"
             for name in CHECKED if prefill.get(name) != decode.get(name)]
    return "; ".join(diffs) or None


def incompatibility(prefill_url: str, prefill: Record, decode_url: str, decode: Record) -> str | None:
    """The refusal's message for one pair, or None when it may pair."""
    diffs = differences(prefill, decode)
    if diffs is None:
        return None
    models = f" ({prefill.get('model')!r} and {decode.get('model')!r})" if prefill.get("model") != decode.get("model") else ""
    return f"prefill server {prefill_url} and decode server {decode_url} cannot pair{models}: {diffs}"


def compatible_pair(p: int, d: int, prefills: Sequence[tuple[int, Record]],
                    decodes: Sequence[tuple[int, Record]]) -> tuple[int, int] | None:
    """(p, d) when they may pair; else a decode that may pair with p, else a prefill that may pair
    with d, else any pair that may (each in the order given: the servers the policy may pick); None
    when no pair may."""
    records_p, records_d = dict(prefills), dict(decodes)
    if differences(records_p.get(p), records_d.get(d)) is None:
        return p, d
    candidates = [(p, other) for other, _ in decodes] + [(other, d) for other, _ in prefills] + [
        (a, b) for a, _ in prefills for b, _ in decodes]
    return next(((a, b) for a, b in candidates if a in records_p and b in records_d
                 and differences(records_p[a], records_d[b]) is None), None)


def pool_pair(pool: WorkerPool, p: int, d: int) -> tuple[int, int]:
    """`compatible_pair` over the pool's servers the policy may pick; IncompatibleServers naming the
    picked pair's differences when no pair may."""
    records = {role: [(load.server_id, pool.info(role, load.server_id).compatibility)
                      for load in pool.loads(role) if load.eligible] for role in (Role.PREFILL, Role.DECODE)}
    pair = compatible_pair(p, d, records[Role.PREFILL], records[Role.DECODE])
    if pair is None:
        prefill, decode = pool.info(Role.PREFILL, p), pool.info(Role.DECODE, d)
        raise IncompatibleServers(incompatibility(prefill.url, prefill.compatibility, decode.url, decode.compatibility))
    return pair


def incompatible_prefills(pool: WorkerPool, decode: Record) -> dict[str, str]:
    """For /workers: each prefill server a decode with record `decode` cannot pair with, and why."""
    out = {}
    for info in pool.infos(Role.PREFILL):
        diffs = differences(info.compatibility, decode)
        if diffs is not None:
            out[info.url] = diffs
    return out
