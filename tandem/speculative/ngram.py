"""Prompt-lookup (n-gram) proposer: drafts are the tokens that followed the latest earlier occurrence of a request's
last n tokens in its own prompt and output. Host-only: it reads token lists the host already has."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Looks up the last prompt_lookup_max .. prompt_lookup_min tokens (longest first) in the tokens before them."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose_all(self, requests: list[tuple[Any, int]]) -> list[list[int]]:
        """Drafts for each (request, most drafts) pair."""
        return [self.propose(request.all_token_ids, k) for request, k in requests]

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to max_drafts tokens that followed the latest earlier match of the longest suffix that has one;
        [] when no suffix of min_n..max_n tokens occurred before."""
        num = len(token_ids)
        if max_drafts <= 0 or num <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            # Windows tokens[i : i + n] with i + n <= num - 1: each has a token after it, and none is the suffix.
            windows = sliding_window_view(tokens[: num - 1], n)
            hits = np.flatnonzero((windows == tokens[num - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return token_ids[start : start + max_drafts]
        return []
