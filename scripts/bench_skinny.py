"""Small-M GEMM benchmark on CUDA with 16-bit weights: cuBLAS (F.linear) against the Triton swap-AB GEMM.

    python scripts/bench_skinny.py --out out/skinny.json [--sweep] [--rows 8,16,32,64] [--sweep-rows 16,32]

For the Llama-3-8B projection shapes at decode batch sizes it times bf16 `F.linear` and `skinny_matmul_triton`
(the tile `skinny_tile` picks), and with --sweep a grid of tiles and split-K counts, reporting each as a
fraction of a device-to-device copy bandwidth measured in the same run (the roofline convention of docs/benchmarks.md).
Times are GPU times from CUDA graphs over enough weight copies (>= 4x L2) that each call streams its weight
from HBM, as a decode step does (bench_gemv.graph_us). Both paths are timed with the launch mode the engine
uses (the Triton GEMM with programmatic dependent launch on Hopper; cuBLAS as torch launches it).
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

from bench_gemv import (  # noqa: E402
    bf16_weight_copies,
    cuda_setup,
    graph_us,
    l2_bytes,
    projection_shapes,
    sweep_tiles,
    write_rows,
)

from tandem.kernels.triton_quant import skinny_matmul_triton, skinny_tile  # noqa: E402

SHAPES = {model: [(name, n, k) for name, n, k, _ in projection_shapes(model)]
          for model in ("llama-3-8b", "llama-2-7b", "qwen3-0.6b", "llama-3.2-1b")}
GRID = list(itertools.product((64, 128), (64, 128), (4,), (3, 4), (1, 2, 4, 8)))
# Past 64 rows (--sweep-rows 128,256): BLOCK_M (the MMA's N) of 64-256 rows a program as well.
WIDE_GRID = [(bm, bn, bk, warps, stages, split)
             for bm, bn, bk, warps in ((64, 64, 128, 4), (128, 64, 64, 4), (128, 64, 128, 4), (128, 128, 64, 8),
                                       (256, 64, 64, 4), (256, 128, 64, 8))
             for stages in (3, 4) for split in (1, 2, 4)]


def sweep_wide(x: torch.Tensor, weights: list[torch.Tensor], weight_bytes: int, copy_gbs: float) -> list[dict]:
    """WIDE_GRID's tiles at x's row count, fastest first (tiles that do not compile left out)."""
    table = []
    for bm, bn, bk, warps, stages, split in WIDE_GRID:
        tile = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages,
                "SPLIT_K": split}
        try:
            us = graph_us([lambda w=w: skinny_matmul_triton(x, w, None, tile) for w in weights], reps=2)
        except Exception:  # noqa: BLE001  out of shared memory / registers for this tile
            continue
        table.append({"us": round(us, 2), "copy_fraction": round(weight_bytes / (us * 1e-6) / 1e9 / copy_gbs, 4),
                      **tile})
    return sorted(table, key=lambda e: e["us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--models", default="llama-3-8b")
    parser.add_argument("--rows", default="8,16,32,64", help="row counts M to time")
    parser.add_argument("--sweep-rows", default="32", help="row counts M to sweep tiles at")
    args = parser.parse_args()
    device, props, copy_gbs = cuda_setup()
    sms, l2 = props.multi_processor_count, l2_bytes(props)
    sweep_rows = [int(v) for v in args.sweep_rows.split(",")]
    rows_out = []
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            weights = bf16_weight_copies(n, k, l2, device)
            for m in [int(v) for v in args.rows.split(",")]:
                x = torch.randn(m, k, device=device).to(torch.bfloat16)
                t = {"cublas": graph_us([lambda w=w: F.linear(x, w) for w in weights]),
                     "triton": graph_us([lambda w=w: skinny_matmul_triton(x, w, None) for w in weights])}
                frac = {p: 2 * n * k / (us * 1e-6) / 1e9 / copy_gbs for p, us in t.items()}
                row = {"model": model, "proj": name, "N": n, "K": k, "M": m, "us": t, "copy_fraction": frac,
                       "speedup": t["cublas"] / t["triton"], "default_tile": skinny_tile(m, n, k, sms)}
                if args.sweep and m in sweep_rows and m > 64:
                    row["sweep"] = sweep_wide(x, weights, 2 * n * k, copy_gbs)[:12]
                elif args.sweep and m in sweep_rows:
                    def calls(tile, x=x, weights=weights):
                        return [lambda w=w: skinny_matmul_triton(x, w, None, tile) for w in weights]

                    row["sweep"] = sweep_tiles(calls, 2 * n * k, copy_gbs, GRID)[:12]
                rows_out.append(row)
                best = f"  best {json.dumps(row['sweep'][0])}" if row.get("sweep") else ""
                print(f"{model:<11} {name:<8} M={m:<3} cublas {t['cublas']:7.1f} us ({frac['cublas']:.2f})  "
                      f"triton {t['triton']:7.1f} us ({frac['triton']:.2f})  {row['speedup']:.2f}x{best}", flush=True)
            del weights
            torch.cuda.empty_cache()
    if args.out:
        write_rows(args.out, props, copy_gbs, rows_out)

if __name__ == "__main__":
    main()
