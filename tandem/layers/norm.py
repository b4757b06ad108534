"""RMSNorm (optionally fused with the residual add) and LayerNorm, computed in float32 like Hugging Face."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.ops import use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)  # [hidden_size]

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if use_triton(x):
            from tandem.kernels.triton_fused import fused_add_rms_norm_triton, rms_norm_triton  # lazy: no Triton on CPU

            if residual is None:
                return rms_norm_triton(x, self.weight, self.eps)
            return fused_add_rms_norm_triton(x, residual, self.weight, self.eps)
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
