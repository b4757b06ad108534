"""FP8 linear benchmark on CUDA: bf16 F.linear vs the FP8 paths of fp8_linear at decode and prefill sizes.

    python scripts/bench_fp8_linear.py --out out/fp8_linear.json [--sweep]

For the Llama-3-8B and Llama-2-7B projection shapes and several row counts M it times (inside CUDA graphs with the
L2 cache flushed before every call, as a decode step streams each layer's weights cold) bf16 `F.linear`, the Triton FP8-weight GEMM (`fp8_weight_matmul_triton`, used up to SMALL_M rows) and
the per-token-quantized `torch._scaled_mm` path (used above it, quantization kernel included), and reports each
as weight GB/s and as a fraction of a device-to-device copy bandwidth measured in the same run (BENCHMARKS.md's
roofline convention), plus the fp8 / bf16 speedup. Pick TANDEM_FP8_SMALL_M from where `triton` stops beating
`scaled_mm`. --sweep also times a grid of Triton tiles and split-K counts per shape at M in SWEEP_ROWS and reports
the best beside the default that `fp8_matmul_tile` picks (for tuning that heuristic).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import copy_bandwidth_gbs, graph_ms  # noqa: E402  (graph_ms: CUDA graphs, L2 flushed per call)

from tandem.kernels.triton_quant import fp8_matmul_tile, fp8_weight_matmul_triton  # noqa: E402
from tandem.layers.quantization import quantize_activation_per_token, quantize_weight_fp8  # noqa: E402

# (name, N, K) of the fused projections.
SHAPES = {
    "llama-3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
    "llama-2-7b": [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008)],
}
ROWS = [1, 8, 16, 32, 64, 128, 256]
SWEEP_ROWS = (1, 32)


def scaled_mm_path(x, q, scale):  # what fp8_linear runs above SMALL_M
    xq, xs = quantize_activation_per_token(x)
    return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M to time")
    parser.add_argument("--sweep-rows", default=",".join(map(str, SWEEP_ROWS)), help="row counts M to sweep")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbs:.0f} GB/s")
    rows_out = []
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            gen = torch.Generator(device=device).manual_seed(0)
            w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
            q, scale = quantize_weight_fp8(w)
            for m in [int(v) for v in args.rows.split(",")]:
                x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
                t = {
                    "bf16": graph_ms(lambda: F.linear(x, w)),
                    "triton": graph_ms(lambda: fp8_weight_matmul_triton(x, q, scale, None)),
                    "scaled_mm": graph_ms(lambda: scaled_mm_path(x, q, scale)),
                }
                row = {"model": model, "proj": name, "N": n, "K": k, "M": m, "ms": t,
                       "copy_fraction": {
                           "bf16": 2 * n * k / (t["bf16"] * 1e-3) / 1e9 / copy_gbs,
                           "triton": n * k / (t["triton"] * 1e-3) / 1e9 / copy_gbs,
                           "scaled_mm": n * k / (t["scaled_mm"] * 1e-3) / 1e9 / copy_gbs},
                       "speedup_vs_bf16": {p: t["bf16"] / t[p] for p in ("triton", "scaled_mm")}}
                if args.sweep and str(m) in args.sweep_rows.split(","):
                    best, table = None, []
                    for bn, warps, stages, split in itertools.product((32, 64, 128), (4, 8), (3, 4), (1, 2, 4, 8)):
                        tile = {"BLOCK_N": bn, "BLOCK_K": 256 if k % 256 == 0 else 128, "num_warps": warps,
                                "num_stages": stages, "SPLIT_K": split}
                        try:
                            ms = graph_ms(lambda: fp8_weight_matmul_triton(x, q, scale, None, tile), reps=10)
                        except Exception:  # out of shared memory / registers for this tile
                            continue
                        table.append({"us": round(ms * 1e3, 2), **tile})
                        if best is None or ms < best[0]:
                            best = (ms, tile)
                    row["sweep"] = sorted(table, key=lambda e: e["us"])
                    if best is not None:
                        row["best_triton_tile"] = {"ms": best[0], **best[1],
                                                   "copy_fraction": n * k / (best[0] * 1e-3) / 1e9 / copy_gbs}
                row["default_tile"] = fp8_matmul_tile(m, n, k, torch.cuda.get_device_properties(device).multi_processor_count)
                rows_out.append(row)
                print(f"{model:<11} {name:<8} M={m:<4} bf16 {t['bf16'] * 1e3:8.1f} us  "
                      f"triton {t['triton'] * 1e3:8.1f} us ({row['speedup_vs_bf16']['triton']:.2f}x)  "
                      f"scaled_mm {t['scaled_mm'] * 1e3:8.1f} us ({row['speedup_vs_bf16']['scaled_mm']:.2f}x)"
                      + (f"  best tile {row['best_triton_tile']}" if "best_triton_tile" in row else ""), flush=True)
            del w, q, scale
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "rows": rows_out}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
