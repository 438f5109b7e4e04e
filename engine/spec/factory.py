"""Build the proposer a speculative config asks for (start-up time, fails loudly)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.config import DType
from engine.kv.cache import PagedKVCache
from engine.models.eagle3 import LoadedEagle3, load_eagle3
from engine.models.loader import LoadedModel, load_model
from engine.models.mtp_assistant import load_assistant
from engine.spec.config import DraftModelConfig, Eagle3Config, MTPConfig, NgramConfig, SuffixConfig
from engine.spec.draft_model import DraftModelProposer, check_draft_compatible
from engine.spec.eagle3 import Eagle3Proposer
from engine.spec.mtp import MTPProposer
from engine.spec.ngram import NgramProposer
from engine.spec.proposer import Proposer
from engine.spec.suffix import SuffixProposer

Draft = LoadedModel | LoadedEagle3  # what has its own KV cache beside the target's


def load_draft(spec: Any, target: LoadedModel, dtype: DType, progress: bool,
               share_target: bool = True) -> Draft | None:
    """Load and check the draft model of a draft_model config or the head of an eagle3 one (None for the
    other methods). `share_target`: the target as its own draft reuses the target's weights (not when
    they are a tensor-parallel slice: the draft runs whole on rank 0)."""
    if isinstance(spec, Eagle3Config):
        try:
            return load_eagle3(spec.model, target, spec.revision, spec.eagle_aux_hidden_state_layer_ids)
        except OSError as e:
            raise ValueError(f"invalid --speculative-config: model: cannot load {spec.model!r}: {e}") from e
    if isinstance(spec, MTPConfig):
        return None  # the assistant reads the target's KV: loaded by build_proposer, next to the runner
    if not isinstance(spec, DraftModelConfig):
        return None
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


def draft_bytes_per_block(draft: Draft, block_size: int) -> int:
    if isinstance(draft, LoadedEagle3):
        return Eagle3Proposer.bytes_per_block(draft, block_size)
    return DraftModelProposer.bytes_per_block(draft, block_size)


def build_proposer(spec: Any, draft: Draft | None, num_blocks: int, block_size: int,
                   target: LoadedModel | None = None, kv: PagedKVCache | None = None,
                   attention_fn: Callable[..., Any] | None = None) -> Proposer:
    """`kv`: the target's paged KV (MTP assistants read it; an EAGLE-3 head's KV has its block count);
    `attention_fn`: the target's attention backend, which a draft model runs too where it can."""
    if isinstance(spec, NgramConfig):
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if isinstance(spec, SuffixConfig):
        return SuffixProposer(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                              spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)
    if isinstance(spec, Eagle3Config):
        assert isinstance(draft, LoadedEagle3)
        if kv is None:
            raise ValueError("method 'eagle3' needs the target's KV cache (the head's KV uses its block ids)")
        use_c = spec.draft_backend == "auto"
        if attention_fn is None:
            return Eagle3Proposer(draft, kv.num_blocks, block_size, use_c=use_c)
        return Eagle3Proposer(draft, kv.num_blocks, block_size, attention_fn, use_c)
    if isinstance(spec, DraftModelConfig):
        assert isinstance(draft, LoadedModel)
        probabilistic = spec.draft_sample_method == "probabilistic"
        if attention_fn is None:
            return DraftModelProposer(draft, num_blocks, block_size, probabilistic=probabilistic)
        return DraftModelProposer(draft, num_blocks, block_size, attention_fn, probabilistic)
    if isinstance(spec, MTPConfig):
        if target is None or kv is None:
            raise ValueError("method 'mtp' needs the target model and its KV cache")
        try:
            assistant = load_assistant(spec.model, target, spec.revision)
        except OSError as e:
            raise ValueError(f"invalid --speculative-config: model: cannot load {spec.model!r}: {e}") from e
        return MTPProposer(assistant, target, kv, spec.draft_min_token_prob,
                           use_c=spec.draft_backend == "auto",
                           probabilistic=spec.draft_sample_method == "probabilistic")
    raise ValueError(f"unsupported speculative method {spec.method!r}")
