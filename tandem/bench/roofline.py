"""Roofline floor of a run: bytes every step must read and the FLOPs it must do, over measured ceilings."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.config import ModelConfig


@dataclass(frozen=True, slots=True)
class Ceilings:
    copy_gbps: float  # device-to-device copy, bytes read + written per second / 1e9
    matmul_tflops: float  # large bf16 (GPU) / fp32 (CPU) matmul
    fp8_matmul_tflops: float | None = None  # large rowwise-scaled FP8 matmul (measured for fp8 runs only)


def measure_ceilings(device: torch.device, fp8: bool = False) -> Ceilings:
    """The ceilings measured in this process (docs/benchmarks.md: never from a datasheet)."""
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
    fp8_tflops = None
    if fp8:
        from tandem.kernels.fp8 import FP8_DTYPE

        a8, b8 = a.to(FP8_DTYPE), b.to(FP8_DTYPE)
        sa = torch.ones(dim, 1, device=device)
        sb = torch.ones(1, dim, device=device)
        fp8_s = _median_seconds(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                                         out_dtype=torch.bfloat16), device)
        fp8_tflops = 2 * dim**3 / fp8_s / 1e12
    return Ceilings(copy_gbps=2 * n_bytes / copy_s / 1e9, matmul_tflops=2 * dim**3 / mm_s / 1e12,
                    fp8_matmul_tflops=fp8_tflops)


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
    weight_bytes: int  # read once per step (indexed-only embedding tables excluded); FP8 weights 1 byte + scales,
    # integer weights their packed codes + scales + zeros
    body_params: int  # parameters a token's forward multiplies by (no embedding, no lm_head)
    lm_head_params: int
    kv_bytes_per_token: int  # K and V of all layers for one token
    attn_flops_per_pair: int  # FLOPs of one (query token, context token) pair over all layers
    fp8_body_params: int = 0  # the body parameters stored (and multiplied) in FP8
    # Mixture of experts: the routed experts' stacks are not in weight_bytes / body_params; a step reads the
    # experts its tokens route to and multiplies each token by top_k of them.
    expert_bytes: int = 0  # this rank's expert stacks over all MoE layers (FP8 scales included)
    expert_params: int = 0  # their parameters
    num_experts: int = 0  # experts per MoE layer over all ranks (0: a dense model)
    top_k: int = 0
    fp8_experts: bool = False
    # Measured distinct experts per layer-forward over the uniform-routing expectation (moe_routing_scale), 1.0
    # where no routing was counted.
    routing_scale: float = 1.0

    def expected_experts(self, num_tokens: int) -> float:
        """Distinct experts per layer that num_tokens tokens route to, expected under uniform routing (the
        dummy weights' router is close to it; trained routers concentrate, so real steps read fewer)."""
        if self.num_experts == 0:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** num_tokens)

    def step_expert_bytes(self, num_tokens: int) -> float:
        """Bytes of the experts a step of num_tokens tokens reads on this rank: each touched expert's share
        (TP: 1/N of every expert; EP: the whole experts that live here, 1/N of them on average)."""
        if self.num_experts == 0:
            return 0.0
        touched = min(self.expected_experts(num_tokens) * self.routing_scale, float(self.num_experts))
        return touched / self.num_experts * self.expert_bytes


def moe_routing_scale(routed: int, step_log: list[tuple[int, int, int]], cost: ModelCost,
                      num_moe_layers: int) -> float:
    """routed (distinct experts summed over every MoE layer's forwards of a run, as the layers' counters hold
    them) over what uniform routing would give for the run's steps: how much more (or less) a step reads than
    the uniform estimate says."""
    expected = num_moe_layers * sum(cost.expected_experts(tokens) for _, tokens, _ in step_log)
    return routed / expected if expected > 0 else 1.0


# Parameters of the routed experts: w13 / w2 in the model dtype or FP8, or their integer stacks (IntWeight).
_EXPERT_SUFFIXES = tuple(f".mlp.{proj}{part}" for proj in ("w13", "w2") for part in ("", "_words", "_scales", "_mins"))


