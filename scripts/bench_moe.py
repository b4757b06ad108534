"""Fused MoE benchmark on CUDA: the Triton path (align + two grouped GEMMs) against a per-expert PyTorch loop, and
against the bytes of the experts each call's routing touches.

    python scripts/bench_moe.py --out out/moe.json [--shape qwen3-30b-a3b|mixtral-8x7b] [--tokens 1,8,64,...]
                                [--fp8] [--int 4,8] [--sweep]

Each fused time is GPU time from a CUDA graph of CALLS calls, each with its own routing (so the experts touched
change from call to call) over COPIES copies of one layer's expert stacks (> 4x L2 in all): every call streams its
experts from HBM, as a decode step does layer after layer. Bytes per call = distinct experts of its routing x one
expert's bytes (exact, counted on the host before capture); the fraction is bytes / time over a device-to-device
copy bandwidth measured in the same run (BENCHMARKS.md's roofline convention). The loop (one masked gather and
two matmuls per expert hit, as transformers runs it) cannot be captured (it sizes tensors from the routing), so it
is timed eagerly with events around each call. --sweep times a few tiles per token count (TANDEM_MOE_TILE format),
and on the pair path (the fewest tokens) its N tiles and both down projections (TANDEM_MOE_PAIR format). --int
times 4- / 8-bit experts (round to nearest, group 128; bytes: codes, scales and mins), whose --sweep compares the
pair path's three kernels (TANDEM_MOE_INT_PAIR gemv / mma / mma_gemv) and the tiles above on the sorted path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import copy_bandwidth_gbs, replay_ms  # noqa: E402

from tandem.kernels.moe_align import route_topk  # noqa: E402
from tandem.kernels.triton_moe import MoETile, fused_moe_triton, moe_tile, use_pair_path  # noqa: E402
from tandem.kernels.triton_moe_int import fused_moe_int_triton  # noqa: E402
from tandem.layers.int_quant import quantize_rtn_experts  # noqa: E402
from tandem.layers.quantization import quantize_weight_fp8  # noqa: E402

SHAPES = {  # (experts, top_k, hidden, expert intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen1.5-moe-a2.7b": (60, 4, 2048, 1408),
}
SWEEP = [MoETile(16, 64, 128, 4, 4), MoETile(16, 128, 128, 4, 3), MoETile(16, 64, 256, 4, 3),
         MoETile(16, 32, 128, 4, 4), MoETile(32, 64, 128, 4, 4), MoETile(64, 128, 64, 8, 3),
         MoETile(64, 128, 64, 4, 4), MoETile(128, 128, 64, 8, 3)]
PAIR_SWEEP = ["8", "16", "32", "64", "8,pairs", "16,pairs", "32,pairs", "64,pairs"]


def loop_moe(x, w13, w2, weights, ids):  # type: ignore[no-untyped-def]
    """transformers' per-expert loop: gather the tokens of each expert hit, two matmuls, index_add back."""
    out = torch.zeros_like(x)
    hit = torch.unique(ids)
    for e in hit.tolist():
        token, slot = torch.where(ids == e)
        h = x[token] @ w13[e].t()
        gate, up = h.chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].t()
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    return out


def expert_stacks(num_experts, hidden, inter, copies, fp8, device, bits=0):  # type: ignore[no-untyped-def]
    stacks = []
    for c in range(copies):
        gen = torch.Generator(device=device).manual_seed(c)
        w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(num_experts, hidden, inter, device=device, generator=gen, dtype=torch.bfloat16) * 0.02
        if fp8:
            q13, s13 = quantize_weight_fp8(w13.view(-1, hidden))
            q2, s2 = quantize_weight_fp8(w2.view(-1, inter))
            stacks.append((q13.view(w13.shape), q2.view(w2.shape), s13.view(num_experts, -1), s2.view(num_experts, -1)))
            del w13, w2
        elif bits:
            stacks.append((quantize_rtn_experts(w13, bits), quantize_rtn_experts(w2, bits), None, None))
            del w13, w2
        else:
            stacks.append((w13, w2, None, None))
    return stacks


def time_fused(stacks, xs, routings, tile):  # type: ignore[no-untyped-def]
    def calls():  # type: ignore[no-untyped-def]
        for i, (x, (weights, ids)) in enumerate(zip(xs, routings)):
            w13, w2, s13, s2 = stacks[i % len(stacks)]
            if s13 is None and not isinstance(w13, torch.Tensor):  # integer experts
                fused_moe_int_triton(x, w13, w2, weights, ids, tile=tile)
            else:
                fused_moe_triton(x, w13, w2, weights, ids, None, s13, s2, tile=tile)

    calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return replay_ms(graph) / len(xs)


