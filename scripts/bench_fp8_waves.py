"""How the W8A8 swap-AB GEMM's weight bandwidth depends on how evenly its programs cover the SMs (CUDA only).

    python scripts/bench_fp8_waves.py --out out/fp8_waves.json [--rows 32]

At decode sizes every program of the GEMM streams the same number of weight bytes, so a grid whose program
count is not a multiple of the SMs leaves some SMs with one program more than others. This times the GEMM on
rows quantized beforehand (as the engine runs it) over output widths N that give different program counts
around the Llama-3-8B projections (qkv 6,144 and gate_up 28,672 rows at K = 4,096), and reports weight GB/s and
the fraction of a device-to-device copy: if the fraction peaks where programs divide evenly over the SMs, the
grid's shape (not the per-program stream) limits these GEMMs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv import cuda_setup, graph_us, l2_bytes, make_weights, write_rows  # noqa: E402

from tandem.kernels.triton_quant import fp8_w8a8_gated, fp8_w8a8_matmul_quantized, w8a8_tile  # noqa: E402
from tandem.layers.quantization import quantize_activation_per_token  # noqa: E402


def fp8_copies(n: int, k: int, l2: int, device) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Enough FP8 weight copies [n, k] (with channel scales) to overflow L2 four times."""
    return make_weights(n, k, "fp8", max(2, -(-4 * l2 // (n * k))), device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--k", type=int, default=4096)
    args = parser.parse_args()
    device, props, copy_gbs = cuda_setup()
    sms, l2 = props.multi_processor_count, l2_bytes(props)
    m, k = args.rows, args.k
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    xq, xs = quantize_activation_per_token(x)
    rows = []
    # Plain GEMM: 64 weight rows a program, unsplit where N gives >= 2/3 of the SMs a tile.
    for programs in (64, 96, 110, 120, 128, 132, 144, 176, 198, 264):
        n = programs * 64
        tile = w8a8_tile(m, n, k, sms)
        weights = fp8_copies(n, k, l2, device)
        us = graph_us([lambda w=w, s=s: fp8_w8a8_matmul_quantized(xq, xs, w, s, None, torch.bfloat16)
                       for w, s in weights])
        rows.append(_row("plain", n, k, tile, us, copy_gbs, sms))
        print(rows[-1], flush=True)
    # Gated gate/up GEMM: 32 outputs (64 weight rows) a program.
    for programs in (264, 330, 396, 420, 448, 480, 528, 560):
        n = programs * 64
        tile = w8a8_tile(m, n, k, sms)
        weights = fp8_copies(n, k, l2, device)
        us = graph_us([lambda w=w, s=s: fp8_w8a8_gated(xq, xs, w, s, torch.bfloat16, quantize=False)
                       for w, s in weights])
        rows.append(_row("gated", n, k, tile, us, copy_gbs, sms))
        print(rows[-1], flush=True)
    if args.out:
        write_rows(args.out, props, copy_gbs, rows, benchmark="fp8_waves", m=m)


def _row(kind: str, n: int, k: int, tile: dict, us: float, copy_gbs: float, sms: int) -> dict:
    gbs = n * k / (us * 1e-6) / 1e9
    programs = -(-n // tile["BLOCK_N"]) * tile["SPLIT_K"]
    return {"kind": kind, "n": n, "k": k, "programs": programs, "programs_per_sm": round(programs / sms, 3),
            "tile": tile, "us": round(us, 2), "weight_gbs": round(gbs, 1), "copy_fraction": round(gbs / copy_gbs, 4)}


if __name__ == "__main__":
    main()
