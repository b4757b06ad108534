"""HostMask: one request's CPU-side next-token constraint — a grammar matcher (xgrammar or llguidance), multi-token
bad words, or both — advanced with each sampled token and written as a row of a token bitmask."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def _is_llguidance(compiled: Any) -> bool:
    """An llguidance LLMatcher (GrammarCache's llguidance form) rather than an xgrammar CompiledGrammar."""
    return type(compiled).__name__ == "LLMatcher"


class HostMask:
    def __init__(self, compiled_grammar: Any | None, bad_word_ids: tuple[tuple[int, ...], ...] = ()) -> None:
        self.matcher: Any = None
        self.llguidance = compiled_grammar is not None and _is_llguidance(compiled_grammar)
        if self.llguidance:  # the cache holds a matcher in its start state: each request advances its own copy
            self.matcher = compiled_grammar.deep_copy()
        elif compiled_grammar is not None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(compiled_grammar)
        self.bad_word_ids = bad_word_ids

    def accept(self, token_id: int) -> bool:
        """Advances the grammar with a sampled token; False when the grammar rejects it (never, with the mask
        applied). Once the grammar is done (xgrammar: it took a stop token; llguidance: only a stop token may
        follow) nothing more is consumed."""
        m = self.matcher
        if m is None or self.is_terminated:
            return True
        if not (m.consume_token(token_id) if self.llguidance else m.accept_token(token_id)):
            logger.warning("grammar rejected sampled token %d", token_id)
            return False
        return True

    @staticmethod
    def accept_all(tokens: list[tuple[HostMask, int]], threaded: bool | None = None) -> int:
        """`accept` of every (mask, sampled token) of one step (each mask at most once), the rows of each backend
        in one call spread over its threads (`threaded`; default: with 4 threads or more: a token takes a few
        microseconds, and on 2 cores waking the threads cost more than they saved, 0.41 against 0.22 ms for 64
        rows); the number of tokens a grammar refused."""
        llg, xgr = [], []
        for mask, token in tokens:
            if mask.matcher is None or mask.is_terminated:
                continue
            (llg if mask.llguidance else xgr).append((mask.matcher, token))
        if threaded is None:
            threaded = _num_threads() >= 4
        if len(llg) + len(xgr) <= 1 or not threaded:  # nothing to spread: the plain call
            return sum(not mask.accept(token) for mask, token in tokens if mask.matcher is not None)
        results: list[bool] = []
        if llg:
            from llguidance.numpy import consume_token_par

            results += consume_token_par(_llg_executor(), llg)
        if xgr:
            results += _xgr_batch().batch_accept_token([m for m, _ in xgr], [t for _, t in xgr])
        rejected = [token for (_, token), ok in zip(llg + xgr, results) if not ok]
        for token in rejected:
            logger.warning("grammar rejected sampled token %d", token)
        return len(rejected)

    @property
    def is_terminated(self) -> bool:
        m = self.matcher
        if m is None:
            return False
        return m.is_stopped() if self.llguidance else m.is_terminated()

    def _allows_all(self) -> bool:
        """No grammar row to fill: no grammar, xgrammar past its stop token, or an llguidance error state (a
        rejected token: the request is past saving). A stopped llguidance matcher still fills: stop tokens."""
        m = self.matcher
        if m is None:
            return True
        return m.is_error() if self.llguidance else m.is_terminated()

    @staticmethod
    def fill_rows(bits: Any, rows: list[tuple[int, HostMask | None, list[int]]]) -> None:
        """Writes rows of the int32 bitmask `bits` (a CPU tensor [rows, ceil(V/32)]), one per (row index, mask or
        None for "allow all", the request's tokens so far): the grammar's allowed set, minus the last token of
        each bad word whose other tokens end the sequence so far. The grammar rows of each backend go in one call
        that spreads them over its threads (an xgrammar row under a bounded string can take milliseconds)."""
        xgr_matchers, xgr_indices, llg_rows = [], [], []
        for index, mask, _ in rows:
            if mask is None or mask._allows_all():
                bits[index].fill_(-1)
            elif mask.llguidance:
                llg_rows.append((mask.matcher, index))
            else:
                xgr_matchers.append(mask.matcher)
                xgr_indices.append(index)
        if len(xgr_matchers) == 1:
            xgr_matchers[0].fill_next_token_bitmask(bits, xgr_indices[0])
        elif xgr_matchers:
            _xgr_batch().batch_fill_next_token_bitmask(xgr_matchers, bits, xgr_indices)
        if llg_rows:
            from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

            if len(llg_rows) == 1:
                fill_next_token_bitmask(llg_rows[0][0], bits.numpy(), llg_rows[0][1])
            else:
                fill_next_token_bitmask_par(_llg_executor(), llg_rows, bits.numpy())
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


def _num_threads() -> int:
    return max(1, min(16, len(os.sched_getaffinity(0))))


_XGR_BATCH: Any = None
_LLG_EXECUTOR: Any = None


def _xgr_batch() -> Any:
    """One xgrammar BatchGrammarMatcher per process, a thread per core up to 16 (its "auto" takes half the cores:
    one thread on a 2-core machine)."""
    global _XGR_BATCH
    if _XGR_BATCH is None:
        import xgrammar as xgr

        _XGR_BATCH = xgr.BatchGrammarMatcher(_num_threads())
    return _XGR_BATCH


def _llg_executor() -> Any:
    """One llguidance executor per process, a thread per core up to 16."""
    global _LLG_EXECUTOR
    if _LLG_EXECUTOR is None:
        import llguidance

        _LLG_EXECUTOR = llguidance.LLExecutor(_num_threads())
    return _LLG_EXECUTOR
