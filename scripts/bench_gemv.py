"""Decode GEMV benchmark on CUDA: the weight-streaming Triton GEMV against what runs without it.

    python scripts/bench_gemv.py --out out/gemv.json [--sweep] [--rows 1,2,4] [--sweep-rows 1,4] [--workers 8]

For the projections of the Llama-2-7B and Llama-3-8B shapes (and one rank's shards of them at TP=2: `--models
llama-2-7b-tp2,llama-3-8b-tp2`) at a few rows it times `gemv_triton` (gate_up with
silu(gate) * up fused) against the path it replaces: bf16 `F.linear` (cuBLAS) and the FP8 tile GEMM
(`fp8_weight_matmul_triton`), each followed by the `silu_and_mul` kernel for gate_up. Every time is GPU time from
a CUDA graph that calls the kernel on enough copies of the weight (>= 4x the L2 size in all) that each call
streams its weight from HBM, as a decode step does layer after layer; no L2 flush kernel is needed (a flush by
writes would leave dirty lines for the timed kernel to write back). Weight bytes over the time, as a fraction
of a device-to-device copy bandwidth measured in the same run, is the roofline convention of docs/benchmarks.md.

--sweep times a grid of tiles (BLOCK_N, BLOCK_K, num_warps) at --sweep-rows (1 and 4) per shape and reports the best
beside `gemv_config`'s choice. The grid's kernels are compiled first by --workers processes in parallel (into
Triton's on-disk cache, which the timing process then reads).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import copy_bandwidth_gbs, replay_ms  # noqa: E402

from tandem.kernels.triton_fused import silu_and_mul_triton  # noqa: E402
from tandem.kernels.triton_gemv import gemv_config, gemv_triton  # noqa: E402
from tandem.kernels.triton_quant import fp8_weight_matmul_triton  # noqa: E402
from tandem.layers.quantization import quantize_weight_fp8  # noqa: E402

def projection_shapes(model: str, tp: int = 1) -> list[tuple[str, int, int, bool]]:
    """(name, weight rows N, K, gated) of a Llama-family named shape's decoder projections, q / k / v and gate / up
    fused (gate_up holds gate then up and yields N / 2 outputs); at tp, one rank's shards: column-parallel N (qkv,
    gate_up) and row-parallel K (o, down) divided."""
    from tandem.models.loader import NAMED_SHAPES

    cfg = NAMED_SHAPES[model]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    return [("qkv", (q + 2 * kv) // tp, hidden, False), ("o", hidden, q // tp, False),
            ("gate_up", 2 * inter // tp, hidden, True), ("down", hidden, inter // tp, False)]


# Each model's projections, and one rank's shards at --tensor-parallel-size 2 ("-tp2").
SHAPES = {f"{model}{suffix}": projection_shapes(model, tp) for suffix, tp in (("", 1), ("-tp2", 2))
          for model in ("llama-2-7b", "llama-3-8b")}
DTYPES = ("bf16", "fp8")


def cuda_setup() -> tuple[torch.device, object, float]:
    """(device, its properties, copy bandwidth in GB/s measured now); exits without CUDA."""
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"{props.name}: copy {copy_gbs:.0f} GB/s, {props.multi_processor_count} SMs, L2 {l2_bytes(props) >> 20} MiB",
          flush=True)
    return device, props, copy_gbs


def l2_bytes(props: object) -> int:
    return getattr(props, "L2_cache_size", 50 << 20)


def sweep_grid(weight_bytes: int, gated: bool, rows: int) -> list[dict]:
    """Tiles worth timing: weight elements per thread and K step (gate and up both, when gated) from 16 up to
    a limit that halves with several rows; above it sm_90 ptxas reports ~255 registers or spills (checked
    offline for every tile of this grid)."""
    grid = []
    bks = (512, 1024, 2048) if weight_bytes == 2 else (1024, 2048, 4096)
    for bn, bk, warps in itertools.product((1, 2, 4, 8, 16), bks, (2, 4, 8)):
        per_thread = (2 if gated else 1) * bn * bk // (32 * warps)
        limit = (128 if weight_bytes == 2 else 64) // (2 if rows > 1 else 1)
        if 16 <= per_thread <= limit:
            grid.append({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps})
    return grid


def bf16_weight_copies(n: int, k: int, l2: int, device, seed: int = 0) -> list[torch.Tensor]:
    """Enough copies of a random bf16 [n, k] weight (>= 2, >= 4x the L2 in all) that a graph calling a kernel
    on each in turn streams every one from HBM."""
    gen = torch.Generator(device=device).manual_seed(seed)
    copies = max(2, -(-4 * l2 // (n * k * 2)))
    return [(torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16) for _ in range(copies)]


def make_weights(n: int, k: int, dtype: str, copies: int, device) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    gen = torch.Generator(device=device).manual_seed(n + k)
    out = []
    for _ in range(copies):
        w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(torch.bfloat16)
        out.append(quantize_weight_fp8(w) if dtype == "fp8" else (w, None))
    return out


def graph_us(calls: list, reps: int = 3) -> float:
    """GPU microseconds per call, from replays of a CUDA graph that runs every call of `calls` reps times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # compile, allocate outside the capture
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(reps):
            for fn in calls:
                fn()
    ms = replay_ms(graph)
    del graph
    return ms * 1e3 / (reps * len(calls))


