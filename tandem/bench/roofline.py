"""Roofline floor of a run: bytes every step must read and the FLOPs it must do, over measured ceilings."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from tandem.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written per second / 1e9
    matmul_tflops: float  # large bf16 (GPU) / fp32 (CPU) matmul


def measure_ceilings(device: torch.device) -> Ceilings:
    """Both ceilings measured in this process (BENCHMARKS.md: never from a datasheet)."""
    if device.type == "cuda":
        n_bytes = 4 << 30
        src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
        dst = torch.empty_like(src)
        dim, dtype = 8192, torch.bfloat16
    else:
        n_bytes = 512 << 20
        src = torch.empty(n_bytes // 4, dtype=torch.float32).normal_()
        dst = torch.empty_like(src)
        dim, dtype = 1024, torch.float32
    a = torch.randn(dim, dim, device=device, dtype=dtype)
    b = torch.randn(dim, dim, device=device, dtype=dtype)
    copy_s = _median_seconds(lambda: dst.copy_(src), device)
    mm_s = _median_seconds(lambda: torch.mm(a, b), device)
    return Ceilings(copy_gbps=2 * n_bytes / copy_s / 1e9, matmul_tflops=2 * dim**3 / mm_s / 1e12)


def _median_seconds(fn, device: torch.device, reps: int = 10) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@dataclass(frozen=True, slots=True)
class ModelCost:
    weight_bytes: int  # read once per step (indexed-only embedding tables excluded)
    body_params: int  # parameters a token's forward multiplies by (no embedding, no lm_head)
    lm_head_params: int
    kv_bytes_per_token: int  # K and V of all layers for one token
    attn_flops_per_pair: int  # FLOPs of one (query token, context token) pair over all layers


def model_cost(model: nn.Module, mc: ModelConfig, tensor_parallel_size: int = 1) -> ModelCost:
    """Per-GPU cost: with tensor parallelism `model` is one rank's shard, and every term is that rank's share
    (the ranks run in parallel; the all-reduces are not counted)."""
    tp = tensor_parallel_size
    elem = next(model.parameters()).element_size()
    total, embed = 0, 0
    for name, p in model.named_parameters():
        total += p.numel()
        if "embed" in name or name.endswith(("wte.weight", "wpe.weight")):
            embed += p.numel()
    lm_head = -(-mc.vocab_size // tp) * mc.hidden_size
    indexed_only = embed - (lm_head if mc.tie_word_embeddings else 0)
    kv_heads = max(mc.num_kv_heads // tp, 1)
    return ModelCost(
        weight_bytes=(total - indexed_only) * elem,
        body_params=total - embed - (0 if mc.tie_word_embeddings else lm_head),
        lm_head_params=lm_head,
        kv_bytes_per_token=2 * mc.num_layers * kv_heads * mc.head_dim * elem,
        attn_flops_per_pair=4 * mc.num_layers * (mc.num_heads // tp) * mc.head_dim,
    )


def floor_seconds(step_log: list[tuple[int, int, int]], cost: ModelCost, ceil: Ceilings) -> float:
    """Σ over steps of max(bytes / bandwidth, flops / matmul rate)."""
    total = 0.0
    bw, rate = ceil.copy_gbps * 1e9, ceil.matmul_tflops * 1e12
    for num_seqs, num_tokens, num_context in step_log:
        bytes_ = cost.weight_bytes + num_context * cost.kv_bytes_per_token
        # Attention pairs: decode rows read their whole context; prefill tokens ~half on average.
        pairs = num_context if num_tokens == num_seqs else num_context * max(num_tokens // max(num_seqs, 1), 1) // 2
        flops = 2 * cost.body_params * num_tokens + 2 * cost.lm_head_params * num_seqs
        flops += cost.attn_flops_per_pair * pairs
        total += max(bytes_ / bw, flops / rate)
    return total
