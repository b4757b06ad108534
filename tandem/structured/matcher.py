"""HostMask: one request's CPU-side next-token constraint — a grammar matcher (xgrammar or llguidance), multi-token
bad words, or both — advanced with each sampled token and written as a row of a token bitmask."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tandem.structured.grammar import LLGuidanceStarts

logger = logging.getLogger(__name__)


def _is_llguidance(compiled: Any) -> bool:
    """An llguidance grammar (GrammarCache's LLGuidanceStarts, or a start-state LLMatcher) rather than an xgrammar
    CompiledGrammar."""
    return isinstance(compiled, LLGuidanceStarts) or type(compiled).__name__ == "LLMatcher"


class HostMask:
    def __init__(self, compiled_grammar: Any | None, bad_word_ids: tuple[tuple[int, ...], ...] = ()) -> None:
        self.matcher: Any = None
        self.llguidance = compiled_grammar is not None and _is_llguidance(compiled_grammar)
        if self.llguidance:  # the cache holds matchers in their start state: each request advances its own copy
            start = compiled_grammar.next_start() if isinstance(compiled_grammar, LLGuidanceStarts) else compiled_grammar
            self.matcher = start.deep_copy()
        elif compiled_grammar is not None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(compiled_grammar)
        self.bad_word_ids = bad_word_ids
        # Its last llguidance row allowed most of the vocabulary (inside a string): the next fill of this matcher is
        # likely one of the slow ones (milliseconds, where most rows take microseconds). Orders the rows of a fill.
        self.dense = False
        # A row of this matcher's current state computed apart, on the row pool (fill_rows' `defer`), into its own
        # buffer: the step waits for it only while the GPU has work, and where it is late its request sits that step
        # out and the next step's row is this one (the matcher has not moved). Nothing else touches the matcher
        # while the job runs.
        self.job: Future[None] | None = None
        self.job_bits: np.ndarray | None = None  # [1, ceil(V / 32)] int32, the job's row

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
            assert mask.job is None, "a token for a matcher whose row is still computed apart"
            if mask.matcher is None or mask.is_terminated:
                continue
            (llg if mask.llguidance else xgr).append((mask.matcher, token))
        if threaded is None:
            threaded = mask_threads() >= 4
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

    def forced_tokens(self, max_tokens: int, encode: Callable[[str], list[int]]) -> list[int]:
        """Up to max_tokens tokens the grammar forces from here (it admits exactly one continuation), in its
        canonical tokenization; the matcher is left as it was. llguidance: its fast-forward tokens (which leave out
        a last token that could merge with what follows). xgrammar: its jump-forward string, encoded with `encode`,
        checked token by token against the matcher and less its last token (which could merge with what follows;
        a string whose tokens the matcher refuses gives only the prefix it accepts)."""
        self.settle()  # a row still computed apart holds the matcher
        m = self.matcher
        if m is None or max_tokens <= 0 or self.is_terminated:
            return []
        if self.llguidance:
            return list(m.compute_ff_tokens()[:max_tokens])
        text = m.find_jump_forward_string()
        if not text:
            return []
        tokens = encode(text)[: max_tokens + 1]
        num_ok = 0
        for token in tokens:
            if not m.accept_token(token):
                break
            num_ok += 1
        if num_ok:
            m.rollback(num_ok)
        return tokens[: min(num_ok, len(tokens) - 1, max_tokens)]

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last num_tokens accepted tokens (drafts consumed to fill their rows' masks)."""
        if num_tokens > 0 and self.matcher is not None:
            self.matcher.rollback(num_tokens)

    @staticmethod
    def fill_draft_rows(bits: Any, rows: list[tuple[list[int], HostMask | None, list[int], list[int]]]) -> None:
        """fill_rows for requests with drafts: each entry is (bitmask row of each position 0..k, mask, tokens so
        far, its k drafts). Position j's row is the mask after drafts 0..j-1: the matchers step through the
        drafts one position at a time, all requests' rows of a position filled in one call, and are rolled back
        at the end. A draft the grammar refuses (never a forced one) ends its request's walk; the rows after it
        allow everything (the verify step rejects that draft, so their samples are never used)."""
        for _, mask, _, _ in rows:
            if mask is not None:
                mask.settle()  # a row still computed apart holds the matcher (these rows are filled anew)
        rows = HostMask._fill_llguidance_draft_rows(bits, rows)
        num_positions = max((len(r[0]) for r in rows), default=0)
        consumed = [0] * len(rows)
        alive = [True] * len(rows)
        for j in range(num_positions):
            entries: list[tuple[int, HostMask | None, list[int]]] = []
            for n, (bit_rows, mask, tokens, drafts) in enumerate(rows):
                if j >= len(bit_rows):
                    continue
                if not alive[n]:
                    entries.append((bit_rows[j], None, tokens))
                    continue
                so_far = tokens + drafts[:j] if j and mask is not None and mask.bad_word_ids else tokens
                entries.append((bit_rows[j], mask, so_far))
            HostMask.fill_rows(bits, entries)
            for n, (bit_rows, mask, _, drafts) in enumerate(rows):
                if j + 1 >= len(bit_rows) or not alive[n] or mask is None or mask.matcher is None:
                    continue
                if mask.is_terminated or not mask._try_accept(drafts[j]):
                    alive[n] = False
                    continue
                consumed[n] += 1
        for (_, mask, _, _), n in zip(rows, consumed):
            if mask is not None:
                mask.rollback(n)

    @staticmethod
    def _fill_llguidance_draft_rows(bits: Any, rows: list[tuple[list[int], HostMask | None, list[int], list[int]]]
                                    ) -> list[tuple[list[int], HostMask | None, list[int], list[int]]]:
        """The llguidance rows of fill_draft_rows with drafts, consecutive bitmask rows and no bad words, in one call
        that walks each matcher through its drafts, fills, and rolls back, spread over the executor's threads;
        returns the other rows (those without drafts are filled with the rest, position 0 only)."""
        fast, rest = [], []
        for entry in rows:
            bit_rows, mask, _, drafts = entry
            if (drafts and mask is not None and mask.llguidance and not mask.bad_word_ids and not mask._allows_all()
                    and bit_rows[-1] - bit_rows[0] == len(bit_rows) - 1 == len(drafts)):
                fast.append((mask.matcher, bit_rows[0], list(drafts)))
                bits[bit_rows[0] : bit_rows[-1] + 1].fill_(-1)  # rows past a refused draft (never used) allow all
            else:
                rest.append(entry)
        if fast:
            from llguidance.numpy import fill_next_token_bitmask_par_with_draft_tokens

            fill_next_token_bitmask_par_with_draft_tokens(_llg_executor(), fast, bits.numpy())
        return rest

    def _try_accept(self, token_id: int) -> bool:
        """Accepts a token if the grammar allows it, else leaves the matcher as it was (an llguidance matcher that
        consumes a refused token is in its error state for good)."""
        m = self.matcher
        if self.llguidance:
            return m.validate_tokens([token_id]) == 1 and m.consume_token(token_id)
        return m.accept_token(token_id)

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
    def fill_rows(bits: Any, rows: list[tuple[int, HostMask | None, list[int]]], spread: bool = True,
                  defer: Callable[[int], bool] | None = None) -> list[int]:
        """Writes rows of the int32 bitmask `bits` (a CPU tensor [rows, ceil(V/32)]), one per (row index, mask or
        None for "allow all", the request's tokens so far): the grammar's allowed set, minus the last token of
        each bad word whose other tokens end the sequence so far. The grammar rows of each backend go in one call
        that spreads them over its threads (an xgrammar row under a bounded string can take milliseconds); with
        `spread`, llguidance's rows go in an order that spaces out the likely slow ones (spread_slow_rows). The
        order changes nothing but the time: each row is written from its own matcher.

        `defer(index)`: whether that row may be computed apart. Such an llguidance row whose last row was dense (the
        likely slow ones), and any row whose job (`job`) is still to be settled, are not written here: each runs on
        the row pool, and the returned indices are those rows, for `settle` (their rows here allow everything)."""
        xgr_matchers, xgr_indices = [], []
        llg_rows: list[tuple[Any, int]] = []
        llg_masks: list[HostMask] = []
        deferred: list[int] = []
        for index, mask, _ in rows:
            if mask is not None and mask.job is not None:  # a row computed apart, not settled: its matcher is busy
                if defer is None:  # nothing here settles it later: its row now
                    mask.settle(bits[index])
                    continue
                deferred.append(index)
                bits[index].fill_(-1)
            elif mask is None or mask._allows_all():
                bits[index].fill_(-1)
            elif (defer is not None and mask.dense and mask.llguidance and not mask.bad_word_ids
                  and defer(index)):
                mask._start_job(bits.shape[1])
                deferred.append(index)
                bits[index].fill_(-1)
            elif mask.llguidance:
                llg_rows.append((mask.matcher, index))
                llg_masks.append(mask)
            else:
                xgr_matchers.append(mask.matcher)
                xgr_indices.append(index)
        if len(xgr_matchers) == 1:
            xgr_matchers[0].fill_next_token_bitmask(bits, xgr_indices[0])
        elif xgr_matchers:
            _xgr_batch().batch_fill_next_token_bitmask(xgr_matchers, bits, xgr_indices)
        if llg_rows:
            from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

            bits_np = bits.numpy()
            if len(llg_rows) == 1:
                fill_next_token_bitmask(llg_rows[0][0], bits_np, llg_rows[0][1])
            else:
                order = spread_slow_rows([m.dense for m in llg_masks]) if spread else range(len(llg_rows))
                fill_next_token_bitmask_par(_llg_executor(), [llg_rows[i] for i in order], bits_np)
            for mask, dense in zip(llg_masks, dense_rows(bits_np, [index for _, index in llg_rows])):
                mask.dense = dense
        for index, mask, all_token_ids in rows:
            if mask is not None and mask.bad_word_ids:
                mask._remove_bad_words(bits[index].numpy(), all_token_ids)
        return deferred

    def _start_job(self, num_words: int) -> None:
        """Computes this matcher's row on the row pool, into job_bits."""
        if self.job_bits is None or self.job_bits.shape[1] != num_words:
            self.job_bits = np.empty((1, num_words), dtype=np.int32)
        self.job = _row_pool().submit(_compute_row, self.matcher, self.job_bits)

    @property
    def job_done(self) -> bool:
        """Whether no row of this matcher is being computed apart (none, or its job has finished)."""
        return self.job is None or self.job.done()

    def settle(self, row: Any | None = None) -> None:
        """Waits for the row computed apart, if any (raising what it raised), and writes it to `row` (a bitmask row,
        a CPU tensor [ceil(V/32)]) where given; the matcher is free again."""
        job, self.job = self.job, None
        if job is None:
            return
        job.result()
        assert self.job_bits is not None
        if row is not None:
            row.numpy()[:] = self.job_bits[0]
        self.dense = dense_rows(self.job_bits, [0])[0]

    def _remove_bad_words(self, row: Any, all_token_ids: list[int]) -> None:
        n = len(all_token_ids)
        for seq in self.bad_word_ids:
            k = len(seq) - 1
            if k <= n and (k == 0 or all_token_ids[n - k :] == list(seq[:-1])):
                token = seq[-1]
                row[token >> 5] &= ~np.int32(np.uint32(1 << (token & 31)).view(np.int32))


def spread_slow_rows(slow: list[bool]) -> list[int]:
    """An order of rows (indices into `slow`) with the slow ones evenly spaced, the first slow row first. A parallel
    fill splits its list in halves, again and again, and each thread runs a contiguous run of it: evenly spaced
    slow rows fall into different runs (two slow rows in one run would double that thread's time) and sit where
    the threads start."""
    slow_rows = [i for i, s in enumerate(slow) if s]
    n, k = len(slow), len(slow_rows)
    if k == 0 or k == n:
        return list(range(n))
    fast_rows = iter(i for i, s in enumerate(slow) if not s)
    order: list[int] = []
    for j, row in enumerate(slow_rows):
        while len(order) < j * n // k:  # slow row j at position j n / k (increasing by more than 1: n > k)
            order.append(next(fast_rows))
        order.append(row)
    order.extend(fast_rows)
    return order


# Words of a row read to tell a dense mask: a band from the middle of the vocabulary (ordinary tokens).
_DENSITY_WORDS = 16


def dense_rows(bits: Any, indices: list[int]) -> list[bool]:
    """Whether each bitmask row (numpy int32 [rows, W]) allows more than half of a band of tokens from the middle of
    the vocabulary: such a grammar state (inside a string) takes milliseconds to fill where most take microseconds,
    and the next state is most often alike."""
    width = bits.shape[1]
    lo = max(0, width // 2 - _DENSITY_WORDS // 2)
    band = bits[indices, lo : lo + _DENSITY_WORDS]  # [len(indices), <= _DENSITY_WORDS]
    allowed = np.unpackbits(np.ascontiguousarray(band).view(np.uint8), axis=1).sum(axis=1)
    return (2 * allowed > 32 * band.shape[1]).tolist()


def mask_threads() -> int:
    """The mask threads: TANDEM_MASK_THREADS where set (to compare counts: the engine's own thread wants a core
    too), else one per core up to 16."""
    value = os.environ.get("TANDEM_MASK_THREADS")
    if value is None:
        return max(1, min(16, len(os.sched_getaffinity(0))))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"TANDEM_MASK_THREADS must be a positive integer, got {value!r}")
    return int(value)


_XGR_BATCH: Any = None
_LLG_EXECUTOR: Any = None
_ROW_POOL: ThreadPoolExecutor | None = None


def _compute_row(matcher: Any, out: np.ndarray) -> None:
    """One llguidance row into `out` ([1, W] int32); the call releases the GIL while it computes."""
    from llguidance.numpy import fill_next_token_bitmask

    fill_next_token_bitmask(matcher, out, 0)


def _row_pool() -> ThreadPoolExecutor:
    """The threads of rows computed apart (HostMask.fill_rows' `defer`), one per mask thread."""
    global _ROW_POOL
    if _ROW_POOL is None:
        _ROW_POOL = ThreadPoolExecutor(max_workers=mask_threads(), thread_name_prefix="grammar-row")
    return _ROW_POOL


def _xgr_batch() -> Any:
    """One xgrammar BatchGrammarMatcher per process, a thread per core up to 16 (its "auto" takes half the cores:
    one thread on a 2-core machine)."""
    global _XGR_BATCH
    if _XGR_BATCH is None:
        import xgrammar as xgr

        _XGR_BATCH = xgr.BatchGrammarMatcher(mask_threads())
    return _XGR_BATCH


def _llg_executor() -> Any:
    """One llguidance executor per process, a thread per core up to 16."""
    global _LLG_EXECUTOR
    if _LLG_EXECUTOR is None:
        import llguidance

        _LLG_EXECUTOR = llguidance.LLExecutor(mask_threads())
    return _LLG_EXECUTOR
