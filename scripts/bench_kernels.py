"""Decode attention benchmark on CUDA: paged Triton kernel vs torch SDPA on contiguous KV, against copy bandwidth.

    python scripts/bench_kernels.py --out out/bench_kernels.json [--sweep]

For every (batch, seq_len) it times `paged_decode_attention` with triton.testing.do_bench (median, L2 flushed
before each run), counts the bytes the step must read/write (all K/V of every context + q + out), and reports
GB/s and the fraction of a device-to-device copy bandwidth measured in the same run (read + write bytes, the
roofline convention of BENCHMARKS.md). The peer is torch SDPA (enable_gqa) on a contiguous KV of the same
contents. --sweep also times a grid of tile/warp/stage/split settings and reports the best, for tuning.
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


def copy_bandwidth_gbs(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy of a 2 GiB buffer, counting read + write bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def make_inputs(batch, seq_len, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """A paged cache with shuffled blocks (block 0 reserved), its block tables, seq_lens and one query per row."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = 1 + batch * blocks_per_seq
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
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
    gathered = gathered.view(batch, -1, num_kv_heads, head_dim)[:, :seq_len]
    return gathered.transpose(1, 2).contiguous()


def sdpa_decode(q, keys, values, scale):
    """torch SDPA for one query token per sequence; GQA through enable_gqa (no KV expansion)."""
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True).squeeze(2)


def bench_shape(args, batch, seq_len, copy_gbs, device) -> dict:
    dtype = DTYPES[args.dtype]
    elem = dtype.itemsize
    q, k_cache, v_cache, block_tables, seq_lens = make_inputs(
        batch, seq_len, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, dtype, device)
    scale = 1.0 / math.sqrt(args.head_dim)
    kv_bytes = 2 * batch * seq_len * args.num_kv_heads * args.head_dim * elem
    io_bytes = 2 * q.numel() * elem + block_tables.numel() * 4 + seq_lens.numel() * 4
    total_bytes = kv_bytes + io_bytes
    out = torch.empty_like(q)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    block_n = decode_block_n(args.head_dim, dtype)
    splits = choose_num_splits(batch, args.num_kv_heads, seq_len, block_n, num_sms)

    def run_tandem(num_splits=splits, rep=200, **cfg):
        workspace = torch.empty(decode_workspace_numel(batch, args.num_heads, args.head_dim, num_splits),
                                dtype=torch.float32, device=device)
        fn = lambda: paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out,  # noqa: E731
                                            num_splits=num_splits, workspace=workspace, **cfg)
        return median_ms(fn, rep)

    ms = run_tandem()
    row = {
        "batch": batch, "seq_len": seq_len, "num_splits": splits, "block_n": block_n,
        "kv_bytes": kv_bytes, "bytes": total_bytes,
        "tandem_ms": ms, "tandem_gbs": total_bytes / (ms * 1e-3) / 1e9,
    }
    row["tandem_copy_fraction"] = row["tandem_gbs"] / copy_gbs

    keys = contiguous_kv(k_cache, block_tables, seq_len)
    values = contiguous_kv(v_cache, block_tables, seq_len)
    try:
        ref = sdpa_decode(q, keys, values, scale)
        row["max_abs_diff_vs_sdpa"] = (out.float() - ref.float()).abs().max().item()
        row["rel_err_vs_sdpa"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        sdpa_ms = median_ms(lambda: sdpa_decode(q, keys, values, scale))
        row.update({"sdpa_ms": sdpa_ms, "sdpa_gbs": total_bytes / (sdpa_ms * 1e-3) / 1e9,
                    "speedup_vs_sdpa": sdpa_ms / ms})
        row["sdpa_copy_fraction"] = row["sdpa_gbs"] / copy_gbs
    except RuntimeError as exc:  # e.g. out of memory in a math fallback: keep tandem's figures
        row["sdpa_error"] = repr(exc)[:300]
    del keys, values

    if args.sweep:
        best = None
        split_options = sorted({max(1, splits // 2), splits, min(64, splits * 2), 1})
        for bn, warps, stages, ns in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), split_options):
            try:
                t = run_tandem(num_splits=ns, rep=50, block_n=bn, num_warps=warps, num_stages=stages)
            except Exception as exc:  # out of shared memory etc.: record and move on
                row.setdefault("sweep_errors", []).append(f"bn={bn} w={warps} s={stages} splits={ns}: {exc!r}"[:200])
                continue
            if best is None or t < best["ms"]:
                best = {"ms": t, "block_n": bn, "num_warps": warps, "num_stages": stages, "num_splits": ns}
        if best is not None:
            best["gbs"] = total_bytes / (best["ms"] * 1e-3) / 1e9
            best["copy_fraction"] = best["gbs"] / copy_gbs
        row["sweep_best"] = best

    del q, k_cache, v_cache, block_tables, seq_lens, out
    torch.cuda.empty_cache()
    return row


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
    parser.add_argument("--sweep", action="store_true", help="also search tile/warp/stage/split settings")
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
              + (f"  best {row['sweep_best']}" if row.get("sweep_best") else ""), flush=True)

    result = {
        "benchmark": "paged_decode_attention",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "layout": {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
                   "block_size": args.block_size, "dtype": args.dtype},
        "copy_bandwidth_gbs": copy_gbs,
        "timing": "triton.testing.do_bench median, L2 flushed before each run",
        "bytes_counted": "K and V of every context position + q + out + block tables + seq_lens",
        "rows": rows,
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
