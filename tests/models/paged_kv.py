"""Test helper: a tiny block allocator and AttentionMetadata builder for driving models step by step."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from tandem.config import ModelConfig
from tandem.kernels.attention_metadata import AttentionMetadata


@dataclass(slots=True)
class Seq:
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Step:
    input_ids: torch.Tensor  # [num_tokens] int32
    positions: torch.Tensor  # [num_tokens] int32
    meta: AttentionMetadata
    last_token_idx: list[int]  # flat index of each real sequence's last token


class PagedKV:
    """One KV cache plus a shuffled free list (block 0 reserved), so sequences own scattered blocks."""

    def __init__(self, config: ModelConfig, num_blocks: int = 64, block_size: int = 4, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_cache = torch.zeros(  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
            config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype=dtype,
            device=self.device,
        )
        self.free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self.free)

    def step(self, seqs: list[Seq], num_new: list[int] | None = None, num_padding_rows: int = 0) -> Step:
        """Schedules num_new[i] tokens of seqs[i] (default: all uncomputed ones), then padding rows."""
        num_new = num_new or [len(s.token_ids) - s.num_computed_tokens for s in seqs]
        ids, positions, slots, starts, seq_lens, last = [], [], [], [0], [], []
        for seq, n in zip(seqs, num_new):
            start = seq.num_computed_tokens
            while len(seq.block_ids) * self.block_size < start + n:
                seq.block_ids.append(self.free.pop())
            for pos in range(start, start + n):
                ids.append(seq.token_ids[pos])
                positions.append(pos)
                slots.append(seq.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
            seq.num_computed_tokens += n
            starts.append(len(ids))
            seq_lens.append(seq.num_computed_tokens)
            last.append(len(ids) - 1)
        for _ in range(num_padding_rows):  # one placeholder token each, context length 0
            ids.append(0)
            positions.append(0)
            slots.append(-1)
            starts.append(len(ids))
            seq_lens.append(0)
        width = max(len(s.block_ids) for s in seqs) + 1  # padded like the runner's static table
        tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
        query_lens = [b - a for a, b in zip(starts, starts[1:])]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        input_ids = torch.tensor(ids, dtype=torch.int32, device=dev)
        return Step(input_ids, torch.tensor(positions, dtype=torch.int32, device=dev), meta, last)