def write_rows(path: str, props: object, copy_gbs: float, rows: list[dict], **extra: object) -> None:
    """The JSON every projection benchmark writes: device, copy bandwidth, how it timed, and its rows."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({**extra, "device": props.name, "copy_gbs": copy_gbs,
                   "timing": "CUDA-graph replay over >= 4x L2 of weight copies, GPU time per call", "rows": rows},
                  f, indent=2)
    print(f"wrote {path}")


def sweep_tiles(make_calls, weight_bytes: int, copy_gbs: float, grid) -> list[dict]:
    """Every tile of `grid` ((BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) tuples) timed over the calls
    make_calls(tile) returns, as GPU us per call and the fraction of copy bandwidth that streaming
    weight_bytes in that time reaches; fastest first. Tiles that do not compile (out of shared memory or
    registers) are left out."""
    table = []
    for bn, bk, warps, stages, split in grid:
        tile = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "SPLIT_K": split}
        try:
            us = graph_us(make_calls(tile), reps=2)
        except Exception:  # noqa: BLE001  out of shared memory / registers for this tile
            continue
        table.append({"us": round(us, 2), "copy_fraction": round(weight_bytes / (us * 1e-6) / 1e9 / copy_gbs, 4),
                      **tile})
    return sorted(table, key=lambda e: e["us"])


def baseline(x, w, s, gated):
    y = F.linear(x, w) if s is None else fp8_weight_matmul_triton(x, w, s, None)
    return silu_and_mul_triton(y) if gated else y


def _compile_worker(jobs: list[tuple[int, int, str, bool, int, dict]]) -> int:
    """Runs each (n, k, dtype, gated, m, config) once on a small weight of the same K: the kernel lands in
    Triton's disk cache (N only changes MASK_N, which the job list covers through n)."""
    device = torch.device("cuda")
    done = 0
    for n, k, dtype, gated, m, cfg in jobs:
        w, s = make_weights(n, k, dtype, 1, device)[0]
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        try:
            gemv_triton(x, w, s, None, gated=gated, config=cfg)
            done += 1
        except Exception:  # out of resources: the timing pass skips it too
            pass
    torch.cuda.synchronize()
    return done


