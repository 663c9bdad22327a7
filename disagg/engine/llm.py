"""The offline API: `LLM(model=...).generate(prompts, SamplingParams)`."""

from __future__ import annotations

from collections.abc import Sequence

from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.core import EngineCore
from disagg.types import InvalidRequest, RequestOutput, SamplingParams

Prompt = str | Sequence[int]


def engine_config(**kwargs) -> EngineConfig:
    """Build an EngineConfig from flat keyword arguments (`model=`, `block_size=`, ...)."""
    parts = {ModelConfig: {}, CacheConfig: {}, SchedulerConfig: {}}
    top = {}
    for key, value in kwargs.items():
        owner = next((cls for cls in parts if key in cls.__dataclass_fields__), None)
        if owner is None and key not in EngineConfig.__dataclass_fields__:
            raise TypeError(f"unknown engine option {key!r}")
        (parts[owner] if owner else top)[key] = value
    return EngineConfig(
        model=ModelConfig(**parts[ModelConfig]),
        cache=CacheConfig(**parts[CacheConfig]),
        scheduler=SchedulerConfig(**parts[SchedulerConfig]),
        **top,
    )


class LLM:
    """Runs prompts to completion in one process. Keyword options are those of the config dataclasses."""

    def __init__(self, model: str = "smollm2-135m", **kwargs):
        self.engine = EngineCore(engine_config(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order."""
        prompts = [prompts] if isinstance(prompts, str) or _is_token_list(prompts) else list(prompts)
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest(f"{len(prompts)} prompts but {len(params)} sampling params", "sampling_params")
        ids = []
        for prompt, p in zip(prompts, params):
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = self.engine.new_request_id()
            self.engine.add_request(request_id, token_ids, p)
            ids.append(request_id)
        return self._run(ids)

    def chat(self, messages: list[dict], sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn with the model's chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate([token_ids], sampling_params)[0]

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        while len(final) < len(request_ids):
            outputs = self.engine.step()
            for out in outputs:
                if out.finished:
                    final[out.request_id] = out
            assert outputs or self.engine.has_unfinished(), "engine idle with requests unanswered"
        return [final[i] for i in request_ids]


def _is_token_list(prompts) -> bool:
    return isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int)
