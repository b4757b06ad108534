"""Per-kernel profile of a benchmark workload's prefill phase: every step until the last prompt is prefilled
(prefill-only and mixed prefill + decode steps), as the benchmark schedules them.

    python scripts/profile_prefill.py --out out/prefill [--workloads nano,seed-async] [--quantization fp8]

Builds the engine the way `tandem bench` does for the workload (random weights of its named shape, its
requests from the fixed seed), warms it up, then steps it in sync mode under torch.profiler until every
request has its prompt in the KV cache. Kernel durations are summed per name over those steps (with CUDA
graphs, the piecewise graphs' kernels included) and compared with the steps' wall time and with the
roofline floor of tandem.bench.roofline (matmul FLOPs at the measured GEMM ceiling, bytes at copy bandwidth).
Writes prefill_<workload>.json and .md into --out.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.bench.roofline import floor_seconds, measure_ceilings, model_cost  # noqa: E402
from tandem.bench.workloads import WORKLOADS, make_requests  # noqa: E402


def build(name: str, quantization: str | None, device: str, limit: int | None
          ) -> tuple[LLM, list[tuple[list[int], int]]]:
    w = WORKLOADS[name]
    if w.model is None:
        raise SystemExit(f"{name} runs the embedded model; profile a named shape")
    max_len = max(w.prompt_len) + max(w.output_len) + w.shared_prefix_len
    dtype = w.dtype if device == "cuda" else "float32"
    llm = LLM(model=w.model, load_format="dummy", dtype=dtype, device=device, max_model_len=max_len + 16,
              max_num_seqs=max(min(w.num_requests, 256), 1), quantization=quantization, overlap=False)
    return llm, make_requests(w, llm.engine.model_config.vocab_size)[:limit]


def prefill_phase(llm: LLM, requests: list[tuple[list[int], int]], tag: str) -> list[object]:
    """Adds every request and steps until all prompts are in the cache; returns the engine's step log entries
    of those steps (for the roofline floor)."""
    engine = llm.engine
    engine.step_log = []
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(f"{tag}{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    prompt_lens = {f"{tag}{i}": len(p) for i, (p, _) in enumerate(requests)}
    for _ in range(100_000):
        engine.step()
        reqs = list(engine.scheduler.running) + list(engine.scheduler.waiting)
        if not any(r.num_computed_tokens < prompt_lens[r.request_id] for r in reqs):
            break
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    log, engine.step_log = engine.step_log, None
    return log


def finish(llm: LLM) -> None:
    engine = llm.engine
    while engine.has_unfinished_requests():
        for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
            engine.abort_request(r.request_id)
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile(name: str, quantization: str | None, device: str = "cuda", limit: int | None = None) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    t0 = time.perf_counter()
    llm, requests = build(name, quantization, device, limit)
    build_s = time.perf_counter() - t0
    prefill_phase(llm, requests[:8], "warm")  # compiles, allocator caches
    finish(llm)
    llm.engine.scheduler.reset_prefix_cache()
    start = time.perf_counter()
    log = prefill_phase(llm, requests, "timed")  # timed without the profiler
    wall_s = time.perf_counter() - start
    finish(llm)
    llm.engine.scheduler.reset_prefix_cache()
    with torch_profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
        prefill_phase(llm, requests, "prof")
    finish(llm)
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in evt.name.lower():
            per_kernel[evt.name].append(evt.time_range.end - evt.time_range.start)
    total_us = sum(sum(v) for v in per_kernel.values())
    ceilings = measure_ceilings(torch.device(device), fp8=quantization == "fp8")
    cost = model_cost(llm.engine.runner.model, llm.engine.model_config,
                      kv_cache_dtype=llm.engine.runner.kv_cache.dtype)
    floor = floor_seconds(log, cost, ceilings)
    rows = sorted(({"kernel": k, "time_us": sum(v), "count": len(v), "share": sum(v) / total_us}
                   for k, v in per_kernel.items()), key=lambda r: -r["time_us"])
    result = {
        "workload": name, "quantization": quantization,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "build_s": round(build_s, 1), "steps": len(log),
        "tokens": sum(len(p) for p, _ in requests), "wall_s": wall_s, "kernel_sum_s": total_us / 1e6,
        "floor_s": floor, "roofline_fraction": floor / wall_s if wall_s else None,
        "ceilings": dataclasses.asdict(ceilings), "kernels": rows,
    }
    llm.shutdown()
    return result


def markdown(res: dict) -> str:
    lines = [
        f"### {res['workload']}{' ' + res['quantization'] if res['quantization'] else ''}: prefill phase "
        f"({res['device']})", "",
        f"{res['steps']} steps, {res['tokens']} prompt tokens: wall {res['wall_s'] * 1e3:.1f} ms (sync mode, no "
        f"profiler), kernels sum {res['kernel_sum_s'] * 1e3:.1f} ms (profiled run), floor "
        f"{res['floor_s'] * 1e3:.1f} ms: roofline fraction {res['roofline_fraction']:.3f}", "",
        "| kernel | time ms | share | count |", "|---|---:|---:|---:|",
    ]
    for r in res["kernels"][:40]:
        name = r["kernel"].replace("|", "/")
        name = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"| `{name}` | {r['time_us'] / 1e3:.2f} | {100 * r['share']:.1f}% | {r['count']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON and markdown tables")
    parser.add_argument("--workloads", default="nano", help="comma list of benchmark workloads with a named shape")
    parser.add_argument("--quantization", choices=("fp8",), default=None)
    parser.add_argument("--requests", type=int, default=None, help="only the first N requests (smoke runs)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run of the script")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("profile_prefill.py needs a CUDA GPU (--device cpu for a smoke run)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in (w.strip() for w in args.workloads.split(",") if w.strip()):
        if name not in WORKLOADS:
            raise SystemExit(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
        res = profile(name, args.quantization, args.device, args.requests)
        suffix = f"_{args.quantization}" if args.quantization else ""
        (out / f"prefill_{name}{suffix}.json").write_text(json.dumps(res, indent=1))
        md = markdown(res)
        (out / f"prefill_{name}{suffix}.md").write_text(md)
        print(md, flush=True)


if __name__ == "__main__":
    main()
