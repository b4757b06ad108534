"""Batched LoRA kernel benchmark on CUDA: the shrink + expand of one projection against its bf16 base matmul.

    python scripts/bench_lora.py --out out/lora_kernels.json [--rank 16] [--slots 16]

For the Llama-3-8B projections with rank-`rank` adapters in a pool of `slots` slots (qkv 4096 -> 6144 with three
parts' rank columns, o 4096 -> 4096, gate_up 4096 -> 28672 with two, down 14336 -> 4096) it times
`lora_add_triton` per mix of tokens and adapters (a decode token on one adapter, 32 decode tokens over 8 adapters,
64 over 16, a 4,096-token prefill of 32 prompts over 8 adapters) beside the bf16 `F.linear` of the same rows (the
base projection the delta is added to): GPU time from a CUDA graph, as the engine replays it. The ratio
base / (base + delta) is the projection's share of the `lora` workload's target.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv import cuda_setup, graph_us, write_rows  # noqa: E402

from tandem.kernels.lora import lora_counters  # noqa: E402
from tandem.kernels.triton_lora import lora_add_triton  # noqa: E402

SHAPES = [("qkv", 6144, 4096, 3), ("o", 4096, 4096, 1), ("gate_up", 28672, 4096, 2), ("down", 4096, 14336, 1)]
MIXES = [("1 token, 1 adapter", 1, 1, 1), ("32 tokens, 8 adapters", 32, 8, 1), ("64 tokens, 16 adapters", 64, 16, 1),
         ("prefill 32 x 128, 8 adapters", 4096, 8, 128)]  # (name, tokens, adapters, tokens a request)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=16)
    args = parser.parse_args()
    device, props, copy_gbs = cuda_setup()
    gen = torch.Generator(device=device).manual_seed(0)
    counters = lora_counters(args.slots, device)
    rows = []
    for name, n_out, k, parts in SHAPES:
        cols = parts * args.rank
        a = torch.randn(args.slots, cols, k, generator=gen, device=device).mul_(k**-0.5).to(torch.bfloat16)
        b = torch.randn(args.slots, n_out, cols, generator=gen, device=device).mul_(0.01).to(torch.bfloat16)
        w = torch.randn(n_out, k, generator=gen, device=device).mul_(k**-0.5).to(torch.bfloat16)
        for mix, tokens, adapters, per_request in MIXES:
            x = torch.randn(tokens, k, generator=gen, device=device, dtype=torch.bfloat16)
            y = torch.zeros(tokens, n_out, device=device, dtype=torch.bfloat16)
            request = torch.arange(tokens, device=device) // per_request
            slots = (request % adapters).to(torch.int32)
            base = graph_us([lambda: F.linear(x, w)])
            delta = graph_us([lambda: lora_add_triton(y, x, a, b, slots, counters)])
            row = {"proj": name, "N": n_out, "K": k, "rank_columns": cols, "mix": mix, "tokens": tokens,
                   "adapters": adapters, "base_us": base, "lora_us": delta, "ratio": base / (base + delta)}
            rows.append(row)
            print(f"{name:<8} {mix:<30} base {base:8.1f} us  lora {delta:7.1f} us  base/(base+lora) "
                  f"{row['ratio']:.3f}", flush=True)
    if args.out:
        write_rows(args.out, props, copy_gbs, rows, benchmark="lora_kernels", rank=args.rank, slots=args.slots)


if __name__ == "__main__":
    main()
