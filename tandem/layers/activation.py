"""Activations: SiLU-and-mul for gated MLPs and gelu_new (tanh approximation) for GPT-2."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.kernels.ops import silu_and_mul

__all__ = ["activation_fn", "gelu_new", "silu_and_mul"]


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def activation_fn(name: str):
    """Elementwise activation by Hugging Face name."""
    table = {"gelu_new": gelu_new, "gelu_pytorch_tanh": gelu_new, "gelu": F.gelu, "relu": F.relu, "silu": F.silu}
    if name not in table:
        raise ValueError(f"unsupported activation {name!r}; expected one of {sorted(table)}")
    return table[name]
