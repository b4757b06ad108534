"""ModelExecutor: one rank's forward and sampling on the slots' static device buffers, eager or from CUDA graphs.

It owns what a step computes on the GPU (carry-over, the model's forward, the logits rows, sampling into the slot's
output buffers) and the graphs that replay it: decode graphs per (slot, batch size) with their sampling graphs, and
piecewise graphs for steps that mix prefills into the decodes. It never touches host memory or streams' ordering:
ModelRunner enqueues its calls on the compute stream between the step's events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.models.llama import AuxHiddenStates
from tandem.runner.cuda_graphs import (
    DecodeGraphs,
    PiecewiseGraphs,
    SamplerVariant,
    graph_batch_sizes,
    piecewise_sizes,
    sampler_variant,
)
from tandem.runner.input_buffers import StepBuffers
from tandem.runner.sampler import sample
from tandem.runner.step_plan import StepPlan
from tandem.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)


class ModelExecutor:
    """The model, its KV cache and the two slots' device buffers; `graphs` / `piecewise` are None where steps run
    eagerly (CPU, cuda_graph off, or switched off by a caller to compare)."""

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, buffers: list[StepBuffers], max_model_len: int,
                 num_heads: int, num_kv_heads: int, num_sms: int) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
        self.buffers = buffers
        self.device = kv_cache.device
        self.max_model_len = max_model_len
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads  # this rank's
        self.num_sms = num_sms  # the SMs one decode wave fills (CUDA only: the decode program order)
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # flat verify steps (one row per token), by row count
        self.graph_logits = torch.empty(0, device=self.device)  # [max_num_seqs, vocab] once decode graphs exist
        self.lora = None  # tandem.lora's LoRAPool with adapters on: the forward reads each token's slot from it
        # Per slot, where the forward copies the hidden states an EAGLE-3 head reads (None: nothing copied).
        self.aux: list[AuxHiddenStates] | None = None

    # ---------------------------------------------------------------- one step

    def run(self, plan: StepPlan, rows_view: bool,
            score: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Enqueues carry-over, forward and logits of a planned step on the current stream: [num_seqs, vocab] logits
        (the static graph rows, all of them unless rows_view, when a caller edits the step's rows in place). `score`
        gets the step's hidden rows [num_tokens, hidden] first (prompt log-probabilities; never a decode graph's)."""
        slot, num_seqs, num_tokens = plan.slot, plan.attention_rows, plan.num_tokens
        if plan.graph_bs is not None:
            graphs = self.verify_graphs if plan.flat else self.graphs
            graphs.replay(slot, plan.graph_bs)  # type: ignore[union-attr]
            return self.graph_logits[: plan.rows] if rows_view else self.graph_logits
        meta = self.meta(slot, num_tokens, num_seqs, plan.max_query_len, plan.max_seq_len, plan.num_decodes,
                         fuse_kv_write=not plan.flat)
        if plan.piece_tokens is not None:
            hidden = self.piecewise.replay(slot, num_tokens, plan.piece_tokens, meta)  # type: ignore[union-attr]
            all_rows = False
        else:
            hidden = self.hidden(slot, num_tokens, meta)
            all_rows = num_tokens == num_seqs
        if score is not None:
            score(hidden)
        return self.logits(slot, hidden, plan.rows, all_rows=all_rows)

    def sample(self, plan: StepPlan, logits: torch.Tensor) -> None:
        """Enqueues the step's sampling into its slot's output buffers: a sampling graph after a decode graph."""
        if plan.graph_bs is not None:
            variant = sampler_variant(plan.all_greedy, plan.any_top_k_top_p, plan.num_logprobs)
            graphs = self.verify_graphs if plan.flat else self.graphs
            graphs.replay_sample(plan.slot, plan.graph_bs, variant)  # type: ignore[union-attr]
        else:
            # Every rank samples from the same all-gathered logits with the same counter-based noise, so each
            # holds the same tokens for its own carry-over.
            self.sample_into(plan.slot, logits, plan.num_seqs, plan.all_greedy, plan.any_top_k_top_p,
                             plan.num_logprobs, plan.rows)
            if plan.verifies:
                self.verify(plan.slot, plan.rows)

    def take_drafts(self, slot: int, drafts: torch.Tensor, num_tokens: int, num_rows: int) -> None:
        """Swaps a verify step's draft_stand_in ids for the drafts a device proposer left in `drafts` (flattened
        in the stand-ins' order), in the input ids and in the draft rows' compared tokens, so that the host never
        waits for the drafts. Enqueued after the slot's H2D and before the forward, on the buffers a graph reads."""
        ints = self.buffers[slot].ints.dev
        flat = drafts.reshape(-1)
        for name, n in (("input_ids", num_tokens), ("row_draft", num_rows)):
            ids = ints[name][:n]
            picked = flat.index_select(0, (-2 - ids).clamp(min=0, max=flat.numel() - 1).long())
            ids.copy_(torch.where(ids < -1, picked.to(ids.dtype), ids))

    def shift_rows(self, slot: int, num_rows: int, block_size: int) -> None:
        """Finishes a flat verify step that was written behind a verify step in flight (write_flat_verify's
        shift_* regions) once that step's accepted counts are on the device: each of a request's rows moves back by
        the drafts the previous step rejected (positions, context lengths, sampling positions, KV slots through its
        block table), and its first row carries the token sampled after the accepted drafts (the first rejected
        draft's row, or the sequence's own row when all were kept). The shifts stay in the slot's row_shift for the
        EAGLE-3 head fed behind this step. Enqueued after the slot's H2D and before the forward; reads only the
        previous slot's outputs, which no upload overwrites."""
        buf, prev = self.buffers[slot], self.buffers[1 - slot]
        ints, longs = buf.ints.dev, buf.longs.dev
        seq = ints["shift_seq"][:num_rows].long()
        behind = seq >= 0
        accepted = prev.out_accepted.index_select(0, seq.clamp(min=0))
        drafts = ints["shift_k"][:num_rows].long()
        shift = torch.where(behind, drafts - accepted, 0)
        buf.row_shift[:num_rows].copy_(shift)
        positions = ints["positions"][:num_rows]
        positions.sub_(shift.to(positions.dtype))
        ints["seq_lens"][:num_rows].sub_(shift.to(torch.int32))
        longs["sample_pos"][:num_rows].sub_(shift)
        pos = positions.long()
        tables = ints["block_tables"][:num_rows]
        moved = tables.gather(1, (pos // block_size)[:, None])[:, 0].long() * block_size + pos % block_size
        slot_mapping = longs["slot_mapping"][:num_rows]
        slot_mapping.copy_(torch.where(behind, moved, slot_mapping))
        carry = longs["carry_src"][:num_rows]
        after = ints["shift_base"][:num_rows].long() + accepted
        carry.copy_(torch.where(behind & (carry >= 0) & (accepted < drafts), after, carry))

    def verify(self, slot: int, num_rows: int) -> None:
        """Counts each sequence's accepted drafts into out_accepted: the drafts before the first whose row's sampled
        token differs from it. Sampling each verified position as a plain step would (same noise, same rules) and
        keeping the drafts up to the first mismatch is exact for any proposer: the output is token for token what
        decoding without drafts gives (an accepted draft is the token sampled at its position; the first mismatch
        position yields the sampled token itself)."""
        buf = self.buffers[slot]
        ints = buf.ints.dev
        # Static over rows 0..num_rows-1 (a verify graph captures it with its sampling): rows that are no draft
        # row name themselves with an index past every count (input_buffers._write_verify_rows).
        seq = ints["row_seq"][:num_rows].long()
        match = buf.out_tokens[:num_rows] == ints["row_draft"][:num_rows]
        num_drafts = ints["num_drafts"][:num_rows].long()
        # A matching row does not lower its sequence's minimum; a mismatch at draft j caps the count at j.
        cap = torch.where(match, num_drafts.index_select(0, seq), ints["row_rank"][:num_rows].long())
        buf.out_accepted[:num_rows].copy_(num_drafts.scatter_reduce(0, seq, cap, reduce="amin"))

    def kept_rows(self, plan: StepPlan) -> torch.Tensor:
        """[plan.rows] int32 after a verify step's sampling: 1 on the rows whose sampled token is output (a
        sequence's accepted drafts' rows, and the row after them: the first rejected draft's, or its own row when
        every draft was accepted), 0 on the others."""
        buf, rows = self.buffers[plan.slot], plan.rows
        ints = buf.ints.dev
        seq = ints["row_seq"][:rows].long()
        accepted = buf.out_accepted[:rows].index_select(0, seq)
        own = torch.arange(rows, device=seq.device) < plan.num_seqs
        num_drafts = ints["num_drafts"][:rows].long().index_select(0, seq)
        keep = (ints["row_rank"][:rows].long() <= accepted) | (own & (accepted == num_drafts))
        return keep.to(torch.int32)

    def meta(self, slot: int, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int,
             num_decodes: int = 0, fuse_kv_write: bool = True) -> AttentionMetadata:
        ints, longs = self.buffers[slot].ints.dev, self.buffers[slot].longs.dev
        # More decode programs than one wave: they start longest context first (write_step's order).
        order = None
        if self.device.type == "cuda" and num_decodes * self.num_kv_heads > self.num_sms:
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
            fuse_kv_write=fuse_kv_write,
        )

    def hidden(self, slot: int, num_tokens: int, meta: AttentionMetadata) -> torch.Tensor:
        """Carry-over and the model's forward on the slot's static device buffers: [num_tokens, hidden]."""
        buf, prev = self.buffers[slot], self.buffers[1 - slot]
        ints, carry_src = buf.ints.dev, buf.longs.dev["carry_src"][:num_tokens]
        input_ids = ints["input_ids"][:num_tokens]
        # Carry-over (seed 002): gather the previous step's sampled tokens, zero the rows that carry
        # nothing, and add them onto this step's placeholder zeros.
        carried = prev.out_tokens.index_select(0, carry_src.clamp(min=0)) * (carry_src >= 0)
        input_ids.add_(carried.to(input_ids.dtype))
        if self.lora is not None:  # the step's per-token adapter slots into the pool's static index
            self.lora.select(ints["lora_slots"][:num_tokens])
        if self.aux is not None:  # inside every graph of the slot too: the copies are captured with the forward
            return self.model(input_ids, ints["positions"][:num_tokens], self.kv_cache, meta, aux=self.aux[slot])
        return self.model(input_ids, ints["positions"][:num_tokens], self.kv_cache, meta)

    def forward(self, slot: int, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int,
                all_rows: bool, logits_out: torch.Tensor | None = None, num_decodes: int = 0,
                fuse_kv_write: bool = True) -> torch.Tensor:
        """Carry-over, forward and logits on the slot's static device buffers; returns [num_seqs, vocab]
        (written into `logits_out` when given)."""
        meta = self.meta(slot, num_tokens, num_seqs, max_query_len, max_seq_len, num_decodes, fuse_kv_write)
        hidden = self.hidden(slot, num_tokens, meta)
        return self.logits(slot, hidden, num_seqs, all_rows, logits_out)

    def logits(self, slot: int, hidden: torch.Tensor, num_seqs: int, all_rows: bool,
               logits_out: torch.Tensor | None = None) -> torch.Tensor:
        if not all_rows:
            hidden = hidden.index_select(0, self.buffers[slot].ints.dev["logits_indices"][:num_seqs])
        return self.model.compute_logits(hidden, logits_out)

    def sample_into(self, slot: int, logits: torch.Tensor, num_seqs: int, all_greedy: bool,
                    any_top_k_top_p: bool, num_logprobs: int, num_rows: int | None = None) -> None:
        """Samples logits [num_rows, vocab] (default num_seqs rows) with the slot's static per-row parameters into its
        output buffers (a verify step's draft rows, beyond num_seqs, hold their sequence's parameters and their own
        position: input_buffers._write_verify_rows).

        Any top-n request computes the top MAX_LOGPROBS (the host reads the first n columns), so eager steps
        and captured graphs, which cannot know n, run the same ops.
        """
        buf = self.buffers[slot]
        ints, longs, floats = buf.ints.dev, buf.longs.dev, buf.floats.dev
        top_n = MAX_LOGPROBS if num_logprobs > 0 else num_logprobs
        num_rows = num_seqs if num_rows is None else num_rows
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

    # ---------------------------------------------------------------- start-up: warm-up and capture

    def warm_mixed_attention(self, max_num_seqs: int, max_num_tokens: int, dtype: torch.dtype) -> None:
        """Compiles a mixed step's attention kernels (the decode kernel's variant for its leading one-token
        sequences, the prefill kernel's for the rest) before the first request, which would otherwise wait for
        them in its first step with prefills behind decodes. Triton specializes on pointer alignment and on
        strides equal to 1, so this runs on slot 0's own metadata buffers (overwritten by the first step) and
        on q as a strided view of a fused projection, as the models pass it: one decode row and one two-token
        prefill on block 0 (never a request's) of layer 0."""
        from tandem.kernels import ops

        if max_num_seqs < 2 or max_num_tokens < 3:
            return  # no step can hold a decode and a prefill
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.kv_cache.shape[-1]
        ints = self.buffers[0].ints.dev
        ints["query_start_loc"][:3] = torch.tensor([0, 1, 3], dtype=torch.int32)
        ints["seq_lens"][:2] = torch.tensor([1, 2], dtype=torch.int32)
        ints["block_tables"][:2].zero_()
        meta = self.meta(0, 3, 2, max_query_len=2, max_seq_len=2, num_decodes=1)
        qkv = torch.zeros(3, (heads + 2 * kv_heads) * dim, dtype=dtype, device=self.device)
        q = qkv[:, : heads * dim].view(3, heads, dim)
        ops.paged_attention(q, self.kv_cache[0, 0], self.kv_cache[0, 1], meta, dim**-0.5)
        if max_num_seqs * self.num_kv_heads > self.num_sms:
            # Decodes beyond a wave start longest first (meta's decode_order): that variant too. (The decode
            # graphs' warm-up does not compile it: their attention is the decode kernel with fused rotary.)
            ints["decode_order"][:1] = 0
            meta = replace(meta, decode_order=ints["decode_order"][:1])
            ops.paged_attention(q, self.kv_cache[0, 0], self.kv_cache[0, 1], meta, dim**-0.5)

    def capture(self, max_num_seqs: int, max_num_tokens: int, piecewise_max_tokens: int | None,
                vocab_size: int, dtype: torch.dtype, stream: torch.cuda.Stream, max_verify_rows: int = 0) -> None:
        """Captures the decode graphs (and their sampling graphs), the flat verify graphs up to max_verify_rows
        rows (speculative decoding), then the piecewise graphs of mixed steps up to piecewise_max_tokens tokens
        (None: every step's; 0: none). Every rank captures the same buckets in the same order (their collectives
        meet)."""
        # [rows, vocab] in the model dtype, outside the graph pool: every graph writes its rows here.
        self.graph_logits = torch.empty(max(max_num_seqs, max_verify_rows), vocab_size, dtype=dtype,
                                        device=self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.graphs = DecodeGraphs(self._decode_step_fn, graph_batch_sizes(max_num_seqs), stream,
                                       sample_fn=self._decode_sample_fn)
            if max_verify_rows:
                self._clear_carried_tokens()
                self.verify_graphs = DecodeGraphs(self._verify_step_fn, graph_batch_sizes(max_verify_rows), stream,
                                                  sample_fn=self._verify_sample_fn, pool=self.graphs.pool)
        logger.info("captured %d decode + %d verify + %d sampling CUDA graphs in %.1f s", len(self.graphs.graphs),
                    len(self.verify_graphs.graphs) if self.verify_graphs else 0,
                    len(self.graphs.sample_graphs), time.perf_counter() - t0)
        # Every step's tokens by default: an eager step launches each layer's kernels from Python, which for a
        # small model takes longer than the GPU needs for them (Qwen3-0.6B: a 4096-token chunk took 23 ms on an
        # H200 eagerly).
        max_pieces = min(max_num_tokens if piecewise_max_tokens is None else piecewise_max_tokens, max_num_tokens)
        if max_pieces > 0:
            self._clear_carried_tokens()
            t0 = time.perf_counter()
            with torch.inference_mode():
                self.piecewise = PiecewiseGraphs(self._hidden_fn, piecewise_sizes(max_pieces), stream,
                                                 self.graphs.pool)
            logger.info("captured %d piecewise CUDA graphs (mixed steps up to %d tokens) in %.1f s",
                        self.piecewise.num_graphs, max_pieces, time.perf_counter() - t0)

    def _clear_carried_tokens(self) -> None:
        """Zeroes the slots' sampled tokens between capture phases: every warm-up forward adds the other slot's
        tokens onto its input ids (the carry-over), which the sampling warm-ups left as arbitrary token ids, and
        ids summed over many warm-ups fall outside the vocabulary."""
        for buf in self.buffers:
            buf.out_tokens.zero_()

    def _hidden_fn(self, slot: int, num_tokens: int) -> torch.Tensor:
        # Piecewise capture: only the pieces run, and they read nothing of the metadata but the slot mapping
        # (the attention between them gets each step's own metadata at replay).
        return self.hidden(slot, num_tokens, self.meta(slot, num_tokens, 1, num_tokens, num_tokens))

    def _decode_step_fn(self, slot: int, batch_size: int) -> torch.Tensor:
        # The lm_head GEMM writes straight into the static logits rows the sampling graphs read.
        return self.forward(slot, batch_size, batch_size, 1, self.max_model_len, all_rows=True,
                            logits_out=self.graph_logits[:batch_size], num_decodes=batch_size)

    def _verify_step_fn(self, slot: int, batch_size: int) -> torch.Tensor:
        # A flat verify step: decode rows that read each other's KV, so the KV is written before the attention.
        return self.forward(slot, batch_size, batch_size, 1, self.max_model_len, all_rows=True,
                            logits_out=self.graph_logits[:batch_size], num_decodes=batch_size, fuse_kv_write=False)

    def _verify_sample_fn(self, slot: int, batch_size: int, variant: SamplerVariant) -> None:
        self._decode_sample_fn(slot, batch_size, variant)
        self.verify(slot, batch_size)

    def _decode_sample_fn(self, slot: int, batch_size: int, variant: SamplerVariant) -> None:
        # All batch_size rows are sampled (padding rows too: their outputs are never downloaded or carried).
        self.sample_into(slot, self.graph_logits[:batch_size], batch_size, all_greedy=not variant.random,
                         any_top_k_top_p=variant.top_k_top_p, num_logprobs=MAX_LOGPROBS if variant.logprobs else -1)

    # ---------------------------------------------------------------- shutdown

    def drop_graphs(self) -> None:
        """Destroys every graph now (the device must be idle)."""
        for graphs in (self.verify_graphs, self.graphs, self.piecewise):
            if graphs is not None:
                graphs.release()
        self.graphs = self.piecewise = self.verify_graphs = None
        self.graph_logits = torch.empty(0, device=self.device)

    def release(self) -> None:
        """Drops the graphs, the KV cache and the weights, so that their memory can go back to the device."""
        self.drop_graphs()
        self.kv_cache = torch.empty(0, device=self.device)
        self.model = None  # type: ignore[assignment]
        self.buffers = []
        self.aux = None
