"""A decode-step model of data-parallel scaling: the efficiency docs/parallelism.md quotes for nano and nano-2k.

Each engine admits requests FIFO up to max_num_seqs and runs decode steps costing f + v x sequences; DP=M
routes the same requests over M such engines with ReplicaRouter (by request count, or by `work`) and is as
slow as its slowest replica. f and v come from nano on 2xH200 (27,373 tok/s at DP=1, 44,448 at DP=2). Prefill
is left out. Run: python scripts/dp_scaling_model.py
"""

from __future__ import annotations

import random

from tandem.engine.router import ReplicaRouter, work

FIXED_S, PER_SEQ_S = 1.2e-3, 0.028e-3  # fitted: (f + 140 v) / (f + 70 v) = 1.62, f + 140 v = 5.1 ms


def engine_seconds(output_lens: list[int], max_num_seqs: int = 256) -> float:
    seconds, queue, running = 0.0, list(output_lens), []
    while queue or running:
        admit = max_num_seqs - len(running)
        running += queue[:admit]
        del queue[:admit]
        seconds += FIXED_S + PER_SEQ_S * len(running)
        running = [n - 1 for n in running if n > 1]
    return seconds


def efficiency(num_requests: int, replicas: int, by_tokens: bool, seed: int) -> float:
    rng = random.Random(seed)
    requests = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(num_requests)]
    one = engine_seconds([n for _, n in requests])
    router = ReplicaRouter(replicas, block_size=16)
    parts: list[list[int]] = [[] for _ in range(replicas)]
    for prompt_len, n in requests:
        prompt = [7] * min(prompt_len, 15)  # under one block: no prefix affinity
        max_new = work([7] * prompt_len, n) - len(prompt) // 8 if by_tokens else None
        parts[router.pick(prompt, max_new)].append(n)
    return one / (replicas * max(engine_seconds(p) for p in parts))


def main() -> None:
    for name, num_requests in (("nano", 256), ("nano-2k", 2048)):
        for replicas in (2, 4):
            by = {label: sum(efficiency(num_requests, replicas, flag, s) for s in range(3)) / 3
                  for label, flag in (("requests", False), ("tokens", True))}
            print(f"{name:8} DP={replicas}: efficiency routed by requests {by['requests']:.3f}, "
                  f"by tokens {by['tokens']:.3f}")


if __name__ == "__main__":
    main()
