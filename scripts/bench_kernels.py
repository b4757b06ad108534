"""Decode attention benchmark on CUDA: paged Triton kernel vs torch SDPA on contiguous KV, against copy bandwidth.

    python scripts/bench_kernels.py --out out/bench_kernels.json [--sweep] [--graph-max-len 4096]

For every (batch, seq_len) it times `paged_decode_attention` as the engine runs it, inside a CUDA graph
(GPU time only: at small shapes a Python-launched Triton kernel is bound by its ~20 us launch, which a
decode graph never pays), with the L2 cache flushed before every call; the peer is torch SDPA (enable_gqa)
on a contiguous KV of the same contents, timed the same way. The eager (triton.testing.do_bench) times are
kept beside them (`*_eager_ms`). It counts the bytes the step must read/write (all K/V of every context +
q + out) and reports GB/s and the fraction of a device-to-device copy bandwidth measured in the same run
(read + write bytes, the roofline convention of docs/benchmarks.md).

--sweep also times a grid of (block_n, num_warps, num_stages, num_splits) per shape, keeps the whole table
in the JSON (`sweep`), prints the best config per shape, and a summary of the best split count per
(batch x kv heads, KV tiles), from which choose_num_splits' constants are picked. --graph-max-len N sizes
the default split count from N instead of the true context, as the engine's decode graphs do (they are
captured for max_model_len).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.kernels.fp8 import FP8_DTYPE  # noqa: E402
from tandem.kernels.reference import to_cache_dtype  # noqa: E402
from tandem.kernels.triton_attention import (  # noqa: E402
    choose_num_splits,
    decode_block_n,
    decode_workspace_numel,
    paged_decode_attention,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def median_ms(fn, rep: int = 200) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def graph_ms(fn, reps: int = 20, flush_bytes: int = 256 << 20) -> float:
    """GPU milliseconds per call of fn, from CUDA-graph replays of [L2 flush, fn] x reps minus [L2 flush] x reps."""
    flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile / autotune / allocate outside the capture
            fn()
    torch.cuda.synchronize()

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                flush.zero_()
                if with_fn:
                    fn()
        return graph

    both, only_flush = capture(True), capture(False)
    ms = (replay_ms(both) - replay_ms(only_flush)) / reps
    del both, only_flush, flush
    return max(ms, 1e-6)


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 7) -> float:
    """Median GPU milliseconds of one replay of a captured graph (CUDA events around each replay)."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy of a 2 GiB buffer, counting read + write bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def make_inputs(batch, seq_len, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0, layout="nhd"):
    """A paged cache with shuffled blocks (block 0 reserved), its block tables, seq_lens and one query per row.
    layout "hnd" stores each block head-major (a kv head's positions of a block contiguous) behind the same
    [num_blocks, block_size, num_kv_heads, head_dim] view."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = 1 + batch * blocks_per_seq
    if layout == "hnd":
        kv = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, generator=gen, device=device,
                         dtype=dtype).transpose(2, 3)
    else:
        kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen, device=device,
                         dtype=dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    return q, kv[0], kv[1], block_tables, seq_lens


def contiguous_kv(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[batch, num_kv_heads, seq_len, head_dim] copy of each sequence's context, for the SDPA peer."""
    batch = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = cache[block_tables.long()]  # [batch, blocks, block_size, kv_heads, dim]
    gathered = gathered.reshape(batch, -1, num_kv_heads, head_dim)[:, :seq_len]
    return gathered.transpose(1, 2).contiguous()


def sdpa_decode(q, keys, values, scale):
    """torch SDPA for one query token per sequence; GQA through enable_gqa (no KV expansion)."""
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True).squeeze(2)


