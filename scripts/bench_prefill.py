"""Prefill attention benchmark on CUDA: the paged causal kernel over (num_stages, num_warps) configurations.

    python scripts/bench_prefill.py --out out/bench_prefill.json [--stages 3 5] [--warps 4 8]

For each layout (heads / kv heads) and (batch, tokens) every sequence prefills its whole context (a paged cache
with shuffled blocks, block size 16, head_dim 128, bf16), timed inside a CUDA graph with the L2 flushed before
each call (GPU time, as scripts/bench_kernels.py). It reports microseconds and the attention TFLOP/s (causal:
half of 4 x tokens^2 x heads x head_dim per sequence), and whether each configuration's output equals the first
configuration's bit for bit (num_stages changes the pipelining, never the arithmetic).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import graph_ms, make_inputs  # noqa: E402

from tandem.kernels.triton_attention import paged_prefill_attention  # noqa: E402

# (num_heads, num_kv_heads, batch, tokens per sequence): Qwen3-0.6B and Llama-3-8B layouts.
SHAPES = [(16, 8, 8, 1024), (16, 8, 16, 512), (32, 8, 4, 1024), (32, 8, 2, 2048)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON results")
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4, 5, 6])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill.py needs a CUDA GPU")
    device = torch.device("cuda")
    rows = []
    for heads, kv_heads, batch, tokens in SHAPES:
        _, k_cache, v_cache, block_tables, seq_lens = make_inputs(batch, tokens, heads, kv_heads, 128, 16,
                                                                  torch.bfloat16, device)
        q = torch.randn(batch * tokens, heads, 128, device=device, dtype=torch.bfloat16)
        query_start_loc = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * tokens
        out = torch.zeros_like(q)
        first = None
        flops = 4 * batch * tokens * tokens / 2 * heads * 128
        for stages in args.stages:
            for warps in args.warps:
                def run(stages: int = stages, warps: int = warps) -> None:
                    paged_prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, tokens,
                                            128**-0.5, out, num_stages=stages, num_warps=warps)

                try:
                    ms = graph_ms(run)
                except Exception as exc:  # out of shared memory etc.: record and move on
                    rows.append({"heads": heads, "kv_heads": kv_heads, "batch": batch, "tokens": tokens,
                                 "num_stages": stages, "num_warps": warps, "error": repr(exc)[:200]})
                    continue
                result = out.clone()
                first = result if first is None else first
                row = {"heads": heads, "kv_heads": kv_heads, "batch": batch, "tokens": tokens, "num_stages": stages,
                       "num_warps": warps, "us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12,
                       "equal_to_first": bool(torch.equal(result, first))}
                rows.append(row)
                print(f"heads {heads}/{kv_heads} batch {batch} x {tokens}: stages {stages} warps {warps} "
                      f"{row['us']:8.1f} us {row['tflops']:6.1f} TFLOP/s equal={row['equal_to_first']}", flush=True)
        del k_cache, v_cache, block_tables, seq_lens, q, out, first
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "benchmark": "paged_prefill_attention", "device": torch.cuda.get_device_name(device),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
        "timing": "CUDA-graph replay, L2 flushed before each call (GPU time)", "rows": rows,
    }, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