def bench(shape: str, tokens: list[int], fp8: bool, sweep: bool, calls: int, bits: int = 0) -> dict:
    device = torch.device("cuda")
    num_experts, top_k, hidden, inter = SHAPES[shape]
    expert_bytes = 3 * hidden * inter * (1 if fp8 else 2)  # FP8 scales (fp32 per channel) are < 0.2% more
    if bits:  # codes, a bf16 scale and a min (bf16 at 4 bits, fp32 at 8) per group of 128
        expert_bytes = 3 * hidden * inter * (bits / 8 + (2 + (2 if bits == 4 else 4)) / 128)
    layer_bytes = num_experts * expert_bytes
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    copies = max(1, min(8, -(-4 * l2 // layer_bytes)))
    stacks = expert_stacks(num_experts, hidden, inter, copies, fp8, device, bits)
    bw = copy_bandwidth_gbs(device)
    rows = []
    for t in tokens:
        gen = torch.Generator(device=device).manual_seed(t)
        xs = [torch.randn(t, hidden, device=device, generator=gen, dtype=torch.bfloat16) for _ in range(calls)]
        routings = [route_topk(torch.randn(t, num_experts, device=device, generator=gen), top_k, True)
                    for _ in range(calls)]
        touched = sum(int(torch.unique(ids).numel()) for _, ids in routings) / calls
        moved = touched * expert_bytes + 2 * t * hidden * 2
        ms = time_fused(stacks, xs, routings, None)
        chosen = moe_tile(t, top_k, num_experts)
        row = {"tokens": t, "pair_path": use_pair_path(t, top_k, num_experts),
               "tile": [getattr(chosen, f) for f in MoETile.__slots__],
               "fused_us": ms * 1e3, "experts_touched": touched, "bytes_mb": moved / 1e6,
               "roofline_fraction": moved / (ms * 1e-3) / (bw * 1e9)}
        if not fp8 and not bits:
            w13, w2, _, _ = stacks[0]
            loop_times = []
            for x, (weights, ids) in zip(xs[:5], routings[:5]):
                loop_moe(x, w13, w2, weights, ids)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = loop_moe(x, w13, w2, weights, ids)
                end.record()
                end.synchronize()
                loop_times.append(start.elapsed_time(end))
                ref = fused_moe_triton(x, w13, w2, weights, ids)
                row["max_abs_err_vs_loop"] = max(row.get("max_abs_err_vs_loop", 0.0),
                                                 float((ref.float() - out.float()).abs().max()))
            row["loop_us"] = sorted(loop_times)[len(loop_times) // 2] * 1e3
            row["speedup_vs_loop"] = row["loop_us"] / row["fused_us"]
        if sweep and row["pair_path"] and bits:
            row["pair_sweep_us"] = {}
            for kernel in ("gemv", "mma", "mma_gemv"):
                os.environ["TANDEM_MOE_INT_PAIR"] = kernel
                try:
                    row["pair_sweep_us"][kernel] = time_fused(stacks, xs, routings, None) * 1e3
                finally:
                    del os.environ["TANDEM_MOE_INT_PAIR"]
        elif sweep and row["pair_path"]:
            row["pair_sweep_us"] = {}
            for spec in PAIR_SWEEP:
                os.environ["TANDEM_MOE_PAIR"] = spec
                try:
                    row["pair_sweep_us"][spec] = time_fused(stacks, xs, routings, None) * 1e3
                finally:
                    del os.environ["TANDEM_MOE_PAIR"]
        elif sweep:
            best = None
            for tile in SWEEP:
                try:
                    us = time_fused(stacks, xs, routings, tile) * 1e3
                except Exception as exc:  # a tile that does not fit shared memory
                    print(f"  tile {tile}: {type(exc).__name__}", flush=True)
                    continue
                if best is None or us < best[1]:
                    best = ([getattr(tile, f) for f in MoETile.__slots__], us)
            row["sweep_best"] = {"tile": best[0], "us": best[1]} if best else None
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"shape": shape, "fp8": fp8, "bits": bits or None, "copy_gbps": bw,
            "device": torch.cuda.get_device_name(device),
            "weight_copies": copies, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="1,8,64,256,1024,4096")
    p.add_argument("--fp8", action="store_true", help="also the FP8-expert kernel (per-channel scales)")
    p.add_argument("--int", default="", help="comma list of 4 / 8: also integer experts at those bit widths")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--calls", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    results = [bench(args.shape, tokens, False, args.sweep, args.calls)]
    if args.fp8:
        torch.cuda.empty_cache()
        results.append(bench(args.shape, tokens, True, args.sweep, args.calls))
    for bits in (int(b) for b in args.int.split(",") if b):
        torch.cuda.empty_cache()
        results.append(bench(args.shape, tokens, False, args.sweep, args.calls, bits))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
