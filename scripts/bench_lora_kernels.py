"""Decode LoRA shrink and expand kernels on CUDA: the one-block kernels against the sorted ones (grouped by slot).

    python scripts/bench_lora_kernels.py --out out/lora_sorted.json [--rank 16] [--slots 16] [--budget-s 120]

For the Llama-3-8B projections with rank-`rank` adapters in a pool of `slots` slots (qkv 4096 -> 6144 with three
parts' rank columns, o 4096 -> 4096, gate_up 4096 -> 28672 with two, down 14336 -> 4096) and decode mixes (32 tokens
over 8 adapters, 64 over 16, and as checks 64 on one adapter and 8 over 8), it times, as GPU us per call from CUDA
graph replays over enough copies of A and B (>= 4x the L2 in all) that each call reads its adapters from HBM as a
decode step does layer after layer: the one-block shrink and expand (`triton_lora`, TANDEM_LORA_SORTED=0's path),
the sorted shrink and expand with their default tiles (`triton_lora_sorted`), and the step's one grouping kernel.
Then, until --budget-s seconds from the start, a grid of the sorted kernels' tiles (expand: BLOCK_N x num_warps; shrink: K splits x
BLOCK_K x num_warps), fastest first. `step_us_*` sums the four projections over the 32 layers (plus the grouping
once, for the sorted kernels): the decode step's LoRA kernel time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv import cuda_setup, graph_us, l2_bytes, projection_shapes, write_rows  # noqa: E402

from tandem.kernels.lora import index_token_slots, lora_counters, slot_groups  # noqa: E402
from tandem.kernels.triton_lora import lora_expand_triton, lora_shrink_block_triton  # noqa: E402
from tandem.kernels.triton_lora_sorted import lora_expand_sorted_triton, lora_shrink_sorted_triton  # noqa: E402

# (name, N, K, adapter parts: q / k / v and gate / up each on rank columns of their own)
SHAPES = [(name, n, k, {"qkv": 3, "gate_up": 2}.get(name, 1))
          for name, n, k, _ in projection_shapes("llama-3-8b")]
MIXES = [(32, 8), (64, 16), (64, 1), (8, 8)]  # (tokens, adapters): token i on adapter i % adapters
LAYERS = 32
EXPAND_GRID = [dict(block_n=bn, num_warps=w) for bn in (64, 128, 256, 512) for w in (4, 8)]
SHRINK_GRID = [dict(splits=s, block_k=bk, num_warps=w) for s in (4, 8, 16) for bk in (128, 256) for w in (4, 8)]


def adapter_copies(slots: int, cols: int, n_out: int, k: int, l2: int, device) -> list[tuple[torch.Tensor, ...]]:
    """(A [slots, cols, k], B [slots, n_out, cols]) bf16 copies, >= 2 and >= 4x the L2 in all."""
    gen = torch.Generator(device=device).manual_seed(n_out + k)
    nbytes = slots * cols * (k + n_out) * 2
    out = []
    for _ in range(max(2, -(-4 * l2 // nbytes))):
        a = (torch.randn(slots, cols, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)
        b = (torch.randn(slots, n_out, cols, generator=gen, device=device) * 0.01).to(torch.bfloat16)
        out.append((a, b))
    return out


def total(*us: float | None) -> float:
    return sum(u for u in us if u is not None) if None not in us else float("nan")


def timed(calls: list) -> float | None:
    try:
        return round(graph_us(calls), 2)
    except Exception as exc:  # noqa: BLE001  a tile that does not compile (registers, shared memory)
        print(f"    skipped: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--budget-s", type=float, default=120.0, help="seconds from the start past which no more grid tiles are timed")
    args = parser.parse_args()
    device, props, copy_gbs = cuda_setup()
    started = time.monotonic()
    index = torch.full((128,), -1, dtype=torch.int32, device=device)  # the pool's static token index
    groups = slot_groups(args.slots, 128, device)
    counters = lora_counters(args.slots, device)
    rows, jobs = [], []
    for tokens, adapters in MIXES:
        step = (torch.arange(tokens, device=device) % adapters).to(torch.int32)
        index_token_slots(step, index, groups)
        group_us = graph_us([lambda: index_token_slots(step, index, groups)])
        for name, n_out, k, parts in SHAPES:
            cols = parts * args.rank
            copies = adapter_copies(args.slots, cols, n_out, k, l2_bytes(props), device)
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            y = torch.zeros(tokens, n_out, device=device, dtype=torch.bfloat16)
            s = lora_shrink_block_triton(x, copies[0][0], index, counters)
            old = lora_expand_triton(y.clone(), s, copies[0][1], index)
            new = lora_expand_sorted_triton(y.clone(), lora_shrink_sorted_triton(x, copies[0][0], groups, counters),
                                            copies[0][1], groups)
            row = {"proj": name, "N": n_out, "K": k, "rank_columns": cols, "tokens": tokens, "adapters": adapters,
                   "max_abs_diff": (old.float() - new.float()).abs().max().item(),
                   "old_shrink_us": timed([lambda a=a: lora_shrink_block_triton(x, a, index, counters)
                                           for a, _ in copies]),
                   "old_expand_us": timed([lambda b=b: lora_expand_triton(y, s, b, index) for _, b in copies]),
                   "new_shrink_us": timed([lambda a=a: lora_shrink_sorted_triton(x, a, groups, counters)
                                           for a, _ in copies]),
                   "new_expand_us": timed([lambda b=b: lora_expand_sorted_triton(y, s, b, groups) for _, b in copies]),
                   "group_us": group_us}
            row["old_us"] = total(row["old_shrink_us"], row["old_expand_us"])
            row["new_us"] = total(row["new_shrink_us"], row["new_expand_us"])
            rows.append(row)
            print(f"{name:<8} {tokens:>3} tokens / {adapters:>2} adapters: one-block shrink {row['old_shrink_us']} "
                  f"expand {row['old_expand_us']} us | sorted shrink {row['new_shrink_us']} expand "
                  f"{row['new_expand_us']} us | diff {row['max_abs_diff']:.2e}", flush=True)
            if adapters > 1 and tokens >= 32:  # the grid, after every default row: 64 over 16 first
                jobs.append((-tokens, name, tokens, adapters, x, y, s, copies))
    step = {}
    for tokens, adapters in MIXES:
        mine = [r for r in rows if r["tokens"] == tokens and r["adapters"] == adapters]
        key = f"{tokens}x{adapters}"
        step[key] = {"old_us": LAYERS * sum(r["old_us"] for r in mine),
                     "new_us": LAYERS * sum(r["new_us"] for r in mine) + mine[0]["group_us"]}
        print(f"step ({LAYERS} layers) {key}: one-block {step[key]['old_us']:8.1f} us, sorted "
              f"{step[key]['new_us']:8.1f} us", flush=True)
    deadline = started + args.budget_s
    sweeps = []
    for _, name, tokens, adapters, x, y, s, copies in sorted(jobs, key=lambda job: (job[0], job[1] != "gate_up")):
        index_token_slots((torch.arange(tokens, device=device) % adapters).to(torch.int32), index, groups)
        if time.monotonic() < deadline:
            sweeps.append(sweep(name, tokens, adapters, x, y, s, copies, groups, counters, deadline))
    if args.out:
        write_rows(args.out, props, copy_gbs, rows, benchmark="lora_sorted_kernels", rank=args.rank,
                   slots=args.slots, step_us=step, sweeps=sweeps)


def sweep(name: str, tokens: int, adapters: int, x, y, s, copies, groups, counters, deadline: float) -> dict:
    """The sorted kernels' tile grid on one projection and mix, fastest first, until the deadline."""
    expand, shrink = [], []
    for tile in EXPAND_GRID:
        if time.monotonic() > deadline:
            break
        us = timed([lambda b=b: lora_expand_sorted_triton(y, s, b, groups, **tile) for _, b in copies])
        if us is not None:
            expand.append({**tile, "us": us})
    for tile in SHRINK_GRID:
        if time.monotonic() > deadline:
            break
        us = timed([lambda a=a: lora_shrink_sorted_triton(x, a, groups, counters, **tile) for a, _ in copies])
        if us is not None:
            shrink.append({**tile, "us": us})
    expand.sort(key=lambda t: t["us"])
    shrink.sort(key=lambda t: t["us"])
    best = lambda table: f"{table[0]} " if table else "-"  # noqa: E731
    print(f"  sweep {name} {tokens}/{adapters}: expand best {best(expand)} shrink best {best(shrink)}", flush=True)
    return {"proj": name, "tokens": tokens, "adapters": adapters, "expand": expand, "shrink": shrink}


if __name__ == "__main__":
    main()