def model_cost(model: nn.Module, mc: ModelConfig, tensor_parallel_size: int = 1,
               kv_cache_dtype: torch.dtype | None = None) -> ModelCost:
    """Per-GPU cost: with tensor parallelism `model` is one rank's shard, and every term is that rank's share
    (the ranks run in parallel; the all-reduces are not counted). FP8 weights count one byte each, and so does
    each K and V element of an FP8 KV cache (kv_cache_dtype; None: the model dtype); 4- / 8-bit integer
    weights count their packed codes, scales and zeros."""
    from tandem.kernels.fp8 import FP8_DTYPE

    tp = tensor_parallel_size
    total, embed, total_bytes, embed_bytes, fp8, head = 0, 0, 0, 0, 0, 0
    expert_params, expert_bytes, fp8_experts = 0, 0, False
    for name, p in model.named_parameters():
        if name.endswith(_EXPERT_SUFFIXES):  # routed experts (layers.moe.FusedMoE): counted per step
            expert_bytes += p.numel() * p.element_size()
            fp8_experts = p.dtype == FP8_DTYPE
            if name.endswith(("_scales", "_mins")):  # integer experts' groups: read, not multiplied
                continue
            # 4- / 8-bit experts' int32 words hold 32 // bits weights each
            bits = model.get_submodule(name.rpartition(".")[0]).int_bits if name.endswith("_words") else 0
            expert_params += p.numel() * (32 // bits if bits else 1)
            continue
        total_bytes += p.numel() * p.element_size()
        if name.endswith((".scales", ".zeros", ".mins", ".perm")):  # an integer weight's groups / act order: read only
            continue
        # An integer weight's qweight packs 8 // bits weights a byte (its kernels' int32 words 32 // bits a word):
        # it multiplies by all of them.
        suffix = name.rpartition(".")[2]
        bits = model.get_submodule(name.rpartition(".")[0]).int_bits if suffix in ("qweight", "words") else 0
        weights = p.numel() * (p.element_size() * 8 // bits if bits else 1)
        total += weights
        if "embed" in name or name.endswith(("wte.weight", "wpe.weight")):
            embed += p.numel()
            embed_bytes += p.numel() * p.element_size()
        elif name.startswith("lm_head."):  # its own weight (untied, or a tied model's quantized copy)
            head += weights
        elif p.dtype == FP8_DTYPE:
            fp8 += p.numel()
    # Per-output-channel scales of FP8 linears are read with their weights.
    total_bytes += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("weight_scale"))
    expert_bytes += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                        if n.endswith(("w13_scale", "w2_scale")))
    elem = embed_bytes // max(embed, 1)  # the model dtype: embeddings are never FP8
    kv_elem = elem if kv_cache_dtype is None else kv_cache_dtype.itemsize
    lm_head = -(-mc.vocab_size // tp) * mc.hidden_size
    # A tied model without a head of its own reads its logits through the embedding table.
    indexed_only_bytes = embed_bytes - (lm_head * elem if mc.tie_word_embeddings and not head else 0)
    kv_heads = max(mc.num_kv_heads // tp, 1)
    return ModelCost(
        weight_bytes=total_bytes - indexed_only_bytes,
        body_params=total - embed - head,
        lm_head_params=lm_head,
        kv_bytes_per_token=2 * mc.num_layers * kv_heads * mc.head_dim * kv_elem,
        attn_flops_per_pair=4 * mc.num_layers * (mc.num_heads // tp) * mc.head_dim,
        fp8_body_params=fp8,
        expert_bytes=expert_bytes,
        expert_params=expert_params,
        num_experts=mc.num_experts,
        top_k=mc.num_experts_per_tok,
        fp8_experts=fp8_experts,
    )


def floor_seconds(step_log: list[tuple[int, int, int]], cost: ModelCost, ceil: Ceilings) -> float:
    """Σ over steps of max(bytes / bandwidth, flops / matmul rate)."""
    return sum(step_floor_seconds(*step, cost, ceil) for step in step_log)


def step_floor_seconds(num_seqs: int, num_tokens: int, num_context: int, cost: ModelCost, ceil: Ceilings) -> float:
    """One step's floor: max(bytes it must read / copy bandwidth, FLOPs it must do / matmul rate)."""
    bw, rate = ceil.copy_gbps * 1e9, ceil.matmul_tflops * 1e12
    # FP8 linears run at the FP8 matmul rate (the bf16 one when it was not measured).
    fp8_rate = (ceil.fp8_matmul_tflops or ceil.matmul_tflops) * 1e12
    bytes_ = cost.weight_bytes + num_context * cost.kv_bytes_per_token + cost.step_expert_bytes(num_tokens)
    # Attention pairs: decode rows read their whole context; prefill tokens ~half on average.
    pairs = num_context if num_tokens == num_seqs else num_context * max(num_tokens // max(num_seqs, 1), 1) // 2
    flops = 2 * (cost.body_params - cost.fp8_body_params) * num_tokens + 2 * cost.lm_head_params * num_seqs
    flops += cost.attn_flops_per_pair * pairs
    compute_s = flops / rate + 2 * cost.fp8_body_params * num_tokens / fp8_rate
    if cost.num_experts:  # each token through top_k experts (this rank's share of them)
        expert_flops = 2 * cost.expert_params * cost.top_k / cost.num_experts * num_tokens
        compute_s += expert_flops / (fp8_rate if cost.fp8_experts else rate)
    return max(bytes_ / bw, compute_s)


# Decode-only steps are told apart by batch size: (label, smallest batch) from the largest down.
DECODE_CLASSES = (("decode >= 128 seqs", 128), ("decode 32-127 seqs", 32), ("decode 8-31 seqs", 8),
                  ("decode < 8 seqs", 1))


def step_classes(step_log: list[tuple[int, int, int]], timeline: Any, cost: ModelCost, ceil: Ceilings
                 ) -> dict[str, dict[str, float]] | None:
    """Where a run's time goes against its floor, by kind of step: steps that prefill (alone or mixed with
    decodes) and decode-only steps by batch size, each with its GPU seconds (the steps' spans on the GPU's
    timeline), its floor seconds and their ratio. None without one GPU span per step (no timeline, or
    timing began mid-run)."""
    if timeline is None:
        return None
    spans = [sp for sp in timeline.spans if sp.lane == "gpu"]
    if len(spans) != len(step_log):
        return None
    classes: dict[str, dict[str, float]] = {}
    for (num_seqs, num_tokens, num_context), span in zip(step_log, spans):
        if num_tokens != num_seqs:
            label = "prefill or mixed"
        else:
            label = next(name for name, lo in DECODE_CLASSES if num_seqs >= lo)
        c = classes.setdefault(label, {"steps": 0, "gpu_s": 0.0, "floor_s": 0.0})
        c["steps"] += 1
        c["gpu_s"] += span.end - span.start
        c["floor_s"] += step_floor_seconds(num_seqs, num_tokens, num_context, cost, ceil)
    for c in classes.values():
        c["roofline_fraction"] = c["floor_s"] / c["gpu_s"] if c["gpu_s"] > 0 else 0.0
    return classes
