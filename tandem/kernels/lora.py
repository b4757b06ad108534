"""The LoRA delta of a batch that mixes adapters: y += (x @ A[slot]^T) @ B[slot]^T per token, slot -1 adding
nothing; the Triton shrink / expand kernels on CUDA, the plain-PyTorch reference below on the CPU."""

from __future__ import annotations

import torch

from tandem.kernels.ops import use_triton

MAX_RANK_TILES = 64  # the Triton shrink's rank tiles a counter buffer serves per slot


def lora_add_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 token_slots: torch.Tensor) -> torch.Tensor:
    """y [n, out] += the delta in place. a [slots, rank, in], b [slots, out, rank] (the scale folded into b),
    token_slots [n] (-1: no adapter). Every token goes through every slot and a one-hot mask keeps its own: no
    host-side count or gather by slot, so it is as graph-safe as the kernels (and exact: the others add zeros)."""
    num_slots, rank, k = a.shape
    n = x.shape[0]
    shrink = (x @ a.reshape(num_slots * rank, k).t()).view(n, num_slots, rank)  # [n, slots, rank]
    own = token_slots.view(n, 1) == torch.arange(num_slots, device=x.device).view(1, num_slots)
    shrink = shrink * own.to(shrink.dtype).unsqueeze(-1)
    # [n, slots * rank] @ [slots * rank, out]
    y += shrink.view(n, num_slots * rank) @ b.transpose(1, 2).reshape(num_slots * rank, b.shape[1])
    return y


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             token_slots: torch.Tensor, counters: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., out] += the per-token adapter delta of x [..., in] (see lora_add_ref); returns y. counters: the
    kernels' split counters (triton_lora.lora_counters), shared by a pool's linears."""
    y2, x2 = y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1])
    slots = token_slots[: x2.shape[0]]
    if use_triton(x2) and not (x2.is_cuda and x2.dtype == torch.float32):
        from tandem.kernels.triton_lora import lora_add_triton  # lazy: CPU runs never import Triton

        lora_add_triton(y2, x2, a, b, slots, counters)
    else:
        lora_add_ref(y2, x2, a, b, slots)
    return y


def lora_counters(num_slots: int, device: torch.device) -> torch.Tensor:
    """The split counters the Triton kernels of a pool of num_slots slots share: zero, and zero again after every
    call, so one buffer serves every linear of a model (their kernels run one after another on a stream)."""
    return torch.zeros(num_slots * MAX_RANK_TILES, dtype=torch.int32, device=device)
