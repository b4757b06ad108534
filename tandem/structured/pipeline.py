"""GrammarPipeline: everything host-side that constrained decoding needs, in the order the engine meets it.

Admission: a structured request's grammar compiles on the cache's worker (each distinct spec once) while the request
waits here; `admit` hands compiled ones to the scheduler. Masks: a constrained request holds a HostMask (its matcher,
and multi-token bad words) from admission to its end. Per step: a collected step's sampled tokens are handed over
(`advance`) and reach the matchers together, spread over the backend's threads, right before the next fill; the
bitmask rows of a launched step are filled from the matchers on a worker thread while the engine schedules and
prepares the next step (`start_fill`), and `finish` joins that fill (or runs it here) and enqueues the step's sampling.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

from tandem.request import Request
from tandem.sampling_params import StructuredOutputParams
from tandem.structured.grammar import BACKENDS, GrammarCache, LLGuidanceStarts
from tandem.structured.grammar import backend as default_backend
from tandem.structured.grammar import validate
from tandem.structured.matcher import HostMask, mask_threads


class GrammarPipeline:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], backend: str | None,
                 strict_json_schema: bool = True) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self.backend = backend or default_backend()  # --grammar-backend, else TANDEM_STRUCTURED_BACKEND
        self.strict_json_schema = strict_json_schema
        self._cache: GrammarCache | None = None  # built at the first structured request
        self.compiling: dict[str, tuple[Request, Future]] = {}  # waiting for their grammar
        self.masks: dict[str, Request] = {}  # requests holding a HostMask
        self._pool: ThreadPoolExecutor | None = None
        self._fill: tuple[object, Future[float]] | None = None  # (the step being filled, its job)
        self._switch_interval: float | None = None  # the interpreter's GIL switch interval while a fill runs
        # Sampled tokens not yet given to their matchers, one list per collected step, oldest first (a mask is in
        # a step at most once, so each list goes in one parallel call; the lists go in order).
        self._tokens: list[list[tuple[HostMask, int]]] = []
        self.fill_time_s = 0.0  # CPU time filling bitmasks (and enqueuing the sampling after them)
        self.wait_time_s = 0.0  # the engine's thread waiting for the worker's fills: the part on its critical path
        self.num_fills = 0
        self.num_rejections = 0  # sampled tokens a grammar refused (a masking bug if ever > 0)
        self.num_sat_out = 0  # rows that sat a step out, their grammar row late (settle)

    # ---------------------------------------------------------------- admission

    def submit(self, request: Request, spec: StructuredOutputParams) -> None:
        """Validates the spec (a quick ValueError with the compiler's message) and starts its compile; the request
        waits here until `admit` finds it compiled."""
        validate(spec, self.backend)
        if self._cache is None:
            # Distinct specs (each tool set is one) compile side by side; a spec seen before is not compiled again.
            self._cache = GrammarCache(self.tokenizer, self.vocab_size, self.stop_token_ids,
                                       max_workers=compile_workers(), backend_name=self.backend,
                                       strict_json_schema=self.strict_json_schema, lineages=grammar_lineages())
        self.compiling[request.request_id] = (request, self._cache.submit(spec))

    def admit(self, schedule: Callable[[Request], None], block: bool) -> list[tuple[Request, Exception]]:
        """Passes requests whose grammar compiled to `schedule` (and gives them their mask); returns those whose
        compile (or scheduling) failed. With `block` (nothing else to do) waits a little for the first compile."""
        if block:
            futures_wait([f for _, f in self.compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        failed: list[tuple[Request, Exception]] = []
        waiting: set[int] = set()  # grammars whose next lineage is not built: their later requests wait too
        for rid, (request, future) in list(self.compiling.items()):
            if not future.done():
                continue
            compiled = None if future.exception() is not None else future.result()
            if isinstance(compiled, LLGuidanceStarts) and (id(compiled) in waiting or not compiled.has_next()):
                waiting.add(id(compiled))  # its lineage is a millisecond or so away; requests keep their order
                continue
            del self.compiling[rid]
            try:
                compiled = future.result()
                schedule(request)
            except Exception as exc:
                failed.append((request, exc))
                continue
            self.attach(request, compiled)
        return failed

    @property
    def cache(self) -> GrammarCache | None:
        """The compile cache of the current backend (None until its first structured request)."""
        return self._cache

    def use_backend(self, name: str) -> None:
        """Compiles later requests with backend `name`; requests already under a grammar keep theirs. The old
        backend's cache is dropped, and a compile still in flight there is cancelled (its request fails)."""
        if name not in BACKENDS:
            raise ValueError(f"structured-output backend must be one of {BACKENDS}, got {name!r}")
        if name != self.backend and self._cache is not None:
            self._cache.shutdown()
            self._cache = None
        self.backend = name

    # ---------------------------------------------------------------- masks

    def attach(self, request: Request, compiled: object | None) -> None:
        """Gives a request its HostMask (compiled grammar, or None for bad words alone)."""
        request.host_mask = HostMask(compiled, request.bad_word_ids)
        self.masks[request.request_id] = request

    def drop(self, request: Request) -> None:
        request.host_mask = None
        self.masks.pop(request.request_id, None)
        if not self.masks and self._fill is None:  # no live mask left: its pending tokens no longer matter
            self._tokens.clear()

    @property
    def active(self) -> bool:
        """Whether some request holds a mask: a prepared step then looks for constrained rows."""
        return bool(self.masks)

    # ---------------------------------------------------------------- forced drafts

    def sync(self) -> None:
        """Gives the matchers every token handed to `advance`, here and now: call only with no fill running (every
        launched step collected), before reading a matcher's state (forced_drafts)."""
        assert self._fill is None, "a fill is running on the worker"
        self._accept_pending()

    def forced_drafts(self, request: Request, max_tokens: int) -> list[int]:
        """The tokens the request's grammar forces next, at most max_tokens (after `sync`): they are verified as
        drafts in its next step, each row under its own mask (HostMask.fill_draft_rows)."""
        mask = request.host_mask
        if mask is None or mask.matcher is None:
            return []
        return mask.forced_tokens(max_tokens, self._encode)

    def _encode(self, text: str) -> list[int]:
        """Text to token ids as the grammar's vocabulary reads them (xgrammar's jump-forward strings)."""
        if self.tokenizer is None:  # synthetic_vocab: the printable ASCII characters are ids 0..94
            return [b - 32 for b in text.encode() if 32 <= b < 127]
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---------------------------------------------------------------- per step

    def advance(self, tokens: list[tuple[HostMask, int]]) -> None:
        """Step N's sampled tokens of constrained requests ((mask, token), each mask once): they reach the matchers
        right before the next fill, on the thread that runs it (`fill` of start_fill / finish, never later)."""
        if tokens and self.masks:  # (no live mask: nothing will read these matchers again)
            self._tokens.append(tokens)

    def _accept_pending(self) -> None:
        pending, self._tokens = self._tokens, []
        for tokens in pending:
            self.num_rejections += HostMask.accept_all(tokens)

    def _accept_and_fill(self, fill: Callable[[], None]) -> float:
        return _timed(lambda: (self._accept_pending(), fill()))

    def start_fill(self, step: object, fill: Callable[[], None]) -> None:
        """Runs `fill` (the step's bitmask rows from the matchers), after the tokens handed to `advance` reach the
        matchers, on the worker thread; nothing if that step's fill is already running.

        The worker holds the GIL only between its parallel calls (a few Python lines each), but each time it wants
        it back while the engine's thread runs Python, CPython makes it wait up to the switch interval (5 ms by
        default: as long as a forward), so while a fill runs the interval is FILL_SWITCH_INTERVAL_S."""
        if self._fill is not None and self._fill[0] is step:
            assert not self._tokens, "tokens handed over after their step's fill started"
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        if self._switch_interval is None and sys.getswitchinterval() > FILL_SWITCH_INTERVAL_S:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(FILL_SWITCH_INTERVAL_S)
        self._fill = (step, self._pool.submit(self._accept_and_fill, fill))

    def filling(self, step: object) -> bool:
        """Whether the worker is filling `step`'s rows (started, not joined yet)."""
        return self._fill is not None and self._fill[0] is step

    def finish(self, step: object, fill: Callable[[], None], launch: Callable[[], None],
               settle: Callable[[], None] | None = None) -> None:
        """Joins the worker filling `step`'s rows (raising what it raised), or fills them here where none does, then
        calls `settle` (the rows computed apart) and `launch` (enqueue the step's sampling); raises on failure."""
        seconds = self.join(step)
        if seconds is None:
            seconds = self._accept_and_fill(fill)
        if settle is not None:
            t0 = time.perf_counter()
            settle()
            self.wait_time_s += time.perf_counter() - t0
        self.fill_time_s += seconds + _timed(launch)
        self.num_fills += 1

    def settle(self, rows: list[tuple[int, Any, HostMask]], write: Callable[[int, HostMask], None],
               may_sit_out: Callable[[Any], bool], gpu_idle: Callable[[], bool]) -> list[Any]:
        """The rows of a step that its fill computed apart ((bitmask row, request, mask)): each is written
        (`write`) once its job is done, waiting while the GPU has work (`gpu_idle()` False: the step's forward is
        still running); once the GPU waits, a late row whose request `may_sit_out` is left out and its request
        returned (it sits the step out: its row's token is dropped), the others are waited for."""
        late = list(rows)
        sat_out: list[Any] = []
        while late:
            pending = []
            for row, request, mask in late:
                if mask.job_done:
                    write(row, mask)
                else:
                    pending.append((row, request, mask))
            late = pending
            if not late:
                break
            if gpu_idle():
                for row, request, mask in late:
                    if may_sit_out(request):
                        sat_out.append(request)
                    else:
                        write(row, mask)
                break
            futures_wait([mask.job for _, _, mask in late if mask.job is not None], timeout=SETTLE_POLL_S,
                         return_when=FIRST_COMPLETED)
        self.num_sat_out += len(sat_out)
        return sat_out

    def join(self, step: object) -> float | None:
        """Waits for the worker filling `step`'s rows: the seconds it took, or None where no worker fills them."""
        job = self._fill
        if job is None or job[0] is not step:
            return None
        self._fill = None
        t0 = time.perf_counter()
        try:
            return job[1].result()
        finally:
            self.wait_time_s += time.perf_counter() - t0
            if self._switch_interval is not None:
                sys.setswitchinterval(self._switch_interval)
                self._switch_interval = None

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._cache is not None:
            self._cache.shutdown()


# The GIL switch interval while a fill runs on the worker: how long the worker may wait for the GIL each time one of
# its parallel calls returns while the engine's thread runs Python (a forced switch costs some microseconds).
FILL_SWITCH_INTERVAL_S = 1e-4


# How often a step waiting for its rows computed apart checks whether the GPU has run out of work.
SETTLE_POLL_S = 1e-4


def sit_out_enabled() -> bool:
    """Whether a late grammar row sits its step out (TANDEM_STRUCTURED_SIT_OUT, default 1; 0: the step waits for
    every row), read per engine."""
    value = os.environ.get("TANDEM_STRUCTURED_SIT_OUT", "1")
    if value not in ("0", "1"):
        raise ValueError(f"TANDEM_STRUCTURED_SIT_OUT must be 0 or 1, got {value!r}")
    return value == "1"


def grammar_lineages() -> int:
    """llguidance start matchers built per grammar (grammar.LLGuidanceStarts): TANDEM_GRAMMAR_LINEAGES, default
    one per mask thread. Copies of one matcher share its lock, so a step's rows filled on many threads wait for each
    other when they descend from one. On the 16-core H200 host (2026-11-29, scripts/bench_mask_step.py, 64 rows, 16
    threads) a step's fill took 11.2 ms from one lineage, 4.8 from 16 and 4.6 from 64."""
    value = os.environ.get("TANDEM_GRAMMAR_LINEAGES")
    if value is None:
        return mask_threads()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"TANDEM_GRAMMAR_LINEAGES must be a positive integer, got {value!r}")
    return int(value)


def compile_workers() -> int:
    """Grammar compile threads: a quarter of the cores, 1 to 4 (the masks' threads need the rest)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) // 4))


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
