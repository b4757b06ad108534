"""ModelRunner: executes what a SchedulerOutput says: fill a slot, H2D, forward (graph or eager), sample, D2H.

`prepare` writes a step into its slot's pinned host buffers; `enqueue` puts its H2D, forward, sampling and D2H on
the GPU streams, ordered by the slot's events, and returns at once; `wait` is the one place per step where the
CPU waits for the GPU, on the step's d2h_done event (docs/architecture.md, "One engine step"). A step with grammar
rows is enqueued without its sampling, which `launch_sampling` adds once the host has filled their bitmask.
The parts: weights.py loads the model, kv_memory.py sizes the KV pool, executor.py runs the forward and sampling
(eager or from CUDA graphs), input_buffers.py holds the pinned A/B slots, streams.py the streams and events.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from tandem.config import EngineConfig, ParallelConfig
from tandem.distributed.group import TPGroup
from tandem.distributed.ranks import TensorParallelGroup, WorkerDiedError
from tandem.layers.parallel import local_kv_heads
from tandem.lora.manager import LoRAManager
from tandem.models.llama import AuxHiddenStates
from tandem.models.loader import model_max_len
from tandem.request import Logprobs
from tandem.runner.executor import ModelExecutor
from tandem.runner.host_masks import HostMaskBuffers
from tandem.runner.input_buffers import StepBuffers, write_flat_verify, write_step
from tandem.runner.kv_memory import KVLayout, num_blocks_from_memory
from tandem.runner.logits_state import LogitsState
from tandem.runner.prompt_logprobs import PromptLogprobs
from tandem.runner.step_plan import PreparedStep, StepHandle, StepPlan, StepResult
from tandem.runner.streams import DeviceStreams, StepEvents
from tandem.runner.weights import load_weights
from tandem.sampling_params import MAX_LOGPROBS
from tandem.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SideOutputs:
    """What a speculative head needs of the target's steps besides their tokens."""

    aux_layers: tuple[int, ...]  # every step copies the residual stream entering these layers, per token
    kv_bytes_per_block: int  # the head's own KV per block of the target's: the pool is sized for both
    extra_kv_bytes: int = 0  # the head's KV past the target's blocks (its chains' scratch blocks)


