"""FP8 (e4m3) numbers the kernels and the layers share: the format's constants, the row-count thresholds of
the decode GEMMs, the row types producer kernels hand to FP8 linears, and the PyTorch definitions of
activation quantization that the Triton kernels must reproduce."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Rows whose |max| is below this get scale MIN_AMAX / FP8_MAX: an all-zero row quantizes to zeros, never NaN.
MIN_AMAX = 1e-12
# _scaled_mm needs K and N divisible by 16; other shapes stay in the model dtype.
FP8_ALIGN = 16
# Decode-sized FP8 GEMMs by row count (scripts/bench_fp8_linear.py; benchmarks/results): one row runs the GEMV
# (Linear dispatches it; x stays in bf16); up to W8A16_MAX_M rows (none by default) the Triton FP8-weight GEMM
# (x stays in bf16, the weight widened in registers: conversion-bound, 0.45-0.58 of copy bandwidth on an H200);
# up to W8A8_MAX_M rows the swap-AB W8A8 GEMM (x quantized per token, both operands straight to the FP8 tensor
# cores: 0.55-0.86 with x quantized beforehand); above, torch._scaled_mm, whose rowwise CUTLASS kernels tile N
# by 128 with no split-K, so a 4096-wide output at M <= 64 runs on 32 CTAs and cannot stream the weight.
# Wherever x is quantized, the kernel that produces it (RMSNorm, SiLU-and-mul) can write it quantized
# (QuantizedRows) so that no separate quantization kernel runs.
W8A16_MAX_M = int(os.environ.get("TANDEM_FP8_W8A16_MAX_M", "1"))
W8A8_MAX_M = int(os.environ.get("TANDEM_FP8_W8A8_MAX_M", "64"))

class QuantizedRows(NamedTuple):
    """Activations quantized per token, as fp8_linear would quantize them: e4m3 rows, their fp32 scales
    (rows ~= q * scale) and the dtype of the unquantized activations (the linear's output dtype). Written by
    a producer kernel (RMSNorm, SiLU-and-mul) whose consumer is an FP8 linear that quantizes x anyway.
    With G > 1 scale columns each row is G groups of k / G columns, each quantized over its own |max|
    (quantize_activation_groups_ref): the decode attention writes one group per kv head for o_proj."""

    q: torch.Tensor  # [n, k] float8_e4m3fn, row-major
    scale: torch.Tensor  # [n, G] fp32, contiguous; G = 1: per token
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def group_size(self) -> int:
        """Columns per scale: k for per-token rows."""
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        """fp32 [n, k]: every value times its group's scale."""
        return self.q.float() * self.scale.repeat_interleave(self.group_size, dim=1)


class PartialSums(NamedTuple):
    """A split-K GEMM's output before its reduce: fp32 partial sums [splits, n, out] whose split-order sum,
    times the channel scale (FP8 weights) plus the bias, rounded to `dtype`, is the linear's output. Handed
    to the add + RMSNorm kernel after it (RMSNorm), which adds them itself, so no reduce kernel runs."""

    ws: torch.Tensor  # [splits, n, out] fp32
    scale: torch.Tensor | None  # [out, 1] fp32 (FP8 weights) or None
    bias: torch.Tensor | None  # [out]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.ws.shape[1:]

    def reduce(self) -> torch.Tensor:
        """The linear's output [n, out], as the split-K reduce kernel computes it (PyTorch, any device)."""
        acc = self.ws[0].clone()
        for part in self.ws[1:]:
            acc += part
        if self.scale is not None:
            acc = acc * self.scale.view(1, -1)
        if self.bias is not None:
            acc = acc + self.bias.float()
        return acc.to(self.dtype)


DEFER_REDUCE = os.environ.get("TANDEM_DEFER_REDUCE", "1") == "1"  # Linear(defer_reduce=True) may return PartialSums


def fp8_quantizes_activations(rows: int) -> bool:
    """Whether fp8_linear quantizes x per token at this many rows (the GEMV and W8A16 paths do not)."""
    return rows > W8A16_MAX_M


def quantize_activation_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch definition the Triton kernel must reproduce bit for bit: IEEE fp32 division, RNE cast."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (x32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_activation_groups_ref(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] float -> (e4m3 [n, k], fp32 scale [n, k / group_size]), every group of group_size consecutive
    columns over its own |max|: scale = amax / 448 as per token, but the values are multiplied by the one
    IEEE-rounded 448 / amax of their group rather than each divided by the scale (the kernel writing them,
    the decode attention, does one division per group; the results differ from a division by at most one
    e4m3 rounding step, where x / scale falls within an fp32 ulp of a rounding boundary)."""
    n, k = x.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group size {group_size} does not divide {k} columns")
    x32 = x.float().reshape(n, k // group_size, group_size)
    amax = x32.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX)
    q = (x32 * (FP8_MAX / amax)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(n, k), (amax / FP8_MAX).view(n, k // group_size)


def group_block_k(group_size: int, block_k: int) -> int:
    """The K tile of a swap-AB GEMM on rows quantized in groups of group_size columns: the largest power of two
    <= block_k that divides the group (each K tile then lies in one group); 0 below 32, the FP8 MMA's K."""
    tile = min(block_k, group_size & -group_size)
    return tile if tile >= 32 else 0
