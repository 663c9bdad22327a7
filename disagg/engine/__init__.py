"""The engine: paged KV cache, continuous batching, Llama-family models, offline API.

`from disagg.engine import LLM, SamplingParams` is the offline entry point. Imports are lazy so
that `import disagg.engine.block_pool` (pure policy) does not pull torch in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from disagg.types import FinishReason, InvalidRequest, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from disagg.engine.core import EngineCore
    from disagg.engine.llm import LLM

__all__ = ["LLM", "EngineCore", "SamplingParams", "RequestOutput", "FinishReason", "InvalidRequest"]


def __getattr__(name: str):
    if name == "LLM":
        from disagg.engine.llm import LLM

        return LLM
    if name == "EngineCore":
        from disagg.engine.core import EngineCore

        return EngineCore
    raise AttributeError(name)
