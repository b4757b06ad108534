"""Where a constrained step's mask time goes: 64 requests under the `structured` workload's schema, each in its own
state, step after step, timed phase by phase as the engine's mask worker runs them (llguidance).

    python scripts/bench_mask_step.py [--rows 64] [--steps 100] [--threads 1,2,4,8,16] [--engine-ms 2.5]
                                      [--out mask_step.json]

Per thread count (the llguidance executor's threads), per step: the tokens reaching the matchers
(`HostMask.accept_all`: its Python and its parallel call), the rows' fill (`HostMask.fill_rows`: its Python, the
parallel call, and the bits.numpy() view), the bitmask's H2D where a GPU is present, and the step's total. Each
row's own fill time is measured too, one row at a time on a copy of its matcher, which gives the least a step can
take on T threads (the longest row, or the rows' sum spread evenly over T) to set beside the parallel call.

`--engine-ms X` then runs the accept and fill on a worker thread while this thread runs X ms of pure Python (the
engine's thread scheduling and writing the next step meanwhile), with the interpreter's default GIL switch interval
and with the short one the engine sets while a fill is in flight: the time from starting the fill to its rows being
ready shows how long the worker waits for the GIL. The vocabulary is the synthetic one of random-weight shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from tandem.bench.structured_workload import SCHEMA
from tandem.sampling_params import StructuredOutputParams
from tandem.structured import matcher as matcher_module
from tandem.structured.grammar import GrammarCache
from tandem.structured.matcher import HostMask
from tandem.structured.pipeline import FILL_SWITCH_INTERVAL_S, grammar_lineages


class CallTimer:
    """Wraps llguidance.numpy's parallel calls (which HostMask imports at call time) to add up their seconds."""

    def __init__(self) -> None:
        import llguidance.numpy as llg_numpy

        self.module = llg_numpy
        self.seconds: dict[str, float] = defaultdict(float)
        self.originals = {name: getattr(llg_numpy, name) for name in ("consume_token_par", "fill_next_token_bitmask_par")}
        for name, fn in self.originals.items():
            setattr(llg_numpy, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return timed

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def random_allowed(bits: torch.Tensor, row: int, vocab_size: int, rng: random.Random) -> int:
    allowed = np.flatnonzero(np.unpackbits(bits[row].numpy().view(np.uint8), bitorder="little")[:vocab_size])
    return int(allowed[rng.randrange(len(allowed))])


def warm_states(compiled: Any, rows: int, vocab_size: int, seed: int) -> list[HostMask]:
    """`rows` matchers, each walked a random number of random allowed tokens into the schema (0 to 150)."""
    rng = random.Random(seed)
    bits = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    masks = []
    for _ in range(rows):
        mask = HostMask(compiled)
        for _ in range(rng.randrange(150)):
            HostMask.fill_rows(bits, [(0, mask, [])])
            if mask.is_terminated:
                break
            mask.accept(random_allowed(bits, 0, vocab_size, rng))
        masks.append(mask if not mask.is_terminated else HostMask(compiled))
    return masks


def copy_masks(masks: list[HostMask]) -> list[HostMask]:
    out = []
    for mask in masks:
        twin = HostMask(None)
        twin.matcher, twin.llguidance = mask.matcher.deep_copy(), True
        out.append(twin)
    return out


def row_costs(masks: list[HostMask], vocab_size: int) -> list[float]:
    """Each row's fill alone on one thread (on a copy of its matcher), seconds."""
    from llguidance.numpy import fill_next_token_bitmask

    scratch = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
    costs = []
    for mask in masks:
        twin = mask.matcher.deep_copy()
        t0 = time.perf_counter()
        fill_next_token_bitmask(twin, scratch, 0)
        costs.append(time.perf_counter() - t0)
    return costs


def least_time(costs: list[float], threads: int) -> float:
    """Longest-first greedy schedule of the rows on `threads` threads: the makespan (within 4/3 of the best)."""
    loads = [0.0] * threads
    for c in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += c
    return max(loads)


def step_work(tokens: list[tuple[HostMask, int]], bits: torch.Tensor, ordered: bool) -> None:
    """What the mask worker runs for one step: the tokens reach the matchers, then the rows are filled."""
    HostMask.accept_all(tokens)
    HostMask.fill_rows(bits, [(j, mask, []) for j, (mask, _) in enumerate(tokens)], spread=ordered)


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


def run_threads(compiled: Any, start: list[HostMask], threads: int, steps: int, vocab_size: int, seed: int,
                ordered: bool, timer: CallTimer, with_costs: bool, engine_s: float | None = None,
                switch_s: float | None = None) -> dict[str, Any]:
    import llguidance

    matcher_module._LLG_EXECUTOR = llguidance.LLExecutor(threads)  # the one the engine's calls use
    masks = copy_masks(start)
    rows = len(masks)
    bits = torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)
    cuda = torch.cuda.is_available()
    bits_cpu = bits.pin_memory() if cuda else bits
    bits_gpu = torch.empty_like(bits, device="cuda") if cuda else None
    rng = random.Random(seed)
    HostMask.fill_rows(bits_cpu, [(j, m, []) for j, m in enumerate(masks)])
    pool = ThreadPoolExecutor(max_workers=1) if engine_s is not None else None
    previous_switch = sys.getswitchinterval()
    phases: dict[str, list[float]] = defaultdict(list)
    try:
        for _ in range(steps):
            tokens = [(m, random_allowed(bits_cpu, j, vocab_size, rng)) for j, m in enumerate(masks)]
            if with_costs:  # each row's fill after its token, alone
                twins = copy_masks([m for m, _ in tokens])
                for twin, (_, token) in zip(twins, tokens):
                    twin.accept(token)
                phases["row_costs"].append(row_costs(twins, vocab_size))
            timer.take()
            if pool is None:
                t0 = time.perf_counter()
                HostMask.accept_all(tokens)
                t1 = time.perf_counter()
                HostMask.fill_rows(bits_cpu, [(j, mask, []) for j, (mask, _) in enumerate(tokens)], spread=ordered)
                t2 = time.perf_counter()
                calls = timer.take()
                phases["accept_par_ms"].append(1e3 * calls.get("consume_token_par", 0.0))
                phases["accept_python_ms"].append(1e3 * (t1 - t0) - phases["accept_par_ms"][-1])
                phases["fill_par_ms"].append(1e3 * calls.get("fill_next_token_bitmask_par", 0.0))
                phases["fill_python_ms"].append(1e3 * (t2 - t1) - phases["fill_par_ms"][-1])
                if cuda:
                    t3 = time.perf_counter()
                    bits_gpu.copy_(bits_cpu, non_blocking=True)
                    torch.cuda.synchronize()
                    phases["h2d_ms"].append(1e3 * (time.perf_counter() - t3))
                phases["total_ms"].append(1e3 * (time.perf_counter() - t0))
            else:
                sys.setswitchinterval(switch_s if switch_s is not None else previous_switch)
                t0 = time.perf_counter()
                job = pool.submit(step_work, tokens, bits_cpu, ordered)
                busy(engine_s)
                t1 = time.perf_counter()
                job.result()
                phases["ready_ms"].append(1e3 * (time.perf_counter() - t0))
                phases["join_wait_ms"].append(1e3 * (time.perf_counter() - t1))
                sys.setswitchinterval(previous_switch)
            for j, mask in enumerate(masks):  # a finished request's place goes to a new one
                if mask.is_terminated:
                    masks[j] = HostMask(compiled)
                    HostMask.fill_rows(bits_cpu, [(j, masks[j], [])])
    finally:
        sys.setswitchinterval(previous_switch)
        if pool is not None:
            pool.shutdown()
    out: dict[str, Any] = {"threads": threads, "ordered": ordered, "steps": steps}
    for name, values in phases.items():
        if name == "row_costs":
            continue
        out[name] = {"mean": statistics.mean(values), "median": statistics.median(values),
                     "p90": sorted(values)[int(0.9 * (len(values) - 1))], "max": max(values)}
    if "row_costs" in phases:
        costs = phases["row_costs"]
        flat = [c for step in costs for c in step]
        out["row_ms"] = {"median": 1e3 * statistics.median(flat), "mean": 1e3 * statistics.mean(flat),
                         "max": 1e3 * max(flat), "rows_over_1ms_per_step": sum(c > 1e-3 for c in flat) / len(costs)}
        out["row_sum_ms_mean"] = 1e3 * statistics.mean(sum(step) for step in costs)
        out["costs"] = costs
    return out


