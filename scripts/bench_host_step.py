"""Host-side cost of one engine step (schedule, prepare the slot, apply tokens) at a large batch, on the CPU.

The GPU never appears here: a tiny dummy model only supplies the runner's buffers, and "sampled" tokens are
made up. What is timed is exactly the CPU work that must fit inside one GPU step for the GPU never to wait:
`Scheduler.schedule`, `ModelRunner._prepare` (the pinned-slot writes) and `EngineCore._update`. The default
shape is the `prefix` workload's decode phase (256 requests, 1088-token prompts, Llama-3.2-1B block count).
--shared-prefix N makes the first N prompt tokens common to every request (the `prefix` workload: 1024) and
also reports `Scheduler.schedule` of each admitting (prefill) step, where the prefix cache looks every prompt up.

    python scripts/bench_host_step.py [--requests 256] [--prompt-len 1088] [--shared-prefix 1024] [--steps 128]
                                      [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import time

from tandem.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1088)
    ap.add_argument("--steps", type=int, default=128, help="decode steps timed after the prefill")
    ap.add_argument("--shared-prefix", type=int, default=0, help="leading prompt tokens common to every request")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    args = ap.parse_args()

    tiny = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512}
    config = EngineConfig(model="llama-3.2-1b", load_format="dummy", hf_overrides=tiny, device="cpu",
                          dtype="float32", max_num_seqs=args.requests, max_model_len=args.prompt_len + args.steps + 64,
                          num_kv_blocks=args.requests * ((args.prompt_len + args.steps + 64) // 16 + 2),
                          max_num_batched_tokens=8192, cuda_graph=False)
    engine = EngineCore(config)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    shared = [rng.randrange(1, 500) for _ in range(min(args.shared_prefix, args.prompt_len))]
    for i in range(args.requests):
        unique = [rng.randrange(1, 500) for _ in range(args.prompt_len - len(shared))]
        engine.add_request(f"r{i}", shared + unique, params)
    runner, scheduler = engine.runner, engine.scheduler
    # Prefill through the scheduler alone (no forward): mark every prompt computed.
    admit_ms = []
    while scheduler.waiting:
        t0 = time.perf_counter()
        sched = scheduler.schedule()
        admit_ms.append(round((time.perf_counter() - t0) * 1e3, 3))
        engine._update(sched, [1] * len(sched.scheduled), None)

    times: dict[str, list[float]] = {"schedule": [], "prepare": [], "update": []}
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    for step in range(args.steps):
        t0 = time.perf_counter()
        sched = scheduler.schedule()
        t1 = time.perf_counter()
        runner.prepare(sched)
        t2 = time.perf_counter()
        engine._update(sched, [rng.randrange(1, 500) for _ in sched.scheduled], None)
        t3 = time.perf_counter()
        times["schedule"].append(t1 - t0)
        times["prepare"].append(t2 - t1)
        times["update"].append(t3 - t2)
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    # Medians: this 2-core machine is shared, and a mean would mostly measure the neighbours.
    per_step = {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
    per_step["total"] = round(sum(per_step.values()), 3)
    print(json.dumps({"requests": args.requests, "prompt_len": args.prompt_len, "shared_prefix": len(shared),
                      "admitting_schedule_ms": admit_ms, "median_ms_per_step": per_step,
                      "us_per_request": round(per_step["total"] * 1e3 / args.requests, 2)}))


if __name__ == "__main__":
    main()
