"""Per-request back-off with static K: after `miss_limit` verifications in a row that accept nothing, a
request skips drafting for `base_skip` steps, doubling on each further miss (up to `max_skip`); any
accepted draft resets it. A rejected verification costs a wider step for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _State:
    misses: int = 0
    skip: int = 0


class DraftBackoff:
    def __init__(self, miss_limit: int = 2, base_skip: int = 2, max_skip: int = 64) -> None:
        self.miss_limit = miss_limit
        self.base_skip = base_skip
        self.max_skip = max_skip
        self._state: dict[str, _State] = {}

    def should_draft(self, request_id: str) -> bool:
        """Called once per step per candidate request; consumes one skipped step."""
        st = self._state.get(request_id)
        if st is None or st.skip == 0:
            return True
        st.skip -= 1
        return False

    def observe(self, request_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        st = self._state.setdefault(request_id, _State())
        if num_accepted > 0:
            st.misses = 0
            return
        st.misses += 1
        if st.misses >= self.miss_limit:
            st.skip = min(self.base_skip << (st.misses - self.miss_limit), self.max_skip)

    def release(self, request_id: str) -> None:
        self._state.pop(request_id, None)
