"""Prefill attention benchmark on CUDA: the paged causal kernel over (num_stages, num_warps) configurations.

    python scripts/bench_prefill.py --out out/bench_prefill.json [--stages 3 5] [--warps 4 8]
        [--block-m 128] [--block-n 64 128] [--sdpa]

For each layout (heads / kv heads) and (batch, tokens) every sequence prefills its whole context (a paged cache
with shuffled blocks, block size 16 unless --block-size, head_dim 128, bf16), timed inside a CUDA graph with
the L2 flushed before each call (GPU time, as scripts/bench_kernels.py). It reports microseconds and the
attention TFLOP/s (causal: half of 4 x tokens^2 x heads x head_dim per sequence), and whether each
configuration's output equals the first configuration's bit for bit (num_stages changes the pipelining, never
the arithmetic; the tile sizes change the order of the online softmax, so other tiles match to rounding only).
--sdpa adds torch's scaled_dot_product_attention on the same q and contiguous K/V (GQA through enable_gqa),
causal, with whichever backend torch picks, as the reference to beat.
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


def sdpa_row(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
             heads: int, kv_heads: int, batch: int, tokens: int, flops: float) -> dict:
    """torch SDPA (causal, GQA) on the same queries and the cache's K/V gathered into contiguous [B, H, T, D]."""
    import torch.nn.functional as F

    def contiguous(cache: torch.Tensor) -> torch.Tensor:  # [blocks, 16, kv_heads, D] -> [B, kv_heads, T, D]
        pages = cache[block_tables.long()]  # [B, blocks, block_size, kv_heads, D]
        return pages.reshape(batch, -1, kv_heads, 128)[:, :tokens].transpose(1, 2).contiguous()

    k, v = contiguous(k_cache), contiguous(v_cache)
    qc = q.view(batch, tokens, heads, 128).transpose(1, 2).contiguous()
    ms = graph_ms(lambda: F.scaled_dot_product_attention(qc, k, v, is_causal=True, enable_gqa=True))
    row = {"heads": heads, "kv_heads": kv_heads, "batch": batch, "tokens": tokens, "kernel": "sdpa",
           "us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12}
    print(f"heads {heads}/{kv_heads} batch {batch} x {tokens}: torch sdpa {row['us']:8.1f} us "
          f"{row['tflops']:6.1f} TFLOP/s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON results")
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4, 5, 6])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--block-m", type=int, nargs="+", default=[0], help="0: the kernel's default")
    parser.add_argument("--block-n", type=int, nargs="+", default=[0], help="0: the kernel's default")
    parser.add_argument("--sdpa", action="store_true", help="also time torch SDPA on contiguous K/V")
    parser.add_argument("--block-size", type=int, default=16, help="cache positions per block (page)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_prefill.py needs a CUDA GPU")
    device = torch.device("cuda")
    rows = []
    for heads, kv_heads, batch, tokens in SHAPES:
        _, k_cache, v_cache, block_tables, seq_lens = make_inputs(batch, tokens, heads, kv_heads, 128, args.block_size,
                                                                  torch.bfloat16, device)
        q = torch.randn(batch * tokens, heads, 128, device=device, dtype=torch.bfloat16)
        query_start_loc = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * tokens
        out = torch.zeros_like(q)
        first = None
        flops = 4 * batch * tokens * tokens / 2 * heads * 128
        if args.sdpa:
            rows.append(sdpa_row(q, k_cache, v_cache, block_tables, heads, kv_heads, batch, tokens, flops))
        configs = [(m, n, stages, warps) for m in args.block_m for n in args.block_n for stages in args.stages
                   for warps in args.warps]
        for block_m, block_n, stages, warps in configs:
            def run(block_m: int = block_m, block_n: int = block_n, stages: int = stages, warps: int = warps) -> None:
                paged_prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, tokens,
                                        128**-0.5, out, num_stages=stages, num_warps=warps, block_m=block_m or None,
                                        block_n=block_n or None)

            config = {"heads": heads, "kv_heads": kv_heads, "batch": batch, "tokens": tokens, "block_m": block_m,
                      "block_n": block_n, "num_stages": stages, "num_warps": warps}
            try:
                ms = graph_ms(run)
            except Exception as exc:  # out of shared memory etc.: record and move on
                rows.append({**config, "error": repr(exc)[:200]})
                continue
            result = out.clone()
            first = result if first is None else first
            row = {**config, "us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12,
                   "equal_to_first": bool(torch.equal(result, first)),
                   "max_abs_diff_to_first": (result.float() - first.float()).abs().max().item()}
            rows.append(row)
            print(f"heads {heads}/{kv_heads} batch {batch} x {tokens}: block {block_m}x{block_n} stages {stages} "
                  f"warps {warps} {row['us']:8.1f} us {row['tflops']:6.1f} TFLOP/s equal={row['equal_to_first']}",
                  flush=True)
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
