"""Token bitmasks decided on the CPU (grammars, multi-token bad words): pinned per-slot rows that each
constrained request's matcher fills after the previous step's tokens arrive, one H2D copy, and one masking
pass over the constrained rows of the logits right before sampling. Unconstrained rows are never read."""

from __future__ import annotations

from typing import Any

import torch


class HostMaskBuffers:
    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        cuda = device.type == "cuda"
        # [max_num_seqs, ceil(V / 32)] int32 per slot: bit b of word w allows token 32 w + b (both backends').
        self.bits_cpu = [torch.zeros(max_num_seqs, self.num_words, dtype=torch.int32, pin_memory=cuda)
                         for _ in range(2)]
        self.rows_cpu = [torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.rows_np = [r.numpy() for r in self.rows_cpu]
        if cuda:
            self.bits_gpu = [torch.zeros_like(b, device=device) for b in self.bits_cpu]
            self.rows_gpu = [torch.zeros_like(r, device=device) for r in self.rows_cpu]
        else:
            self.bits_gpu, self.rows_gpu = self.bits_cpu, self.rows_cpu
        self.shifts = torch.arange(32, dtype=torch.int32, device=device)  # [32]

    def fill(self, slot: int, mask_rows: list[tuple[int, Any]]) -> None:
        """Row j of the slot's bitmask: what request j of `mask_rows` ((batch row, request)) may sample next."""
        bits, rows = self.bits_cpu[slot], self.rows_np[slot]
        entries = []  # (bitmask row, HostMask or None, tokens so far); None: the request ended meanwhile (its
        for j, (row, request) in enumerate(mask_rows):  # token will be dropped), so its row allows everything
            entries.append((j, request.host_mask, request.all_token_ids))
            rows[j] = row
        some = next((mask for _, mask, _ in entries if mask is not None), None)
        if some is None:
            bits[: len(entries)].fill_(-1)
        else:
            type(some).fill_rows(bits, entries)  # HostMask.fill_rows (runner does not import structured/)

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
