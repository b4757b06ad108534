"""Token bitmasks decided on the CPU (grammars, multi-token bad words): pinned per-slot rows that each
constrained request's matcher fills after the previous step's tokens arrive, one H2D copy, and one masking
pass over the constrained rows of the logits right before sampling. Unconstrained rows are never read."""

from __future__ import annotations

from typing import Any

import torch


class HostMaskBuffers:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        cuda = device.type == "cuda"
        # [max_rows, ceil(V / 32)] int32 per slot: bit b of word w allows token 32 w + b (both backends'). A row per
        # constrained sequence, and one per grammar-forced draft in a verify step.
        self.bits_cpu = [torch.zeros(max_rows, self.num_words, dtype=torch.int32, pin_memory=cuda)
                         for _ in range(2)]
        self.rows_cpu = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.rows_np = [r.numpy() for r in self.rows_cpu]
        if cuda:
            self.bits_gpu = [torch.zeros_like(b, device=device) for b in self.bits_cpu]
            self.rows_gpu = [torch.zeros_like(r, device=device) for r in self.rows_cpu]
        else:
            self.bits_gpu, self.rows_gpu = self.bits_cpu, self.rows_cpu
        self.shifts = torch.arange(32, dtype=torch.int32, device=device)  # [32]
        # Per slot: (bitmask row, request, its HostMask) of the rows its last fill left to be computed apart (fill's
        # `defer`)
        self.deferred: list[list[tuple[int, Any, Any]]] = [[], []]

    def fill(self, slot: int, mask_rows: list[tuple[list[int], Any, list[int]]], defer: bool = False) -> int:
        """Fills the slot's bitmask from `mask_rows`: (logits row of each position, request, drafts) per constrained
        request, where a request without drafts has one position (its own row) and one with k drafts has k + 1
        (draft j's row gets the mask after drafts 0..j-1, the sequence's own row the mask after all k). Returns the
        number of bitmask rows written. `defer` (a step without drafts): a request's likely slow grammar row may be
        computed apart (HostMask.fill_rows), unless its penalties count every sampled token on the device; those
        rows are in `deferred[slot]` until settled."""
        bits, rows = self.bits_cpu[slot], self.rows_np[slot]
        self.deferred[slot] = []
        # (bitmask rows, HostMask or None, tokens so far, drafts); None: the request ended meanwhile (its token
        # will be dropped), so its rows allow everything
        entries = []
        b = 0
        for logits_rows, request, drafts in mask_rows:
            n = len(logits_rows)
            rows[b : b + n] = logits_rows
            entries.append((list(range(b, b + n)), request.host_mask, request.all_token_ids, drafts))
            b += n
        some = next((mask for _, mask, _, _ in entries if mask is not None), None)
        if some is None:
            bits[:b].fill_(-1)
        elif b == len(entries):  # no drafts: one row each
            requests = [request for _, request, _ in mask_rows]
            deferred = type(some).fill_rows(
                bits, [(r[0], mask, tokens) for r, mask, tokens, _ in entries],
                defer=(lambda i: not requests[i].sampling_params.uses_logits_state) if defer else None)
            self.deferred[slot] = [(i, requests[i], entries[i][1]) for i in deferred]
        else:
            type(some).fill_draft_rows(bits, entries)  # HostMask's (runner does not import structured/)
        return b

    def settle(self, slot: int, row: int, mask: Any) -> None:
        """Writes a row computed apart into the slot's bitmask (waiting for it; HostMask.settle)."""
        mask.settle(self.bits_cpu[slot][row])

    def upload(self, slot: int, num_rows: int) -> None:
        """H2D of the first num_rows bitmask rows and their batch rows (call on the H2D stream)."""
        if self.bits_gpu[slot] is not self.bits_cpu[slot]:
            self.bits_gpu[slot][:num_rows].copy_(self.bits_cpu[slot][:num_rows], non_blocking=True)
            self.rows_gpu[slot][:num_rows].copy_(self.rows_cpu[slot][:num_rows], non_blocking=True)

    def apply(self, slot: int, logits: torch.Tensor, num_rows: int) -> None:
        """Sets the disallowed logits of the constrained rows to -inf, in place ([num_seqs, V] logits)."""
        bits = self.bits_gpu[slot][:num_rows]  # [k, W]
        rows = self.rows_gpu[slot][:num_rows]  # [k]
        allowed = ((bits[:, :, None] >> self.shifts) & 1).view(num_rows, -1)[:, : logits.shape[-1]]  # [k, V]
        masked = logits.index_select(0, rows).masked_fill(allowed == 0, float("-inf"))
        logits.index_copy_(0, rows, masked)
