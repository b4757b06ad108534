"""Scheduler: continuous batching that picks, every step, the next n tokens of each request to compute."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.request import FinishReason, Logprobs, Request, RequestStatus
from tandem.scheduler.kv_cache_manager import KVCacheManager
from tandem.scheduler.lora_slots import AdapterSlots
from tandem.scheduler.output import ScheduledRequest, SchedulerOutput

PLACEHOLDER_TOKEN_ID = 0  # input id of a pending position; the runner adds the carried token on the GPU


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int  # including the reserved block 0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_loras: int = 0  # LoRA adapters resident at once (device slots); 0: adapters off
    # Steps a waiting request may be passed over by later requests that run on an adapter (while it waits for a
    # slot) before it holds them back: then no later adapter request is admitted ahead of it (Scheduler._admit).
    max_lora_skips: int = 64

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_lora_skips"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.max_model_len, int) or self.max_model_len < 2:
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is reserved), got {self.num_blocks!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # Without chunking a (re)computed request must fit one step whole, or it waits forever.
            raise ValueError(
                f"with chunked prefill disabled, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )

    @property
    def max_kv_tokens(self) -> int:
        """Token positions the whole pool holds (block 0 excluded)."""
        return (self.num_blocks - 1) * self.block_size


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(config.block_size, config.num_blocks, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # unfinished requests (waiting or running) by id
        self.num_preemptions = 0
        self.lora_slots = AdapterSlots(config.max_loras) if config.max_loras else None

    # --- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request; ValueError when it can never be scheduled.

        When the pool holds fewer positions than the context, request.max_model_len is lowered
        to what the pool holds, so a lone request finishes for LENGTH instead of preempting
        itself forever.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("the prompt must contain at least one token")
        max_model_len = min(request.max_model_len, self.config.max_model_len)
        if num_prompt >= max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens, which leaves no room to generate within "
                f"the context limit of {max_model_len} tokens"
            )
        if num_prompt > self.config.max_kv_tokens:
            raise ValueError(
                f"the prompt has {num_prompt} tokens but the KV cache holds only "
                f"{self.config.max_kv_tokens} ({self.config.num_blocks - 1} blocks of {self.config.block_size})"
            )
        # Positions 0..max_model_len-2 get KV (the last output token is never fed back).
        request.limit_context(min(max_model_len, self.config.max_kv_tokens + 1))
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(
        self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None
    ) -> Request | None:
        """Finishes a waiting or running request (also while a step that holds it is in flight).

        Returns None for unknown or already finished ids. Tokens of steps still in flight are
        dropped by update_from_output.
        """
        request = self.requests.get(request_id)
        if request is None:
            return None
        request.finish_reason, request.stop_reason = reason, stop_reason
        self._finish(request)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.lora_slots is not None:
            self.lora_slots.begin_step()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        kv = self.kv_cache_manager
        allocate = kv.allocate_slots
        tables, published, bs, caching = kv.tables, kv.published, kv.block_size, kv.enable_prefix_caching
        chunked = self.config.enable_chunked_prefill
        running = self.running
        i = 0
        num_drafts = 0
        while i < len(running) and budget > 0:
            request = running[i]
            i += 1
            pending = request.num_pending_tokens
            start = request.num_computed_tokens
            num_known = len(request.all_token_ids)
            # A verify step in flight holds its drafts' positions too (as if all were accepted).
            num_new = num_known + pending + request.num_drafts_in_flight - start
            # Done once pending lands; a max_tokens=0 request (scoring) stops only once its prompt is computed.
            if ((len(request.output_token_ids) + pending >= request.max_output_tokens
                 and (request.max_output_tokens > 0 or start >= num_known))
                    or num_new == 0 or (num_new > budget and not chunked)):
                continue
            if num_new > budget:
                num_new = budget
            # Speculative decoding: the known last token plus the drafts proposed for it, verified in one forward.
            # With a verify step in flight (pending 1: drafts proposed ahead, EngineCore._verify_ahead), the first
            # position is the token that step samples after its accepted drafts.
            num_draft = 0
            if request.draft_token_ids:
                if num_new == 1 and pending <= 1 and budget > 1:
                    num_draft = min(len(request.draft_token_ids), budget - 1)
                    num_new += num_draft
                else:
                    request.draft_token_ids = []
            # The overlap loop's decode step, nearly every request of every step: the one position (start ==
            # num_known) is the token the step in flight samples. allocate_slots' no-change case (room in the held
            # blocks, every full block of known tokens published) is checked here without the call.
            carry_decode = num_new == 1 and pending == 1
            block_ids = None
            if carry_decode:
                held = tables.get(request.request_id)
                if held is not None and start < len(held) * bs and (
                        not caching or num_known // bs <= published[request.request_id]):
                    block_ids = held
            if block_ids is None:
                block_ids = allocate(request, num_new)
            if block_ids is None:
                block_ids = self._preempt_until_fits(request, num_new, preempted)
                if block_ids is None:
                    break  # the request preempted itself: it was the last one running
            if carry_decode:  # the entry _schedule_tokens would build, written inline
                request.num_computed_tokens = start + 1
                request.num_pending_tokens = 2
                scheduled.append(ScheduledRequest(request, start, 1, [PLACEHOLDER_TOKEN_ID], True, block_ids, True))
            elif num_draft:
                # The known last token (or, behind a step in flight, the placeholder for the token it samples),
                # then the drafts.
                token_ids = request.all_token_ids[start:num_known] if not pending else [PLACEHOLDER_TOKEN_ID]
                token_ids += request.draft_token_ids[:num_draft]
                request.draft_token_ids = []
                request.num_computed_tokens = start + num_new
                request.num_pending_tokens = pending + 1
                request.num_drafts_in_flight += num_draft
                scheduled.append(ScheduledRequest(request, start, num_new, token_ids, pending > 0, block_ids, True,
                                                  num_draft))
                num_drafts += num_draft
            else:
                scheduled.append(self._schedule_tokens(request, num_new, block_ids))
            budget -= num_new
        # Admitting after a preemption would take back the blocks we just had to free.
        if not preempted:
            budget = self._admit(budget, scheduled)
        total = self.config.max_num_batched_tokens - budget
        out = SchedulerOutput(scheduled=scheduled, num_scheduled_tokens=total, preempted_request_ids=preempted,
                              num_draft_tokens=num_drafts)
        if self.lora_slots is not None:
            out.lora_loads_wait = self.lora_slots.loads_overwrite_busy
            out.lora_loads = self.lora_slots.take_loads()
        return out

    def _preempt_until_fits(self, request: Request, num_new: int, preempted: list[str]) -> list[int] | None:
        """Preempts from the tail of `running` until `request`'s allocation fits; None if `request` itself went."""
        while True:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if block_ids is not None:
                return block_ids

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV, start over from the front of the queue."""
        self.kv_cache_manager.free(request)
        if self.lora_slots is not None:
            self.lora_slots.release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admits waiting requests in arrival order while the budget, the sequence limit and free blocks allow;
        returns the budget left. The first request that does not fit the budget or the blocks stops admission, and
        so does a preempted request whose last token is still in flight.

        LoRA: a request whose adapter can get no device slot (every slot held by running requests' adapters) is
        passed over, not waited on: later requests whose adapter is resident (or that use none) are admitted
        ahead of it. A free slot always goes to the earliest waiting request that needs one (the scan is in
        order), so what could starve a passed-over request is later requests keeping the slots busy. Each step in
        which a later request is admitted onto an adapter slot ahead of it counts as one skip; once a request has
        been skipped max_lora_skips times, no request behind it that runs on an adapter is admitted (base-model
        requests still are) until it has a slot: the slots in use drain as their requests finish, and it takes the
        first one freed."""
        kv = self.kv_cache_manager
        waiting, running = self.waiting, self.running
        lora_slots = self.lora_slots
        max_skips = self.config.max_lora_skips
        passed: list[tuple[Request, int]] | None = None  # (passed over for a slot, its position in the scan)
        held_back = False  # a request skipped max_lora_skips times is waiting: later adapter requests wait too
        last_lora_admit = -1  # scan position of the last admitted request that runs on an adapter
        pos = idx = 0
        while idx < len(waiting) and budget > 0 and len(running) < self.config.max_num_seqs:
            request = waiting[idx]
            pos += 1
            if request.num_pending_tokens > 0:
                break  # preempted with a token in flight; its tokens are not all known yet
            uses_slot = lora_slots is not None and request.lora_request is not None
            if uses_slot and (held_back or not lora_slots.can_acquire(request)):  # type: ignore[union-attr]
                if not held_back:
                    if request.num_lora_skips >= max_skips:
                        held_back = True
                    if passed is None:
                        passed = []
                    passed.append((request, pos))
                idx += 1
                continue
            if request.sampling_params.prompt_logprobs is None:
                computed_blocks, num_cached = kv.get_computed_blocks(request)
            else:  # a cached prefix has no logits: compute the whole prompt (its blocks are still published)
                computed_blocks, num_cached = [], 0
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if uses_slot:
                acquired = lora_slots.acquire(request)  # type: ignore[union-attr]
                assert acquired, "can_acquire said a slot was there"
            block_ids = kv.allocate_slots(request, num_new, computed_blocks)
            if block_ids is None:
                if uses_slot:
                    lora_slots.release(request)  # type: ignore[union-attr]
                break
            if idx == 0:
                waiting.popleft()
            else:
                del waiting[idx]
            if uses_slot:
                last_lora_admit = pos
            running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            scheduled.append(self._schedule_tokens(request, num_new, block_ids))
            budget -= num_new
        if passed is not None:
            for request, at in passed:
                if at < last_lora_admit:
                    request.num_lora_skips += 1
        return budget

    def _schedule_tokens(self, request: Request, num_new: int, block_ids: list[int]) -> ScheduledRequest:
        """Builds the entry for positions [num_computed, num_computed + num_new) and advances the counters."""
        start = request.num_computed_tokens
        end = start + num_new
        known = request.all_token_ids
        num_known = len(known)
        pending = request.num_pending_tokens
        # At most one step ahead of this one is unresolved: update_from_output(N) runs before schedule(N+2).
        assert pending <= 1, f"{request.request_id}: two steps in flight ahead of this one"
        assert end <= num_known + pending
        carry = end > num_known
        if carry:
            # Only the last position can be pending: the token the previous step is sampling.
            assert end == num_known + 1 and pending == 1
            token_ids = known[start:num_known]
            token_ids.append(PLACEHOLDER_TOKEN_ID)
        else:
            token_ids = known[start:end]
        sample = end == num_known + pending
        request.num_computed_tokens = end
        if sample:
            request.num_pending_tokens += 1
        # Positional: keyword construction costs twice as much, and this runs for every request every step.
        return ScheduledRequest(request, start, num_new, token_ids, carry, block_ids, sample)

    @staticmethod
    def sit_out(in_flight: ScheduledRequest, upcoming: ScheduledRequest) -> None:
        """A decoding request sits out the step in flight (its grammar row came late; ModelRunner.sit_out): that
        step yields it no token (its entry no longer samples), and the upcoming step, which was to carry that token,
        computes the step in flight's position again from the known token before it."""
        request = upcoming.request
        assert in_flight.request is request and in_flight.sample and upcoming.carry and request.num_pending_tokens == 2
        in_flight.sample = False
        request.num_pending_tokens -= 1
        request.num_computed_tokens -= 1
        upcoming.num_computed_tokens -= 1
        upcoming.carry = False
        upcoming.token_ids = [request.all_token_ids[upcoming.num_computed_tokens]]

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled_token_ids: Sequence[int],
        logprobs: Sequence[Logprobs] | None = None,
        verified: dict[int, tuple[list[int], list[Logprobs] | None]] | None = None,
    ) -> list[Request]:
        """Applies a finished step's sampled tokens (row i = out.scheduled[i]); returns the requests touched.

        `verified` holds, for the rows that verified drafts, the tokens the step produced (the accepted drafts and
        one more) and their log-probabilities; a step with drafts sets every touched request's num_new_tokens."""
        if verified is not None:
            return self._update_verified(out, sampled_token_ids, logprobs, verified)
        touched: list[Request] = []
        finished = RequestStatus.FINISHED
        now: float | None = None
        ended: list[Request] | None = None
        for i, entry in enumerate(out.scheduled):
            if not entry.sample:
                continue
            request = entry.request
            if request.status is finished:
                continue  # aborted or stopped while this step was in flight: never output
            assert request.num_pending_tokens > 0, f"{request.request_id}: token arrived that was not pending"
            request.num_pending_tokens -= 1
            if not request.max_output_tokens:  # max_tokens=0: the prompt is computed, the sampled token unused
                request.finish_reason = FinishReason.LENGTH
                if ended is None:
                    ended = []
                ended.append(request)
                touched.append(request)
                continue
            token = sampled_token_ids[i]
            request.output_token_ids.append(token)  # Request.append_output_token, inlined for the hot loop
            request.all_token_ids.append(token)
            if logprobs is not None and request.sampling_params.logprobs is not None:
                request.output_logprobs.append(logprobs[i])
            if request.first_token_time is None:
                request.first_token_time = now = now or time.monotonic()
            if (token in request.stop_token_set or len(request.output_token_ids) >= request.max_output_tokens) \
                    and request.check_stop():
                if ended is None:
                    ended = []
                ended.append(request)
            touched.append(request)
        if ended is not None:
            self._finish_many(ended)
        return touched

    def _update_verified(self, out: SchedulerOutput, sampled_token_ids: Sequence[int],
                         logprobs: Sequence[Logprobs] | None,
                         verified: dict[int, tuple[list[int], list[Logprobs] | None]]) -> list[Request]:
        """update_from_output for a step with drafts: each row appends its tokens up to the first that ends it."""
        touched: list[Request] = []
        ended: list[Request] = []
        for i, entry in enumerate(out.scheduled):
            request = entry.request
            if not entry.sample or request.status is RequestStatus.FINISHED:
                continue
            assert request.num_pending_tokens > 0, f"{request.request_id}: token arrived that was not pending"
            request.num_pending_tokens -= 1
            if not request.max_output_tokens:
                request.finish_reason = FinishReason.LENGTH
                request.num_new_tokens = 0
                ended.append(request)
                touched.append(request)
                continue
            request.num_drafts_in_flight -= entry.num_draft
            if entry.num_draft:
                tokens, token_logprobs = verified[i]
                num_accepted = len(tokens) - 1
                request.num_draft_tokens += entry.num_draft
                request.num_accepted_tokens += num_accepted
                if request.status is RequestStatus.RUNNING:
                    # The rejected drafts' positions hold KV of tokens that are not the request's: recompute there.
                    request.num_computed_tokens -= entry.num_draft - num_accepted
            else:
                tokens = [sampled_token_ids[i]]
                token_logprobs = [logprobs[i]] if logprobs is not None else None
            want_logprobs = token_logprobs is not None and request.sampling_params.logprobs is not None
            num_new = 0
            for j, token in enumerate(tokens):
                request.output_token_ids.append(token)
                request.all_token_ids.append(token)
                num_new += 1
                if want_logprobs:
                    request.output_logprobs.append(token_logprobs[j])  # type: ignore[index]
                if (token in request.stop_token_set or len(request.output_token_ids) >= request.max_output_tokens) \
                        and request.check_stop():
                    ended.append(request)
                    break
            request.num_new_tokens = num_new
            if request.first_token_time is None:
                request.first_token_time = time.monotonic()
            touched.append(request)
        if ended:
            self._finish_many(ended)
        return touched

    def _finish_many(self, requests: list[Request]) -> None:
        """_finish for a step's finished requests, with one pass over the queues (a whole batch can end at once)."""
        finished = RequestStatus.FINISHED
        was_waiting = False
        for request in requests:
            was_waiting |= request.status is RequestStatus.WAITING  # preempted while its last step was in flight
            request.status = finished
            self.kv_cache_manager.free(request)
            if self.lora_slots is not None:
                self.lora_slots.release(request)
            del self.requests[request.request_id]
        self.running[:] = [r for r in self.running if r.status is not finished]
        if was_waiting:
            kept = [r for r in self.waiting if r.status is not finished]
            self.waiting.clear()
            self.waiting.extend(kept)

    def _finish(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED
        self.kv_cache_manager.free(request)
        if self.lora_slots is not None:
            self.lora_slots.release(request)
        del self.requests[request.request_id]
        for queue in (self.running, self.waiting):
            for i, queued in enumerate(queue):
                if queued is request:  # identity: Request's dataclass __eq__ compares every field
                    del queue[i]
                    return
        raise AssertionError(f"{request.request_id} was neither running nor waiting")

    # --- stats ---------------------------------------------------------------------------------
    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def adapter_requests(self) -> tuple[dict[str, int], dict[str, int]]:
        """(running, waiting) requests per LoRA adapter name; requests of the base model are not counted."""
        def count(requests: Sequence[Request]) -> dict[str, int]:
            out: dict[str, int] = {}
            for r in requests:
                if r.lora_request is not None:
                    out[r.lora_request.lora_name] = out.get(r.lora_request.lora_name, 0) + 1
            return out

        return count(self.running), count(self.waiting)

    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.num_free_blocks()

    def kv_cache_usage(self) -> float:
        return self.kv_cache_manager.usage()

    def prefix_cache_hit_rate(self) -> float:
        return self.kv_cache_manager.prefix_hit_rate()

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()
