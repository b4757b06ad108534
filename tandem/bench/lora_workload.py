"""The `lora` workload: random rank-16 adapters on all seven projections of a shape with random weights, against the
same shape's base model in one run: 32 sequences over 8 adapters, one adapter at batch 1, and 256 requests over 64
adapters through 16 device slots (paging in from host memory), at most 64 running; tok/s of each and its ratio to the
base model's pass of the same requests."""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from typing import Any

# (name, requests, adapters; 0: the base model) of each pass; each adapter pass is compared with the base pass of
# the same requests. At most MAX_RUNNING run at once: the paging pass runs 256 requests, 4 per adapter in a shuffled
# order, so that max_loras slots hold the adapters of up to MAX_RUNNING running requests while the others page in.
PASSES = (("base-32", 32, 0), ("8-adapters-32", 32, 8), ("base-1", 1, 0), ("1-adapter-1", 1, 1),
          ("base-256", 256, 0), ("64-adapters-256", 256, 64))
RANK = 16
MAX_RUNNING = 64


def write_adapter(folder: str, shapes: dict[str, list[int]], rank: int, seed: int) -> str:
    """A PEFT folder with a random rank-`rank` adapter on every module of `shapes` (name -> [in, out])."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (n_in, n_out) in shapes.items():
        # Small values: the adapters move the logits without making every token the same.
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * n_in**-0.5
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": sorted({m.rsplit(".", 1)[-1] for m in shapes})}, f)
    return folder


def _timed(llm: Any, prompts: list[list[int]], max_tokens: int, loras: list[Any] | None) -> tuple[float, int]:
    from tandem.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def pass_adapters(adapters: list[Any], num_requests: int, num_adapters: int) -> list[Any]:
    """The adapter of each request of a pass: the first num_adapters adapters in turn, shuffled (fixed seed) when
    there are more requests than running slots, so the pass pages adapters in and out as requests finish."""
    loras = [adapters[i % num_adapters] for i in range(num_requests)]
    if num_requests > MAX_RUNNING:
        random.Random(0).shuffle(loras)
    return loras


def run_lora_workload(model: str, scale: float = 1.0, prompt_len: int = 128, output_len: int = 256,
                      max_loras: int = 16) -> dict[str, Any]:
    """Base passes on an engine without LoRA, then the adapter passes on one with it (max_loras slots, 64 adapters
    in host memory: their host copies are made before the passes, so the paging pass measures copies from host
    memory into the device slots, not reads from disk), each after a warm-up of its own shape."""
    import torch

    from tandem import LLM, LoRARequest
    from tandem.bench.workloads import Workload, make_requests

    cuda = torch.cuda.is_available()
    prompt_len, output_len = max(1, int(prompt_len * scale)), max(2, int(output_len * scale))
    kwargs: dict[str, Any] = dict(model=model, load_format="dummy", max_model_len=prompt_len + output_len + 16,
                                  max_num_seqs=MAX_RUNNING)
    if not cuda:
        kwargs.update(device="cpu", dtype="float32")
    rows: list[dict[str, Any]] = []

    def run(llm: Any, name: str, num_seqs: int, loras: list[Any] | None) -> None:
        w = Workload(name, model, num_seqs, (prompt_len, prompt_len), (output_len, output_len))
        prompts = [p for p, _ in make_requests(w, llm.engine.model_config.vocab_size, seed=len(rows))]
        _timed(llm, prompts[: min(num_seqs, 8)], 4, None if loras is None else loras[: min(num_seqs, 8)])
        lora = llm.engine.runner.lora
        before = (lora.num_page_ins, lora.num_host_copies) if lora is not None else (0, 0)
        seconds, tokens = _timed(llm, prompts, output_len, loras)
        row = {"pass": name, "num_seqs": num_seqs, "seconds": seconds, "tokens_per_s": tokens / seconds}
        extra = ""
        if lora is not None:  # adapters copied into device slots, and host copies made (read from disk), in the pass
            row.update(page_ins=lora.num_page_ins - before[0], host_copies=lora.num_host_copies - before[1])
            extra = f" {row['page_ins']:>5} page-ins {row['host_copies']:>3} host copies"
        rows.append(row)
        print(f"{name:>16} {tokens / seconds:>10.1f} tok/s {seconds:>8.2f} s{extra}", flush=True)

    base = LLM(**kwargs)
    for name, num_seqs, num_adapters in PASSES:
        if num_adapters == 0:
            run(base, name, num_seqs, None)
    base.shutdown()
    del base
    llm = LLM(**kwargs, enable_lora=True, max_loras=max_loras, max_lora_rank=RANK, max_cpu_loras=64)
    shapes = {k: list(v) for k, v in llm.engine.runner.lora.module_shapes().items()}
    with tempfile.TemporaryDirectory(prefix="tandem-lora-bench-") as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, write_adapter(os.path.join(tmp, f"a{i}"), shapes, RANK, i))
                    for i in range(64)]
        for adapter in adapters:  # host copies made on the loader thread, before any pass is timed
            llm.engine.add_lora(adapter)
        llm.engine.runner.lora.wait_ready()
        for name, num_seqs, num_adapters in PASSES:
            if num_adapters:
                run(llm, name, num_seqs, pass_adapters(adapters, num_seqs, num_adapters))
    llm.shutdown()
    by_name = {r["pass"]: r for r in rows}
    ratios = {name: by_name[name]["tokens_per_s"] / by_name[f"base-{n}"]["tokens_per_s"]
              for name, n, k in PASSES if k}
    for name, ratio in ratios.items():
        print(f"{name} / base: {ratio:.3f}")
    return {"workload": "lora", "model": model, "rank": RANK, "max_loras": max_loras, "max_num_seqs": MAX_RUNNING,
            "prompt_len": prompt_len,
            "output_len": output_len, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "date": time.strftime("%Y-%m-%d"), "rows": rows, "vs_base": ratios}
