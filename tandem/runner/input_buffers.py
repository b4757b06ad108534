"""Per-slot step buffers: pinned host staging written through numpy views, and static device twins.

Two slots (A/B) exist so that step N+1 is written and uploaded while step N still reads its own
slot on the GPU. Nothing here allocates per step: the runner writes numpy views in place and issues
one non_blocking copy per packed buffer.
"""

from __future__ import annotations

import numpy as np
import torch


class PackedBuffer:
    """Named regions of one host tensor (pinned on CUDA) and of its device twin (the same tensor on CPU)."""

    def __init__(self, fields: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> None:
        sizes = {name: int(np.prod(shape)) for name, shape in fields.items()}
        total = sum(sizes.values())
        cuda = device.type == "cuda"
        self.cpu = torch.zeros(total, dtype=dtype, pin_memory=cuda)
        self.gpu = torch.zeros(total, dtype=dtype, device=device) if cuda else self.cpu
        self.np: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        self.offsets: dict[str, int] = {}
        host_np = self.cpu.numpy()
        offset = 0
        for name, shape in fields.items():
            size = sizes[name]
            self.offsets[name] = offset
            self.np[name] = host_np[offset : offset + size].reshape(shape)
            self.dev[name] = self.gpu[offset : offset + size].view(shape)
            offset += size
        self.total = total

    def upload(self, num_elements: int | None = None) -> None:
        """Copies the first num_elements host elements to the device (call on the H2D stream)."""
        if self.gpu is self.cpu:
            return
        n = self.total if num_elements is None else num_elements
        self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


class StepBuffers:
    """Inputs and outputs of one slot."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_logprobs: int,
        device: torch.device,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        # Block tables come last so that a step uploads only the rows it uses.
        self.ints = PackedBuffer(
            {
                "input_ids": (max_num_tokens,),
                "positions": (max_num_tokens,),
                "query_start_loc": (max_num_seqs + 1,),
                "seq_lens": (max_num_seqs,),
                "logits_indices": (max_num_seqs,),
                "top_k": (max_num_seqs,),
                "block_tables": (max_num_seqs, max_blocks_per_seq),
            },
            torch.int32,
            device,
        )
        self.longs = PackedBuffer(
            {
                "slot_mapping": (max_num_tokens,),
                "carry_src": (max_num_tokens,),  # -1: no carry-over; else a row of the previous step's tokens
                "seeds": (max_num_seqs,),
                "sample_pos": (max_num_seqs,),
            },
            torch.int64,
            device,
        )
        self.floats = PackedBuffer(
            {"temperature": (max_num_seqs,), "top_p": (max_num_seqs,)}, torch.float32, device
        )
        # Outputs: static device tensors (the next step's carry-over reads out_tokens) and pinned host twins.
        cuda = device.type == "cuda"
        self.out_tokens = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        self.out_logprob = torch.zeros(max_num_seqs, dtype=torch.float32, device=device)
        self.out_top_ids = torch.zeros(max_num_seqs, max(max_logprobs, 1), dtype=torch.int64, device=device)
        self.out_top_lp = torch.zeros(max_num_seqs, max(max_logprobs, 1), dtype=torch.float32, device=device)
        if cuda:
            self.host_tokens = torch.zeros_like(self.out_tokens, device="cpu").pin_memory()
            self.host_logprob = torch.zeros_like(self.out_logprob, device="cpu").pin_memory()
            self.host_top_ids = torch.zeros_like(self.out_top_ids, device="cpu").pin_memory()
            self.host_top_lp = torch.zeros_like(self.out_top_lp, device="cpu").pin_memory()
        else:
            self.host_tokens, self.host_logprob = self.out_tokens, self.out_logprob
            self.host_top_ids, self.host_top_lp = self.out_top_ids, self.out_top_lp
        self.host_tokens_np = self.host_tokens.numpy()
        self.host_logprob_np = self.host_logprob.numpy()
        self.host_top_ids_np = self.host_top_ids.numpy()
        self.host_top_lp_np = self.host_top_lp.numpy()

    def upload(self, num_seqs: int) -> None:
        """H2D of everything the step reads: the packed scalars and the used block-table rows."""
        used_ints = self.ints.offsets["block_tables"] + num_seqs * self.max_blocks_per_seq
        self.ints.upload(used_ints)
        self.longs.upload()
        self.floats.upload()

    def download(self, num_seqs: int, num_logprobs: int) -> None:
        """D2H of the sampled tokens (and log-probabilities when asked); call on the D2H stream."""
        if self.host_tokens is self.out_tokens:
            return
        self.host_tokens[:num_seqs].copy_(self.out_tokens[:num_seqs], non_blocking=True)
        if num_logprobs >= 0:
            self.host_logprob[:num_seqs].copy_(self.out_logprob[:num_seqs], non_blocking=True)
        if num_logprobs > 0:
            self.host_top_ids[:num_seqs].copy_(self.out_top_ids[:num_seqs], non_blocking=True)
            self.host_top_lp[:num_seqs].copy_(self.out_top_lp[:num_seqs], non_blocking=True)
