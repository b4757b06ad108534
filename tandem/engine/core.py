"""EngineCore: add/abort requests and step() the overlap loop that glues scheduler and runner.

One step (docs/architecture.md, "One engine step"): schedule N+1, prepare it, launch it, then collect N (wait for
its tokens, update the requests). With overlap off the same code collects the step it just launched. Both produce
identical tokens under greedy sampling.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import time
from collections.abc import Container
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from tandem.config import EngineConfig
from tandem.engine.draft_model import DraftModelProposer, draft_engine_config
from tandem.engine.eagle3 import aux_states, eagle3_proposer, load_eagle3_head
from tandem.lora_request import LoRARequest
from tandem.outputs import EngineOutput
from tandem.profiling.timeline import Timeline
from tandem.request import FinishReason, Logprobs, Request, RequestStatus
from tandem.runner.model_runner import ModelRunner
from tandem.runner.step_plan import PreparedStep, StepHandle
from tandem.runner.worker import engine_runner
from tandem.sampling_params import SamplingParams
from tandem.scheduler.output import SchedulerOutput
from tandem.scheduler.scheduler import Scheduler, SchedulerConfig
from tandem.speculative.controller import SpecController
from tandem.speculative.eagle3 import Eagle3Proposer
from tandem.speculative.ngram import NgramProposer
from tandem.structured.matcher import HostMask
from tandem.structured.pipeline import GrammarPipeline, sit_out_enabled

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    prefix_cache_hit_rate: float  # hit tokens / queried tokens
    num_free_blocks: int
    num_blocks: int
    num_steps: int
    num_prompt_tokens: int  # prompt tokens admitted so far
    num_generation_tokens: int  # output tokens produced so far
    num_preemptions: int
    spec_draft_tokens: int = 0  # speculative decoding: tokens proposed and verified so far
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_accepted_per_position: tuple[int, ...] = ()  # entry j: verify rows whose draft j was accepted
    spec_verified_rows: int = 0  # sequences' draft runs verified (mean accepted length: 1 + accepted / this)
    lora_running: dict[str, int] = field(default_factory=dict)  # LoRA: running requests per adapter name
    lora_waiting: dict[str, int] = field(default_factory=dict)  # ... and waiting ones (a slot, their host copy)
    lora_page_ins: int = 0  # adapters copied into a device slot so far
    lora_host_copies: int = 0  # adapters read from their folder into host memory so far


def all_plain_ints(ids: list[object]) -> bool:
    """Whether every element is exactly an int (no bool, float or int subclass), at C speed: a 1k-token prompt
    in ~20 us, where a per-element isinstance loop takes ~10x that. Callers fall back to their own loop for
    the other cases, to accept int subclasses or to name the offending element."""
    return set(map(type, ids)) == {int}


def check_lora_request(lora_request: object, enable_lora: bool) -> None:
    """ValueError, naming the adapter, for a lora_request no engine could take (the rules of add_lora before the
    adapter is read): not a LoRARequest, or given to an engine started without enable_lora."""
    if not isinstance(lora_request, LoRARequest):
        raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
    if not enable_lora:
        raise ValueError(f"LoRA adapter {lora_request.lora_name!r} given, but the engine was started without "
                         "enable_lora")


def check_new_request(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      in_use: Container[str], vocab_size: int, max_model_len: int) -> None:
    """ValueError, naming what is wrong, for a request no engine could take (the rules of add_request)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError("request_id must be a non-empty string")
    if request_id in in_use:
        raise ValueError(f"request_id {request_id!r} is already in use")
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if not all_plain_ints(prompt_token_ids) or min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        for t in prompt_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt token id {t!r} is not an integer in [0, {vocab_size})")
    num_prompt = len(prompt_token_ids)
    if num_prompt >= max_model_len:
        raise ValueError(f"the prompt has {num_prompt} tokens but the context limit (max_model_len) is "
                         f"{max_model_len}: at most {max_model_len - 1} prompt tokens fit")
    if params.max_tokens is not None and num_prompt + params.max_tokens > max_model_len:
        raise ValueError(f"max_tokens={params.max_tokens} plus the prompt's {num_prompt} tokens exceeds the "
                         f"context limit of {max_model_len} tokens")
    for name in ("logit_bias", "allowed_token_ids"):
        bad = [t for t in (getattr(params, name) or ()) if t >= vocab_size]
        if bad:
            raise ValueError(f"{name} names token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


def bad_word_token_ids(tokenizer: object, words: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(banned single tokens, multi-token sequences) of each bad word, as written and after a space (the two
    ways a word starts inside text)."""
    if not words:
        return (), ()
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer, and this model has none")
    single: set[int] = set()
    multi: set[tuple[int, ...]] = set()
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
            if len(ids) == 1:
                single.add(ids[0])
            elif ids:
                multi.add(ids)
    return tuple(sorted(single)), tuple(sorted(multi))


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.spec = config.speculative
        draft = None
        head, side = None, None
        if self.spec is not None and self.spec.method == "draft_model":
            # Before the target's runner, which then sizes its KV cache around the draft's memory.
            draft = DraftModelProposer(EngineCore(draft_engine_config(config, self.spec, config.max_model_len)))
        if self.spec is not None and self.spec.method == "eagle3":
            head, side = load_eagle3_head(config)  # likewise, and the runner copies the hidden states it reads
        # Rank 0's runner (spawning ranks 1..N-1 for tensor parallelism; under torchrun the other ranks never
        # return from this call: worker.py serves rank 0's steps in their processes, then ends them).
        self.runner: ModelRunner = engine_runner(config, side)
        if self.runner.group is not None:
            # Before interpreter teardown, which would otherwise destroy the communicators after (or while)
            # the CUDA graphs holding them are freed; registered after multiprocessing's hook, so it runs first.
            atexit.register(self.shutdown)
        self.tokenizer = self.runner.tokenizer
        self.model_config = self.runner.model_config
        if draft is not None:
            try:
                draft.check_vocabulary(self.model_config.vocab_size, self.tokenizer)
            except ValueError:
                draft.shutdown()
                atexit.unregister(self.shutdown)  # this engine never started: nothing for exit to shut down
                self.runner.shutdown()
                raise
        self.proposer: NgramProposer | DraftModelProposer | Eagle3Proposer | None = draft
        self.eagle3: Eagle3Proposer | None = None  # fed every collected step while any proposer is on
        if head is not None:
            try:
                self.proposer = self.eagle3 = eagle3_proposer(head, self.runner)
            except ValueError:
                atexit.unregister(self.shutdown)
                self.runner.shutdown()
                raise
        if self.spec is not None and self.spec.method == "ngram":
            self.proposer = NgramProposer(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        # A request can never grow past what the whole KV pool holds (block 0 is reserved).
        self.max_model_len = min(self.runner.max_model_len, (self.runner.num_blocks - 1) * config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=config.block_size, num_blocks=self.runner.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching, enable_chunked_prefill=config.enable_chunked_prefill,
            max_loras=config.max_loras if config.enable_lora else 0,
        ))
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.grammar = GrammarPipeline(self.tokenizer, self.model_config.vocab_size, sorted(eos),
                                       config.grammar_backend, config.strict_json_schema)
        self.overlap = config.overlap
        self._rng = random.Random(config.seed)
        self._requests: dict[str, Request] = {}  # unfinished requests
        self._loading: dict[str, Request] = {}  # waiting for their adapter's host copy, in arrival order
        self._lora_epochs: dict[int, int] = {}  # lora_int_id -> times it was removed (Request.lora_epoch)
        self._inflight: StepHandle | None = None  # step N while step N+1 is being scheduled (overlap)
        self.timeline: Timeline | None = None
        self.step_log: list[tuple[int, int, int]] | None = None  # (seqs, tokens, context tokens) per step
        self._timeline_base: tuple[object, float] | None = None
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.spec_draft_tokens = self.spec_accepted_tokens = self.spec_verified_rows = 0
        self.spec_controller = SpecController() if self.spec is not None and self.spec.adaptive else None
        self._speculated = False  # whether the step launched last proposed drafts (its tokens come next)
        # An EAGLE-3 head's drafts for the step being launched, left on the device (its output, and the requests
        # holding its draft_stand_in ids); TANDEM_DEVICE_DRAFTS=0 brings them to the host instead.
        self._pending_drafts: tuple[torch.Tensor, list[Request]] | None = None
        self.device_drafts = os.environ.get("TANDEM_DEVICE_DRAFTS") != "0"
        # TANDEM_VERIFY_AHEAD=1: schedule a verify step behind the one in flight (_verify_ahead) instead of collecting
        # it first. Off by default: at batch 1 the EAGLE-3 head's work behind each verify step already covers the
        # host's collect, and the later-adapting draft count cost more than it saved (docs/architecture.md).
        self.ahead = os.environ.get("TANDEM_VERIFY_AHEAD") == "1"
        self._collected_prefill = False  # a step collected in this call computed prompt tokens (not timed)
        self._step_end = 0.0
        self.spec_accepted_per_position = [0] * (self.spec.num_speculative_tokens if self.spec else 0)
        # Grammar-forced drafts (structured output): the most per request and step (0: off), and their counters.
        self.forced_k = config.forced_drafts
        self.sit_out = sit_out_enabled()  # a late grammar row sits its step out (_settle_rows)
        self.forced_draft_tokens = self.forced_accepted_tokens = self.forced_verified_rows = 0

    # ---------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_request: LoRARequest | None = None) -> None:
        self._check_open()
        check_new_request(request_id, prompt_token_ids, params, self._requests, self.model_config.vocab_size,
                          self.max_model_len)
        if lora_request is not None:
            self.add_lora(lora_request)  # ValueError naming the adapter when it cannot serve
        if self.config.tensor_parallel_size > 1 and params.uses_logits_state:
            raise ValueError("penalties, logit_bias, allowed_token_ids and bad_words are not supported with "
                             "tensor_parallel_size > 1")
        banned, bad_seqs = bad_word_token_ids(self.tokenizer, params.bad_words)
        spec = params.structured_output
        if spec is not None:
            if self.config.tensor_parallel_size > 1:
                raise ValueError("structured output is not supported with tensor_parallel_size > 1")
            if self.tokenizer is None and self.config.load_format != "dummy":
                raise ValueError("structured output needs a tokenizer, and this model has none")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            sampling_seed=seed,
            banned_token_ids=banned,
            bad_word_ids=bad_seqs,
            lora_request=lora_request,
        )
        if self.spec is not None:
            request.spec_k = self.spec.num_speculative_tokens
        if lora_request is not None:
            request.lora_epoch = self._lora_epochs.get(lora_request.lora_int_id, 0)
            self.runner.lora.pin(lora_request)  # its host copy is made (on the loader thread) and kept till it ends
        try:
            if spec is not None:
                self.grammar.submit(request, spec)  # scheduled once its grammar is compiled (at once if seen before)
            else:
                self._schedule(request)  # raises ValueError if it can never fit the KV pool
                if bad_seqs:
                    self.grammar.attach(request, None)
        except Exception:
            if lora_request is not None:
                self.runner.lora.unpin(lora_request.lora_int_id)
            raise
        if params.prompt_logprobs is not None:
            self.runner.prompt_logprobs.add(request)  # its prompt rows get scored as they are computed
        self._requests[request_id] = request
        self.num_prompt_tokens += len(prompt_token_ids)

    def _schedule(self, request: Request) -> None:
        """Hands a request to the scheduler, or holds it here while its adapter's host copy is being made."""
        lora = request.lora_request
        if lora is not None and not self.runner.lora.ready(lora):  # type: ignore[union-attr]
            self._loading[request.request_id] = request
        else:
            self.scheduler.add_request(request)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Checks an adapter (its config and tensor shapes, at once, so that a bad one fails here) and starts making
        its host copy on the loader thread; it pages into a device slot when a request that uses it is admitted.
        ValueError naming the adapter when it cannot serve."""
        check_lora_request(lora_request, self.runner.lora is not None)
        self.runner.lora.add(lora_request)  # type: ignore[union-attr]

    def remove_lora(self, lora_int_id: int) -> None:
        """Unloads an adapter: requests already queued or running with it finish with it; new ones must load it
        again. Unknown ids are ignored."""
        if self.runner.lora is not None:
            self.runner.lora.remove(lora_int_id)
            self._lora_epochs[lora_int_id] = self._lora_epochs.get(lora_int_id, 0) + 1  # its cached blocks: stale
            if self.scheduler.lora_slots is not None:
                self.scheduler.lora_slots.forget(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.runner.lora is None else list(self.runner.lora.known.values())

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
                      stop_reason: int | str | None = None) -> None:
        """Ends a request now (abort, or a stop string the caller matched); unknown ids are ignored."""
        if request_id not in self._requests:
            return
        compiling = self.grammar.compiling.pop(request_id, None)
        held = compiling[0] if compiling is not None else self._loading.pop(request_id, None)
        if held is not None:
            held.status, held.finish_reason, held.stop_reason = RequestStatus.FINISHED, reason, stop_reason
        else:
            self.scheduler.finish_request(request_id, reason, stop_reason)
        self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or self._inflight is not None

    def _check_open(self) -> None:
        if self.runner.released:
            raise RuntimeError("the engine is shut down")

    def _forget(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.host_mask is not None:
            self.grammar.drop(request)
        if request.lora_request is not None:
            self.runner.lora.unpin(request.lora_request.lora_int_id)  # type: ignore[union-attr]

    # ---------------------------------------------------------------- structured output

    @property
    def structured_backend(self) -> str:
        return self.grammar.backend

    def use_structured_backend(self, name: str) -> None:
        """Compiles later structured requests with backend `name` (xgrammar or llguidance); meant for between runs."""
        self.grammar.use_backend(name)

    def use_forced_drafts(self, enabled: bool) -> None:
        """Switches grammar-forced drafts on (up to the config's max_forced_drafts per request and step, where the
        config allows them) or off, from the next step on; outputs are the same either way (for comparisons)."""
        self.forced_k = self.config.forced_drafts if enabled else 0

    @property
    def num_grammar_rejections(self) -> int:
        """Sampled tokens a request's grammar refused (a masking bug if ever > 0)."""
        return self.grammar.num_rejections

    def num_host_masks(self) -> int:
        """Requests holding grammar / bad-word state now (0 once every constrained request has ended)."""
        return len(self.grammar.masks)

    @property
    def mask_time_s(self) -> float:
        """CPU time filling grammar bitmasks (and enqueuing the sampling after them)."""
        return self.grammar.fill_time_s

    @property
    def num_mask_steps(self) -> int:
        return self.grammar.num_fills

    @property
    def mask_wait_s(self) -> float:
        """Time the engine's thread waited for the worker's bitmask fills (a fill that ends before the next step is
        written costs none)."""
        return self.grammar.wait_time_s

    def _admit_compiled(self) -> list[EngineOutput]:
        """Moves requests whose grammar compiled into the scheduler; a failed compile fails its request."""
        idle = self._inflight is None and not self.scheduler.num_running() and not self.scheduler.num_waiting()
        outputs = []
        for request, exc in self.grammar.admit(self._schedule, block=idle):
            outputs.append(self._refuse(request, f"structured output: {exc}"))
        return outputs

    def _admit_loaded(self) -> list[EngineOutput]:
        """Moves requests whose adapter's host copy is made into the scheduler, in arrival order; an adapter that
        failed to load fails its requests (only those), naming it."""
        lora = self.runner.lora
        assert lora is not None
        if self._inflight is None and not self.scheduler.num_running() and not self.scheduler.num_waiting():
            lora.host.wait_any(0.05)  # nothing else to do: wait a little for a copy rather than spin
        outputs = []
        failed: dict[int, str] = {}  # lora_int_id -> why its host copy could not be made
        for rid, request in list(self._loading.items()):
            lora_request = request.lora_request
            assert lora_request is not None
            message = failed.get(lora_request.lora_int_id)
            if message is None:
                try:
                    if not lora.ready(lora_request):
                        continue
                except Exception as exc:  # ValueErrors name the adapter; anything else gets its name here
                    message = str(exc) if isinstance(exc, ValueError) else \
                        f"LoRA adapter {lora_request.lora_name!r} could not be loaded: {exc!r}"
                    failed[lora_request.lora_int_id] = message
            del self._loading[rid]
            if message is None:
                try:
                    self.scheduler.add_request(request)
                    continue
                except ValueError as exc:
                    message = str(exc)
            outputs.append(self._refuse(request, message))
        return outputs

    def _refuse(self, request: Request, message: str) -> EngineOutput:
        """Ends a request that never reached the scheduler (its grammar or adapter failed), with the reason."""
        request.status, request.finish_reason, request.error = RequestStatus.FINISHED, FinishReason.ABORT, message
        self._forget(request.request_id)
        return EngineOutput(request.request_id, [], None, True, FinishReason.ABORT, None, request.num_prompt_tokens,
                            0, error=message)

    # ---------------------------------------------------------------- the loop

    def step(self) -> list[EngineOutput]:
        """One turn of the pipeline: admit requests whose grammar compiled, schedule and launch step N+1, then
        collect step N. Without overlap, the step just launched is the one collected."""
        self._check_open()
        if not self.overlap and self._inflight is not None:
            # Overlap was switched off with a step in flight: collect that one first.
            previous, self._inflight = self._inflight, None
            return self._collect(previous)
        outputs = self._admit_compiled() if self.grammar.compiling else []
        if self._loading:
            outputs += self._admit_loaded()
        speculated, self._speculated = self._speculated, False
        self._collected_prefill = False
        inflight = self._inflight
        ahead = self._verify_ahead(inflight) if inflight is not None else None
        if ahead is not None:
            self._propose_ahead(inflight, ahead)  # type: ignore[arg-type]
        else:
            if inflight is not None and inflight.sched.num_draft_tokens:
                # How many of its drafts each request keeps decides where its next tokens go: collect it first.
                self._inflight = None
                outputs += self._collect(inflight)
            if self.proposer is not None or self.forced_k:
                outputs += self._propose()
        if self.timeline is not None:
            self.timeline.step = self.num_steps
        self.num_steps += 1
        launched, failed = self._launch()
        if failed:
            return outputs + failed
        previous = launched
        if self.overlap:
            previous, self._inflight = self._inflight, launched
        if previous is not None:
            outputs += self._collect(previous)
        inflight = self._inflight
        if inflight is not None and inflight.sampling_pending and not self.grammar.filling(inflight):
            # Its grammar rows need step N's tokens, which the matchers have now (where _collect did not start
            # their fill already): they fill on a worker while the caller takes the outputs and step N+2 is
            # scheduled and prepared.
            self.grammar.start_fill(inflight, partial(self.runner.fill_masks, inflight, self._defers()))
        if self.spec_controller is not None:
            now = time.perf_counter()
            if self._step_end and not self._collected_prefill:
                self.spec_controller.record(speculated, now - self._step_end, sum(len(o.new_token_ids) for o in outputs))
            # Only back-to-back steps are timed: once idle, the time until the caller brings work is no step's.
            self._step_end = now if self.has_unfinished_requests() else 0.0
        return outputs

    def _propose(self) -> list[EngineOutput]:
        """Drafts for the next step: the tokens its grammar forces for a request under a grammar (forced drafts),
        the proposer's for the others (speculative decoding). Both read each request's tokens up to its last on the
        host, so the step in flight is collected first (returning its outputs). The proposer is off while more than
        disable_by_batch_size requests run or its controller finds that speculating does not pay; a request with a
        grammar gets only forced drafts."""
        spec, scheduler = self.spec, self.scheduler
        running = scheduler.running
        if not running:
            return []
        forced = self.forced_k > 0 and self._grammar_running()
        speculate = (spec is not None and self.proposer is not None and len(running) <= spec.disable_by_batch_size
                     and (self.spec_controller is None or self.spec_controller.speculate()))
        if not forced and not speculate:
            return []
        # Timed as speculating, drafts or not: it pays for the collect before launching.
        self._speculated = self._speculated or speculate
        outputs: list[EngineOutput] = []
        if self._inflight is not None:
            previous, self._inflight = self._inflight, None
            outputs = self._collect(previous)
        if forced:
            self._timed("forced", self._propose_forced)
        if not speculate:
            return outputs
        eligible: list[tuple[Request, int]] = []
        for request in scheduler.running:
            room = 0 if request.host_mask is not None else _draft_room(request)
            if room > 0:
                eligible.append((request, min(request.spec_k, room)))
        if not eligible:
            return outputs
        proposer = self.proposer
        assert proposer is not None
        on_device = None
        propose_on_device = getattr(proposer, "propose_on_device", None)
        if propose_on_device is not None and self._drafts_on_device([r for r, _ in eligible]):
            on_device = self._timed("propose", lambda: propose_on_device(eligible))
        if on_device is not None:
            proposals, tokens = on_device
            self._pending_drafts = (tokens, [r for r, _ in eligible])
        else:
            proposals = self._timed("propose", lambda: proposer.propose_all(eligible))
        for (request, _), drafts in zip(eligible, proposals):
            request.draft_token_ids = drafts
        return outputs

    def _verify_ahead(self, inflight: StepHandle) -> list[int] | None:
        """How many drafts each request of the verify step in flight verifies in the next step, where that step can
        be scheduled before this one is collected (None where not). The EAGLE-3 head is drafting them behind it
        (Eagle3Proposer.prefetch), the next step is scheduled as if every draft in flight were accepted, and the
        device moves its positions back by the rejected ones (ModelExecutor.shift_rows). So: overlap on, the head's
        chain behind `inflight` the last one enqueued, speculation on, every running request in `inflight` and
        none waiting (a new one would be a prompt step, which cannot shift), and each request with room for every
        token in flight and two more (it cannot end by length in `inflight`: it ends only by a stop token there,
        and its next step is then dropped)."""
        spec, eagle3, running = self.spec, self.eagle3, self.scheduler.running
        if (not self.overlap or spec is None or eagle3 is None or not self.ahead
                or getattr(self.proposer, "drafts_ahead", None) is None
                or not inflight.shiftable or not eagle3.prefetched(inflight.sched) or self.scheduler.waiting
                or self._loading or self.grammar.compiling or len(running) > spec.disable_by_batch_size
                or len(running) != len(inflight.sched.scheduled)
                or (self.spec_controller is not None and not self.spec_controller.speculate())):
            return None
        ks: list[int] = []
        for entry in inflight.sched.scheduled:
            request = entry.request
            room = request.max_output_tokens - len(request.output_token_ids) - (entry.num_draft + 1) - 1
            if request.status is not RequestStatus.RUNNING or not entry.sample or room < 1:
                return None
            ks.append(min(request.spec_k, room))
        return ks

    def _propose_ahead(self, inflight: StepHandle, ks: list[int]) -> None:
        """Gives each request of the verify step in flight the stand-ins of the drafts the head's chain behind it
        makes (_verify_ahead); the scheduler places them behind the token that step samples."""
        self._speculated = True
        accepted = self.runner.buffers[inflight.slot].out_accepted
        ahead = self.proposer.drafts_ahead(inflight.sched, ks, accepted)  # type: ignore[union-attr]
        assert ahead is not None, "_verify_ahead checked that the chain is there"
        proposals, tokens = ahead
        requests = [entry.request for entry in inflight.sched.scheduled]
        for request, drafts in zip(requests, proposals):
            request.draft_token_ids = drafts
        self._pending_drafts = (tokens, requests)

    def _drafts_on_device(self, requests: list[Request]) -> bool:
        """Whether a proposer that can (an EAGLE-3 head: propose_on_device) may leave its drafts on the device, so that
        the host schedules and prepares the verify step while the head drafts: on one rank, and for no request whose
        penalties or bias count its drafts on the host (runner.logits_state)."""
        return (self.runner.group is None and self.device_drafts
                and not any(r.sampling_params.uses_logits_state for r in requests))

    def _grammar_running(self) -> bool:
        """Whether a running request decodes under a grammar (its next step may get forced drafts)."""
        running = RequestStatus.RUNNING
        return any(r.status is running and r.host_mask is not None and r.host_mask.matcher is not None
                   for r in self.grammar.masks.values())

    def _propose_forced(self) -> None:
        """Gives each decoding request under a grammar the tokens its grammar forces next as drafts (at most
        forced_k each, and max_num_seqs in all: the grammar rows the runner holds for drafts). The step in flight
        has been collected, so every matcher can be brought to the request's last token."""
        self.grammar.sync()
        budget = self.config.max_num_seqs
        running = RequestStatus.RUNNING
        for request in self.grammar.masks.values():
            if budget <= 0:
                break
            if request.status is not running:
                continue
            k = min(self.forced_k, _draft_room(request), budget)
            drafts = self.grammar.forced_drafts(request, k) if k > 0 else []
            if drafts:
                request.draft_token_ids = drafts
                budget -= len(drafts)

    def _launch(self) -> tuple[StepHandle | None, list[EngineOutput]]:
        """Schedules, prepares and enqueues step N+1 behind step N, whose sampling (held back for its grammar rows)
        goes to the GPU first; (the launched step or None, the outputs of requests failed by a launch error)."""
        sched: SchedulerOutput | None = None
        previous = self._inflight
        try:
            sched = self._timed("schedule", self.scheduler.schedule)
            prepared = None
            if sched.scheduled:
                prepared = self._timed("prepare", lambda: self.runner.prepare(sched, self.grammar.active))
            if previous is not None and previous.sampling_pending:
                self._launch_sampling(previous, prepared)
            drafts = None
            if self._pending_drafts is not None:
                drafts, proposed = self._pending_drafts
                self._pending_drafts = None
                for request in proposed:  # stand-ins the scheduler did not take must not outlive this step
                    request.draft_token_ids = []
            if prepared is None:
                return None, []
            handle = self._timed("launch", lambda: self.runner.enqueue(prepared, drafts))
            if self._may_prefetch(handle):
                eagle3, buf = self.eagle3, self.runner.buffers[handle.slot]
                assert eagle3 is not None
                shift = buf.row_shift if handle.shifted else None
                handle.shiftable = self._timed("prefetch", lambda: eagle3.prefetch(
                    handle.sched, aux_states(self.runner, handle.slot), buf.out_tokens, buf.out_accepted, shift))
            return handle, []
        except Exception as exc:  # a failure to build or launch the step fails its requests, not the engine
            logger.exception("engine step failed at launch")
            failed = self._fail(sched.scheduled if sched is not None else [], exc)
            if previous is not None:
                failed += self._fail(previous.sched.scheduled, exc)
                self._drop(previous)
                self._inflight = None
            return None, failed

    def _may_prefetch(self, handle: StepHandle) -> bool:
        """Whether the EAGLE-3 head drafts the next step right behind this one on the device (Eagle3Proposer.prefetch):
        a flat verify step whose sampling is enqueued, while drafts may stay on the device (_drafts_on_device) and
        no request in it decodes under a grammar (they take no drafts from the head)."""
        spec = self.spec
        if (self.eagle3 is None or self.proposer is None or spec is None or not handle.draft_rows
                or not handle.plan.flat or handle.sampling_pending
                or len(self.scheduler.running) > spec.disable_by_batch_size):
            return False
        requests = [s.request for s in handle.sched.scheduled]
        return self._drafts_on_device(requests) and all(r.host_mask is None for r in requests)

    def _launch_sampling(self, handle: StepHandle, upcoming: PreparedStep | None = None) -> None:
        """Fills a step's grammar bitmask rows (or joins the worker filling them) and enqueues its sampling; rows
        computed apart that are late may sit it out, moved into `upcoming` (the next step, prepared, not enqueued)."""
        fill = partial(self.runner.fill_masks, handle, self._defers())
        launch = partial(self.runner.launch_sampling, handle)
        settle = partial(self._settle_rows, handle, upcoming)
        self._timed("mask", lambda: self.grammar.finish(handle, fill, launch, settle))

    def _defers(self) -> bool:
        """Whether steps' likely slow grammar rows are computed apart (each may then sit the step out): with
        overlap on one rank, and neither drafts nor forced drafts (their steps are collected before the next; a step
        with drafts never defers a row: HostMaskBuffers.fill)."""
        return (self.sit_out and self.overlap and self.proposer is None and not self.forced_k
                and self.runner.group is None)

    def _settle_rows(self, handle: StepHandle, upcoming: PreparedStep | None) -> None:
        """Writes the step's grammar rows computed apart as they finish, while its forward runs. Once the GPU would
        wait, a late row sits the step out where the upcoming step decodes its request from this step's token (one
        position, no drafts, no device penalty counts): the step samples the row under no mask and its token is
        dropped, and the upcoming step computes this step's position again (ModelRunner.sit_out, Scheduler.sit_out),
        under the row once it is done. Tokens are those of the sync loop, one step later."""
        rows = self.runner.deferred_rows(handle)
        if not rows:
            return
        following: dict[int, int] = {}  # id(request) -> its index in the upcoming step
        if upcoming is not None and not upcoming.draft_rows and not upcoming.shifted:
            following = {id(s.request): i for i, s in enumerate(upcoming.sched.scheduled)
                         if s.carry and s.num_scheduled_tokens == 1}
        entries = {id(s.request): s for s in handle.sched.scheduled} if following else {}
        running = RequestStatus.RUNNING

        def may_sit_out(request: Request) -> bool:
            entry = entries.get(id(request))
            return (entry is not None and id(request) in following and entry.sample and entry.num_scheduled_tokens == 1
                    and request.status is running and request.num_pending_tokens == 2)

        sat_out = self.grammar.settle(rows, partial(self.runner.settle_row, handle), may_sit_out,
                                      handle.events.forward_done.query)
        for request in sat_out:
            index = following[id(request)]
            self.runner.sit_out(upcoming, index)  # type: ignore[arg-type]
            Scheduler.sit_out(entries[id(request)], upcoming.sched.scheduled[index])  # type: ignore[union-attr]

    def _collect(self, handle: StepHandle) -> list[EngineOutput]:
        """Waits for a launched step's tokens (enqueuing its sampling first where its grammar rows held it back)
        and applies them to the requests."""
        if handle.sampling_pending:
            try:
                self._launch_sampling(handle)
            except Exception as exc:
                logger.exception("engine step failed filling grammar masks")
                if self._inflight is handle:
                    self._inflight = None
                self._drop(handle)
                return self._fail(handle.sched.scheduled, exc)
        try:
            result = self._timed("wait", lambda: self.runner.wait(handle))
        except Exception as exc:
            logger.exception("engine step failed on the device")
            outputs = self._fail(handle.sched.scheduled, exc)
            if self._inflight is not None and self._inflight is not handle:
                outputs += self._fail(self._inflight.sched.scheduled, exc)
                self._drop(self._inflight)
            self._inflight = None
            return outputs
        # A step that computed prompt tokens says nothing of decoding's cost per token.
        self._collected_prefill |= handle.num_tokens > handle.num_seqs + handle.sched.num_draft_tokens
        if self.step_log is not None:
            self.step_log.append((handle.num_seqs, handle.num_tokens, handle.num_context_tokens))
        if self.timeline is not None:
            for name, start, end in handle.events.gpu_spans(self._timeline_base):
                self.timeline.add_gpu(name, start, end, handle.step_index)
        # The next step's grammar rows need only this step's tokens, which are here: their fill starts now, on the
        # worker, and runs beside the update, the caller's share and the next step's scheduling.
        handed_over = self._start_next_fill(handle, result.token_ids) if result.verified is None else False
        for request, first_token, entries in result.prompt_logprobs or ():
            if request.request_id in self._requests:  # else aborted meanwhile
                request.add_prompt_logprobs(first_token, entries)
        outputs = self._timed("update", lambda: self._update(handle.sched, result.token_ids, result.logprobs,
                                                             result.verified, advance=not handed_over))
        if result.verified is not None and self._inflight is not None and self._inflight.shifted:
            _settle_shifted(handle.sched, result.verified, self._inflight.sched)
        eagle3 = self.eagle3
        if (eagle3 is not None and self.proposer is not None and self.spec is not None
                and len(self.scheduler.running) <= self.spec.disable_by_batch_size):
            # The head reads the hidden states of every position the target computed, drafts or not (above
            # disable_by_batch_size no drafts are proposed, and the positions computed then go unread).
            self._timed("observe", lambda: eagle3.observe(handle.sched, handle.plan.flat,
                                                           aux_states(self.runner, handle.slot)))
        return outputs

    def _start_next_fill(self, handle: StepHandle, token_ids: list[int]) -> bool:
        """Right after a plain step's tokens land, with the next step in flight waiting for its grammar rows: hands
        the matchers their tokens (those `_update` would give them: each sampled row of a request under a grammar
        that is still running) and starts the rows' fill on the worker; whether it did. Not where a row of the next
        step reads its request's tokens (multi-token bad words), which `_update` has yet to append."""
        inflight = self._inflight
        if inflight is None or inflight is handle or not inflight.sampling_pending or not self.grammar.active:
            return False
        if any(r.host_mask is not None and r.host_mask.bad_word_ids for _, r, _ in inflight.mask_rows or ()):
            return False
        finished, requests = RequestStatus.FINISHED, self._requests
        tokens: list[tuple[HostMask, int]] = []
        for entry, token in zip(handle.sched.scheduled, token_ids):
            request = entry.request
            mask = request.host_mask
            if (mask is not None and entry.sample and request.status is not finished and request.max_output_tokens
                    and request.request_id in requests):
                tokens.append((mask, token))
        self.grammar.advance(tokens)
        self.grammar.start_fill(inflight, partial(self.runner.fill_masks, inflight, self._defers()))
        return True

    def _update(self, sched: SchedulerOutput, token_ids: list[int], logprobs: list[Logprobs] | None,
                verified: dict[int, tuple[list[int], list[Logprobs] | None]] | None = None,
                advance: bool = True) -> list[EngineOutput]:
        """Applies a collected step's tokens to its requests; with `advance`, hands them to the grammar matchers
        (else `_start_next_fill` did)."""
        if verified is not None:
            self._count_verified(sched, verified)
            touched = self.scheduler.update_from_output(sched, token_ids, logprobs, verified)
            return self._outputs(touched, verify=True)
        # A request is in a step at most once and each sampling entry appends one token, so every touched
        # request's new output is exactly its last token.
        touched = self.scheduler.update_from_output(sched, token_ids, logprobs)
        return self._outputs(touched, verify=False, advance=advance)

    def _count_verified(self, sched: SchedulerOutput, verified: dict[int, tuple[list[int], list[Logprobs] | None]]
                        ) -> None:
        """Acceptance counters, and each request's draft budget: one more after a fully accepted run, else one
        past what was accepted (fewer wasted rows where the proposer guesses wrong)."""
        spec = self.spec
        per_position = self.spec_accepted_per_position
        for row, (tokens, _) in verified.items():
            request = sched.scheduled[row].request
            if request.status is RequestStatus.FINISHED:
                continue  # ended by a stop token in the verify step before (this step was scheduled behind it)
            num_draft, accepted = sched.scheduled[row].num_draft, len(tokens) - 1
            if request.host_mask is not None or spec is None:  # a grammar's forced drafts
                self.forced_draft_tokens += num_draft
                self.forced_accepted_tokens += accepted
                self.forced_verified_rows += 1
                continue
            self.spec_draft_tokens += num_draft
            self.spec_accepted_tokens += accepted
            self.spec_verified_rows += 1
            for j in range(accepted):
                per_position[j] += 1
            request.spec_k = (min(spec.num_speculative_tokens, request.spec_k + 1) if accepted == num_draft
                              else accepted + 1)

    def _outputs(self, touched: list[Request], verify: bool, advance: bool = True) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        requests = self._requests
        finished_status = RequestStatus.FINISHED
        num_scored = num_tokens = 0
        # grammar_tokens[j]: (HostMask, its request's j-th new token) of this step; they reach the matchers together,
        # position after position, before the next fill.
        grammar_tokens: list[list[tuple[HostMask, int]]] = []
        for req in touched:
            rid = req.request_id
            if rid not in requests:
                continue  # aborted meanwhile: its token is dropped
            host_mask = req.host_mask
            num_new = req.num_new_tokens if verify else 1
            if advance and host_mask is not None and req.output_token_ids and num_new:
                for j, token in enumerate(req.output_token_ids[-num_new:]):
                    if j == len(grammar_tokens):
                        grammar_tokens.append([])
                    grammar_tokens[j].append((host_mask, token))
            new_lp = req.output_logprobs[-num_new:] if req.sampling_params.logprobs is not None and num_new else None
            prompt_lp = None
            if req.sampling_params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                prompt_lp, req.prompt_logprobs_sent = req.prompt_logprobs, True
                num_scored += not req.output_token_ids and not verify  # max_tokens=0: finished without a token
            scheduled_at = req.first_scheduled_time
            finished = req.status is finished_status
            cached = req.num_cached_tokens
            out = EngineOutput(rid, req.output_token_ids[-num_new:] if num_new else [], new_lp, finished,
                               req.finish_reason, req.stop_reason, len(req.prompt_token_ids),
                               cached if cached > 0 else 0, None,
                               scheduled_at - req.arrival_time if scheduled_at else None, prompt_lp)
            if finished:
                out.spec_draft_tokens, out.spec_accepted_tokens = req.num_draft_tokens, req.num_accepted_tokens
            outputs.append(out)
            if finished:
                self._forget(rid)
            num_tokens += num_new
        self.num_generation_tokens += num_tokens - num_scored
        for tokens in grammar_tokens:
            self.grammar.advance(tokens)
        return outputs

    def _fail(self, scheduled: list, exc: Exception) -> list[EngineOutput]:
        # Blocks published for the failed step may hold garbage KV: forget every cached prefix.
        self.scheduler.reset_prefix_cache()
        if _is_out_of_memory(exc):
            # The step's activations did not fit: its requests fail, their blocks go back to the pool, and
            # the allocator's cached segments are returned so the next (smaller) step finds the memory.
            _release_cached_device_memory()
        outputs = []
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        for s in scheduled:
            req: Request = s.request
            rid = req.request_id
            if rid not in self._requests:
                continue
            self.scheduler.finish_request(rid, FinishReason.ABORT)
            req.error = message
            outputs.append(EngineOutput(rid, [], None, True, FinishReason.ABORT, None, req.num_prompt_tokens,
                                        max(req.num_cached_tokens, 0), error=message))
            self._forget(rid)
        return outputs

    def _drop(self, handle: StepHandle) -> None:
        """Waits out a step whose results are discarded, so its slot is free before it is rewritten."""
        try:
            self.grammar.join(handle)
        except Exception:  # the step is dropped: what its rows' fill raised no longer matters
            logger.exception("filling a dropped step's grammar rows failed")
        try:
            self.runner.drain(handle)
        except Exception:  # the device itself failed: nothing left to wait for
            logger.exception("could not wait for a dropped step")

    def _timed(self, name: str, fn):  # type: ignore[no-untyped-def]
        if self.timeline is None:
            return fn()
        with self.timeline.span(name):
            return fn()

    @property
    def fatal_error(self) -> str | None:
        """Why no step can succeed any more (a tensor-parallel rank died), else None. The server's engine-core
        process exits on it, so that its replica is taken out rather than failing every request it gets."""
        group = getattr(self.runner, "group", None)
        return getattr(group, "failure", None) if group is not None else None

    def shutdown(self) -> None:
        """Frees the GPU state and stops the tensor-parallel workers; the engine cannot step afterwards.
        Idempotent."""
        atexit.unregister(self.shutdown)
        if self._inflight is not None:
            try:
                self.grammar.join(self._inflight)
            except Exception:
                logger.exception("filling grammar rows failed during shutdown")
        self.grammar.shutdown()
        if self.runner.lora is not None:
            self.runner.lora.shutdown()
        self._loading.clear()
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.shutdown()
        if self.eagle3 is not None:
            self.eagle3.release()
        self._inflight = None  # the runner finishes (or, after a failure, aborts) what is still on the device
        self._requests.clear()
        self.runner.shutdown()

    # ---------------------------------------------------------------- profiling and stats

    def start_timeline(self) -> Timeline:
        """Records CPU spans of every step and GPU spans of each step's compute from now on."""
        self.timeline = Timeline()
        self.runner.set_timing(True)
        if self.runner.device.type == "cuda":
            import torch

            base = torch.cuda.Event(enable_timing=True)
            base.record(self.runner.streams.compute)
            base.synchronize()
            self._timeline_base = (base, time.perf_counter())
        return self.timeline

    def stop_timeline(self) -> Timeline | None:
        tl, self.timeline = self.timeline, None
        group = self.runner.group
        if tl is not None and group is not None and group.failure is None:
            for rank, step, start, end in group.collect_spans():  # the other ranks' GPUs, lanes gpu1..gpuN-1
                tl.add_gpu("compute", start, end, step, lane=f"gpu{rank}")
        self.runner.set_timing(False)
        self._timeline_base = None
        return tl

    def stats(self) -> EngineStats:
        s = self.scheduler
        lora = self.runner.lora
        running, waiting = s.adapter_requests() if lora is not None else ({}, {})
        for request in self._loading.values():  # waiting for their adapter's host copy
            name = request.lora_request.lora_name  # type: ignore[union-attr]
            waiting[name] = waiting.get(name, 0) + 1
        return EngineStats(
            num_running=s.num_running(),
            num_waiting=s.num_waiting(),
            kv_cache_usage=s.kv_cache_usage(),
            prefix_cache_hit_rate=s.prefix_cache_hit_rate(),
            num_free_blocks=s.num_free_blocks(),
            num_blocks=self.runner.num_blocks,
            num_steps=self.num_steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_preemptions=s.num_preemptions,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_accepted_per_position=tuple(self.spec_accepted_per_position),
            spec_verified_rows=self.spec_verified_rows,
            lora_running=running,
            lora_waiting=waiting,
            lora_page_ins=lora.num_page_ins if lora is not None else 0,
            lora_host_copies=lora.num_host_copies if lora is not None else 0,
        )


def _settle_shifted(sched: SchedulerOutput, verified: dict[int, tuple[list[int], list[Logprobs] | None]],
                    behind: SchedulerOutput) -> None:
    """Once a verify step is collected, the step scheduled behind it (as if every draft were accepted) learns where
    its requests' rows really start: each moves back by its request's rejected drafts, as the device moved them."""
    rejected = {id(sched.scheduled[row].request): sched.scheduled[row].num_draft - (len(tokens) - 1)
                for row, (tokens, _) in verified.items()}
    for entry in behind.scheduled:
        if entry.carry:
            entry.num_computed_tokens -= rejected.get(id(entry.request), 0)


def _draft_room(request: Request) -> int:
    """How many drafts a running request may take in its next step: 0 while it has a token in flight or is still in
    its prompt; else its room before max_tokens less the one token the step samples anyway. Penalties and bias
    apply to its draft rows too (each row's penalties count the drafts before it: runner.logits_state)."""
    if request.num_pending_tokens:
        return 0
    if request.num_computed_tokens != len(request.all_token_ids) - 1:
        return 0
    return max(0, request.max_output_tokens - len(request.output_token_ids) - 1)


def _is_out_of_memory(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError)


def _release_cached_device_memory() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            torch.cuda.empty_cache()
        except Exception:  # the device itself failed: nothing to release
            logger.exception("could not release the cached device memory after an out-of-memory step")
