"""Rotary position embedding (half-rotation layout) with default, linear and Llama-3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tandem.kernels.ops import use_triton, write_kv

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def inverse_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 [rotary_dim // 2] angular frequency per rotated pair, after the configured scaling."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scheme: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    original_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    long_wavelen = original_len / low_freq_factor  # beyond this: fully scaled
    short_wavelen = original_len / high_freq_factor  # below this: unchanged
    scaled = torch.where(wavelen > long_wavelen, inv_freq / factor, inv_freq)
    blend = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_band = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates the first and second half of each head (Hugging Face Llama layout) by position-dependent angles."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(head_dim, theta, scaling)  # [head_dim // 2] float32
        positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        # Angles in float32, then cast to the model dtype, as Hugging Face does before multiplying.
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.get_default_dtype())
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [max_positions, head_dim]

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] -> (cos, sin), each [num_tokens, 1, head_dim // 2]; computed once per step."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; rotates pairs (i, i + head_dim / 2) by the step's angles."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_qk(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], may be a strided view of the fused qkv output
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q, k). On CUDA one fused kernel rotates q and k IN PLACE; on CPU they are left untouched."""
    if use_triton(q):
        from tandem.kernels.triton_fused import rotary_triton  # lazy: no Triton on CPU

        rotary_triton(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def rotary_write_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], may be a strided view of the fused qkv output
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    q_norm: nn.Module | None = None,  # per-head RMSNorm of q and k (Qwen3), both or neither
    k_norm: nn.Module | None = None,
    q_out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]: where the rotated q goes
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q/k norm,) rotary and the KV-cache write; returns the (q, k) that attention reads.

    On CUDA one fused kernel does all of it per layer, normalizing and rotating q and k IN PLACE (q into
    q_out instead where given); on CPU the separate reference layers run (norm outputs are fresh tensors, q
    and k are left untouched, q_out receives a copy of the rotated q). With q_out the q returned is q_out.
    """
    norms = q_norm is not None and k_norm is not None
    fusable = not norms or q_norm.eps == k_norm.eps  # type: ignore[union-attr]
    if (use_triton(q)) and fusable:
        from tandem.kernels.triton_rotary_kv import rotary_write_kv_triton  # lazy: no Triton on CPU

        rotary_write_kv_triton(
            q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
            q_norm.weight if norms else None, k_norm.weight if norms else None,  # type: ignore[union-attr]
            q_norm.eps if norms else 1e-6,  # type: ignore[union-attr]
            q_out=q_out,
        )
        return (q if q_out is None else q_out), k
    if q_norm is not None and k_norm is not None:
        q, k = q_norm(q), k_norm(k)
    q, k = apply_rotary_qk(q, k, cos, sin)
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    if q_out is not None:
        q = q_out.copy_(q)
    return q, k
