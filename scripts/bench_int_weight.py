"""W4A16 / W8A16 kernel benchmark on CUDA: the int-weight GEMV and tile GEMM against the bf16 torch matmul.

    python scripts/bench_int_weight.py --out out/int_weight.json [--bits 4,8] [--rows 1,4,16,4096] [--group 128]
        [--shapes qkv,o,gate_up,down] [--sweep]

For the Llama-3-8B projections (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096; the lm_head
stays bf16) at each row count it times `int_weight_matmul_triton` (the path `ops.int_weight_linear` picks for that
many rows), the bf16 `F.linear` (cuBLAS) on the same shape, up to 4 rows also the other decode path (GEMV or
tile GEMM: what use_int_gemv should pick), and at the prefill row count the dequantize-then-cuBLAS alternative.
Every time is GPU time from a CUDA graph that calls the kernel on enough copies of the weight
(>= 4x the L2 in all) that each call streams its weight from HBM, as a decode step does layer after layer. Bytes
are the packed codes + scales + mins (the zeros' role; bf16, fp32 mins at 8 bits), and for the bf16 matmul its
weight; the fraction of a device-to-
device copy bandwidth measured in the same run is the roofline figure (target at one row: >= 0.80), beside TFLOP/s.

At one row with 4-bit bf16 weights the path is the tensor-core GEMV (triton_int_gemv_mma; variant gemv_fp32: the fp32
CUDA-core GEMV it replaces, which TANDEM_INT_GEMV_MMA=0 selects). Its time includes adding a K split (in its own
last program); the variants deferred, reduce_kernel and split1 (K split shapes) and gated, gated_unfused (gate_up)
time it as the decode step runs each projection and against the kernels that saves (mma_variants). 2 to 8 rows
take it too where the groups are whole parts (variant gemm: the tile GEMM they ran before and that
TANDEM_INT_MMA_MAX_ROWS=1 selects), and 9 to 32 rows at 4 bits (fewer with TANDEM_INT_MMA_ROWS_MAX) the many-row
kernel (triton_int_mma_rows; variant gemm: the tile GEMM, which TANDEM_INT_MMA_ROWS_MAX=8 selects).

--sweep also times a grid of GEMV tiles (BLOCK_N, BLOCK_K, num_warps; for the tensor-core GEMV ROW_BLOCKS,
num_warps, SPLIT_K; for the many-row kernel ROW_BLOCKS, SPLIT_K, X_SPREAD) where the GEMV runs (1 row) and of GEMM tiles
at 4 and 16 rows and the prefill rows, and reports the best beside the default config (a grid takes minutes:
sweep one --rows value and --bits 4 at a time).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv import cuda_setup, graph_us, l2_bytes, projection_shapes, write_rows  # noqa: E402

from tandem.kernels.int_weight import repack_int_weight  # noqa: E402
from tandem.kernels.triton_int_gemv_mma import int_mma_gemv, mma_gemv_config, use_mma_gemv  # noqa: E402
from tandem.kernels.triton_int_mma_rows import int_mma_rows, mma_rows_config, use_mma_rows  # noqa: E402
from tandem.kernels.triton_int_weight import (  # noqa: E402
    dequant_min_rows,
    dequantize_int_weight_triton,
    int_gemm_config,
    int_gemv_config,
    int_weight_matmul_triton,
    swap_ab_config,
    use_int_gemv,
)

def int_weight_copies(n: int, k: int, bits: int, group: int, l2: int, device) -> list:
    """Enough random IntWeight copies (>= 2, >= 4x the L2 in all) that a graph calling a kernel on each in turn
    streams every one from HBM."""
    gen = torch.Generator(device=device).manual_seed(n + k + bits)
    nbytes = n * k * bits // 8 + 2 * 2 * n * (k // group)
    out = []
    for _ in range(max(2, -(-4 * l2 // nbytes))):
        qweight = torch.randint(0, 256, (n, k * bits // 8), generator=gen, device=device, dtype=torch.uint8)
        scales = (torch.rand(n, k // group, generator=gen, device=device) * 0.01).to(torch.bfloat16)
        zeros = torch.full((n, k // group), 2 ** (bits - 1), device=device, dtype=torch.bfloat16)
        out.append(repack_int_weight(qweight, scales, zeros, bits, group))
    return out


def bf16_copies(n: int, k: int, l2: int, device) -> list[torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(n + k)
    count = max(2, -(-4 * l2 // (n * k * 2)))
    return [(torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16) for _ in range(count)]


def gemv_grid() -> list[dict]:
    return [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
            for bn, bk, w in itertools.product((1, 2, 4, 8), (1024, 2048, 4096), (2, 4, 8))]


def mma_gemv_grid() -> list[dict]:
    return [{"ROW_BLOCKS": rb, "num_warps": w, "SPLIT_K": sk}
            for rb, w, sk in itertools.product((1, 2, 4), (4, 8), (1, 2, 4, 8))]


def mma_rows_grid() -> list[dict]:
    return [{"ROW_BLOCKS": rb, "num_warps": 4, "SPLIT_K": sk, "X_SPREAD": xs}
            for rb, sk, xs in itertools.product((1, 2, 4), (1, 2, 4, 8), (False, True))]


def gemm_grid(m: int) -> list[dict]:
    if m <= 64:  # the 64-row tile and the swap-AB one (16 rows: BLOCK_M 16)
        grid = [{"BLOCK_M": 64, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_stages": 3, "num_warps": w,
                 "SWAP_AB": False} for bn, bk, sk, w in itertools.product((128, 256), (128, 256), (2, 4, 8), (4, 8))]
        if m <= 16:
            grid += [{"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": bk, "SPLIT_K": sk, "num_stages": 3, "num_warps": 4,
                      "SWAP_AB": True, "GROUP_M": 1} for bk, sk in itertools.product((128, 256), (2, 4, 8))]
        return grid
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_stages": st, "num_warps": 8, "SPLIT_K": 1}
            for bm, bn, bk, st in itertools.product((128, 256), (128, 256), (32, 64), (3, 4))]


def sweep(x, weights, gemv: bool, grid: list[dict], frac, mma: bool = False, rows: bool = False) -> list[dict]:
    """Every tile of grid timed (GPU us per call) with its roofline fraction, fastest first; tiles that do not
    compile (shared memory, registers) are left out. mma: the grid is the tensor-core GEMV's; rows: the many-row
    kernel's."""
    table = []
    for cfg in grid:
        try:
            if rows:
                us = graph_us([lambda w=w, c=cfg: int_mma_rows(x, w, config=c) for w in weights], reps=2)
            elif mma:
                us = graph_us([lambda w=w, c=cfg: int_mma_gemv(x, w, config=c) for w in weights], reps=2)
            else:
                us = graph_us([lambda w=w, c=cfg: int_weight_matmul_triton(x, w, gemv=gemv, config=c)
                               for w in weights], reps=2)
        except Exception:  # noqa: BLE001  out of resources for this tile
            continue
        table.append({**cfg, "us": round(us, 2), "copy_fraction": round(frac(us), 4)})
    return sorted(table, key=lambda e: e["us"])


