"""All-reduce latency per message size on every local GPU: NCCL, the symmetric-memory one-shot and two-shot
kernels, and tandem's dispatch (TPGroup.all_reduce), each as 64 calls captured in one CUDA graph.

    python3 scripts/bench_all_reduce.py [--world-size N] [--sizes 8192,65536,...] [--out all_reduce.json]

Also checks, for each peer-to-peer path and size, that the sum equals NCCL's within bf16 tolerance and that two
runs on the same input give the same bits. NVLink multicast stays off (tandem's NCCL_ENV).

Where the one-shot kernel takes the message, it also times what a decoder layer does with it, as rows of 4,096:
the one-shot all-reduce followed by the residual add + RMSNorm kernel (`one_shot_norm`), against the fused kernel
doing all three (`fused_norm`, SymmetricAllReduce.add_rms_norm), and checks that the two agree, and that the fused
kernel given a split-K GEMM's partial sums gives the bits it gives for their reduce kernel's output.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.kernels.fp8 import PartialSums  # noqa: E402
from tandem.kernels.triton_quant import reduce_partial_sums_triton  # noqa: E402
from tandem.config import ParallelConfig  # noqa: E402
from tandem.distributed.all_reduce import SymmetricAllReduce  # noqa: E402
from tandem.distributed.group import TPGroup  # noqa: E402
from tandem.distributed.ranks import NCCL_ENV  # noqa: E402

CALLS = 64  # all-reduces in one captured graph: a decode step of a 32-layer model makes 64 (+1)
DEFAULT_SIZES = [8 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20]
DTYPE = torch.bfloat16
NORM_DIM = 4096  # hidden size of the rows the norm paths take (Llama-2-7B, Llama-3-8B)


def _paths(comm: SymmetricAllReduce, tp: TPGroup) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    def nccl(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    return {"nccl": nccl, "one_shot": lambda x: comm.run(x, "one_shot"), "two_shot": lambda x: comm.run(x, "two_shot"),
            "tandem": tp.all_reduce}


def _graph_us(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, replays: int = 20) -> float:
    """Microseconds a call, CALLS calls captured in one graph, the median of `replays` timed replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(x)
    times = []
    for _ in range(replays + 3):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    times = sorted(times[3:])
    return times[len(times) // 2]


def _check(fn: Callable[[torch.Tensor], torch.Tensor], numel: int, rank: int) -> dict[str, Any]:
    """The path's sum against NCCL's (max relative error) and two runs bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn(numel, device="cuda", dtype=DTYPE, generator=gen)
    ref = x.float().clone()
    dist.all_reduce(ref)
    first = fn(x.clone()).float()
    second = fn(x.clone()).float()
    err = ((first - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
    return {"max_rel_err": err, "deterministic": bool(torch.equal(first, second))}


def _norm_paths(comm: SymmetricAllReduce, rows: int, device: torch.device
                ) -> dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]]:
    """The all-reduce followed by the residual add and RMSNorm, as two kernels and as the fused one; each returns
    the normed rows and the new residual."""
    from tandem.kernels.triton_fused import fused_add_rms_norm_triton

    gen = torch.Generator(device="cuda").manual_seed(7)  # the same residual and weight on every rank
    residual = torch.randn(rows, NORM_DIM, device=device, dtype=DTYPE, generator=gen)
    weight = torch.randn(NORM_DIM, device=device, dtype=DTYPE, generator=gen)

    def two_kernels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm_triton(comm.run(x.view(rows, NORM_DIM), "one_shot"), residual, weight, 1e-5)

    def fused(x: torch.Tensor | PartialSums) -> tuple[torch.Tensor, torch.Tensor]:
        out = comm.add_rms_norm(x if isinstance(x, PartialSums) else x.view(rows, NORM_DIM), residual, weight, 1e-5)
        assert out is not None, "the fused kernel refused a one-shot message"
        return out

    return {"one_shot_norm": two_kernels, "fused_norm": fused}


def _worker(rank: int, world: int, port: int, sizes: list[int], out: str | None) -> None:
    os.environ.update(NCCL_ENV)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    comm = SymmetricAllReduce(dist.group.WORLD, device, DTYPE, max(sizes))
    tp = TPGroup(ParallelConfig(dist.get_rank(), dist.get_world_size()))  # the engine's dispatch over this buffer
    tp.p2p = comm
    rows = []
    for size in sizes:
        numel = size // DTYPE.itemsize
        x = torch.zeros(numel, device=device, dtype=DTYPE)
        row: dict[str, Any] = {"bytes": size, "tandem_path": comm.path(x)}
        for name, fn in _paths(comm, tp).items():
            if name in ("one_shot", "two_shot") and size > comm.max_bytes:
                continue
            row[f"{name}_us"] = round(_graph_us(fn, x), 2)
            if name != "nccl":
                row[f"{name}_check"] = _check(fn, numel, rank)
        if comm.path(x) == "one_shot" and comm.fused and numel % NORM_DIM == 0:
            paths = _norm_paths(comm, numel // NORM_DIM, device)
            for name, fn in paths.items():
                row[f"{name}_us"] = round(_graph_us(fn, x), 2)
            gen = torch.Generator(device="cuda").manual_seed(99 + rank)
            y = torch.randn(numel, device=device, dtype=DTYPE, generator=gen)
            ref, first, second = (torch.cat(paths[n](y.clone())).float()
                                  for n in ("one_shot_norm", "fused_norm", "fused_norm"))
            # The same rows as a split-K GEMM's partial sums (3 splits, a bias on rank 0), which the fused
            # kernel adds up itself: the bits of the reduce kernel's output going in.
            parts = PartialSums(torch.randn(3, numel // NORM_DIM, NORM_DIM, device=device, generator=gen),
                                None, y[:NORM_DIM].clone() if rank == 0 else None, DTYPE)
            from_parts = torch.cat(paths["fused_norm"](parts))
            from_reduced = torch.cat(paths["fused_norm"](reduce_partial_sums_triton(parts)))
            row["fused_norm_check"] = {
                "max_abs_diff_vs_two_kernels": (first - ref).abs().max().item(),
                # bf16 rounding of sums taken in another order: relative to the value (at least 1)
                "max_rel_diff_vs_two_kernels": ((first - ref).abs() / ref.abs().clamp_min(1.0)).max().item(),
                "deterministic": bool(torch.equal(first, second)),
                "partial_sums_equal_reduced": bool(torch.equal(from_parts, from_reduced)),
                "barrier_timeouts": int(comm.timed_out.item()),
            }
        rows.append(row)
        if rank == 0:
            print(f"{size >> 10:>6} KiB  " + "  ".join(f"{k[:-3]} {v:6.2f} us" for k, v in row.items()
                                                      if k.endswith("_us")) + f"  (tandem: {row['tandem_path']})",
                  flush=True)
    if rank == 0:
        result = {"world_size": world, "dtype": str(DTYPE), "calls_per_graph": CALLS,
                  "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                  "one_shot_max_bytes": comm.one_shot_max, "two_shot_max_bytes": comm.two_shot_max, "sizes": rows}
        print(json.dumps(result, indent=1))
        if out:
            with open(out, "w") as f:
                json.dump(result, f, indent=2)
    tp.release()
    del comm
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count())
    parser.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES), help="message bytes, comma list")
    parser.add_argument("--out", default=None, help="JSON file for the table")
    args = parser.parse_args()
    if args.world_size < 2:
        raise SystemExit(f"needs at least 2 GPUs, {torch.cuda.device_count()} visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(NCCL_ENV)  # the spawned ranks inherit it too
    sizes = [int(s) for s in args.sizes.split(",")]
    mp.spawn(_worker, args=(args.world_size, port, sizes, args.out), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
