"""Grammar-mask time on the CPU, per backend: the rows of a batch of requests under one JSON schema, filled the way
the engine fills them (HostMask.fill_rows) step after step, each request taking a random allowed token.

    python scripts/bench_grammar_masks.py [--rows 32] [--steps 120] [--vocab-size 128256] [--out masks.json]

The vocabulary is the synthetic one of random-weight shapes (structured.grammar.synthetic_vocab) and the schema
the `structured` workload's, so the figures are the CPU side of that workload's mask time per step.
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


def run(backend: str, rows: int, steps: int, vocab_size: int, seed: int) -> dict[str, object]:
    os.environ["TANDEM_STRUCTURED_BACKEND"] = backend
    cache = GrammarCache(None, vocab_size, [vocab_size - 1])
    compiled = cache.submit(StructuredOutputParams(json=json.dumps(SCHEMA))).result()
    masks = [HostMask(compiled) for _ in range(rows)]
    bits = torch.zeros(rows, (vocab_size + 31) // 32, dtype=torch.int32)
    rng = random.Random(seed)
    step_ms, done = [], 0
    for _ in range(steps):
        live = [(j, m, []) for j, m in enumerate(masks) if not m.is_terminated]
        if not live:
            break
        start = time.perf_counter()
        HostMask.fill_rows(bits, live)
        step_ms.append(1e3 * (time.perf_counter() - start))
        for j, mask, _ in live:
            row = bits[j].numpy().view(np.uint8)
            allowed = np.flatnonzero(np.unpackbits(row, bitorder="little")[:vocab_size])
            mask.accept(int(allowed[rng.randrange(len(allowed))]))
            done += mask.is_terminated
    cache.shutdown()
    return {"backend": backend, "rows": rows, "steps": len(step_ms), "vocab_size": vocab_size,
            "threads": len(os.sched_getaffinity(0)), "mean_ms_per_step": statistics.mean(step_ms),
            "median_ms_per_step": statistics.median(step_ms), "max_ms_per_step": max(step_ms),
            "finished_rows": done}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = [run(b, args.rows, args.steps, args.vocab_size, args.seed) for b in BACKENDS]
    print(f"{'backend':>10} {'steps':>5} {'mean ms':>8} {'median ms':>9} {'max ms':>7}  ({args.rows} rows a step)")
    for r in results:
        print(f"{r['backend']:>10} {r['steps']:>5} {r['mean_ms_per_step']:>8.2f} {r['median_ms_per_step']:>9.2f} "
              f"{r['max_ms_per_step']:>7.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python scripts/bench_grammar_masks.py", "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
