"""Attention layer: writes this step's K/V into the paged cache, then attends through the block tables."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from tandem.kernels import ops
from tandem.layers.attention_metadata import AttentionMetadata
from tandem.layers.quantization import FP8_DTYPE, QuantizedRows, fp8_quantizes_activations
from tandem.layers.rotary import rotary_write_kv


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
        fp8_out: bool = False,  # the output feeds an FP8 linear (o_proj)
    ) -> torch.Tensor | QuantizedRows:  # [num_tokens, num_heads * head_dim]
        """(q/k norm,) rotary, this step's K/V into the cache, then attention. In a decode step on CUDA the decode
        kernel does all of it (ops.decode_attention_rotary: one kernel per layer where there were two, and the
        context's KV streams before the qkv projection has finished); otherwise rotary_write_kv, then attend.
        fp8_out: where the FP8 linear would quantize the output per token, a decode kernel that can writes it
        quantized (QuantizedRows)."""
        cos, sin = rotary
        if (_split is None and meta.is_decode and q.shape[0] == meta.num_seqs
                and ops.fuses_decode_rotary(q, k, cos, q_norm, k_norm)):
            norms = q_norm is not None and k_norm is not None
            rows = self._fp8_rows(q, k_cache, meta) if fp8_out else None
            out = ops.decode_attention_rotary(
                q, k, v, cos, sin, k_cache, v_cache, meta, self.scale,
                q_norm.weight if norms else None, k_norm.weight if norms else None,  # type: ignore[union-attr]
                q_norm.eps if norms else 1e-6,  # type: ignore[union-attr]
                fp8_rows=rows,
            )
            if rows is not None:
                return QuantizedRows(*rows, q.dtype)
            return out.reshape(q.shape[0], self.num_heads * self.head_dim)
        q, k = rotary_write_kv(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, q_norm, k_norm)
        return self.attend(q, k_cache, v_cache, meta, fp8_out)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        fp8_out: bool = False,
    ) -> torch.Tensor | QuantizedRows:  # [num_tokens, num_heads * head_dim]
        """Attention alone, for callers that wrote this step's K/V already (the fused rotary + KV write)."""
        if _split is not None:
            out = _split(self, q, k_cache, v_cache)
        elif fp8_out and (rows := self._fp8_rows(q, k_cache, meta)) is not None:
            ops.decode_attention_fp8_rows(q, k_cache, v_cache, meta, self.scale, rows)
            return QuantizedRows(*rows, q.dtype)
        else:
            out = ops.paged_attention(q, k_cache, v_cache, meta, self.scale)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _fp8_rows(
        self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Buffers for the output quantized per token, where an FP8 linear would quantize these rows and the
        decode kernel can write them (ops.decode_writes_fp8_rows); else None."""
        if not fp8_quantizes_activations(q.shape[0]) or not ops.decode_writes_fp8_rows(q, k_cache, meta):
            return None
        return (torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=FP8_DTYPE, device=q.device),
                torch.empty(q.shape[0], 1, dtype=torch.float32, device=q.device))
