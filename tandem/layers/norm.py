"""RMSNorm (optionally fused with the residual add) and LayerNorm, computed in float32 like Hugging Face."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.fp8 import PartialSums, QuantizedRows, fp8_quantizes_activations
from tandem.kernels.ops import use_triton
from tandem.distributed.group import Unreduced


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)  # [hidden_size]

    def forward(
        self, x: torch.Tensor | PartialSums | Unreduced, residual: torch.Tensor | None = None, fp8_out: bool = False
    ) -> torch.Tensor | QuantizedRows | tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual). fp8_out (the output
        feeds FP8 linears only): where those would quantize x per token (fp8_quantizes_activations) and
        Triton runs, norm(...) comes quantized by this kernel, as QuantizedRows; otherwise as a tensor.
        x may be a split-K linear's PartialSums (Linear's defer_reduce): the Triton kernel adds them up; or a
        row-parallel product not yet summed over ranks (Unreduced), reduced here, with the add and the norm in
        the same kernel where the peer-to-peer all-reduce allows."""
        if isinstance(x, Unreduced):
            quantize = fp8_out and fp8_quantizes_activations(x.partial.shape[0])
            fused = None if quantize or residual is None else x.group.add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = x.reduce()
        if isinstance(x, PartialSums):
            if residual is not None and use_triton(x.ws):
                from tandem.kernels.triton_fused import fused_add_rms_norm_triton  # lazy: no Triton on CPU

                quantize = fp8_out and fp8_quantizes_activations(x.shape[0])
                return fused_add_rms_norm_triton(x, residual, self.weight, self.eps, quantize)
            x = x.reduce()
        if use_triton(x):
            from tandem.kernels.triton_fused import fused_add_rms_norm_triton, rms_norm_triton  # lazy: no Triton on CPU

            quantize = fp8_out and x.dim() == 2 and fp8_quantizes_activations(x.shape[0])
            if residual is None:
                return rms_norm_triton(x, self.weight, self.eps, quantize)
            return fused_add_rms_norm_triton(x, residual, self.weight, self.eps, quantize)
        if residual is not None:
            x = x + residual
            residual = x
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        out = self.weight * normed
        return out if residual is None else (out, residual)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)  # [hidden_size]
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)  # [hidden_size]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
