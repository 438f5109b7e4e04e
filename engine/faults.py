"""Fault injection for reliability tests (`EngineConfig.fault_injection`; never set in production): a rule
maps a fault kind to a trigger token id, and a request whose prompt holds that token suffers the fault."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

FaultKind = Literal["raise_in_forward", "nan_logits", "bad_token", "proposer_error", "detokenize_error",
                    "add_request_error"]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)


class InjectedFault(RuntimeError):
    pass


class FaultHooks:
    def __init__(self, rules: dict[str, int] | None = None) -> None:
        rules = rules or {}
        unknown = set(rules) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"fault_injection: unknown fault kinds {sorted(unknown)} (known: {FAULT_KINDS})")
        self.rules = dict(rules)

    def hits(self, kind: FaultKind, prompt_token_ids: list[int]) -> bool:
        trigger = self.rules.get(kind)
        return trigger is not None and trigger in prompt_token_ids

    def rows(self, kind: FaultKind, prompts: Iterable[list[int]]) -> list[bool]:
        """Per request: whether the fault hits it."""
        return [self.hits(kind, p) for p in prompts]

    def raise_if(self, kind: FaultKind, prompts: Iterable[list[int]]) -> None:
        """Raise if the fault hits any of these requests (MemoryError for add_request_error)."""
        if kind in self.rules and any(self.rows(kind, prompts)):
            error = MemoryError if kind == "add_request_error" else InjectedFault
            raise error(f"injected fault: {kind}")


NO_FAULTS = FaultHooks()
