"""FP8 linear benchmark on CUDA: bf16 F.linear vs the FP8 paths of fp8_linear at decode and prefill sizes.

    python scripts/bench_fp8_linear.py --out out/fp8_linear.json [--sweep]

For the Llama-3-8B and Llama-2-7B projection shapes and several row counts M it times bf16 `F.linear`, the FP8
GEMV (`gemv`, up to 4 rows), the Triton FP8-weight GEMM (`triton`: x not quantized), the W8A8 swap-AB GEMM
(`w8a8`: x quantized per token by the quantization kernel, then both operands on the FP8 tensor cores; `w8a8_gemm`:
the GEMM alone on rows quantized beforehand, as the engine runs it after an RMSNorm or SiLU-and-mul kernel that
writes quantized rows; `quant`: the quantization kernel alone, its fraction counting the bf16 read and the e4m3
write) and the per-token-quantized `torch._scaled_mm` path, and reports each as weight GB/s and as a fraction of a
device-to-device copy bandwidth measured in the same run (the roofline convention of docs/benchmarks.md), plus the fp8 /
bf16 speedup. Times are GPU times from CUDA graphs that call each path on enough weight copies (>= 4x L2) that
every call streams its weight from HBM, as a decode step does (bench_gemv.graph_us). --sweep also times a grid
of tiles and split-K counts of the W8A8 GEMM (on pre-quantized rows) per shape at M in SWEEP_ROWS and reports the
best beside the default
that `w8a8_tile` picks (for tuning that heuristic).
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

from bench_gemv import (  # noqa: E402  (graph_us: CUDA graphs over weight copies that overflow L2)
    bf16_weight_copies,
    cuda_setup,
    graph_us,
    l2_bytes,
    projection_shapes,
    sweep_tiles,
    write_rows,
)

from tandem.kernels.triton_gemv import gemv_triton  # noqa: E402
from tandem.kernels.triton_quant import (  # noqa: E402
    fp8_matmul_tile,
    fp8_w8a8_matmul_quantized,
    fp8_w8a8_matmul_triton,
    fp8_weight_matmul_triton,
    quantize_per_token_triton,
    w8a8_tile,
)
from tandem.layers.quantization import quantize_activation_per_token, quantize_weight_fp8  # noqa: E402
from tandem.models.loader import NAMED_SHAPES  # noqa: E402

# (name, N, K) of the fused projections; Llama-3-8B's lm_head too (FP8 only with --quantize-lm-head).
SHAPES = {model: [(name, n, k) for name, n, k, _ in projection_shapes(model)] for model in ("llama-3-8b", "llama-2-7b")}
SHAPES["llama-3-8b"].append(("lm_head", NAMED_SHAPES["llama-3-8b"]["vocab_size"],
                             NAMED_SHAPES["llama-3-8b"]["hidden_size"]))
ROWS = [1, 8, 16, 32, 64, 128]
SWEEP_ROWS = (16, 32)
PATHS = ("bf16", "gemv", "triton", "w8a8", "w8a8_gemm", "quant", "scaled_mm")


def scaled_mm_path(x, q, scale):  # what fp8_linear runs above W8A8_MAX_M
    xq, xs = quantize_activation_per_token(x)
    return torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=x.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts M to time")
    parser.add_argument("--projs", default=None, help="comma list of projection names to time (default: all)")
    parser.add_argument("--sweep-rows", default=",".join(map(str, SWEEP_ROWS)), help="row counts M to sweep")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {PATHS} (bf16 always runs)")
    args = parser.parse_args()
    device, props, copy_gbs = cuda_setup()
    sms, l2 = props.multi_processor_count, l2_bytes(props)
    sweep_rows = [int(v) for v in args.sweep_rows.split(",")]
    paths = ["bf16"] + [p for p in args.paths.split(",") if p and p != "bf16"]
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise SystemExit(f"unknown paths {unknown}; known: {PATHS}")
    rows_out = []
    for model in args.models.split(","):
        for name, n, k in SHAPES[model]:
            if args.projs and name not in args.projs.split(","):
                continue
            gen = torch.Generator(device=device).manual_seed(1)
            bf16 = bf16_weight_copies(n, k, l2, device)  # overflows L2 (the FP8 copies: half as many bytes)
            fp8 = [quantize_weight_fp8(w) for w in bf16]
            for m in [int(v) for v in args.rows.split(",")]:
                x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
                xq = quantize_per_token_triton(x)
                calls = {
                    "bf16": [lambda w=w: F.linear(x, w) for w in bf16],
                    "gemv": [lambda q=q, s=s: gemv_triton(x, q, s) for q, s in fp8],
                    "triton": [lambda q=q, s=s: fp8_weight_matmul_triton(x, q, s, None) for q, s in fp8],
                    "w8a8": [lambda q=q, s=s: fp8_w8a8_matmul_triton(x, q, s, None) for q, s in fp8],
                    # The GEMM alone on rows quantized beforehand: what a producer kernel that writes e4m3
                    # rows and their scales would leave to it; "quant" is the quantization kernel alone.
                    "w8a8_gemm": [lambda q=q, s=s: fp8_w8a8_matmul_quantized(*xq, q, s, None, x.dtype) for q, s in fp8],
                    "quant": [lambda: quantize_per_token_triton(x)],
                    "scaled_mm": [lambda q=q, s=s: scaled_mm_path(x, q, s) for q, s in fp8],
                }
                t = {}
                for p in paths:
                    if p == "gemv" and m > 4:
                        continue
                    try:
                        t[p] = graph_us(calls[p])
                    except Exception as e:  # noqa: BLE001  a variant that does not compile here
                        print(f"  {p} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                frac = {p: (2 if p == "bf16" else 1) * n * k / (t[p] * 1e-6) / 1e9 / copy_gbs for p in t}
                frac["quant"] = m * k * 3 / (t["quant"] * 1e-6) / 1e9 / copy_gbs if "quant" in t else None
                row = {"model": model, "proj": name, "N": n, "K": k, "M": m, "us": t, "copy_fraction": frac,
                       "speedup_vs_bf16": {p: t["bf16"] / t[p] for p in t if p not in ("bf16", "quant")},
                       "default_tile": {"triton": fp8_matmul_tile(m, n, k, sms), "w8a8": w8a8_tile(m, n, k, sms)}}
                if args.sweep and m in sweep_rows:
                    # The engine's W8A8 path: rows quantized by their producer.
                    def calls(tile, x=x, xq=xq, fp8=fp8):
                        return [lambda q=q, s=s: fp8_w8a8_matmul_quantized(*xq, q, s, None, x.dtype, tile)
                                for q, s in fp8]

                    row["sweep"] = {"w8a8": sweep_tiles(calls, n * k, copy_gbs, itertools.product(
                        (64, 128), (128, 256), (4,), (3, 4), (1, 2, 4, 8)))}
                    row["best_tile"] = {p: v[0] for p, v in row["sweep"].items() if v}
                rows_out.append(row)
                best = "  best " + json.dumps(row["best_tile"]) if "best_tile" in row else ""
                print(f"{model:<11} {name:<8} M={m:<4} " + "  ".join(
                    f"{p} {t[p]:7.1f} us ({frac[p]:.2f})" for p in t) + best, flush=True)
            del bf16, fp8
            torch.cuda.empty_cache()
    if args.out:
        write_rows(args.out, props, copy_gbs, rows_out)

if __name__ == "__main__":
    main()