def precompile(jobs: list, workers: int) -> None:
    if workers <= 1 or not jobs:
        return
    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        done = sum(pool.map(_compile_worker, chunks))
    print(f"precompiled {done}/{len(jobs)} kernels in {time.time() - t0:.0f}s with {workers} processes", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--models", default="llama-2-7b,llama-3-8b", help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--rows", default="1,2,4", help="row counts M to time with the default tile")
    parser.add_argument("--sweep-rows", default="1,4", help="row counts M to sweep tiles at")
    parser.add_argument("--workers", type=int, default=8, help="processes that precompile the sweep's kernels")
    args = parser.parse_args()
    device, props, copy_gbs = cuda_setup()
    sms, l2 = props.multi_processor_count, l2_bytes(props)
    models, dtypes = args.models.split(","), args.dtypes.split(",")
    rows_m = [int(v) for v in args.rows.split(",")]
    sweep_rows = [int(v) for v in args.sweep_rows.split(",")] if args.sweep else []
    shapes = [(model, *shape) for model in models for shape in SHAPES[model]]
    if args.sweep:
        jobs, seen = [], set()
        for dtype in dtypes:
            for _, _, n, k, gated in shapes:
                for m in sweep_rows:
                    for cfg in sweep_grid(1 if dtype == "fp8" else 2, gated, m):
                        # Shapes share a compiled kernel unless the tile's masks differ.
                        key = (dtype, gated, m, k % cfg["BLOCK_K"] == 0,
                               (n // (2 if gated else 1)) % cfg["BLOCK_N"] == 0, tuple(sorted(cfg.items())))
                        if key not in seen:
                            seen.add(key)
                            jobs.append((n, k, dtype, gated, m, cfg))
        precompile(jobs, args.workers)
    results = []
    for model, name, n, k, gated in shapes:
        for dtype in dtypes:
            wbytes = 1 if dtype == "fp8" else 2
            copies = max(2, -(-4 * l2 // (n * k * wbytes)))
            weights = make_weights(n, k, dtype, copies, device)
            n_out = n // 2 if gated else n
            for m in rows_m:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                base = graph_us([lambda w=w, s=s: baseline(x, w, s, gated) for w, s in weights])
                gemv = graph_us([lambda w=w, s=s: gemv_triton(x, w, s, None, gated=gated) for w, s in weights])
                frac = lambda us: n * k * wbytes / (us * 1e-6) / 1e9 / copy_gbs  # noqa: E731
                row = {"model": model, "proj": name, "N": n, "K": k, "gated": gated, "dtype": dtype, "M": m,
                       "baseline_us": base, "gemv_us": gemv, "speedup": base / gemv,
                       "baseline_copy_fraction": frac(base), "gemv_copy_fraction": frac(gemv),
                       "gemv_config": gemv_config(m, n_out, k, wbytes, gated, sms)}
                if m in sweep_rows:
                    table = []
                    for cfg in sweep_grid(wbytes, gated, m):
                        try:
                            us = graph_us([lambda w=w, s=s, c=cfg: gemv_triton(x, w, s, None, gated=gated, config=c)
                                           for w, s in weights], reps=2)
                        except Exception as exc:  # noqa: BLE001  out of shared memory / registers
                            table.append({**cfg, "error": type(exc).__name__})
                            continue
                        table.append({**cfg, "us": round(us, 2), "copy_fraction": round(frac(us), 4)})
                    timed = sorted((e for e in table if "us" in e), key=lambda e: e["us"])
                    row["sweep"] = timed + [e for e in table if "us" not in e]
                    if timed:
                        row["best"] = timed[0]
                results.append(row)
                best = f"  best {row['best']}" if "best" in row else ""
                print(f"{model:<11} {name:<8} {dtype:<5} M={m}  base {base:7.1f} us ({frac(base):.3f})  "
                      f"gemv {gemv:7.1f} us ({frac(gemv):.3f})  x{base / gemv:.2f}{best}", flush=True)
            del weights
            torch.cuda.empty_cache()
    if args.out:
        write_rows(args.out, props, copy_gbs, results, benchmark="decode_gemv", date=time.strftime("%Y-%m-%d"),
                   torch=torch.__version__, sms=sms, l2_bytes=l2)

if __name__ == "__main__":
    main()
