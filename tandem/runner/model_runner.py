"""ModelRunner: executes what a SchedulerOutput says — fill a slot, H2D, forward (graph or eager), sample, D2H.

The hot path (`launch` and `wait`) never synchronizes with the GPU except in `wait`, on the step's
d2h_done event: that is the one place per step where the CPU waits (DESIGN.md invariant 1).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from tandem.config import EngineConfig, ModelConfig, ParallelConfig
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.fp8 import FP8_DTYPE
from tandem.layers.all_reduce import create_symmetric_all_reduce
from tandem.layers.parallel import local_kv_heads, set_tp_group
from tandem.layers.quantization import check_fp8_device
from tandem.models.loader import load_model_and_tokenizer, model_max_len
from tandem.runner.cuda_graphs import (
    DecodeGraphs,
    PiecewiseGraphs,
    SamplerVariant,
    graph_batch_sizes,
    piecewise_sizes,
    sampler_variant,
)
from tandem.runner.input_buffers import StepBuffers, StepShape, write_step
from tandem.runner.host_masks import HostMaskBuffers
from tandem.runner.logits_state import LogitsState
from tandem.runner.prompt_logprobs import PromptLogprobs
from tandem.runner.sampler import sample
from tandem.runner.streams import DeviceStreams, StepEvents
from tandem.runner.tensor_parallel import StepPlan, TensorParallelGroup, WorkerDiedError
from tandem.sampling_params import MAX_LOGPROBS
from tandem.scheduler.output import SchedulerOutput

logger = logging.getLogger(__name__)


Logprobs = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class StepHandle:
    """A launched step: what the CPU needs to read its results once d2h_done fires."""

    sched: SchedulerOutput
    slot: int
    num_seqs: int
    num_logprobs: int
    events: StepEvents
    graph_batch_size: int | None  # None: eager
    num_tokens: int = 0
    step_index: int = 0
    num_context_tokens: int = 0  # sum of the sequences' context lengths: KV the step reads
    # Set while the step's sampling waits for its grammar bitmask: (plan, logits, [(row, request)]).
    pending: tuple[StepPlan, torch.Tensor, list[tuple[int, Any]]] | None = None


@dataclass(slots=True)
class PreparedStep:
    """A step written into its slot's host buffers and not yet enqueued (ModelRunner.prepare)."""

    sched: SchedulerOutput
    plan: StepPlan
    num_context_tokens: int
    mask_rows: list[tuple[int, Any]]  # (batch row, request) of the rows a host mask constrains


@dataclass(slots=True)
class StepResult:
    token_ids: list[int]
    logprobs: list[Logprobs] | None
    # (request, index of its first scored prompt token, one entry per token) of the requests with prompt_logprobs
    prompt_logprobs: list[tuple[Any, int, list[Logprobs]]] | None = None