def gil_model(masks: list[HostMask], engine_s: float, accept_s: float, fill_s: float, switch_s: float | None,
              steps: int) -> dict[str, Any]:
    """The worker's GIL handovers alone: its Python passes over the rows (as accept_all and fill_rows make them),
    with sleeps (which free the GIL, as llguidance's parallel calls do) for the calls, while this thread runs
    `engine_s` of Python. Median seconds from start to ready."""
    rows = [(j, mask, []) for j, mask in enumerate(masks)]

    def work() -> None:
        pairs = [(m.matcher, j) for j, m, _ in rows if not m.is_terminated]
        time.sleep(accept_s)
        pairs = [(m.matcher, j) for j, m, _ in rows if not m._allows_all()]
        time.sleep(fill_s)
        del pairs

    previous = sys.getswitchinterval()
    ready = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        try:
            sys.setswitchinterval(switch_s or previous)
            for _ in range(steps):
                t0 = time.perf_counter()
                job = pool.submit(work)
                busy(engine_s)
                job.result()
                ready.append(time.perf_counter() - t0)
        finally:
            sys.setswitchinterval(previous)
    return {"gil_model": True, "engine_ms": 1e3 * engine_s, "switch_interval_s": switch_s or previous,
            "work_ms": 1e3 * (accept_s + fill_s), "ready_ms": 1e3 * statistics.median(ready)}