def bench_shape(args, batch, seq_len, copy_gbs, device) -> dict:
    dtype = DTYPES[args.dtype]
    q, k_cache, v_cache, block_tables, seq_lens = make_inputs(
        batch, seq_len, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, dtype, device,
        layout=args.layout)
    if args.kv_cache_dtype == "fp8":  # the same values in an e4m3 cache (SDPA reads them widened to q's dtype)
        k_cache, v_cache = to_cache_dtype(k_cache, FP8_DTYPE), to_cache_dtype(v_cache, FP8_DTYPE)
    elem = k_cache.dtype.itemsize
    scale = 1.0 / math.sqrt(args.head_dim)
    kv_bytes = 2 * batch * seq_len * args.num_kv_heads * args.head_dim * elem
    io_bytes = 2 * q.numel() * dtype.itemsize + block_tables.numel() * 4 + seq_lens.numel() * 4
    total_bytes = kv_bytes + io_bytes
    out = torch.empty_like(q)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    block_n = decode_block_n(args.head_dim, k_cache.dtype, batch * args.num_kv_heads, num_sms)
    splits = choose_num_splits(batch, args.num_kv_heads, args.graph_max_len or seq_len, block_n, num_sms)

    def run_tandem(num_splits=splits, graph=True, **cfg):
        workspace = torch.empty(decode_workspace_numel(batch, args.num_heads, args.head_dim, num_splits),
                                dtype=torch.float32, device=device)
        fn = lambda: paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out,  # noqa: E731
                                            num_splits=num_splits, workspace=workspace, **cfg)
        return graph_ms(fn) if graph else median_ms(fn)

    ms = run_tandem(num_stages=args.num_stages)
    row = {
        "batch": batch, "seq_len": seq_len, "num_splits": splits, "block_n": block_n,
        "kv_bytes": kv_bytes, "bytes": total_bytes,
        "tandem_ms": ms, "tandem_gbs": total_bytes / (ms * 1e-3) / 1e9,
        "tandem_eager_ms": run_tandem(graph=False, num_stages=args.num_stages),
    }
    row["tandem_copy_fraction"] = row["tandem_gbs"] / copy_gbs
    if args.fp8_out:  # the output quantized for an FP8 o_proj (one group per sequence and kv head)
        fp8 = torch.empty(out.shape, dtype=torch.float8_e4m3fn, device=device)
        out_scale = torch.empty(batch, args.num_kv_heads, dtype=torch.float32, device=device)
        row["tandem_fp8_out_ms"] = graph_ms(lambda: paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, out=fp8, out_scale=out_scale, num_splits=splits,
            num_stages=args.num_stages))

    keys = contiguous_kv(k_cache, block_tables, seq_len).to(dtype)
    values = contiguous_kv(v_cache, block_tables, seq_len).to(dtype)
    try:
        ref = sdpa_decode(q, keys, values, scale)
        row["max_abs_diff_vs_sdpa"] = (out.float() - ref.float()).abs().max().item()
        row["rel_err_vs_sdpa"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        sdpa_ms = graph_ms(lambda: sdpa_decode(q, keys, values, scale))
        row["sdpa_eager_ms"] = median_ms(lambda: sdpa_decode(q, keys, values, scale))
        row.update({"sdpa_ms": sdpa_ms, "sdpa_gbs": total_bytes / (sdpa_ms * 1e-3) / 1e9,
                    "speedup_vs_sdpa": sdpa_ms / ms})
        row["sdpa_copy_fraction"] = row["sdpa_gbs"] / copy_gbs
    except RuntimeError as exc:  # e.g. out of memory in a math fallback: keep tandem's figures
        row["sdpa_error"] = repr(exc)[:300]
    del keys, values

    if args.sweep:
        best, table = None, []
        num_tiles = -(-seq_len // block_n)
        split_options = sorted({1, splits} | {n for n in args.sweep_splits if n <= 2 * num_tiles})
        for bn, warps, stages, ns in itertools.product(args.sweep_block_n, args.sweep_warps, args.sweep_stages,
                                                       split_options):
            try:
                t = run_tandem(num_splits=ns, block_n=bn, num_warps=warps, num_stages=stages)
            except Exception as exc:  # out of shared memory etc.: record and move on
                row.setdefault("sweep_errors", []).append(f"bn={bn} w={warps} s={stages} splits={ns}: {exc!r}"[:200])
                continue
            entry = {"ms": t, "block_n": bn, "num_warps": warps, "num_stages": stages, "num_splits": ns}
            table.append(entry)
            if best is None or t < best["ms"]:
                best = dict(entry)
        if best is not None:
            best["gbs"] = total_bytes / (best["ms"] * 1e-3) / 1e9
            best["copy_fraction"] = best["gbs"] / copy_gbs
            if "sdpa_ms" in row:
                best["speedup_vs_sdpa"] = row["sdpa_ms"] / best["ms"]
        row["sweep_best"] = best
        row["sweep"] = table

    del q, k_cache, v_cache, block_tables, seq_lens, out
    torch.cuda.empty_cache()
    return row


def print_sweep_summary(rows: list[dict], num_kv_heads: int) -> None:
    """Best config per shape, and per shape the fastest split count at the default tile settings."""
    print("\nsweep: best per shape (programs = batch x kv heads; tiles = KV tiles of block_n per sequence)")
    print(f"{'batch':>5} {'seq':>6} {'programs':>8} {'best us':>8} {'bn':>4} {'w':>2} {'s':>2} {'splits':>6} "
          f"{'vs sdpa':>7}   us by splits at the default block_n, 4 warps, 2 stages")
    for row in rows:
        best = row.get("sweep_best")
        if not best:
            continue
        default = {e["num_splits"]: e["ms"] for e in row["sweep"]
                   if e["block_n"] == row["block_n"] and e["num_warps"] == 4 and e["num_stages"] == 2}
        by_split = " ".join(f"{ns}:{ms * 1e3:.1f}" for ns, ms in sorted(default.items()))
        print(f"{row['batch']:>5} {row['seq_len']:>6} {row['batch'] * num_kv_heads:>8} {best['ms'] * 1e3:>8.1f} "
              f"{best['block_n']:>4} {best['num_warps']:>2} {best['num_stages']:>2} {best['num_splits']:>6} "
              f"{best.get('speedup_vs_sdpa', float('nan')):>7.2f}   {by_split}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path of the JSON results")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--num-heads", type=int, default=32)  # Llama-3-8B layout
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--layout", choices=["nhd", "hnd"], default="nhd",
                        help="cache memory order within a block: positions then heads (the engine's), or heads first")
    parser.add_argument("--fp8-out", action="store_true",
                        help="also time the kernel writing its output quantized for an FP8 o_proj")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: the cache in e4m3 (bytes counted at one per element; SDPA's peer KV stays in "
                             "--dtype)")
    parser.add_argument("--sweep", action="store_true", help="also search tile/warp/stage/split settings")
    parser.add_argument("--sweep-block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--sweep-warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sweep-stages", type=int, nargs="+", default=[2, 3, 5],
                        help="Triton num_stages; the page-table load takes stages of its own, so tiles are "
                             "double-buffered only from 5")
    parser.add_argument("--sweep-splits", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--num-stages", type=int, default=None, help="the kernel's num_stages outside the sweep")
    parser.add_argument("--graph-max-len", type=int, default=0,
                        help="size the default split count from this static bound (the engine's max_model_len)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")

    device = torch.device("cuda")
    import triton

    copy_gbs = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name(device)}: copy bandwidth {copy_gbs:.1f} GB/s (read + write)")
    rows = []
    header = f"{'batch':>5} {'seq':>6} {'splits':>6} {'tandem us':>10} {'GB/s':>8} {'frac':>6} " \
             f"{'sdpa us':>9} {'sdpa GB/s':>9} {'speedup':>7}"
    print(header)
    for batch, seq_len in itertools.product(args.batch_sizes, args.seq_lens):
        row = bench_shape(args, batch, seq_len, copy_gbs, device)
        rows.append(row)
        sdpa = (f"{row['sdpa_ms'] * 1e3:>9.1f} {row['sdpa_gbs']:>9.0f} {row['speedup_vs_sdpa']:>7.2f}"
                if "sdpa_ms" in row else f"  sdpa failed: {row['sdpa_error'][:60]}")
        print(f"{batch:>5} {seq_len:>6} {row['num_splits']:>6} {row['tandem_ms'] * 1e3:>10.1f} "
              f"{row['tandem_gbs']:>8.0f} {row['tandem_copy_fraction']:>6.3f} {sdpa}"
              + (f"  fp8 out {row['tandem_fp8_out_ms'] * 1e3:.1f} us" if "tandem_fp8_out_ms" in row else "")
              + (f"  best {row['sweep_best']}" if row.get("sweep_best") else ""), flush=True)

    result = {
        "benchmark": "paged_decode_attention",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "layout": {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
                   "block_size": args.block_size, "dtype": args.dtype, "memory_order": args.layout,
                   "kv_cache_dtype": args.kv_cache_dtype},
        "copy_bandwidth_gbs": copy_gbs,
        "timing": "CUDA-graph replay, L2 flushed before each call (GPU time); *_eager_ms: triton do_bench median",
        "graph_max_len": args.graph_max_len or None,
        "bytes_counted": "K and V of every context position + q + out + block tables + seq_lens",
        "rows": rows,
    }
    if args.sweep:
        print_sweep_summary(rows, args.num_kv_heads)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
