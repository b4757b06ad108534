"""Grammar-mask time on the CPU, per backend: the rows of a batch of requests under one JSON schema, filled the way
the engine fills them (HostMask.fill_rows) step after step, each request taking a random allowed token.

    python scripts/bench_grammar_masks.py [--rows 32] [--steps 120] [--vocab-size 128256] [--sequential]
                                          [--out masks.json]

The vocabulary is the synthetic one of random-weight shapes (structured.grammar.synthetic_vocab) and the schema
the `structured` workload's, so the figures are the CPU side of that workload's mask time per step. A step is the
rows' fill and then their tokens reaching the matchers (`accept ms`). With --sequential each backend also runs one
call per row for both (the rows one after another on one thread), beside the engine's threaded calls.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import numpy as np
import torch

from tandem.bench.structured_workload import SCHEMA
from tandem.sampling_params import StructuredOutputParams
from tandem.structured.grammar import BACKENDS, GrammarCache
from tandem.structured.matcher import HostMask


def run(backend: str, rows: int, steps: int, vocab_size: int, seed: int, sequential: bool) -> dict[str, object]:
    os.environ["TANDEM_STRUCTURED_BACKEND"] = backend
    cache = GrammarCache(None, vocab_size, [vocab_size - 1])
    compiled = cache.submit(StructuredOutputParams(json=json.dumps(SCHEMA))).result()
    masks = [HostMask(compiled) for _ in range(rows)]
    bits = torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)
    rng = random.Random(seed)
    step_ms, accept_ms, done = [], [], 0
    for _ in range(steps):
        live = [(j, m, []) for j, m in enumerate(masks) if not m.is_terminated]
        if not live:
            break
        start = time.perf_counter()
        if sequential:
            for row in live:
                HostMask.fill_rows(bits, [row])
        else:
            HostMask.fill_rows(bits, live)
        step_ms.append(1e3 * (time.perf_counter() - start))
        tokens = []
        for j, mask, _ in live:
            row = bits[j].numpy().view(np.uint8)
            allowed = np.flatnonzero(np.unpackbits(row, bitorder="little")[:vocab_size])
            tokens.append((mask, int(allowed[rng.randrange(len(allowed))])))
        start = time.perf_counter()
        if sequential:
            assert all(mask.accept(token) for mask, token in tokens)
        else:
            assert HostMask.accept_all(tokens) == 0
        accept_ms.append(1e3 * (time.perf_counter() - start))
        done += sum(mask.is_terminated for mask, _ in tokens)
    cache.shutdown()
    return {"backend": backend, "calls": "one per row" if sequential else "threaded", "rows": rows,
            "steps": len(step_ms), "vocab_size": vocab_size, "threads": len(os.sched_getaffinity(0)),
            "mean_ms_per_step": statistics.mean(step_ms), "median_ms_per_step": statistics.median(step_ms),
            "max_ms_per_step": max(step_ms), "mean_accept_ms_per_step": statistics.mean(accept_ms),
            "finished_rows": done}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequential", action="store_true", help="also one call per row, one row after another")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = [run(b, args.rows, args.steps, args.vocab_size, args.seed, seq) for b in BACKENDS
               for seq in ((False, True) if args.sequential else (False,))]
    print(f"{'backend':>10} {'calls':>11} {'steps':>5} {'mean ms':>8} {'median ms':>9} {'max ms':>7} "
          f"{'accept ms':>9}  ({args.rows} rows a step)")
    for r in results:
        print(f"{r['backend']:>10} {r['calls']:>11} {r['steps']:>5} {r['mean_ms_per_step']:>8.2f} "
              f"{r['median_ms_per_step']:>9.2f} {r['max_ms_per_step']:>7.1f} {r['mean_accept_ms_per_step']:>9.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python scripts/bench_grammar_masks.py" + (" --sequential" * args.sequential),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
