"""Speculative-decoding counters from a server's Prometheus `/metrics`, diffed over a run.

Servers without `/metrics` (mlx_lm.server) or without speculation simply yield None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_PREFIX = "vllm:spec_decode_"


@dataclass(slots=True)
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: dict[int, float] = field(default_factory=dict)

    def minus(self, before: SpecCounters) -> SpecCounters:
        pos = {p: v - before.per_pos.get(p, 0.0) for p, v in self.per_pos.items()}
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, pos)


def parse_spec_counters(text: str) -> SpecCounters | None:
    """Sum the spec-decode counters over every label set (model, engine); None when absent."""
    out = SpecCounters()
    seen = False
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(_PREFIX):
            continue
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue  # skip *_created
            seen = True
            base = s.name[len(_PREFIX):-len("_total")]
            if base == "num_drafts":
                out.drafts += s.value
            elif base == "num_draft_tokens":
                out.draft_tokens += s.value
            elif base == "num_accepted_tokens":
                out.accepted += s.value
            elif base == "num_accepted_tokens_per_pos" and "position" in s.labels:
                p = int(s.labels["position"])
                out.per_pos[p] = out.per_pos.get(p, 0.0) + s.value
    return out if seen else None


async def scrape(client: httpx.AsyncClient, base_url: str) -> SpecCounters | None:
    try:
        resp = await client.get(base_url.rstrip("/") + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return parse_spec_counters(resp.text)
    except ValueError:  # not Prometheus text
        return None


def acceptance_summary(delta: SpecCounters | None) -> dict[str, Any] | None:
    """vLLM's definitions: acceptance rate = accepted / drafted tokens; mean acceptance length =
    1 + accepted / drafts (the bonus token included); per-position rate = accepted at i / drafts."""
    if delta is None:
        return None
    drafts = delta.drafts
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(delta.draft_tokens),
        "num_accepted_tokens": int(delta.accepted),
        "acceptance_rate": delta.accepted / delta.draft_tokens if delta.draft_tokens else None,
        "mean_acceptance_length": 1 + delta.accepted / drafts if drafts else None,
        "accepted_per_position": [int(delta.per_pos[p]) for p in sorted(delta.per_pos)],
        "acceptance_rate_per_position": [delta.per_pos[p] / drafts if drafts else None
                                         for p in sorted(delta.per_pos)],
    }


def merge_spec(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Add the counts of several `acceptance_summary` results and recompute the rates."""
    width = max(len(p["accepted_per_position"]) for p in parts)
    per_pos = {i: float(sum(p["accepted_per_position"][i] for p in parts
                            if i < len(p["accepted_per_position"]))) for i in range(width)}
    return acceptance_summary(SpecCounters(
        drafts=sum(p["num_drafts"] for p in parts), draft_tokens=sum(p["num_draft_tokens"] for p in parts),
        accepted=sum(p["num_accepted_tokens"] for p in parts), per_pos=per_pos)) or {}