class ModelRunner:
    """One rank's model, KV cache shard, slot buffers, streams and graphs. With a tensor-parallel group,
    rank 0 (the engine's) broadcasts each prepared step; the other ranks run it through launch_remote."""

    def __init__(self, config: EngineConfig, group: TensorParallelGroup | None = None) -> None:
        self.config = config
        self.group = group
        self.parallel = group.parallel if group is not None else ParallelConfig()
        self.device = group.device if group is not None else config.resolved_device()
        self.dtype = config.resolved_dtype()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        if config.quantization == "fp8":
            check_fp8_device(self.device)
        self.kv_cache_dtype = config.resolved_kv_cache_dtype()
        if self.kv_cache_dtype == FP8_DTYPE and self.device.type == "cuda":
            # The CPU holds one too (the reference kernels convert with torch); the Triton kernels need e4m3
            # conversions in hardware.
            check_fp8_device(self.device, "kv_cache_dtype fp8")
        self.model, self.model_config, self.tokenizer = load_model_and_tokenizer(
            config, self.device, self.dtype, self.parallel, load_tokenizer=self.parallel.rank == 0)
        self.model.eval()
        mc: ModelConfig = self.model_config
        self.num_kv_heads = local_kv_heads(mc, self.parallel)  # this rank's share of the KV heads
        self._num_sms = 0  # the SMs one decode wave fills (CUDA only: the decode program order)
        if self.device.type == "cuda":
            from tandem.kernels.triton_attention import device_sms  # lazy: CPU runs never import Triton

            self._num_sms = device_sms(self.device)
        self.max_model_len = config.max_model_len or min(model_max_len(mc), 8192)
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
        self.max_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        self.streams = DeviceStreams(self.device)
        self.timing = False
        self.buffers = [
            StepBuffers(self.max_num_tokens, self.max_num_seqs, self.max_blocks_per_seq, MAX_LOGPROBS, self.device)
            for _ in range(2)
        ]
        self.logits_state = LogitsState(self.max_num_seqs, mc.vocab_size, self.device)
        self.host_masks = HostMaskBuffers(self.max_num_seqs, mc.vocab_size, self.device)
        # Prompt rows are scored max_num_seqs at a time: the logits the KV budget's profiling forward made room for.
        self.prompt_logprobs = PromptLogprobs(self.max_num_tokens, MAX_LOGPROBS, min(self.max_num_seqs, 256),
                                              self.device)
        self.any_host_masks = False  # set by the engine while some request has a grammar or multi-token bad words
        self.num_blocks = config.num_kv_blocks or self._num_blocks_from_memory()
        if group is not None and config.num_kv_blocks is None:
            # One scheduler drives every rank: all KV shards get the block count of the tightest GPU.
            self.num_blocks = group.min_over_ranks(self.num_blocks)
        # [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads (this rank's), head_dim]
        self.kv_cache = torch.zeros(
            mc.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, mc.head_dim,
            dtype=self.kv_cache_dtype, device=self.device,
        )
        logger.info("KV cache: %d blocks of %d tokens in %s (%.2f GiB)", self.num_blocks, self.block_size,
                    str(self.kv_cache_dtype).removeprefix("torch."),
                    self.kv_cache.numel() * self.kv_cache.element_size() / 2**30)
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        # The fused all-reduce's timeout flag: ([1] int32 on the device, sticky; its pinned host copy).
        self._all_reduce_timeout: tuple[torch.Tensor, torch.Tensor] | None = None
        if group is not None:
            # Before any capture: decode steps' all-reduces ([batch, hidden]) go peer to peer, larger ones to NCCL.
            p2p = create_symmetric_all_reduce(dist.group.WORLD, self.device, self.dtype,
                                              self.max_num_seqs * mc.hidden_size * self.dtype.itemsize)
            set_tp_group(None, p2p)
            if p2p is not None and p2p.fused:
                # The fused kernel's wait gives up on a peer that never arrives and sets this flag (its rows are
                # then garbage): each step copies it to the host, and a rank that sees it fails the group.
                self._all_reduce_timeout = (p2p.timed_out, torch.zeros(1, dtype=torch.int32).pin_memory())
            if p2p is not None:
                logger.info("peer-to-peer all-reduce up to %d KiB (one-shot up to %d KiB), NCCL above",
                            p2p.max_bytes >> 10, p2p.one_shot_max >> 10)
        if self.device.type == "cuda":
            with torch.inference_mode():
                self._warm_mixed_attention()
            torch.cuda.synchronize()
            if config.cuda_graph:
                # [max_num_seqs, vocab] in the model dtype, outside the graph pool: every graph writes its rows here.
                self._graph_logits = torch.empty(self.max_num_seqs, mc.vocab_size, dtype=self.dtype,
                                                 device=self.device)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    self.graphs = DecodeGraphs(
                        self._decode_step_fn, graph_batch_sizes(self.max_num_seqs), self.streams.compute,
                        sample_fn=self._decode_sample_fn,
                    )
                logger.info("captured %d decode + %d sampling CUDA graphs in %.1f s", len(self.graphs.graphs),
                            len(self.graphs.sample_graphs), time.perf_counter() - t0)
                # Every step's tokens by default: an eager step launches each layer's kernels from Python, which
                # for a small model takes longer than the GPU needs for them (Qwen3-0.6B: a 4096-token chunk
                # took 23 ms on an H200 eagerly).
                max_pieces = config.piecewise_max_tokens
                if max_pieces is None:
                    max_pieces = self.max_num_tokens
                max_pieces = min(max_pieces, self.max_num_tokens)
                if max_pieces > 0:  # every rank captures the same buckets in the same order (their collectives)
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        self.piecewise = PiecewiseGraphs(self._hidden_fn, piecewise_sizes(max_pieces),
                                                         self.streams.compute, self.graphs.pool)
                    logger.info("captured %d piecewise CUDA graphs (mixed steps up to %d tokens) in %.1f s",
                                self.piecewise.num_graphs, max_pieces, time.perf_counter() - t0)
            if group is not None and self.piecewise is None:
                self._warm_nccl()
        self._events = [StepEvents(self.device, self.timing) for _ in range(2)]
        self._span_pending: list[int | None] = [None, None]  # worker: timed step per slot not yet read
        self._span_base: tuple[object, float] = (None, 0.0)
        self._spans: list[tuple[int, float, float]] = []
        self._step_index = 0
        self._prev_rows: dict[str, int] = {}  # request id -> row in the previous step's sampled tokens
        self.released = False  # shutdown() ran: graphs, KV cache and weights are gone

    def _warm_mixed_attention(self) -> None:
        """Compiles a mixed step's attention kernels (the decode kernel's variant for its leading one-token
        sequences, the prefill kernel's for the rest) before the first request, which would otherwise wait for
        them in its first step with prefills behind decodes. Triton specializes on pointer alignment and on
        strides equal to 1, so this runs on slot 0's own metadata buffers (overwritten by the first step) and
        on q as a strided view of a fused projection, as the models pass it: one decode row and one two-token
        prefill on block 0 (never a request's) of layer 0."""
        from tandem.kernels import ops

        if self.max_num_seqs < 2 or self.max_num_tokens < 3:
            return  # no step can hold a decode and a prefill
        mc = self.model_config
        heads, kv_heads, dim = mc.num_heads // self.parallel.size, self.num_kv_heads, mc.head_dim
        ints = self.buffers[0].ints.dev
        ints["query_start_loc"][:3] = torch.tensor([0, 1, 3], dtype=torch.int32)
        ints["seq_lens"][:2] = torch.tensor([1, 2], dtype=torch.int32)
        ints["block_tables"][:2].zero_()
        meta = self._meta(0, 3, 2, max_query_len=2, max_seq_len=2, num_decodes=1)
        qkv = torch.zeros(3, (heads + 2 * kv_heads) * dim, dtype=self.dtype, device=self.device)
        q = qkv[:, : heads * dim].view(3, heads, dim)
        ops.paged_attention(q, self.kv_cache[0, 0], self.kv_cache[0, 1], meta, dim**-0.5)
        if self.max_num_seqs * self.num_kv_heads > self._num_sms:
            # Decodes beyond a wave start longest first (_meta's decode_order): that variant too. (The decode
            # graphs' warm-up does not compile it: their attention is the decode kernel with fused rotary.)
            ints["decode_order"][:1] = 0
            meta = replace(meta, decode_order=ints["decode_order"][:1])
            ops.paged_attention(q, self.kv_cache[0, 0], self.kv_cache[0, 1], meta, dim**-0.5)

    def _warm_nccl(self) -> None:
        """NCCL connects a communicator's peers on its first collectives of each size class; with mixed steps eager
        (no piecewise capture, whose warm-up runs them all) the first prefill would wait for that. Every rank calls
        this at the same point of its start-up."""
        numel = self.max_num_tokens * self.model_config.hidden_size
        x = torch.zeros(numel, dtype=self.dtype, device=self.device)
        size = 1 << 14
        while True:
            dist.all_reduce(x[: min(size, numel)])
            if size >= numel:
                break
            size *= 8
        torch.cuda.synchronize(self.device)

    def set_timing(self, enabled: bool) -> None:
        """Turns on timing events around each step's GPU work (for the timeline)."""
        self.timing = enabled
        self._events = [StepEvents(self.device, enabled) for _ in range(2)]

    # ---------------------------------------------------------------- sizing

    def _kv_bytes_per_block(self) -> int:
        elem = self.kv_cache_dtype.itemsize
        mc = self.model_config
        return 2 * mc.num_layers * self.num_kv_heads * mc.head_dim * self.block_size * elem

    def _num_blocks_from_memory(self) -> int:
        if self.device.type != "cuda":
            budget = int(self.config.cpu_kv_cache_gib * (1 << 30))
        else:
            budget = self._gpu_kv_budget()
        num_blocks = budget // self._kv_bytes_per_block()
        # More blocks than every seat filled to the context limit can never be used.
        cap = self.max_num_seqs * self.max_blocks_per_seq + 1
        num_blocks = min(num_blocks, cap)
        if num_blocks < 2:
            raise ValueError(
                f"not enough memory for the KV cache: {budget / 2**30:.2f} GiB left, "
                f"{self._kv_bytes_per_block()} bytes per block"
            )
        return int(num_blocks)

    @torch.inference_mode()
    def _gpu_kv_budget(self) -> int:
        """Memory left for the KV cache after the weights and a profiling forward at full token budget."""
        mc = self.model_config
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        num_tokens = self.max_num_tokens
        scratch = torch.zeros(mc.num_layers, 2, 1, self.block_size, self.num_kv_heads, mc.head_dim,
                              dtype=self.kv_cache_dtype, device=self.device)
        ids = torch.zeros(num_tokens, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(1, math.ceil(num_tokens / self.block_size), dtype=torch.int32,
                                     device=self.device),
            max_query_len=num_tokens, max_seq_len=num_tokens,
        )
        hidden = self.model(ids, ids, scratch, meta)
        logits = self.model.compute_logits(hidden[: self.max_num_seqs])
        sample(logits, torch.ones(logits.shape[0], device=self.device),
               torch.full((logits.shape[0],), 5, dtype=torch.int32, device=self.device),
               torch.full((logits.shape[0],), 0.9, device=self.device),
               torch.zeros(logits.shape[0], dtype=torch.int64, device=self.device),
               torch.zeros(logits.shape[0], dtype=torch.int64, device=self.device),
               all_greedy=False, any_top_k_top_p=True, num_logprobs=MAX_LOGPROBS)
        del hidden, logits, scratch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # so that `free` below counts the profiling activations as free again
        activation_peak = torch.cuda.max_memory_allocated(self.device) - base
        free, total = torch.cuda.mem_get_info(self.device)
        reserve_for_graphs = 512 << 20
        budget = int(free - (1.0 - self.config.gpu_memory_utilization) * total - activation_peak
                     - reserve_for_graphs)
        logger.info("KV budget %.2f GiB (free %.2f, activation peak %.2f)", budget / 2**30, free / 2**30,
                    activation_peak / 2**30)
        return max(budget, 0)

    # ---------------------------------------------------------------- forward

    def _meta(self, slot: int, num_tokens: int, num_seqs: int, max_query_len: int,
              max_seq_len: int, num_decodes: int = 0) -> AttentionMetadata:
        ints, longs = self.buffers[slot].ints.dev, self.buffers[slot].longs.dev
        # More decode programs than one wave: they start longest context first (write_step's order).
        order = None
        if self.device.type == "cuda" and num_decodes * self.num_kv_heads > self._num_sms:
            order = ints["decode_order"][:num_decodes]
        return AttentionMetadata(
            slot_mapping=longs["slot_mapping"][:num_tokens],
            query_start_loc=ints["query_start_loc"][: num_seqs + 1],
            seq_lens=ints["seq_lens"][:num_seqs],
            block_tables=ints["block_tables"][:num_seqs],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_decodes=num_decodes,
            decode_order=order,
        )

    def _hidden(self, slot: int, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """Carry-over and the model's forward on the slot's static device buffers: [num_tokens, hidden]."""
        buf, prev = self.buffers[slot], self.buffers[1 - slot]
        ints, carry_src = buf.ints.dev, buf.longs.dev["carry_src"][:num_tokens]
        input_ids = ints["input_ids"][:num_tokens]
        # Carry-over (seed 002): gather the previous step's sampled tokens, zero the rows that carry
        # nothing, and add them onto this step's placeholder zeros.
        carried = prev.out_tokens.index_select(0, carry_src.clamp(min=0)) * (carry_src >= 0)
        input_ids.add_(carried.to(input_ids.dtype))
        return self.model(input_ids, ints["positions"][:num_tokens], self.kv_cache, meta)

    def _forward(self, slot: int, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int,
                 all_rows: bool, logits_out: torch.Tensor | None = None, num_decodes: int = 0) -> torch.Tensor:
        """Carry-over, forward and logits on the slot's static device buffers; returns [num_seqs, vocab]
        (written into `logits_out` when given)."""
        meta = self._meta(slot, num_tokens, num_seqs, max_query_len, max_seq_len, num_decodes)
        hidden = self._hidden(slot, num_tokens, meta)
        return self._logits(slot, hidden, num_seqs, all_rows, logits_out)

    def _logits(self, slot: int, hidden: torch.Tensor, num_seqs: int, all_rows: bool,
                logits_out: torch.Tensor | None = None) -> torch.Tensor:
        if not all_rows:
            hidden = hidden.index_select(0, self.buffers[slot].ints.dev["logits_indices"][:num_seqs])
        return self.model.compute_logits(hidden, logits_out)

    def _hidden_fn(self, slot: int, num_tokens: int) -> torch.Tensor:
        # Piecewise capture: only the pieces run, and they read nothing of the metadata but the slot mapping
        # (the attention between them gets each step's own metadata at replay).
        return self._hidden(slot, num_tokens, self._meta(slot, num_tokens, 1, num_tokens, num_tokens))

    def _decode_step_fn(self, slot: int, batch_size: int) -> torch.Tensor:
        # The lm_head GEMM writes straight into the static logits rows the sampling graphs read.
        return self._forward(slot, batch_size, batch_size, 1, self.max_model_len, all_rows=True,
                             logits_out=self._graph_logits[:batch_size], num_decodes=batch_size)

    def _decode_sample_fn(self, slot: int, batch_size: int, variant: SamplerVariant) -> None:
        # All batch_size rows are sampled (padding rows too: their outputs are never downloaded or carried).
        self._sample_into(slot, self._graph_logits[:batch_size], batch_size, all_greedy=not variant.random,
                          any_top_k_top_p=variant.top_k_top_p, num_logprobs=MAX_LOGPROBS if variant.logprobs else -1)

    def _sample_into(self, slot: int, logits: torch.Tensor, num_rows: int, all_greedy: bool,
                     any_top_k_top_p: bool, num_logprobs: int) -> None:
        """Samples logits [num_rows, vocab] with the slot's static per-row parameters into its output buffers.

        Any top-n request computes the top MAX_LOGPROBS (the host reads the first n columns), so eager steps
        and captured graphs, which cannot know n, run the same ops.
        """
        buf = self.buffers[slot]
        ints, longs, floats = buf.ints.dev, buf.longs.dev, buf.floats.dev
        top_n = MAX_LOGPROBS if num_logprobs > 0 else num_logprobs
        out = sample(
            logits, floats["temperature"][:num_rows], ints["top_k"][:num_rows], floats["top_p"][:num_rows],
            longs["seeds"][:num_rows], longs["sample_pos"][:num_rows],
            all_greedy=all_greedy, any_top_k_top_p=any_top_k_top_p, num_logprobs=top_n,
            min_p=floats["min_p"][:num_rows],
        )
        buf.out_tokens[:num_rows].copy_(out.token_ids)
        if out.logprobs is not None:
            buf.out_logprob[:num_rows].copy_(out.logprobs)
        if out.top_ids is not None and out.top_logprobs is not None:
            buf.out_top_ids[:num_rows, :top_n].copy_(out.top_ids)
            buf.out_top_lp[:num_rows, :top_n].copy_(out.top_logprobs)

    # ---------------------------------------------------------------- host-side preparation

    def _prepare(self, sched: SchedulerOutput, slot: int, pad_to: int | None,
                 pad_tokens_to: int | None = None) -> StepShape:
        """Writes the step into the slot's pinned host buffers and remembers each request's output row."""
        rows: dict[str, int] = {}
        shape = write_step(self.buffers[slot], sched, self._prev_rows, self.block_size, pad_to, rows, pad_tokens_to)
        self.logits_state.prepare(slot, sched.scheduled, shape.any_logits_state)
        self._prev_rows = rows
        return shape

    # ---------------------------------------------------------------- launch / wait

    @torch.inference_mode()
    def prepare(self, sched: SchedulerOutput) -> PreparedStep:
        """Writes one step into its slot's pinned host buffers; nothing reaches the GPU until enqueue(). Between
        the two the engine may complete the previous step (its grammar rows), which this step's forward follows."""
        slot = self._step_index % 2
        num_seqs = len(sched.scheduled)
        num_tokens = sched.num_scheduled_tokens
        # A step that scores prompt rows needs its hidden rows: never a decode graph (which returns only logits).
        scores_prompt = self.prompt_logprobs.prepare(slot, sched)
        decode_only = num_tokens == num_seqs and not scores_prompt
        graph_bs = self.graphs.padded_size(num_seqs) if (self.graphs is not None and decode_only) else None
        piece_tokens = None
        if self.piecewise is not None and not decode_only:
            piece_tokens = self.piecewise.padded_size(num_tokens)
        shape = self._prepare(sched, slot, graph_bs, piece_tokens)
        plan = StepPlan(slot, num_seqs, num_tokens, graph_bs, shape.all_greedy, shape.any_top_k_top_p,
                        shape.num_logprobs, shape.max_query_len, shape.max_seq_len, self._step_index, self.timing,
                        shape.num_decodes, piece_tokens, *self.prompt_logprobs.plan_shape(slot))
        # Rows whose next token a grammar (or a multi-token bad word) decides on the CPU: their sampling waits for
        # launch_sampling, after the previous step's tokens have reached the matchers.
        mask_rows = [(i, s.request) for i, s in enumerate(sched.scheduled)
                     if s.sample and s.request.host_mask is not None] if self.any_host_masks else []
        return PreparedStep(sched, plan, shape.num_context_tokens, mask_rows)

    @torch.inference_mode()
    def enqueue(self, prepared: PreparedStep) -> StepHandle:
        """Enqueues a prepared step on the GPU streams and returns without waiting."""
        plan, mask_rows = prepared.plan, prepared.mask_rows
        if plan.step_index != self._step_index:
            raise RuntimeError(f"step {plan.step_index} was prepared, but the runner is at step {self._step_index}")
        pending = None
        if self.group is None:
            events, logits = self._enqueue(plan, download=True, defer_sampling=bool(mask_rows))
            if mask_rows:
                pending = (plan, logits, mask_rows)
        else:
            # The other ranks get the filled host buffers before this rank launches (CPU to CPU only).
            self.group.send_step(plan, self.buffers[plan.slot], self.prompt_logprobs.regions(plan.slot))
            try:
                events, _ = self._enqueue(plan, download=True)
            except Exception as exc:  # on gloo the model's collectives run here: a dead peer surfaces now
                self.group.raise_failure(exc)
        self._step_index += 1  # only once enqueued: a failed launch leaves the slot order unchanged
        return StepHandle(prepared.sched, plan.slot, plan.num_seqs, plan.num_logprobs, events, plan.graph_bs,
                          plan.num_tokens, plan.step_index, prepared.num_context_tokens, pending)

    @torch.inference_mode()
    def launch_remote(self, plan: StepPlan) -> None:
        """Ranks 1..N-1: rank 0's step, received into this rank's slot buffers, launched without the D2H."""
        if plan.step_index != self._step_index or plan.slot != self._step_index % 2:
            raise RuntimeError(f"tensor-parallel rank {self.parallel.rank} expected step {self._step_index}, "
                               f"got step {plan.step_index} (slot {plan.slot})")
        if plan.timing != self.timing:
            self._set_worker_timing(plan.timing)
        # This rank's own GPU must be done with the slot's previous step before its buffers are rewritten
        # (rank 0 has the same guarantee from its wait on that step).
        events = self._events[plan.slot]
        if self._all_reduce_timeout is not None:
            events.d2h_done.synchronize()  # after compute_done: the flag's copy too
        else:
            events.compute_done.synchronize()
        self._check_all_reduce_timeout()  # raises: the worker leaves, and rank 0 fails the group
        self._record_worker_span(plan.slot)
        prompt_rows = self.prompt_logprobs.receive(plan.slot, plan.prompt_rows, plan.prompt_top_k)
        self.group.recv_payload(plan, self.buffers[plan.slot], prompt_rows)  # type: ignore[union-attr]
        self._enqueue(plan, download=False)
        if self.timing:
            self._span_pending[plan.slot] = plan.step_index
        self._step_index += 1

    # ---------------------------------------------------------------- worker GPU spans (timeline)

    def _set_worker_timing(self, enabled: bool) -> None:
        """Worker: new events for the timeline; the old ones may still guard in-flight steps, so drain first."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for slot in (0, 1):
            self._record_worker_span(slot)
        self.set_timing(enabled)
        if enabled and self.device.type == "cuda":
            base = torch.cuda.Event(enable_timing=True)
            base.record(self.streams.compute)
            base.synchronize()
            self._span_base = (base, time.perf_counter())

    def _record_worker_span(self, slot: int) -> None:
        """Worker: the GPU span of the slot's last timed step, whose compute_done has already fired."""
        step = self._span_pending[slot]
        if step is None:
            return
        self._span_pending[slot] = None
        ev = self._events[slot]
        if self.device.type != "cuda":
            self._spans.append((step, ev.compute_start.time, ev.compute_done.time))  # type: ignore[attr-defined]
            return
        base_event, base_time = self._span_base
        self._spans.append((step, base_time + base_event.elapsed_time(ev.compute_start) / 1000.0,
                            base_time + base_event.elapsed_time(ev.compute_done) / 1000.0))

    def take_worker_spans(self) -> list[tuple[int, float, float]]:
        """Worker: (step, start, end) of every timed step so far, waiting for the last ones to finish."""
        for slot in (0, 1):
            if self._span_pending[slot] is not None:
                self._events[slot].compute_done.synchronize()
                self._record_worker_span(slot)
        spans, self._spans = self._spans, []
        return spans

    def _enqueue(self, plan: StepPlan, download: bool,
                 defer_sampling: bool = False) -> tuple[StepEvents, torch.Tensor]:
        """H2D of the slot, forward (graph, piecewise graphs or eager), sampling, and (rank 0) D2H, ordered by
        the slot's events. With defer_sampling only the H2D and the forward are enqueued; `_enqueue_sampling`
        adds the rest once the step's grammar bitmask is known. Returns the events and the step's logits."""
        slot, num_seqs, num_tokens, graph_bs = plan.slot, plan.num_seqs, plan.num_tokens, plan.graph_bs
        piece_tokens = plan.piece_tokens
        buf = self.buffers[slot]
        events = self._events[slot]  # free to re-record: the slot's previous step was waited for
        streams = self.streams
        with streams.on("h2d"):
            buf.upload(graph_bs or num_seqs)
            self.logits_state.upload(slot)
            self.prompt_logprobs.upload(slot)
            streams.record("h2d", events.h2d_done)
        streams.wait("compute", events.h2d_done)
        with streams.on("compute"):
            streams.record("compute", events.compute_start)
            if graph_bs is not None:
                # Forward, then sampling of the same static logits: two graph launches, no kernel outside.
                self.graphs.replay(slot, graph_bs)  # type: ignore[union-attr]
                # The static logits rows; a view only when something edits them before the sampling graph.
                logits = self._graph_logits[:num_seqs] if (defer_sampling or self.logits_state.plans[slot]) \
                    else self._graph_logits
            elif piece_tokens is not None:
                meta = self._meta(slot, num_tokens, num_seqs, plan.max_query_len, plan.max_seq_len,
                                  plan.num_decodes)
                hidden = self.piecewise.replay(slot, num_tokens, piece_tokens, meta)  # type: ignore[union-attr]
                self.prompt_logprobs.compute(slot, hidden, self.model.compute_logits)
                logits = self._logits(slot, hidden, num_seqs, all_rows=False)
            elif self.prompt_logprobs.plans[slot] is not None:  # eager, keeping the hidden rows to score
                meta = self._meta(slot, num_tokens, num_seqs, plan.max_query_len, plan.max_seq_len,
                                  plan.num_decodes)
                hidden = self._hidden(slot, num_tokens, meta)
                self.prompt_logprobs.compute(slot, hidden, self.model.compute_logits)
                logits = self._logits(slot, hidden, num_seqs, all_rows=num_tokens == num_seqs)
            else:
                logits = self._forward(slot, num_tokens, num_seqs, plan.max_query_len, plan.max_seq_len,
                                       all_rows=num_tokens == num_seqs, num_decodes=plan.num_decodes)
            # Penalties and bias (only when a row uses them) edit the logits rows in place.
            self.logits_state.apply(slot, logits)
        events.deferred = defer_sampling
        if defer_sampling:
            with streams.on("compute"):
                streams.record("compute", events.forward_done)
        else:
            self._enqueue_sampling(plan, logits, download, None)
        return events, logits

    def _enqueue_sampling(self, plan: StepPlan, logits: torch.Tensor, download: bool, num_masked: int | None) -> None:
        """Sampling (after the grammar bitmask of `num_masked` rows, when given), counts, and the D2H."""
        slot, num_seqs, graph_bs, num_logprobs = plan.slot, plan.num_seqs, plan.graph_bs, plan.num_logprobs
        buf = self.buffers[slot]
        events = self._events[slot]
        streams = self.streams
        if num_masked is not None:
            with streams.on("h2d"):
                self.host_masks.upload(slot, num_masked)
                streams.record("h2d", events.mask_done)
            streams.wait("compute", events.mask_done)
        with streams.on("compute"):
            if num_masked is not None:
                streams.record("compute", events.sample_start)
                self.host_masks.apply(slot, logits, num_masked)
            if graph_bs is not None:
                variant = sampler_variant(plan.all_greedy, plan.any_top_k_top_p, num_logprobs)
                self.graphs.replay_sample(slot, graph_bs, variant)  # type: ignore[union-attr]
            else:
                # Every rank samples from the same all-gathered logits with the same counter-based noise, so
                # each holds the same tokens for its own carry-over.
                self._sample_into(slot, logits, num_seqs, plan.all_greedy, plan.any_top_k_top_p, num_logprobs)
            self.logits_state.count(slot, buf.out_tokens[:num_seqs])
            streams.record("compute", events.compute_done)
        if download or self._all_reduce_timeout is not None:
            streams.wait("d2h", events.compute_done)
            with streams.on("d2h"):
                if download:
                    buf.download(num_seqs, num_logprobs)
                    self.prompt_logprobs.download(slot)
                if self._all_reduce_timeout is not None:
                    flag, host_flag = self._all_reduce_timeout
                    host_flag.copy_(flag, non_blocking=True)
                streams.record("d2h", events.d2h_done)

    def fill_masks(self, handle: StepHandle) -> None:
        """CPU only: fills the bitmask rows of a step launched with grammar rows from each request's matcher
        (which has seen every token up to the previous step's). Touches nothing but the step's pinned bitmask
        slot and the matchers it reads, so it may run on a worker thread while the next step is prepared."""
        pending = handle.pending
        assert pending is not None, "fill_masks on a step without grammar rows"
        plan, _, mask_rows = pending
        self.host_masks.fill(plan.slot, mask_rows)

    @torch.inference_mode()
    def launch_sampling(self, handle: StepHandle) -> None:
        """Completes a step launched with grammar rows, after fill_masks: uploads the rows on the H2D stream and
        enqueues masking, sampling and the D2H. The forward was enqueued by enqueue() and may be running now."""
        pending = handle.pending
        assert pending is not None, "launch_sampling on a step without grammar rows"
        plan, logits, mask_rows = pending
        self._enqueue_sampling(plan, logits, download=True, num_masked=len(mask_rows))
        handle.pending = None

    def wait(self, handle: StepHandle) -> StepResult:
        """Blocks until the step's tokens are in host memory: the one CPU wait per step."""
        if self.group is not None:
            self.group.wait_event(handle.events.d2h_done)  # polls, so that a dead rank is an error, not a hang
            self._check_all_reduce_timeout()
        else:
            handle.events.d2h_done.synchronize()
        buf, n = self.buffers[handle.slot], handle.num_seqs
        token_ids = buf.host_tokens_np[:n].tolist()
        logprobs: list[Logprobs] | None = None
        if handle.num_logprobs >= 0:
            chosen_np = buf.host_logprob_np[:n]
            k = handle.num_logprobs
            top_ids_np, top_lp_np = buf.host_top_ids_np[:n, :k], buf.host_top_lp_np[:n, :k]
            logprobs = [
                (float(chosen_np[i]), list(zip(top_ids_np[i].tolist(), top_lp_np[i].tolist())))
                for i in range(n)
            ]
        return StepResult(token_ids, logprobs, self.prompt_logprobs.read(handle.slot))

    def _check_all_reduce_timeout(self) -> None:
        """Fails the group (every later step too) once this rank's fused all-reduce gave up waiting for a peer:
        the steps since hold garbage rows. The flag reaches the host with each step's D2H copy."""
        if self._all_reduce_timeout is None or not int(self._all_reduce_timeout[1][0]):
            return
        group = self.group
        assert group is not None
        if group.failure is None:
            group.failure = (f"tensor-parallel rank {self.parallel.rank}: the peer-to-peer all-reduce gave up "
                             "waiting for a peer (a rank stalled or died mid-step); this group's results are invalid")
        raise WorkerDiedError(group.failure)

    def step_gpu_spans(self, handle: StepHandle, base: tuple[object, float] | None) -> list[tuple[str, float, float]]:
        """(name, start, end) of the step's GPU work on the perf_counter clock; call after wait(). One "compute"
        span, or for a step whose sampling waited for a grammar bitmask, "compute" (the forward) and "sample"."""
        ev = handle.events
        if not ev.timing:  # launched before timing was turned on
            return []
        if self.device.type != "cuda":
            return [("compute", ev.compute_start.time, ev.compute_done.time)]  # type: ignore[attr-defined]
        if base is None:
            return []
        base_event, base_time = base

        def at(event: object) -> float:
            return base_time + base_event.elapsed_time(event) / 1000.0  # type: ignore[attr-defined]

        if ev.deferred:
            return [("compute", at(ev.compute_start), at(ev.forward_done)),
                    ("sample", at(ev.sample_start), at(ev.compute_done))]
        return [("compute", at(ev.compute_start), at(ev.compute_done))]

    def drain(self, handle: StepHandle) -> None:
        """Waits out a step whose results are discarded (returns at once when a rank is dead)."""
        if self.group is not None:
            if self.group.failure is None:
                self.group.wait_event(handle.events.d2h_done)
        elif handle.pending is not None:  # its sampling was never enqueued: the forward is what runs
            handle.events.forward_done.synchronize()
        else:
            handle.events.d2h_done.synchronize()

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
        self._drop_graphs()
        if self.group is not None:
            set_tp_group(None)  # the peer-to-peer all-reduce's symmetric-memory buffer goes with the graphs
        self.kv_cache = torch.empty(0, device=self.device)
        self.model = None  # type: ignore[assignment]
        self.buffers = []
        if empty_cache and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _drop_graphs(self) -> None:
        for graphs in (self.graphs, self.piecewise):
            if graphs is not None:
                graphs.release()
        self.graphs = self.piecewise = None
        if hasattr(self, "_graph_logits"):
            self._graph_logits = torch.empty(0, device=self.device)

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
            self._drop_graphs()
        except Exception:
            logger.warning("could not release the CUDA graphs after a rank failed", exc_info=True)
        closer.join()
        self.release(empty_cache=False)  # freeing device memory would wait for kernels the abort may not end
