"""HostMask: one request's CPU-side next-token constraint — a grammar matcher, multi-token bad words, or both —
advanced with each sampled token and written as a row of a token bitmask."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


class HostMask:
    def __init__(self, compiled_grammar: Any | None, bad_word_ids: tuple[tuple[int, ...], ...] = ()) -> None:
        self.matcher = None
        if compiled_grammar is not None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(compiled_grammar)
        self.bad_word_ids = bad_word_ids
        self.rejected = False  # a token the grammar did not allow reached it (never, with the mask applied)

    def accept(self, token_id: int) -> None:
        """Advances the grammar with a sampled token."""
        m = self.matcher
        if m is None or m.is_terminated():
            return
        if not m.accept_token(token_id):
            self.rejected = True
            logger.warning("grammar rejected sampled token %d", token_id)

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def fill(self, bits: Any, index: int, all_token_ids: list[int]) -> None:
        """Writes row `index` of the int32 bitmask `bits` (a CPU tensor [rows, ceil(V/32)]): the grammar's
        allowed set, minus the last token of each bad word whose other tokens end the sequence so far."""
        HostMask.fill_rows(bits, [(index, self, all_token_ids)])

    @staticmethod
    def fill_rows(bits: Any, rows: list[tuple[int, HostMask | None, list[int]]]) -> None:
        """fill() for many rows (row index, mask or None for "allow all", the request's tokens so far): the
        grammar rows in one xgrammar call that spreads them over its threads (a row under a bounded string
        can take milliseconds: its tokens are checked one by one), then the bad words row by row."""
        matchers, indices = [], []
        for index, mask, _ in rows:
            m = mask.matcher if mask is not None else None
            if m is not None and not m.is_terminated():
                matchers.append(m)
                indices.append(index)
            else:
                bits[index].fill_(-1)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bits, indices[0])
        elif matchers:
            _batch_matcher().batch_fill_next_token_bitmask(matchers, bits, indices)
        for index, mask, all_token_ids in rows:
            if mask is not None and mask.bad_word_ids:
                mask._remove_bad_words(bits[index].numpy(), all_token_ids)

    def _remove_bad_words(self, row: Any, all_token_ids: list[int]) -> None:
        n = len(all_token_ids)
        for seq in self.bad_word_ids:
            k = len(seq) - 1
            if k <= n and (k == 0 or all_token_ids[n - k :] == list(seq[:-1])):
                token = seq[-1]
                row[token >> 5] &= ~np.int32(np.uint32(1 << (token & 31)).view(np.int32))


_BATCH: Any = None


def _batch_matcher() -> Any:
    """One xgrammar BatchGrammarMatcher per process, with a thread per core up to 16 (xgrammar's "auto" takes
    half the cores: one thread on a 2-core machine)."""
    global _BATCH
    if _BATCH is None:
        import xgrammar as xgr

        _BATCH = xgr.BatchGrammarMatcher(max(1, min(16, len(os.sched_getaffinity(0)))))
    return _BATCH