def bound_ms(costs: list[list[float]], threads: int) -> float:
    """Mean over steps of the least time the rows can take on `threads` threads."""
    return 1e3 * statistics.mean(least_time(step, threads) for step in costs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--threads", default=None, help="comma-separated executor thread counts (default 1,2,4,..,cores)")
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--engine-ms", type=float, default=2.5, help="Python on the engine's thread while the worker fills")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lineages", type=int, default=0,
                   help="start matchers the rows descend from (default: TANDEM_GRAMMAR_LINEAGES, as the engine)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    threads = ([int(t) for t in args.threads.split(",")] if args.threads else
               sorted({t for t in (1, 2, 4, 8, 12, 16, cores - 1, cores) if 1 <= t <= max(cores, 1)}))
    os.environ["TANDEM_STRUCTURED_BACKEND"] = "llguidance"
    cache = GrammarCache(None, args.vocab_size, [args.vocab_size - 1], backend_name="llguidance",
                         lineages=args.lineages or grammar_lineages())
    compiled = cache.submit(StructuredOutputParams(json=json.dumps(SCHEMA))).result()
    start = warm_states(compiled, args.rows, args.vocab_size, args.seed)
    timer = CallTimer()
    results: list[dict[str, Any]] = []
    costs: list[list[float]] | None = None
    print(f"{args.rows} rows, {args.steps} steps, {cores} cores; ms per step (mean / p90)")
    print(f"{'threads':>7} {'order':>7} {'accept py':>10} {'accept par':>11} {'fill py':>10} {'fill par':>11} "
          f"{'h2d':>6} {'total':>11} {'bound':>6}")
    for t in threads:
        for ordered in (False, True):
            r = run_threads(compiled, start, t, args.steps, args.vocab_size, args.seed, ordered, timer,
                            with_costs=costs is None)
            if costs is None:
                costs = r.pop("costs")
                print(f"rows alone: median {r['row_ms']['median']:.3f} ms, mean {r['row_ms']['mean']:.3f}, max "
                      f"{r['row_ms']['max']:.2f}; {r['row_ms']['rows_over_1ms_per_step']:.1f} rows over 1 ms a step; "
                      f"sum {r['row_sum_ms_mean']:.2f} ms a step; least ms a step on 4 / 8 / 15 / 16 threads: "
                      + " / ".join(f"{bound_ms(costs, n):.2f}" for n in (4, 8, 15, 16)))
            r["bound_ms"] = bound_ms(costs, t)
            results.append(r)

            def f(name: str) -> str:
                v = r.get(name)
                return f"{v['mean']:.2f}/{v['p90']:.2f}" if v else "-"

            print(f"{t:>7} {'slow 1st' if ordered else 'as is':>7} {f('accept_python_ms'):>10} "
                  f"{f('accept_par_ms'):>11} {f('fill_python_ms'):>10} {f('fill_par_ms'):>11} "
                  f"{f('h2d_ms'):>6} {f('total_ms'):>11} {r['bound_ms']:>6.2f}")
    print(f"\nworker fill beside {args.engine_ms} ms of Python on this thread: ms from start to ready (mean / p90), "
          "and this thread's wait at the join")
    for t, switch, ordered in [(t, s, o) for t in sorted({max(threads), max(1, max(threads) - 1)}, reverse=True)
                               for s in (None, FILL_SWITCH_INTERVAL_S) for o in (False, True)]:
            r = run_threads(compiled, start, t, args.steps, args.vocab_size, args.seed, ordered, timer, False,
                            engine_s=args.engine_ms / 1e3, switch_s=switch)
            r["switch_interval_s"] = switch or sys.getswitchinterval()
            results.append(r)
            print(f"  {t:>2} threads, switch interval {1e3 * r['switch_interval_s']:.1f} ms, "
                  f"{'slow first' if ordered else 'as is':>10}:"
                  f" ready {r['ready_ms']['mean']:.2f} / {r['ready_ms']['p90']:.2f}, join wait "
                  f"{r['join_wait_ms']['mean']:.2f} / {r['join_wait_ms']['p90']:.2f}")
    print(f"\nGIL model (any machine): the worker's Python as above, its parallel calls replaced by sleeps of the "
          f"least time on 16 threads (accept 0.1 ms, fill {bound_ms(costs, 16):.2f} ms), beside Python on this thread")
    for engine_ms in (0.0, args.engine_ms, 2 * args.engine_ms):
        for switch in (None, FILL_SWITCH_INTERVAL_S):
            r = gil_model(start, engine_ms / 1e3, 1e-4, bound_ms(costs, 16) / 1e3, switch, args.steps)
            results.append(r)
            print(f"  {engine_ms:.1f} ms of engine Python, switch interval {1e3 * r['switch_interval_s']:.1f} ms: ready "
                  f"{r['ready_ms']:.2f} ms (GIL-free work {r['work_ms']:.2f} ms)")
    cache.shutdown()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"command": " ".join(sys.argv), "cores": cores, "results": results}, fh, indent=1)


if __name__ == "__main__":
    threading.current_thread().name = "engine"
    main()
