"""Build the proposer a speculative config asks for (start-up time, fails loudly)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.models.loader import LoadedModel
from engine.runner import ModelRunner
from engine.spec.config import DraftModelConfig, MTPConfig, NgramConfig, SuffixConfig
from engine.spec.proposer import Proposer


def load_draft(spec: Any, target: LoadedModel, dtype: str, progress: bool,
               share_target: bool = True) -> LoadedModel | None:
    """Load and check the draft model of a draft_model config (None for model-free methods).
    `share_target`: the target as its own draft reuses the target's weights (not when they are a
    tensor-parallel slice: the draft runs whole on rank 0)."""
    if isinstance(spec, MTPConfig):
        return None  # the assistant reads the target's KV: loaded by build_proposer, next to the runner
    if not isinstance(spec, DraftModelConfig):
        return None
    from engine.models.loader import load_model
    from engine.spec.draft_model import check_draft_compatible

    same = Path(spec.model).expanduser().resolve() == Path(target.path).resolve() or spec.model == target.name
    if same and spec.quantization is None and share_target:
        draft = target  # the target as its own draft shares weights, not KV
    else:
        try:
            draft = load_model(target.path if same else spec.model, dtype=dtype, revision=spec.revision,
                               progress=progress, quantization=spec.quantization)
        except (OSError, ValueError) as e:
            raise ValueError(f"invalid --speculative-config: model: cannot load {spec.model!r}: {e}") from e
    check_draft_compatible(target, draft)
    return draft


def build_proposer(spec: Any, draft: LoadedModel | None, num_blocks: int, block_size: int,
                   target: LoadedModel | None = None, runner: ModelRunner | None = None) -> Proposer:
    if isinstance(spec, NgramConfig):
        from engine.spec.ngram import NgramProposer

        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if isinstance(spec, SuffixConfig):
        from engine.spec.suffix import SuffixProposer

        return SuffixProposer(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                              spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)
    if isinstance(spec, DraftModelConfig):
        from engine.spec.draft_model import DraftModelProposer

        assert draft is not None
        probabilistic = spec.draft_sample_method == "probabilistic"
        if runner is None:
            return DraftModelProposer(draft, num_blocks, block_size, probabilistic=probabilistic)
        return DraftModelProposer(draft, num_blocks, block_size, runner.caches[0].attention_fn, probabilistic)
    if isinstance(spec, MTPConfig):
        from engine.models.mtp_assistant import load_assistant
        from engine.spec.mtp import MTPProposer

        if target is None or runner is None:
            raise ValueError("method 'mtp' needs the target model and its runner")
        try:
            assistant = load_assistant(spec.model, target, spec.revision)
        except OSError as e:
            raise ValueError(f"invalid --speculative-config: model: cannot load {spec.model!r}: {e}") from e
        return MTPProposer(assistant, target, runner, spec.draft_min_token_prob,
                           use_c=spec.draft_backend == "auto",
                           probabilistic=spec.draft_sample_method == "probabilistic")
    raise ValueError(f"unsupported speculative method {spec.method!r}")
