"""Fault injection for reliability tests (`EngineConfig.fault_injection`; never set in production).

A rule maps a fault kind to a trigger token id: a request whose prompt contains that token suffers
the fault each time it is in a step (`add_request_error`: a MemoryError once, as the engine takes it in).
Tests send prompts as token-id lists, so they choose exactly which requests fail while the rest of the
batch must carry on unharmed.
"""

from __future__ import annotations

from typing import Literal

FaultKind = Literal["raise_in_forward", "nan_logits", "bad_token", "proposer_error", "detokenize_error",
                    "add_request_error"]
FAULT_KINDS: tuple[str, ...] = ("raise_in_forward", "nan_logits", "bad_token", "proposer_error",
                                "detokenize_error", "add_request_error")


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    def __init__(self, rules: dict[str, int]) -> None:
        unknown = set(rules) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"fault_injection: unknown fault kinds {sorted(unknown)} (known: {FAULT_KINDS})")
        self.rules = dict(rules)

    def hits(self, kind: FaultKind, prompt_token_ids: list[int]) -> bool:
        trigger = self.rules.get(kind)
        return trigger is not None and trigger in prompt_token_ids
