"""Per-kernel profile of one decode step (forward graph + sampling graph replay) for named random-weight shapes.

    python scripts/profile_decode.py --out out/profile [--workloads bs1,seed-async,nano] [--context 512]
        [--quantization fp8|int4|int8] [--kv-cache-dtype fp8] [--tensor-parallel-size 2] [--lora 8]

For each workload the engine is built with random weights of the named shape (load_format=dummy), every row
gets a prompt of --context tokens and decodes a few steps in sync mode; then the last decode step's slot is
re-uploaded from its pinned host buffers and its captured graphs are replayed: timed with CUDA events (median
step time), and profiled with torch.profiler (kernel name, launches per step, and per step the time each
kernel adds to the step: its end past its predecessor's end; raw durations overlap under PDL). The weight-bytes floor is weight bytes / a device-to-device copy bandwidth measured in the same run
(read + write bytes, the roofline convention of tandem.bench.roofline); the KV floor adds the K/V the step
reads. Writes profile_<workload>.json and .md per workload and summary.md into --out.

With --tensor-parallel-size N the graphs cannot be replayed on rank 0 alone (every rank takes part in the
all-reduces), so rank 0 is profiled over real decode steps instead (engine.step() in sync mode, which the other
ranks follow); its step time is then the sum of the added times (the GPU's span, host gaps left out), and the
floors are rank 0's shard's bytes.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem import LLM, SamplingParams  # noqa: E402
from tandem.bench.roofline import measure_ceilings, model_cost  # noqa: E402
from tandem.runner.cuda_graphs import sampler_variant  # noqa: E402

# workload -> (named shape, batch): the shapes of the bs1, seed-async and nano benchmarks (prefix: llama-3.2-1b).
WORKLOADS = {
    "bs1": ("llama-2-7b", 1),
    "bs1-8b": ("llama-3-8b", 1),
    "seed-async": ("llama-3-8b", 32),
    "batch-16": ("llama-3-8b", 16),  # the Llama-3-8B shape at 16 and 24 rows (the int4 many-row kernel's range)
    "batch-24": ("llama-3-8b", 24),
    "nano": ("qwen3-0.6b", 256),
    "prefix": ("llama-3.2-1b", 32),
    "70b-bs1": ("llama-3-70b", 1),  # needs --tensor-parallel-size >= 2 in bf16
    "70b-batch": ("llama-3-70b", 32),
    "moe-bs1": ("qwen3-30b-a3b", 1),  # 128 experts, top 8
    "lora-32": ("llama-3-8b", 32),  # the lora workload's 32-sequence pass (with --lora 8)
    "lora-64": ("llama-3-8b", 64),  # the paging pass's full batch (with --lora 16: every slot in use)
}
DECODE_STEPS = 4
REPLAYS = 10
BY_POSITION = False  # --by-position
KV_CACHE_DTYPE = "auto"  # --kv-cache-dtype
TENSOR_PARALLEL_SIZE = 1  # --tensor-parallel-size
LORA_ADAPTERS = 0  # --lora N: rows spread over N adapters (0: no LoRA)
LORA_SLOTS, LORA_RANK = 16, 16  # the lora workload's device slots and rank


def build(shape: str, batch: int, context: int, quantization: str | None = None) -> LLM:
    max_model_len = context + 64
    blocks_per_seq = -(-max_model_len // 16)
    lora = dict(enable_lora=True, max_loras=LORA_SLOTS, max_lora_rank=LORA_RANK) if LORA_ADAPTERS else {}
    return LLM(model=shape, load_format="dummy", dtype="bfloat16", device="cuda", max_model_len=max_model_len,
               max_num_seqs=batch, max_num_batched_tokens=max(8192, context), num_kv_blocks=batch * blocks_per_seq + 8,
               overlap=False, seed=0, quantization=quantization, kv_cache_dtype=KV_CACHE_DTYPE,
               tensor_parallel_size=TENSOR_PARALLEL_SIZE, **lora)


def adapters(llm: LLM, folder: str) -> list:
    """LORA_ADAPTERS random rank-LORA_RANK adapters on all seven projections (the lora workload's), written to
    folder."""
    from tandem import LoRARequest
    from tandem.bench.lora_workload import write_adapter

    engine = llm.engine
    shapes = {k: list(v) for k, v in engine.runner.lora.module_shapes().items()}
    return [LoRARequest(f"a{i}", i + 1, write_adapter(f"{folder}/a{i}", shapes, LORA_RANK, i))
            for i in range(LORA_ADAPTERS)]


def decode_a_few_steps(llm: LLM, batch: int, context: int, greedy: bool) -> None:
    import tempfile

    engine = llm.engine
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = (SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True) if greedy
              else SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, ignore_eos=True, seed=1))
    loras = adapters(llm, tempfile.mkdtemp(prefix="profile-lora-")) if LORA_ADAPTERS else []
    for lora in loras:  # host copies made on the loader thread before the requests come
        engine.add_lora(lora)
    if loras:
        engine.runner.lora.wait_ready()
    for i in range(batch):
        engine.add_request(f"p{i}", [rng.randrange(10, vocab - 10) for _ in range(context)], params,
                           lora_request=loras[i % len(loras)] if loras else None)
    decode_steps = 0
    for _ in range(10_000):
        engine.step()  # sync mode: each step is finished when step() returns
        running = engine.scheduler.running
        prefilled = len(running) == batch and all(r.num_computed_tokens > context for r in running)
        decode_steps += prefilled  # every row past its prompt: that step was decode-only
        if decode_steps >= DECODE_STEPS:
            break
    else:
        raise RuntimeError("the engine never reached decode with every row running")
    torch.cuda.synchronize()


def by_position(kernels: list[tuple[float, float, str]], layers: int) -> list[tuple[float, float, str]]:
    """Labels each launch of a kernel that runs k times a layer with its position in the layer ("name [i/k]"),
    so a table tells the projections' GEMMs (qkv, o, gate_up, down) apart."""
    counts = collections.Counter(name for _, _, name in kernels)
    seen: dict[str, int] = collections.defaultdict(int)
    out = []
    for start, end, name in kernels:
        per_step = counts[name] // REPLAYS
        k = per_step // layers if layers and per_step % layers == 0 else 0
        if k > 1:
            out.append((start, end, f"{name} [{seen[name] % per_step % k}/{k}]"))
        else:
            out.append((start, end, name))
        seen[name] += 1
    return out


def profile_kernels(fn, layers: int = 0) -> tuple[dict[str, list[float]], dict[str, float]]:  # type: ignore[no-untyped-def]
    """Over REPLAYS calls of fn: kernel name -> durations (us), and kernel name -> the step time it adds (us,
    summed): how far its end lies past the end of the kernel before it. Under programmatic dependent launch a
    kernel's programs start while its predecessor runs and wait, so durations overlap and overstate; the
    added time does not (the added times of a step sum to its span). Host-to-device copies left out."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = collections.defaultdict(list)
    added: dict[str, float] = collections.defaultdict(float)
    kernels = sorted(((evt.time_range.start, evt.time_range.end, evt.name) for evt in prof.events()
                      if evt.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in evt.name.lower()),
                     key=lambda e: e[1])  # host-side ops and the re-upload (not part of the step) left out
    if layers:
        kernels = by_position(kernels, layers)
    last_end = None
    for start, end, name in kernels:
        per_kernel[name].append(end - start)
        # A kernel that starts after the previous one ended (a replay's first) adds only its own duration.
        added[name] += end - (start if last_end is None or start > last_end else last_end)
        last_end = end
    return per_kernel, added


def profile_workload(name: str, context: int, copy_gbps: float, greedy: bool, quantization: str | None) -> dict:
    shape, batch = WORKLOADS[name]
    t0 = time.perf_counter()
    llm = build(shape, batch, context, quantization)
    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.graphs
    if graphs is None:
        raise RuntimeError("CUDA graphs are off; the profile is of graph replays")
    build_s = time.perf_counter() - t0
    decode_a_few_steps(llm, batch, context, greedy)
    slot = (runner.step_index - 1) % 2
    num_seqs = len(engine.scheduler.running)  # all decoding: the last step's batch
    graph_bs = graphs.padded_size(num_seqs)
    buf = runner.buffers[slot]
    variant = sampler_variant(greedy, not greedy, -1)
    stream = runner.streams.compute

    def replay() -> None:
        # Re-upload the slot's inputs first: the carry-over adds into input_ids, so a bare replay would
        # add the carried tokens twice.
        with torch.cuda.stream(stream):
            buf.upload(graph_bs)
            graphs.replay(slot, graph_bs)
            graphs.replay_sample(slot, graph_bs, variant)

    def upload_only() -> None:
        with torch.cuda.stream(stream):
            buf.upload(graph_bs)

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        times = []
        for _ in range(REPLAYS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    step_us = 0.0
    if TENSOR_PARALLEL_SIZE == 1:  # rank 0 alone would wait for its peers in the all-reduces
        replay()
        torch.cuda.synchronize()
        step_us = timed(replay) - timed(upload_only)

    def eager_step() -> None:
        # The same work launched kernel by kernel (only if the profiler cannot see inside graph replays).
        with torch.cuda.stream(stream), torch.inference_mode():
            buf.upload(graph_bs)
            logits = runner.executor.forward(slot, graph_bs, graph_bs, 1, runner.max_model_len, all_rows=True)
            runner.executor.sample_into(slot, logits, graph_bs, not variant.random, variant.top_k_top_p, -1)

    mode = "graph"
    layers = runner.model_config.num_layers if BY_POSITION else 0
    if TENSOR_PARALLEL_SIZE > 1:  # rank 0 over real steps (the other ranks replay with it)
        mode = f"rank 0 of {TENSOR_PARALLEL_SIZE}, real decode steps"
        per_kernel, added = profile_kernels(engine.step, layers)
    else:
        per_kernel, added = profile_kernels(replay, layers)
    if not per_kernel:
        mode = "eager (the profiler saw no kernels inside graph replays)"
        per_kernel, added = profile_kernels(eager_step, layers)
    total_us = sum(sum(v) for v in per_kernel.values()) / REPLAYS
    added_total = sum(added.values()) / REPLAYS
    if TENSOR_PARALLEL_SIZE > 1:
        step_us = added_total
    rows = sorted(
        ({"kernel": k, "time_us": sum(v) / REPLAYS, "count": len(v) / REPLAYS,
          "share": (sum(v) / REPLAYS) / total_us if total_us else 0.0,
          "added_us": added[k] / REPLAYS,
          "added_share": added[k] / REPLAYS / added_total if added_total else 0.0} for k, v in per_kernel.items()),
        key=lambda r: -r["added_us"],
    )
    cost = model_cost(runner.model, runner.model_config, TENSOR_PARALLEL_SIZE, kv_cache_dtype=runner.kv_cache.dtype)
    context_tokens = sum(r.num_computed_tokens for r in engine.scheduler.running)
    kv_bytes = context_tokens * cost.kv_bytes_per_token
    weight_floor_us = cost.weight_bytes / (copy_gbps * 1e9) * 1e6
    kv_floor_us = (cost.weight_bytes + kv_bytes) / (copy_gbps * 1e9) * 1e6
    result = {
        "workload": name, "shape": shape, "quantization": quantization, "lora_adapters": LORA_ADAPTERS,
        "batch": batch, "graph_batch_size": graph_bs,
        "context": context, "kv_cache_dtype": str(runner.kv_cache.dtype), "tensor_parallel_size": TENSOR_PARALLEL_SIZE,
        "sampler_variant": variant._asdict(), "profiled": mode, "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "build_s": round(build_s, 1),
        "step_us": step_us, "kernel_sum_us": total_us, "added_sum_us": added_total, "copy_gbps": copy_gbps,
        "weight_bytes": cost.weight_bytes, "kv_bytes": kv_bytes,
        "weight_floor_us": weight_floor_us, "weight_kv_floor_us": kv_floor_us,
        "roofline_fraction": kv_floor_us / step_us if step_us > 0 else None,
        "kernels": rows,
    }
    del engine, runner, graphs
    llm.shutdown()  # a tensor-parallel engine leaves its process group, so the next workload can make one
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def markdown(res: dict) -> str:
    lines = [
        f"### {res['workload']}: {res['shape']}{' ' + res['quantization'] if res.get('quantization') else ''}"
        f"{' over %d LoRA adapters' % res['lora_adapters'] if res.get('lora_adapters') else ''} at batch "
        f"{res['batch']}, context {res['context']}, KV cache {res.get('kv_cache_dtype', 'bf16')} ({res['device']})",
        "",
        f"step {res['step_us']:.1f} us (kernels sum {res['kernel_sum_us']:.1f} us, added times sum "
        f"{res['added_sum_us']:.1f} us); weight floor "
        f"{res['weight_floor_us']:.1f} us, weight + KV floor {res['weight_kv_floor_us']:.1f} us "
        f"(copy {res['copy_gbps']:.0f} GB/s): roofline fraction {res['roofline_fraction']:.3f}; "
        f"profiled: {res['profiled']}",
        "",
        "`added us`: how much later the step ends because of the kernel (its end past its predecessor's end),",
        "summed per name; `time us`: its durations, which overlap under programmatic dependent launch.",
        "",
        "| kernel | added us | added share | count | time us |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in res["kernels"]:
        name = r["kernel"].replace("|", "/")
        name = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"| `{name}` | {r['added_us']:.1f} | {100 * r['added_share']:.1f}% | {r['count']:g} | "
                     f"{r['time_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON and markdown tables")
    parser.add_argument("--workloads", default="bs1,seed-async,nano", help=f"comma list of {sorted(WORKLOADS)}")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per row")
    parser.add_argument("--sampling", choices=("greedy", "top-p"), default="greedy")
    parser.add_argument("--quantization", choices=("fp8", "int4", "int8"), default=None,
                        help="FP8 or 4- / 8-bit integer weights (the weight floor counts their stored bytes)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="fp8: an FP8 KV cache (KV floor in its FP8 bytes)")
    parser.add_argument("--by-position", action="store_true",
                        help="one row per position in the layer for kernels that run several times a layer")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="N > 1: rank 0 of N profiled over real decode steps (see above)")
    parser.add_argument("--lora", type=int, default=0,
                        help=f"N > 0: LoRA on, the rows spread over N random rank-{LORA_RANK} adapters on all seven "
                             f"projections ({LORA_SLOTS} device slots; N <= {LORA_SLOTS})")
    args = parser.parse_args()
    global BY_POSITION, KV_CACHE_DTYPE, TENSOR_PARALLEL_SIZE, LORA_ADAPTERS
    if not 0 <= args.lora <= LORA_SLOTS:
        raise SystemExit(f"--lora must be 0 to {LORA_SLOTS}")
    LORA_ADAPTERS = args.lora
    BY_POSITION = args.by_position
    KV_CACHE_DTYPE = args.kv_cache_dtype
    TENSOR_PARALLEL_SIZE = args.tensor_parallel_size
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py needs a CUDA GPU")
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {sorted(WORKLOADS)}")
    if args.context < 1:
        raise SystemExit("--context must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    copy_gbps = measure_ceilings(torch.device("cuda")).copy_gbps
    torch.cuda.empty_cache()
    print(f"copy bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)
    summary = []
    for name in names:
        t0 = time.perf_counter()
        res = profile_workload(name, args.context, copy_gbps, args.sampling == "greedy", args.quantization)
        (out / f"profile_{name}.json").write_text(json.dumps(res, indent=2))
        md = markdown(res)
        (out / f"profile_{name}.md").write_text(md)
        summary.append(md)
        print(md, flush=True)
        print(f"({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    (out / "summary.md").write_text("\n".join(summary))


if __name__ == "__main__":
    main()
