"""Attention layer: writes this step's K/V into the paged cache, then attends through the block tables."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from tandem.kernels import ops
from tandem.layers.attention_metadata import AttentionMetadata


class AttentionSplit(Protocol):
    """Takes over every attention call while piecewise CUDA graphs are captured (runner/cuda_graphs.py):
    returns the tensor that will hold the attention output at replay, [num_tokens, num_heads, head_dim]."""

    def __call__(self, layer: Attention, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> torch.Tensor: ...


_split: AttentionSplit | None = None


@contextlib.contextmanager
def split_at_attention(split: AttentionSplit) -> Iterator[None]:
    """Routes every Attention.attend inside the block to `split` instead of the attention kernel."""
    global _split
    if _split is not None:
        raise RuntimeError("attention is already split")
    _split = split
    try:
        yield
    finally:
        _split = None


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """Attention alone, for callers that wrote this step's K/V already (the fused rotary + KV write)."""
        if _split is not None:
            out = _split(self, q, k_cache, v_cache)
        else:
            out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