def mma_variants(name: str, n: int, k: int, bits: int, sms: int, group: int) -> dict[str, dict]:
    """The one-row tensor-core GEMV as the decode step runs each projection, beside the kernels it saves: o and down
    hand a K split to the add + RMSNorm (deferred: the GEMV alone), qkv adds its split in its last program (the
    default) where the reduce kernel did (TANDEM_INT_MMA_FOLD_REDUCE=0) or does not split (split1), and gate_up
    writes silu(gate) * up itself (gated) where the GEMV and silu_and_mul ran (gated_unfused)."""
    split = mma_gemv_config(n, k, bits, sms, group_size=group)["SPLIT_K"] > 1
    out: dict[str, dict] = {}
    if split:
        out.update(deferred=dict(defer=True), reduce_kernel=dict(env={"TANDEM_INT_MMA_FOLD_REDUCE": "0"}),
                   split1=dict(mma_config={"SPLIT_K": 1}))
    if name == "gate_up":
        out.update(gated=dict(gated=True), gated_unfused=dict(unfused=True))
    return out


def time_variant(x: torch.Tensor, weights: list, kw: dict) -> float:
    """GPU us a call of int_weight_matmul_triton with kw (env: variables set while the graph is captured; mma_config:
    the tensor-core GEMV with that config; unfused: the product then silu_and_mul_triton)."""
    from tandem.kernels.triton_fused import silu_and_mul_triton

    kw = dict(kw)
    env, mma_config, unfused = kw.pop("env", {}), kw.pop("mma_config", None), kw.pop("unfused", False)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        if mma_config is not None:
            return graph_us([lambda w=w: int_mma_gemv(x, w, config=mma_config) for w in weights])
        if unfused:
            return graph_us([lambda w=w: silu_and_mul_triton(int_weight_matmul_triton(x, w)) for w in weights])
        return graph_us([lambda w=w: int_weight_matmul_triton(x, w, **kw) for w in weights])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--bits", default="4,8")
    parser.add_argument("--rows", default="1,4,16,4096", help="row counts M (the largest is the prefill case)")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down", help="projections to time")
    parser.add_argument("--model", default="llama-3-8b", help="the named Llama-family shape whose projections to "
                                                               "time (llama-3-70b: the 70B shape's)")
    args = parser.parse_args()
    device, props, copy_gbs = cuda_setup()
    sms, l2 = props.multi_processor_count, l2_bytes(props)
    rows_m = [int(v) for v in args.rows.split(",")]
    prefill = max(rows_m)
    results = []
    for name, n, k, _ in (shape for shape in projection_shapes(args.model) if shape[0] in args.shapes.split(",")):
        dense = bf16_copies(n, k, l2, device)
        for bits in (int(b) for b in args.bits.split(",")):
            weights = int_weight_copies(n, k, bits, args.group, l2, device)
            w0 = weights[0]  # bytes a call streams: the codes, the scales and the mins (the zeros' role)
            nbytes = sum(t.numel() * t.element_size() for t in (w0.words, w0.scales, w0.mins))
            for m in rows_m:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                flops = 2 * m * n * k
                frac = lambda us, b=nbytes: b / (us * 1e-6) / 1e9 / copy_gbs  # noqa: E731
                us = graph_us([lambda w=w: int_weight_matmul_triton(x, w) for w in weights])
                bf16 = graph_us([lambda w=w: F.linear(x, w) for w in dense])
                gemv = use_int_gemv(m)
                mma = (gemv or m > 1) and use_mma_gemv(x, weights[0])  # TANDEM_INT_MMA_MAX_ROWS: up to 8 rows
                many = use_mma_rows(x, weights[0])  # 9 to 32 rows at 4 bits (TANDEM_INT_MMA_ROWS_MAX: fewer)
                make = int_gemv_config if gemv else int_gemm_config
                path = ("mma_rows" if many else "gemv_mma" if mma else "gemv" if gemv
                        else "dequant+cublas" if m >= dequant_min_rows() else "gemm")
                config = (mma_rows_config(n, k, sms) if many
                          else mma_gemv_config(n, k, bits, sms, group_size=args.group, m_rows=m) if mma
                          else make(m, n, k, bits, args.group, sms))
                row = {"model": args.model, "proj": name, "N": n, "K": k, "bits": bits, "group": args.group, "M": m,
                       "path": path, "config": config, "us": us,
                       "copy_fraction": frac(us), "tflops": flops / (us * 1e-6) / 1e12, "bf16_us": bf16,
                       "bf16_copy_fraction": n * k * 2 / (bf16 * 1e-6) / 1e9 / copy_gbs,
                       "bf16_tflops": flops / (bf16 * 1e-6) / 1e12, "speedup_vs_bf16": bf16 / us}
                # The decode paths the defaults did not pick, for use_int_gemv / TANDEM_INT_GEMV_MAX_ROWS and
                # int_gemm_config's 64-row tile against the swap-AB one.
                variants = {}
                if mma:  # the fp32 CUDA-core GEMV the tensor-core one replaces (a config selects it)
                    variants["gemv_fp32"] = dict(gemv=True, config=int_gemv_config(m, n, k, bits, args.group, sms))
                    if m == 1:
                        variants.update(mma_variants(name, n, k, bits, sms, args.group))
                    else:  # the tile GEMM these rows ran before
                        variants["gemm"] = dict(gemv=False)
                if many:  # the tile GEMM these rows ran before
                    variants["gemm"] = dict(gemv=False)
                if m <= 4 and not (mma and m > 1):
                    variants["gemm" if gemv else "gemv"] = dict(gemv=not gemv)
                if m <= 16:
                    variants["gemm_swap_ab"] = dict(gemv=False, config=swap_ab_config(n, k, bits, sms))
                row["variants"] = {}
                for label, kw in variants.items():
                    t = time_variant(x, weights, kw)
                    row["variants"][label] = {"us": t, "copy_fraction": frac(t)}
                if m == prefill and m > 64:
                    deq = graph_us([lambda w=w: F.linear(x, dequantize_int_weight_triton(w, x.dtype))
                                    for w in weights[:2]])
                    row["dequant_cublas_us"] = deq
                if args.sweep and (m in (1, 4) or m == 16 or m == prefill or many):
                    if many:
                        table = sweep(x, weights, gemv, mma_rows_grid(), frac, rows=True)
                    elif mma:
                        table = sweep(x, weights, gemv, mma_gemv_grid(), frac, mma=True)
                    else:
                        table = sweep(x, weights, gemv, gemv_grid() if gemv else gemm_grid(m), frac)
                    row["sweep"] = table[:12]
                    if table:
                        row["best"] = table[0]
                results.append(row)
                extra = f"  dequant+cuBLAS {row['dequant_cublas_us']:.1f} us" if "dequant_cublas_us" in row else ""
                for label, v in row["variants"].items():
                    extra += f"  {label} {v['us']:.1f} us ({v['copy_fraction']:.3f})"
                best = f"  best {row['best']}" if "best" in row else ""
                print(f"{name:<8} int{bits} M={m:<5} {row['path']}  {us:8.1f} us ({row['copy_fraction']:.3f} of copy, "
                      f"{row['tflops']:.1f} TFLOP/s)  bf16 {bf16:8.1f} us  x{bf16 / us:.2f}{extra}{best}", flush=True)
            del weights
            torch.cuda.empty_cache()
        del dense
        torch.cuda.empty_cache()
    if args.out:
        write_rows(args.out, props, copy_gbs, results, benchmark="int_weight_linear", date=time.strftime("%Y-%m-%d"),
                   torch=torch.__version__, sms=sms, l2_bytes=l2)


if __name__ == "__main__":
    main()
