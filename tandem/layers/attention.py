"""Attention layer: writes this step's K/V into the paged cache, then attends through the block tables."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from tandem.kernels import ops
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.fp8 import QuantizedRows
from tandem.layers.rotary import rotary_write_kv


class AttentionSplit(Protocol):
    """Takes over every attention call while piecewise CUDA graphs are captured (runner/cuda_graphs.py):
    returns the tensor that will hold the attention output at replay, [num_tokens, num_heads, head_dim].
    q_out(q) is where the eager attention will read q at replay: a layer that produces its q anyway (the
    rotary kernel) writes it there, and the call that follows finds it in place (no copy)."""

    def __call__(self, layer: Attention, q: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> torch.Tensor: ...

    def q_out(self, q: torch.Tensor) -> torch.Tensor: ...


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

    def rotary_attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], raw (views of the fused qkv output)
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        rotary: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) of this step's positions
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        q_norm: nn.Module | None = None,  # per-head RMSNorm of q and k first (Qwen3), both or neither
        k_norm: nn.Module | None = None,
        fp8_out: bool = False,  # the caller's o_proj holds FP8 weights
    ) -> torch.Tensor | QuantizedRows:  # [num_tokens, num_heads * head_dim]
        """(q/k norm,) rotary, this step's K/V into the cache, then attention. In a decode step on CUDA the decode
        kernel does all of it (ops.decode_attention_rotary: one kernel per layer where there were two, and the
        context's KV streams before the qkv projection has finished); otherwise rotary_write_kv, then attend.
        With fp8_out, a decode step where ops.decode_fp8_groups allows it returns the output quantized for the
        FP8 o_proj (QuantizedRows, one group per kv head) instead of in the model dtype."""
        cos, sin = rotary
        decode = _split is None and meta.is_decode and q.shape[0] == meta.num_seqs and meta.fuse_kv_write
        fp8 = fp8_out and decode and ops.decode_fp8_groups(q, self.num_kv_heads)
        if decode and ops.fuses_decode_rotary(q, k, cos, q_norm, k_norm):
            norms = q_norm is not None and k_norm is not None
            out = ops.decode_attention_rotary(
                q, k, v, cos, sin, k_cache, v_cache, meta, self.scale,
                q_norm.weight if norms else None, k_norm.weight if norms else None,  # type: ignore[union-attr]
                q_norm.eps if norms else 1e-6,  # type: ignore[union-attr]
                fp8_out=fp8,
            )
            return out if fp8 else out.reshape(q.shape[0], self.num_heads * self.head_dim)
        # Under a piecewise capture the rotated q goes straight where the eager attention reads it at replay.
        q_out = _split.q_out(q) if _split is not None else None
        q, k = rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, q_norm, k_norm, q_out)
        if fp8:
            return ops.decode_attention(q, k_cache, v_cache, meta, self.scale, fp8_out=True)
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