class ModelRunner:
    """One rank's model, KV cache shard, slot buffers, streams and graphs. With a tensor-parallel group, rank 0 (the
    engine's) sends each prepared step to the other ranks, which run it through worker.py's loop."""

    def __init__(self, config: EngineConfig, group: TensorParallelGroup | None = None,
                 side: SideOutputs | None = None) -> None:
        self.config, self.group = config, group
        self.tp = group.comm if group is not None else TPGroup()
        self.parallel: ParallelConfig = self.tp.parallel
        self.device = group.device if group is not None else config.resolved_device()
        self.dtype = config.resolved_dtype()
        loaded = load_weights(config, self.device, self.dtype, self.tp)
        self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
        # An EAGLE-3 head (on rank 0) embeds its drafts with the whole embedding table: a table split over the ranks'
        # vocabularies is gathered once here (every rank joins; only rank 0 keeps it).
        self.full_embeddings: torch.Tensor | None = None
        if side is not None and self.tp.size > 1:
            table = self.tp.all_gather_last_dim(loaded.model.model.embed_tokens.weight.t())  # [hidden, ranks x rows]
            if self.tp.rank == 0:
                self.full_embeddings = table.t()[: loaded.config.vocab_size].contiguous()
            del table
        self.max_model_len = config.max_model_len or min(model_max_len(self.model_config), 8192)
        self.block_size, self.max_num_seqs = config.block_size, config.max_num_seqs
        self.max_num_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        self.streams = DeviceStreams(self.device)
        spec = config.speculative
        spec_drafts = spec.num_speculative_tokens if spec is not None else 0
        # Grammar-forced drafts: at most max_num_seqs of them in a step (EngineCore._propose), any request's.
        forced = config.forced_drafts
        max_drafts = max(spec_drafts, forced)
        # Flat verify steps (decode graphs of one row per token) for as many sequences as speculation runs for,
        # and for every sequence plus as many forced drafts.
        self.max_verify_rows = max(min(spec.disable_by_batch_size, config.max_num_seqs) * (1 + spec_drafts)
                                   if spec is not None else 0, 2 * config.max_num_seqs if forced else 0)
        # LoRA adapters (tandem.lora): the device pool is allocated before the KV cache is sized from what is left.
        self.lora = None if not config.enable_lora else LoRAManager(
            loaded.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, self.max_num_tokens,
            self.dtype, self.device, self.parallel.size)
        self.buffers = [StepBuffers(self.max_num_tokens, self.max_num_seqs, self.max_blocks_per_seq, MAX_LOGPROBS,
                                    self.device, max_drafts, lora=self.lora is not None) for _ in range(2)]
        vocab = self.model_config.vocab_size
        self.logits_state = LogitsState(self.max_num_seqs, vocab, self.device)
        # Grammar rows: every sequence's, and (forced drafts) as many draft rows (drafts of other proposers go to
        # requests without a grammar).
        self.host_masks = HostMaskBuffers(self.max_num_seqs * (2 if forced else 1), vocab, self.device)
        # Prompt rows are scored max_num_seqs at a time: the logits the KV budget's profiling forward made room for.
        self.prompt_logprobs = PromptLogprobs(self.max_num_tokens, MAX_LOGPROBS, min(self.max_num_seqs, 256),
                                              self.device)
        self.num_kv_heads = local_kv_heads(self.model_config, self.parallel)  # this rank's share of the KV heads
        layout = KVLayout(self.model_config.num_layers, self.block_size, self.num_kv_heads,
                          self.model_config.head_dim, loaded.kv_cache_dtype)
        # Each slot's aux hidden states [max_num_tokens, layers x hidden], before the KV pool takes what is left.
        aux = None if side is None else [AuxHiddenStates(side.aux_layers, torch.zeros(
            self.max_num_tokens, len(side.aux_layers) * self.model_config.hidden_size, dtype=self.dtype,
            device=self.device)) for _ in range(2)]
        sizing = layout
        if side is not None and side.kv_bytes_per_block:  # the head's KV as whole extra layers of the target's
            per_layer = layout.bytes_per_block // layout.num_layers
            sizing = replace(layout, num_layers=layout.num_layers + math.ceil(side.kv_bytes_per_block / per_layer))
        self.num_blocks = config.num_kv_blocks or num_blocks_from_memory(
            config, sizing, loaded.model, self.device, self.max_num_tokens, self.max_blocks_per_seq,
            side.extra_kv_bytes if side is not None else 0)
        if group is not None and config.num_kv_blocks is None:
            # One scheduler drives every rank: all KV shards get the block count of the tightest GPU.
            self.num_blocks = group.min_over_ranks(self.num_blocks)
        self.executor = ModelExecutor(loaded.model, layout.allocate(self.num_blocks, self.device), self.buffers,
                                      self.max_model_len, self.model_config.num_heads // self.parallel.size,
                                      self.num_kv_heads, _device_sms(self.device))
        self.executor.lora = None if self.lora is None else self.lora.pool
        self.executor.aux = aux
        self._start_device()
        self.timing = False
        self.events = [StepEvents(self.device, False) for _ in range(2)]
        self.step_index = 0
        self._prev_rows: dict[str, int] = {}  # request id -> row in the previous step's sampled tokens
        self._prev_drafts: dict[str, tuple[int, int]] = {}  # request id -> (drafts, first draft row) there (flat)
        # The fused all-reduce's timeout flag (device, sticky) and its pinned host copy, read with each step's D2H.
        flag = self.tp.timed_out
        self._timeout_flag = None if flag is None else (flag, torch.zeros(1, dtype=torch.int32).pin_memory())
        self.released = False  # shutdown() ran: graphs, KV cache and weights are gone

    def _start_device(self) -> None:
        """Peer-to-peer all-reduce (before any capture), kernel warm-up and graph capture; nothing on the CPU."""
        if self.device.type != "cuda":
            return
        config, mc = self.config, self.model_config
        if self.group is not None:  # decode steps' all-reduces ([batch, hidden]) go peer to peer, larger to NCCL
            max_bytes = self.max_num_seqs * mc.hidden_size * self.dtype.itemsize
            self.tp.enable_peer_to_peer(self.device, self.dtype, max_bytes)
        with torch.inference_mode():
            self.executor.warm_mixed_attention(self.max_num_seqs, self.max_num_tokens, self.dtype)
        torch.cuda.synchronize()
        if config.cuda_graph:
            self.executor.capture(self.max_num_seqs, self.max_num_tokens, config.piecewise_max_tokens,
                                  mc.vocab_size, self.dtype, self.streams.compute, self.max_verify_rows)
        if self.group is not None and self.piecewise is None:  # eager mixed steps: connect NCCL's sizes now
            self.tp.warm_nccl(self.max_num_tokens * mc.hidden_size, self.dtype, self.device)

    # ---------------------------------------------------------------- what callers read (and tests switch off)

    @property
    def model(self) -> Any:
        return self.executor.model

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.executor.kv_cache

    @property
    def graphs(self) -> Any:
        return self.executor.graphs

    @graphs.setter
    def graphs(self, value: Any) -> None:
        self.executor.graphs = value

    @property
    def piecewise(self) -> Any:
        return self.executor.piecewise

    @piecewise.setter
    def piecewise(self, value: Any) -> None:
        self.executor.piecewise = value

    def set_timing(self, enabled: bool) -> None:
        """Turns on timing events around each step's GPU work (for the timeline)."""
        self.timing = enabled
        self.events = [StepEvents(self.device, enabled) for _ in range(2)]

    # ---------------------------------------------------------------- prepare / enqueue / wait

    @torch.inference_mode()
    def prepare(self, sched: SchedulerOutput, constrained: bool = False) -> PreparedStep:
        """Writes one step into its slot's pinned host buffers; nothing reaches the GPU until enqueue(). With
        `constrained` (some request has a grammar or multi-token bad words) its rows get a host bitmask."""
        slot = self.step_index % 2
        num_seqs, num_tokens = len(sched.scheduled), sched.num_scheduled_tokens
        # A step that scores prompt rows needs its hidden rows: never a decode graph (which returns only logits).
        scores_prompt = self.prompt_logprobs.prepare(slot, sched)
        decode_only = num_tokens == num_seqs and not scores_prompt
        graphs, pieces = self.executor.graphs, self.executor.piecewise
        # Every sequence decodes or verifies drafts: one attention row per token, a decode step (graph) of its own.
        flat = (sched.num_draft_tokens > 0 and not scores_prompt and num_tokens <= self.buffers[slot].max_rows
                and all(s.num_scheduled_tokens == 1 + s.num_draft for s in sched.scheduled))
        decode_rows = num_tokens if flat else num_seqs
        if flat:
            graphs = self.executor.verify_graphs
        graph_bs = graphs.padded_size(decode_rows) if (graphs is not None and (decode_only or flat)) else None
        if flat and graphs is not None and graph_bs is None:
            flat = False  # more rows than the largest decode graph: the drafts' sequences run as short prefills
        piece_tokens = (pieces.padded_size(num_tokens) if (pieces is not None and not decode_only and not flat)
                        else None)
        rows: dict[str, int] = {}
        if flat:
            shape = write_flat_verify(self.buffers[slot], sched, self._prev_rows, self.block_size, graph_bs, rows,
                                      self._prev_drafts)
        else:
            shape = write_step(self.buffers[slot], sched, self._prev_rows, self.block_size, graph_bs, rows,
                               piece_tokens)
        if self._prev_drafts and not shape.shifted and any(s.carry and s.request.request_id in self._prev_drafts
                                                           for s in sched.scheduled):
            raise RuntimeError("a step carries tokens from a verify step in flight but is not a flat verify step "
                               "(only those finish their positions on the device)")
        # Each verifying request's (drafts, first draft row) in this step, for a flat step written behind it.
        self._prev_drafts = ({sched.scheduled[i].request.request_id: (k, first) for i, first, k in shape.draft_rows}
                             if flat and shape.draft_rows else {})
        self.logits_state.prepare(slot, sched.scheduled, shape.any_logits_state, shape.draft_rows, shape.num_rows)
        if self.lora is not None:  # each token's adapter slot, and the adapters to page in before the step
            self.lora.write_slots(self.buffers[slot].ints.np["lora_slots"], sched.scheduled, num_tokens,
                                  max(num_tokens, graph_bs or 0, piece_tokens or 0),
                                  shape.draft_rows if flat else None)
            self.lora.stage(sched.lora_loads, sched.lora_loads_wait)
        self._prev_rows = rows
        plan = StepPlan(slot, num_seqs, num_tokens, graph_bs, shape.all_greedy, shape.any_top_k_top_p,
                        shape.num_logprobs, shape.max_query_len, shape.max_seq_len, self.step_index, self.timing,
                        shape.num_decodes, piece_tokens, *self.prompt_logprobs.plan_shape(slot),
                        shape.num_rows if shape.draft_rows else 0)
        # Rows whose next token a grammar (or a multi-token bad word) decides on the CPU: their sampling waits for
        # launch_sampling, after the previous step's tokens have reached the matchers.
        mask_rows = _mask_rows(sched, shape.draft_rows) if constrained else []
        return PreparedStep(sched, plan, shape.num_context_tokens, mask_rows, shape.draft_rows, shape.shifted)

    @torch.inference_mode()
    def enqueue(self, prepared: PreparedStep, drafts: torch.Tensor | None = None) -> StepHandle:
        """Enqueues a prepared step on the GPU streams and returns without waiting. `drafts`: the device output of
        a proposer whose draft_stand_in ids the step's input ids hold (one rank only)."""
        plan = prepared.plan
        if drafts is not None and self.group is not None:
            raise RuntimeError("drafts left on the device reach no other rank: propose them on the host")
        if plan.step_index != self.step_index:
            raise RuntimeError(f"step {plan.step_index} was prepared, but the runner is at step {self.step_index}")
        handle = StepHandle(prepared.sched, plan, self.events[plan.slot], prepared.num_context_tokens,
                            draft_rows=prepared.draft_rows, shifted=prepared.shifted)
        if prepared.shifted and self.group is not None:
            raise RuntimeError("a step behind a verify step in flight reaches no other rank: collect that step first")
        if self.group is not None:
            lora_message = None if self.lora is None else self.lora.take_staged_message()
            if lora_message is not None:  # adapters to page in: every rank reads its own shards
                self.group.send_bytes(lora_message)
            # The other ranks get the filled host buffers before this rank launches (CPU to CPU only).
            regions = plan.regions(self.buffers[plan.slot]) + self.prompt_logprobs.regions(plan.slot)
            self.group.send_step(plan.fields(), regions)
            try:
                self.enqueue_plan(plan, download=True)
            except Exception as exc:  # on gloo the model's collectives run here: a dead peer surfaces now
                self.group.raise_failure(exc)
        elif prepared.mask_rows:
            handle.logits = self.enqueue_plan(plan, download=True, defer_sampling=True, drafts=drafts,
                                              shifted=prepared.shifted)
            handle.mask_rows = prepared.mask_rows
        else:
            self.enqueue_plan(plan, download=True, drafts=drafts, shifted=prepared.shifted)
        self.step_index += 1  # only once enqueued: a failed launch leaves the slot order unchanged
        return handle

    def enqueue_plan(self, plan: StepPlan, download: bool, defer_sampling: bool = False,
                     drafts: torch.Tensor | None = None, shifted: bool = False) -> torch.Tensor:
        """H2D of the slot, forward, sampling and (rank 0) D2H, ordered by the slot's events; with defer_sampling
        only the H2D and the forward (`_enqueue_sampling` adds the rest); `drafts` fills the step's draft
        stand-ins first (enqueue), `shifted` finishes rows written behind a verify step in flight
        (ModelExecutor.shift_rows). Returns the step's logits rows."""
        buf, events, streams = self.buffers[plan.slot], self.events[plan.slot], self.streams
        with streams.on("h2d"):
            buf.upload(plan.graph_bs or plan.attention_rows)
            self.logits_state.upload(plan.slot)
            self.prompt_logprobs.upload(plan.slot)
            if self.lora is not None:  # last: where a page-in waits for the step in flight, only it waits
                self.lora.upload(*((streams.h2d, streams.compute) if streams.cuda else (None, None)))
            streams.record("h2d", events.h2d_done)
        streams.wait("compute", events.h2d_done)
        with streams.on("compute"):
            streams.record("compute", events.compute_start)
            if drafts is not None and drafts.numel():
                self.executor.take_drafts(plan.slot, drafts, plan.num_tokens, plan.rows)
            if shifted:
                self.executor.shift_rows(plan.slot, plan.rows, self.block_size)
            score = None  # the prompt rows' log-probabilities, from the step's hidden rows
            if self.prompt_logprobs.plans[plan.slot] is not None:
                score = partial(self.prompt_logprobs.compute, plan.slot, compute_logits=self.model.compute_logits)
            logits = self.executor.run(plan, rows_view=defer_sampling or bool(self.logits_state.plans[plan.slot]),
                                       score=score)
            # Penalties and bias, only where a row uses them (a verify step's draft rows with their sequence's).
            self.logits_state.apply(plan.slot, logits)
        events.deferred = defer_sampling
        if defer_sampling:
            with streams.on("compute"):
                streams.record("compute", events.forward_done)
        else:
            self._enqueue_sampling(plan, logits, download, None)
        return logits

    def _enqueue_sampling(self, plan: StepPlan, logits: torch.Tensor, download: bool, num_masked: int | None) -> None:
        """Sampling (after the grammar bitmask of `num_masked` rows, when given), counts, and the D2H."""
        buf, events, streams = self.buffers[plan.slot], self.events[plan.slot], self.streams
        if num_masked is not None:
            with streams.on("h2d"):
                self.host_masks.upload(plan.slot, num_masked)
                streams.record("h2d", events.mask_done)
            streams.wait("compute", events.mask_done)
        with streams.on("compute"):
            if num_masked is not None:
                streams.record("compute", events.sample_start)
                self.host_masks.apply(plan.slot, logits, num_masked)
            self.executor.sample(plan, logits)
            # A verify step counts the accepted drafts and the token after them: the rows the verify kept.
            verified = plan.verifies and self.logits_state.plans[plan.slot] is not None
            self.logits_state.count(plan.slot, buf.out_tokens, self.executor.kept_rows(plan) if verified else None)
            streams.record("compute", events.compute_done)
        if download or self._timeout_flag is not None:
            streams.wait("d2h", events.compute_done)
            with streams.on("d2h"):
                if download:
                    buf.download(plan.num_seqs, plan.num_logprobs, plan.rows)
                    self.prompt_logprobs.download(plan.slot)
                if self._timeout_flag is not None:
                    flag, host_flag = self._timeout_flag
                    host_flag.copy_(flag, non_blocking=True)
                streams.record("d2h", events.d2h_done)

    def fill_masks(self, handle: StepHandle, defer: bool = False) -> None:
        """CPU only: fills the bitmask rows of a step launched with grammar rows from each request's matcher
        (which has seen every token up to the previous step's). Touches nothing but the step's pinned bitmask
        slot and the matchers it reads, so it may run on a worker thread while the next step is prepared.
        `defer`: likely slow rows may be computed apart (HostMaskBuffers.fill; deferred_rows, settle_row)."""
        assert handle.mask_rows is not None, "fill_masks on a step without grammar rows"
        self.host_masks.fill(handle.slot, handle.mask_rows, defer=defer)

    def deferred_rows(self, handle: StepHandle) -> list[tuple[int, Any, Any]]:
        """(bitmask row, request, HostMask) of the step's grammar rows still computed apart after its fill."""
        return self.host_masks.deferred[handle.slot]

    def settle_row(self, handle: StepHandle, row: int, mask: Any) -> None:
        """Writes a grammar row computed apart into the step's bitmask, waiting for it."""
        self.host_masks.settle(handle.slot, row, mask)

    def sit_out(self, prepared: PreparedStep, index: int) -> None:
        """Moves sequence `index` of a prepared one-token step, which carries the token the step in flight samples
        for it, back by one position: that row sits the step in flight out (its sampled token is dropped), so this
        step computes the position the step in flight computed again, from the known token there, and samples what
        that step would have (the noise is a function of the position). Host buffers only: call before enqueue."""
        s = prepared.sched.scheduled[index]
        assert s.carry and s.num_scheduled_tokens == 1 and not s.num_draft, "sit_out of a row that carries no token"
        pos = s.num_computed_tokens - 1
        buf, bs = self.buffers[prepared.plan.slot], self.block_size
        ints, longs = buf.ints.np, buf.longs.np
        t = int(ints["query_start_loc"][index])
        ints["input_ids"][t] = s.request.all_token_ids[pos]
        ints["positions"][t] = pos
        longs["slot_mapping"][t] = s.block_ids[pos // bs] * bs + pos % bs
        longs["carry_src"][t] = -1
        ints["seq_lens"][index] = pos + 1
        longs["sample_pos"][index] = pos + 1

    @torch.inference_mode()
    def launch_sampling(self, handle: StepHandle) -> None:
        """Completes a step launched with grammar rows, after fill_masks: uploads the rows on the H2D stream and
        enqueues masking, sampling and the D2H. The forward was enqueued by enqueue() and may be running now."""
        assert handle.mask_rows is not None and handle.logits is not None, "launch_sampling without grammar rows"
        num_masked = sum(len(logits_rows) for logits_rows, _, _ in handle.mask_rows)
        self._enqueue_sampling(handle.plan, handle.logits, download=True, num_masked=num_masked)
        handle.mask_rows = handle.logits = None

    def wait(self, handle: StepHandle) -> StepResult:
        """Blocks until the step's tokens are in host memory: the one CPU wait per step."""
        if self.group is not None:
            self.group.wait_event(handle.events.d2h_done)  # polls, so that a dead rank is an error, not a hang
            self.check_all_reduce_timeout()
        else:
            handle.events.d2h_done.synchronize()
        buf, n = self.buffers[handle.slot], handle.plan.rows
        token_ids = buf.host_tokens_np[:n].tolist()
        logprobs: list[Logprobs] | None = None
        if handle.plan.num_logprobs >= 0:
            chosen_np = buf.host_logprob_np[:n]
            k = handle.plan.num_logprobs
            top_ids_np, top_lp_np = buf.host_top_ids_np[:n, :k], buf.host_top_lp_np[:n, :k]
            logprobs = [
                (float(chosen_np[i]), list(zip(top_ids_np[i].tolist(), top_lp_np[i].tolist())))
                for i in range(n)
            ]
        verified = None
        if handle.draft_rows:
            verified = _verified_tokens(handle.draft_rows, token_ids, logprobs, buf.host_accepted_np.tolist())
        num_seqs = handle.num_seqs
        return StepResult(token_ids[:num_seqs], logprobs[:num_seqs] if logprobs is not None else None,
                          self.prompt_logprobs.read(handle.slot), verified)

    def check_all_reduce_timeout(self) -> None:
        """Fails the group (every later step too) once this rank's fused all-reduce gave up waiting for a peer:
        the steps since hold garbage rows. The flag reaches the host with each step's D2H copy."""
        if self._timeout_flag is None or not int(self._timeout_flag[1][0]):
            return
        group = self.group
        assert group is not None
        if group.failure is None:
            group.failure = (f"tensor-parallel rank {self.parallel.rank}: the peer-to-peer all-reduce gave up "
                             "waiting for a peer (a rank stalled or died mid-step); this group's results are invalid")
        raise WorkerDiedError(group.failure)

    def drain(self, handle: StepHandle) -> None:
        """Waits out a step whose results are discarded (returns at once when a rank is dead)."""
        if self.group is not None:
            if self.group.failure is None:
                self.group.wait_event(handle.events.d2h_done)
        elif handle.sampling_pending:  # its sampling was never enqueued: the forward is what runs
            handle.events.forward_done.synchronize()
        else:
            handle.events.d2h_done.synchronize()

    # ---------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Frees this rank's graphs, KV cache and weights and, with tensor parallelism, stops the workers and
        leaves the group; the runner cannot launch afterwards. Idempotent.

        The order is what lets NCCL tear down: rank 0 first finishes its own GPU work, then tells the workers
        to stop (each then does the same as this rank: synchronize, release its graphs, destroy the group);
        the CUDA graphs, which hold references on the communicator, go before the group is destroyed."""
        if self.released:
            return
        group = self.group
        if group is not None:
            group.check_alive_quietly()
        if group is not None and group.failure is not None:
            self._release_after_failure(group)
            return
        try:
            self._synchronize()
        except WorkerDiedError:  # a worker died just now: abort instead
            self._release_after_failure(group)  # type: ignore[arg-type]
            return
        if group is not None:
            group.stop_workers()
        self.release()
        if group is not None:
            group.close()

    def release(self, empty_cache: bool = True) -> None:
        """Drops the graphs (resetting them now, not whenever the collector gets to them), the KV cache, the
        weights and the slot buffers, so that the GPU memory is free for the next engine of this process."""
        if self.released:
            return
        self.released = True
        self.executor.release()
        self.tp.release()  # the symmetric-memory buffers go with the graphs that captured them
        self.buffers = []
        if empty_cache and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _synchronize(self) -> None:
        """Waits for every kernel this rank launched: no graph may be destroyed under a running replay. Rank 0
        polls an event per stream while it watches its workers, since a collective with a dead peer never ends."""
        if self.device.type != "cuda":
            return
        if self.group is None or not self.group.procs:
            torch.cuda.synchronize(self.device)
            return
        for stream in (self.streams.h2d, self.streams.compute, self.streams.d2h):
            event = torch.cuda.Event()
            event.record(stream)
            self.group.wait_event(event)
        torch.cuda.synchronize(self.device)  # anything else (no collective is left running now)

    def _release_after_failure(self, group: TensorParallelGroup) -> None:
        """A peer is gone and this GPU may be spinning in a collective that never completes: abort the
        communicator (its kernels then exit) while the graphs are dropped (the abort waits for them)."""
        closer = threading.Thread(target=group.close, name="tandem-tp-abort", daemon=True)
        closer.start()
        try:
            self.executor.drop_graphs()
        except Exception:
            logger.warning("could not release the CUDA graphs after a rank failed", exc_info=True)
        closer.join()
        self.release(empty_cache=False)  # freeing device memory would wait for kernels the abort may not end


def _mask_rows(sched: SchedulerOutput, draft_rows: list[tuple[int, int, int]] | None
               ) -> list[tuple[list[int], Any, list[int]]]:
    """(logits row of each position, request, drafts) of the step's rows a host mask constrains: a sequence's own
    row, and in a verify step its draft rows first (draft j's row samples the token after drafts 0..j-1)."""
    drafts_of = {row: (first, k) for row, first, k in draft_rows or ()}
    out: list[tuple[list[int], Any, list[int]]] = []
    for i, s in enumerate(sched.scheduled):
        if not s.sample or s.request.host_mask is None:
            continue
        first, k = drafts_of.get(i, (0, 0))
        if k:
            out.append(([*range(first, first + k), i], s.request, s.token_ids[-k:]))
        else:
            out.append(([i], s.request, []))
    return out


def _verified_tokens(draft_rows: list[tuple[int, int, int]], row_tokens: list[int], logprobs: list[Logprobs] | None,
                     accepted: list[int]) -> dict[int, tuple[list[int], list[Logprobs] | None]]:
    """Each verifying sequence's tokens: its accepted drafts (rows first..first+a-1 sampled them), then the token
    sampled where the first draft was rejected, or after the last draft (the sequence's own row) when none was."""
    out: dict[int, tuple[list[int], list[Logprobs] | None]] = {}
    for row, first, k in draft_rows:
        a = accepted[row]
        rows = list(range(first, first + a)) + [first + a if a < k else row]
        out[row] = ([row_tokens[r] for r in rows], [logprobs[r] for r in rows] if logprobs is not None else None)
    return out


def _device_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    from tandem.kernels.triton_attention import device_sms  # lazy: CPU runs never import Triton

    return device_sms(device)

