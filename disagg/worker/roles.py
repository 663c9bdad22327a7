"""Which role a DP worker runs: `RoleSpec`, built by the front, pickled to the worker with its spec.

A spec holds a factory, a plain top-level function that pickles by reference and is called in the
worker. The three roles' factories import their classes where they run: the front imports this
module without torch, and the worker imports only the role it runs. Tests pass factories of their own
(tests/faults/slow_reads.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from disagg.engine.core import EngineCore
    from disagg.worker.role import Role


def unified_role(core: EngineCore, dp_rank: int, model_name: str) -> Role:
    from disagg.worker.unified import UnifiedRole  # torch: the worker process only

    return UnifiedRole(core, dp_rank, model_name)


def prefill_role(core: EngineCore, dp_rank: int, model_name: str, **kwargs) -> Role:
    from prefill.role import PrefillRole  # torch: the worker process only

    return PrefillRole(core, dp_rank, model_name, **kwargs)


def decode_role(core: EngineCore, dp_rank: int, model_name: str, **kwargs) -> Role:
    from decode.role import DecodeRole  # torch: the worker process only

    return DecodeRole(core, dp_rank, model_name, **kwargs)


@dataclass(frozen=True)
class RoleSpec:
    """A role's factory and its keyword arguments, and what the server's /server_info says of the
    role (`info`: a decode's `max_local_prefill_tokens`, which our router reads)."""

    factory: Callable[..., Role] = unified_role
    kwargs: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    @property
    def moves_kv(self) -> bool:
        """A P/D role: its transfer backend registers the worker's KV cache (a TP group then keeps
        its caches in one shared file)."""
        return self.factory is not unified_role

    def build(self, core: EngineCore, dp_rank: int, model_name: str) -> Role:
        return self.factory(core, dp_rank, model_name, **self.kwargs)
