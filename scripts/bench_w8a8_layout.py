"""How fast a small-M W8A8 GEMM can stream its FP8 weight, by how it loads the weight tiles (CUDA only).

    python scripts/bench_w8a8_layout.py --out out/w8a8_layout.json [--rows 32] [--models llama-3-8b]

The decode GEMMs of FP8 models stream their weight at ~27 GB/s an SM (about 0.84 of copy bandwidth on an
H200 with every SM busy: scripts/bench_fp8_waves.py), whatever the programs an SM. This asks whether the
way the tiles are fetched is what limits them. One probe kernel (the swap-AB W8A8 tile GEMM reduced to its
stream: e4m3 weight tile x e4m3 rows on the tensor cores, fp32 partial sums out) runs with its weight tiles
  - `rowmajor`: pointer loads from the [N, K] weight, as the engine's kernel does (cp.async, 64 rows of
    BLOCK_K bytes a tile),
  - `blocked`: pointer loads from a copy laid out tile by tile ([N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K]),
    so that every tile is one contiguous run of memory,
  - `tma`: a host-made tensor descriptor over the [N, K] weight (the Hopper tensor memory accelerator),
and beside them a plain read of the same bytes (`read`: each program xors a contiguous share, no MMA), the
engine's own kernel (`engine`: fp8_w8a8_matmul_quantized at its default tile), with --bf16 the engine's 16-bit
swap-AB GEMM on a bf16 copy (`engine_bf16`, twice the bytes), and with --persistent-per-sm a persistent
variant (`persistent`: a fixed grid of programs an SM, each a contiguous run of N tiles over all of K, with
and without Triton's flattened pipeline across the tiles). Every figure is GPU time per call from CUDA-graph
replays over enough weight copies to overflow L2 four times, and the fraction of a device-to-device copy's
bandwidth that streaming the weight bytes in that time reaches.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fp8_waves import fp8_copies  # noqa: E402
from bench_gemv import SHAPES, bf16_weight_copies, cuda_setup, graph_us, l2_bytes, write_rows  # noqa: E402

from tandem.kernels.triton_quant import fp8_w8a8_matmul_quantized, skinny_matmul_triton  # noqa: E402
from tandem.layers.quantization import quantize_activation_per_token  # noqa: E402

LAYOUTS = {"rowmajor": 0, "blocked": 1, "tma": 2}


@triton.jit
def _probe_kernel(x_ptr, xs_ptr, w_ptr, w_desc, s_ptr, ws_ptr, M, N, K, K_SPLIT,
                  LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program = BLOCK_N weight rows x all M rows over K range [pid_k * K_SPLIT, +K_SPLIT): fp32 sums times the
    # row and channel scales into ws[pid_k, m, n].
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None] * K + (k_begin + offs_k)[None, :]
    if LAYOUT == 1:
        tile0 = (pid_n * (K // BLOCK_K) + k_begin // BLOCK_K).to(tl.int64) * (BLOCK_N * BLOCK_K)
        w_ptrs = w_ptr + tile0 + tl.arange(0, BLOCK_N)[:, None] * BLOCK_K + offs_k[None, :]
        w_step = BLOCK_N * BLOCK_K
    else:
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + (k_begin + offs_k)[None, :]
        w_step = BLOCK_K
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        if LAYOUT == 2:
            w = w_desc.load([pid_n * BLOCK_N, k0])
        else:
            w = tl.load(w_ptrs)
        acc = tl.dot(w, tl.trans(x), acc)
        x_ptrs += BLOCK_K
        w_ptrs += w_step
    acc = acc * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
    acc = acc * tl.load(s_ptr + offs_n)[:, None]
    ws_ptrs = ws_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
    tl.store(ws_ptrs, acc, mask=m_mask[None, :])


@triton.jit
def _persistent_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K, K_TILES: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLATTEN: tl.constexpr,
                       STAGES: tl.constexpr):
    # Program = a contiguous run of N tiles (tiles * pid / programs ..), each over all of K, in one pipelined
    # loop nest (FLATTEN: the K loops of consecutive tiles pipelined as one, so no refill between tiles).
    # The rows are the MMA's M (padded to BLOCK_M), the weight tile its N: out[m, n] = sum_k x[m, k] w[n, k].
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles = N // BLOCK_N
    t_lo = pid * tiles // programs
    t_hi = (pid + 1) * tiles // programs
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    for t in tl.range(t_lo, t_hi, flatten=FLATTEN, num_stages=STAGES):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in tl.range(0, K_TILES, num_stages=STAGES):
            x = tl.load(x_ptr + offs_m[:, None] * K + (kk * BLOCK_K + offs_k)[None, :], mask=m_mask[:, None],
                        other=0.0)
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + (kk * BLOCK_K + offs_k)[None, :])
            acc = tl.dot(x, tl.trans(w), acc)
        acc = acc * xs[:, None] * tl.load(s_ptr + offs_n)[None, :]
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None])


@triton.jit
def _read_kernel(w_ptr, out_ptr, chunk, total, BLOCK: tl.constexpr):
    # Program = one contiguous share of `chunk` int32 words: their xor, so no load is elided.
    begin = tl.program_id(0).to(tl.int64) * chunk
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(0, chunk, BLOCK):
        idx = begin + start + offs
        acc = acc ^ tl.load(w_ptr + idx, mask=idx < total, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, axis=0))


def blocked_copy(w: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    n, k = w.shape
    return w.view(n // block_n, block_n, k // block_k, block_k).permute(0, 2, 1, 3).contiguous()


def probe_calls(layout: str, weights, xq, xs, tile: dict, ws: torch.Tensor) -> list:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = xq.shape
    bn, bk, split = tile["BLOCK_N"], tile["BLOCK_K"], tile["SPLIT_K"]
    calls = []
    for w, s in weights:
        n = w.shape[0]
        k_split = triton.cdiv(triton.cdiv(k, bk), split) * bk
        grid = (n // bn, triton.cdiv(k, k_split))
        src = blocked_copy(w, bn, bk) if layout == "blocked" else w
        desc = TensorDescriptor.from_tensor(w, [bn, bk]) if layout == "tma" else None

        def call(src=src, desc=desc, s=s, n=n, k_split=k_split, grid=grid):
            _probe_kernel[grid](xq, xs, src, desc, s, ws, m, n, k, k_split, LAYOUT=LAYOUTS[layout],
                                BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk,
                                num_warps=tile.get("num_warps", 4), num_stages=tile["num_stages"])
        calls.append(call)
    return calls


def persistent_calls(weights, xq, xs, tile: dict, out: torch.Tensor, programs: int) -> list:
    m, k = xq.shape
    calls = []
    for w, s in weights:
        n = w.shape[0]
        calls.append(lambda w=w, s=s, n=n: _persistent_kernel[(programs,)](
            xq, xs, w, s, out, m, n, k, K_TILES=k // tile["BLOCK_K"], BLOCK_M=64, BLOCK_N=tile["BLOCK_N"],
            BLOCK_K=tile["BLOCK_K"], FLATTEN=bool(tile["flatten"]), STAGES=tile["num_stages"],
            num_warps=tile.get("num_warps", 4)))
    return calls


def read_calls(weights, programs: int, out: torch.Tensor) -> list:
    calls = []
    for w, _ in weights:
        words = w.view(torch.int32).view(-1)
        chunk = triton.cdiv(triton.cdiv(words.numel(), programs), 1024) * 1024
        grid = (triton.cdiv(words.numel(), chunk),)
        calls.append(lambda words=words, chunk=chunk, grid=grid: _read_kernel[grid](
            words, out, chunk, words.numel(), BLOCK=1024, num_warps=4))
    return calls


def time_or_none(what: str, make_calls) -> float | None:
    """GPU us per call of the calls make_calls() returns; None (and a line saying why) for a configuration that
    does not compile (out of shared memory etc.)."""
    try:
        return graph_us(make_calls())
    except Exception as exc:  # noqa: BLE001
        print(f"{what}: {exc!r}"[:300], flush=True)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--models", default="llama-3-8b")
    parser.add_argument("--block-k", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 6])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--block-n", type=int, nargs="+", default=[64])
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--projs", default="", help="comma list of projections (default: all)")
    parser.add_argument("--bf16", action="store_true", help="also time the engine's bf16 swap-AB GEMM")
    parser.add_argument("--persistent-per-sm", type=int, nargs="*", default=[],
                        help="also time a persistent kernel with this many programs an SM (each a run of N tiles)")
    parser.add_argument("--read-per-sm", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    device, props, copy_gbs = cuda_setup()
    sms, l2 = props.multi_processor_count, l2_bytes(props)
    m = args.rows
    rows = []
    for model in args.models.split(","):
        for name, n, k, _gated in SHAPES[model]:
            if args.projs and name not in args.projs.split(","):
                continue
            weights = fp8_copies(n, k, l2, device)
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            xq, xs = quantize_activation_per_token(x)
            xs = xs.reshape(-1).contiguous()
            ws = torch.empty(max(args.splits) * m * n, dtype=torch.float32, device=device)

            def record(kind: str, us: float | None, weight_bytes: int = n * k, **cfg) -> None:
                if us is None:  # the configuration did not compile
                    return
                rows.append({"model": model, "proj": name, "n": n, "k": k, "rows": m, "kind": kind, **cfg,
                             "us": round(us, 2),
                             "copy_fraction": round(weight_bytes / (us * 1e-6) / 1e9 / copy_gbs, 4)})
                print(rows[-1], flush=True)

            xs2 = xs.view(-1, 1)
            record("engine", graph_us([lambda w=w, s=s: fp8_w8a8_matmul_quantized(xq, xs2, w, s, None, torch.bfloat16)
                                       for w, s in weights]))
            if args.bf16:  # the engine's 16-bit decode GEMM on the same shape (twice the bytes)
                w16 = bf16_weight_copies(n, k, l2, device)
                record("engine_bf16", graph_us([lambda w=w: skinny_matmul_triton(x, w, None) for w in w16]),
                       weight_bytes=2 * n * k)
                del w16
            out = torch.empty(max(args.read_per_sm) * sms, dtype=torch.int32, device=device)
            for per_sm in args.read_per_sm:
                record("read", graph_us(read_calls(weights, per_sm * sms, out)), programs=per_sm * sms)
            for layout, bn, bk, warps, stages, split in itertools.product(
                    args.layouts, args.block_n, args.block_k, args.warps, args.stages, args.splits):
                if k % bk or (k // bk) % split or n % bn:
                    continue
                tile = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "SPLIT_K": split}
                us = time_or_none(f"{name} {layout} {tile}", lambda: probe_calls(layout, weights, xq, xs, tile, ws))
                record(layout, us, programs=(n // bn) * split, **tile)
            out16 = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            for per_sm, bn, bk, stages, flatten in itertools.product(args.persistent_per_sm, args.block_n,
                                                                     args.block_k, args.stages, (0, 1)):
                if k % bk or n % bn:
                    continue
                tile = {"BLOCK_N": bn, "BLOCK_K": bk, "num_stages": stages, "flatten": flatten}
                us = time_or_none(f"{name} persistent {tile}",
                                  lambda: persistent_calls(weights, xq, xs, tile, out16, per_sm * sms))
                record("persistent", us, programs=per_sm * sms, **tile)
            del weights
            torch.cuda.empty_cache()
    if args.out:
        write_rows(args.out, props, copy_gbs, rows, rows_m=m)


if __name__ == "__main__":
    main()
