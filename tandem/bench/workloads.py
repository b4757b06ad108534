"""The named benchmark workloads (docs/benchmarks.md) and their request generators."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    model: str | None  # named shape (random weights) or None: the embedded SmolLM2 GGUF
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range (lo == hi: fixed)
    output_len: tuple[int, int]
    shared_prefix_len: int = 0  # tokens of a common system prompt before each unique prompt
    dtype: str = "bfloat16"
    device: str = "cuda"
    what: str = ""


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("cpu", None, 16, (64, 64), (64, 64), dtype="float32", device="cpu",
                 what="SmolLM2-135M fp32 on CPU, 16 requests x 64 new tokens"),
        Workload("seed-async", "llama-3-8b", 32, (256, 256), (1024, 1024),
                 what="the seed's async experiment, scaled down"),
        Workload("bs1", "llama-2-7b", 1, (128, 128), (256, 256), what="CUDA graphs at batch 1"),
        Workload("bs1-8b", "llama-3-8b", 1, (128, 128), (256, 256),
                 what="bs1 at the Llama-3-8B shape (the FP8 target's shape: GQA, 128K vocabulary)"),
        Workload("bs8-8b", "llama-3-8b", 8, (128, 128), (256, 256),
                 what="8 requests at the Llama-3-8B shape: decode at a few rows (4-bit: the tensor-core GEMV's rows)"),
        Workload("prefill-4k", "llama-3-8b", 16, (4096, 4096), (1, 1),
                 what="16 prompts of 4,096 tokens, one new token each: prefill alone (a step of 4,096 rows each)"),
        Workload("nano", "qwen3-0.6b", 256, (100, 1024), (100, 1024), what="many short requests"),
        Workload("nano-2k", "qwen3-0.6b", 2048, (100, 1024), (100, 1024),
                 what="nano's distribution, 2,048 requests: keeps 256 sequences running on each of several "
                      "data-parallel replicas"),
        Workload("prefix", "llama-3.2-1b", 256, (64, 64), (128, 128), shared_prefix_len=1024,
                 what="prefix sharing"),
        Workload("70b-bs1", "llama-3-70b", 1, (128, 128), (256, 256),
                 what="Llama-3-70B shape at batch 1 (needs --tensor-parallel-size >= 2 in bf16)"),
        Workload("70b-batch", "llama-3-70b", 32, (256, 256), (512, 512),
                 what="Llama-3-70B shape, 32 requests (needs --tensor-parallel-size >= 2 in bf16)"),
        # Mixtures of experts: a decode step reads the experts its tokens route to, so its floor moves with the batch.
        Workload("moe-bs1", "qwen3-30b-a3b", 1, (256, 256), (512, 512),
                 what="Qwen3-30B-A3B shape (128 experts, top 8) at batch 1"),
        Workload("moe-batch", "qwen3-30b-a3b", 64, (256, 256), (512, 512),
                 what="Qwen3-30B-A3B shape, 64 requests (most experts touched per step)"),
        Workload("mixtral-tp2", "mixtral-8x7b", 32, (256, 256), (512, 512),
                 what="Mixtral-8x7B shape, 32 requests (needs --tensor-parallel-size 2; peer ep: the other of "
                      "TP and EP experts)"),
    ]
}


def make_requests(w: Workload, vocab_size: int, seed: int = 0, scale: float = 1.0) -> list[tuple[list[int], int]]:
    """(prompt token ids, new tokens) per request, from a fixed seed; `scale` shrinks lengths for smoke runs."""
    rng = random.Random(seed)

    def draw(lo_hi: tuple[int, int]) -> int:
        lo, hi = (max(1, int(x * scale)) for x in lo_hi)
        return rng.randint(lo, hi)

    # Ids from a middle band of the vocabulary: no special tokens, same distribution for every peer.
    lo_id, hi_id = min(1000, vocab_size // 4), vocab_size - 1
    prefix = [rng.randint(lo_id, hi_id) for _ in range(int(w.shared_prefix_len * scale))]
    out = []
    for _ in range(w.num_requests):
        prompt = prefix + [rng.randint(lo_id, hi_id) for _ in range(draw(w.prompt_len))]
        out.append((prompt, draw(w.output_len)))
    return out
