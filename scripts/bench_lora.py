"""Batched LoRA kernel benchmark on CUDA: a LoRA target projection as the engine runs it, against its base.

    python scripts/bench_lora.py --out out/lora_kernels.json [--rank 16] [--slots 16]

For the Llama-3-8B projections with rank-`rank` adapters in a pool of `slots` slots (qkv 4096 -> 6144 with three
parts' rank columns, o 4096 -> 4096, gate_up 4096 -> 28672 with two, down 14336 -> 4096) it times a bf16 `Linear`
called as the decoder layer calls it (gate_up: `forward_silu_and_mul`; o and down: `defer_reduce=True`) per mix of
tokens and adapters (a decode token on one adapter, 32 decode tokens over 8 adapters, 64 over 16, a 4,096-token
prefill of 32 prompts over 8 adapters): without adapters (`base_us`: the GEMV, skinny GEMM or cuBLAS the rows
take), with them and the delta in the decode kernels' epilogue where they run (`fused_us`: a shrink kernel, then
base + expand), and with the separate shrink and expand kernels after the base output (`unfused_us`,
TANDEM_LORA_FUSED=0: at decode mixes the sorted kernels over the step's tokens grouped by slot, as the pool groups
them; `one_block_us`: the one-block kernels they replace, TANDEM_LORA_SORTED=0). GPU time from a CUDA graph, as the
engine replays it. The ratio base / lora is the projection's share of the `lora` workload's target. At one token it
also times the two shrink kernels alone: the one-pass GEMV over the token's A rows that the fused path runs
(`shrink_gemv_us`) and the token-block kernel with its K split and second pass (`shrink_block_us`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv import cuda_setup, graph_us, projection_shapes, write_rows  # noqa: E402

from tandem.kernels.lora import index_token_slots, lora_counters, slot_groups  # noqa: E402
from tandem.kernels.triton_gemv import lora_shrink_triton  # noqa: E402
from tandem.kernels.triton_lora import lora_shrink_block_triton  # noqa: E402
from tandem.layers.linear import Linear  # noqa: E402
from tandem.lora.pool import LoRADelta  # noqa: E402

# (name, N, K, adapter parts: q / k / v and gate / up each on rank columns of their own)
SHAPES = [(name, n, k, {"qkv": 3, "gate_up": 2}.get(name, 1))
          for name, n, k, _ in projection_shapes("llama-3-8b")]
MIXES = [("1 token, 1 adapter", 1, 1, 1), ("32 tokens, 8 adapters", 32, 8, 1), ("64 tokens, 16 adapters", 64, 16, 1),
         ("prefill 32 x 128, 8 adapters", 4096, 8, 128)]  # (name, tokens, adapters, tokens a request)


def timed(linear: Linear, name: str, x: torch.Tensor, fused: bool) -> float:
    """GPU us of one call as the decoder layer makes it; TANDEM_LORA_FUSED is read while the graph is captured (the
    step's grouping is made before it, by the caller)."""
    os.environ["TANDEM_LORA_FUSED"] = "1" if fused else "0"
    if name == "gate_up":
        return graph_us([lambda: linear.forward_silu_and_mul(x)])
    return graph_us([lambda: linear(x, defer_reduce=name in ("o", "down"))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=16)
    args = parser.parse_args()
    device, props, copy_gbs = cuda_setup()
    gen = torch.Generator(device=device).manual_seed(0)
    slots = torch.full((4096,), -1, dtype=torch.int32, device=device)  # the pool's static token index
    groups = slot_groups(args.slots, 4096, device)  # and its grouping by slot
    counters = lora_counters(args.slots, device)
    rows = []
    for name, n_out, k, parts in SHAPES:
        cols = parts * args.rank
        linear = Linear(k, n_out).to(device, torch.bfloat16)
        linear.weight.data = torch.randn(n_out, k, generator=gen, device=device).mul_(k**-0.5).to(torch.bfloat16)
        a = torch.randn(args.slots, cols, k, generator=gen, device=device).mul_(k**-0.5).to(torch.bfloat16)
        b = torch.randn(args.slots, n_out, cols, generator=gen, device=device).mul_(0.01).to(torch.bfloat16)
        delta = LoRADelta(a, b, slots, counters, groups=groups)
        for mix, tokens, adapters, per_request in MIXES:
            x = torch.randn(tokens, k, generator=gen, device=device, dtype=torch.bfloat16)
            request = torch.arange(tokens, device=device) // per_request
            step = (request % adapters).to(torch.int32)
            os.environ["TANDEM_LORA_SORTED"] = "0"
            index_token_slots(step, slots, groups)  # as the pool's select writes it; not grouped
            linear.lora = None
            base = timed(linear, name, x, fused=True)
            linear.lora = delta
            one_block = timed(linear, name, x, fused=False)
            os.environ.pop("TANDEM_LORA_SORTED")
            index_token_slots(step, slots, groups)  # grouped where the pool groups a step
            fused, unfused = timed(linear, name, x, fused=True), timed(linear, name, x, fused=False)
            row = {"proj": name, "N": n_out, "K": k, "rank_columns": cols, "mix": mix, "tokens": tokens,
                   "adapters": adapters, "base_us": base, "fused_us": fused, "unfused_us": unfused,
                   "one_block_us": one_block, "grouped": groups.num_tokens > 0, "ratio_fused": base / fused,
                   "ratio_unfused": base / unfused, "ratio_one_block": base / one_block}
            if tokens == 1:
                row["shrink_gemv_us"] = graph_us([lambda: lora_shrink_triton(x, a, slots)])
                row["shrink_block_us"] = graph_us([lambda: lora_shrink_block_triton(x, a, slots, counters)])
            rows.append(row)
            shrinks = (f"  shrink gemv {row['shrink_gemv_us']:.1f} us, block {row['shrink_block_us']:.1f} us"
                       if tokens == 1 else "")
            print(f"{name:<8} {mix:<30} base {base:8.1f} us  lora fused {fused:8.1f} us ({row['ratio_fused']:.3f})  "
                  f"separate {unfused:8.1f} us ({row['ratio_unfused']:.3f}) one-block {one_block:8.1f} us "
                  f"({row['ratio_one_block']:.3f}){shrinks}", flush=True)
    os.environ.pop("TANDEM_LORA_FUSED")
    if args.out:
        write_rows(args.out, props, copy_gbs, rows, benchmark="lora_kernels", rank=args.rank, slots=args.slots)


if __name__ == "__main__":
    main()
