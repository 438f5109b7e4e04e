"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, no threads, no server."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from tqdm import tqdm

from engine import platform
from engine.config import EngineConfig
from engine.sampling import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.models.loader import LoadedModel


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, generation header included."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@dataclass(slots=True)
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    time_to_first_token: float | None = None  # seconds from submission
    e2e_latency: float | None = None


class LLM:
    def __init__(self, model: str | None = None, loaded: LoadedModel | None = None,
                 generation_config: str = "auto", override_generation_config: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        """`generation_config` / `override_generation_config`: as the server's flags, they make the
        SamplingParams `generate` uses when given none (`get_default_sampling_params`)."""
        platform.setup()  # before the engine's modules import mlx
        from engine.core import EngineCore  # these import MLX: `import engine.llm` stays light
        from engine.models.loader import generation_defaults

        self.core = EngineCore(EngineConfig(model=model, **kwargs), loaded=loaded)
        self.tokenizer = self.core.tokenizer
        self._ids = itertools.count()
        self.sampling_defaults = generation_defaults(generation_config, self.core.loaded.path,
                                                     override_generation_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's defaults (vLLM's name)."""
        return SamplingParams(**self.sampling_defaults)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        # One prompt (text or token ids) or a list of them (checking prompts[0] narrows nothing for mypy).
        batch = cast("Sequence[str | Sequence[int]]", [prompts] if one else prompts)
        if isinstance(params, Sequence):
            plist = list(params)
        else:
            plist = [params or self.get_default_sampling_params()] * len(batch)
        if len(plist) != len(batch):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        results: dict[str, CompletionOutput] = {}
        order = []
        for prompt, p in zip(batch, plist, strict=True):
            rid = str(next(self._ids))
            ids = self.encode(prompt)
            self.core.add_request(rid, ids, p)
            results[rid] = CompletionOutput(request_id=rid, prompt_token_ids=ids)
            order.append(rid)
        bar = tqdm(total=len(order), desc="generate", disable=not use_tqdm)
        t0 = time.perf_counter()
        while self.core.has_unfinished():
            outputs, _ = self.core.step()
            for out in outputs:
                r = results[out.request_id]
                if out.new_token_ids and r.time_to_first_token is None:
                    r.time_to_first_token = time.perf_counter() - t0
                r.token_ids.extend(out.new_token_ids)
                r.text += out.new_text
                if out.new_logprobs:
                    r.logprobs.extend(out.new_logprobs)
                if out.finished:
                    r.e2e_latency = time.perf_counter() - t0
                    r.finish_reason, r.stop_reason, r.error = out.finish_reason, out.stop_reason, out.error
                    r.num_cached_tokens = out.num_cached_tokens
                    r.spec_num_drafts = out.spec_num_drafts
                    r.spec_num_draft_tokens = out.spec_num_draft_tokens
                    r.spec_num_accepted_tokens = out.spec_num_accepted_tokens
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]
