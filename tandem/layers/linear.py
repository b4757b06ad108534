"""Linear and embedding layers whose parameters start uninitialized (the loader fills every one)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b; the weight is allocated with torch.empty on the ambient device and dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)



def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[n, hidden] x [vocab, hidden]^T -> [n, vocab] float32.

    On the CPU a few rows against a vocabulary-sized weight run ~30% faster as W @ h^T (the long
    vocabulary dimension becomes the GEMM's M); on CUDA cuBLAS picks well either way.
    """
    if hidden.device.type == "cpu" and hidden.shape[0] <= 64:
        return torch.mm(weight, hidden.t()).t().float()
    return F.linear(hidden, weight).float()
