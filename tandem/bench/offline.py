"""`tandem bench` (offline throughput of the named workloads, peers side by side) and `tandem profile`."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from tandem.bench.workloads import WORKLOADS, Workload, make_requests
from tandem.config import KV_CACHE_DTYPES, environment


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def run_tandem(llm: Any, requests: list[tuple[list[int], int]], *, overlap: bool = True, graphs: bool = True,
               record: bool = False) -> dict[str, Any]:
    """One timed pass of `requests` through an existing LLM; ablations flip the engine between passes."""
    if llm.config.data_parallel_size > 1:
        return run_data_parallel(llm, requests, overlap=overlap, graphs=graphs, record=record)
    engine = llm.engine
    saved_graphs = engine.runner.graphs, engine.runner.piecewise
    engine.overlap = overlap
    if not graphs:
        engine.runner.graphs = engine.runner.piecewise = None
    engine.step_log = []
    tl = engine.start_timeline() if record else None
    r = _timed_generate(llm, requests)
    if record:
        engine.stop_timeline()
    step_log, engine.step_log = engine.step_log, None
    (engine.runner.graphs, engine.runner.piecewise), engine.overlap = saved_graphs, llm.config.overlap
    r.update({
        "num_steps": len(step_log),
        "gpu_busy_pct": tl.gpu_busy_pct() if tl is not None else None,
        # Tensor parallelism: every rank's GPU ("gpu" is rank 0, "gpu1".. the others).
        "gpu_busy_pct_per_rank": {n: tl.gpu_busy_pct(n) for n in tl.gpu_lanes()} if tl is not None else None,
        "_timeline": tl, "_step_log": step_log,
    })
    return r


def run_data_parallel(llm: Any, requests: list[tuple[list[int], int]], *, overlap: bool = True,
                      graphs: bool = True, record: bool = False) -> dict[str, Any]:
    """One timed pass through data-parallel replicas: tokens/s only, since their steps, GPU spans and
    engine switches live in other processes."""
    if not overlap or not graphs or record:
        raise ValueError("--sync, --no-cuda-graph and timelines need data_parallel_size=1: "
                         "the replicas run in other processes")
    r = _timed_generate(llm, requests)
    r.update({"num_steps": None, "gpu_busy_pct": None, "gpu_busy_pct_per_rank": None, "_timeline": None,
              "_step_log": None})
    return r


def _timed_generate(llm: Any, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    from tandem import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt = sum(len(p) for p, _ in requests)
    return {
        "seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
        "total_tokens_per_s": (generated + prompt) / seconds, "_outputs": [o.outputs[0].token_ids for o in outs],
    }


def run_hf_generate_batch(model_ref: Any, requests: list[tuple[list[int], int]], device: str) -> dict[str, Any]:
    """transformers continuous batching (`generate_batch`, or its manager for per-request lengths)."""
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = model_ref
    lengths = {n for _, n in requests}
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(lengths), eos_token_id=-1, pad_token_id=0)
    max_len = max(len(p) + n for p, n in requests)
    cb = ContinuousBatchingConfig(
        num_blocks=None if device.startswith("cuda") else (len(requests) * max_len) // 256 + 8,
        max_batch_tokens=None if device.startswith("cuda") else 1024,
    )
    inputs = [p for p, _ in requests]
    start = time.perf_counter()
    if len(lengths) == 1:
        results = model.generate_batch(inputs, generation_config=gen, continuous_batching_config=cb,
                                       progress_bar=False)
        generated = sum(len(r.generated_tokens) for r in results.values())
    else:
        generated = 0
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb) as mgr:
            ids = [mgr.add_request(p, max_new_tokens=n) for p, n in requests]
            done = 0
            while done < len(ids):
                r = mgr.get_result(timeout=5)
                if r is not None and r.is_finished():
                    generated += len(r.generated_tokens)
                    done += 1
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds}


def run_hf_generate(model: Any, requests: list[tuple[list[int], int]], device: str,
                    cache_implementation: str | None = None) -> dict[str, Any]:
    """transformers `model.generate` (static batching), one request at a time: the bs1 peer."""
    import torch

    generated, start = 0, time.perf_counter()
    for prompt, n in requests:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             cache_implementation=cache_implementation, pad_token_id=0)
        generated += out.shape[1] - len(prompt)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds}


def load_hf_peer(w: Workload, dtype: str, device: str) -> Any:
    """The same model for transformers: the GGUF via its loader, or random weights of the named shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandem.config import DTYPES
    from tandem.models.loader import NAMED_SHAPES, default_model_path

    torch_dtype = DTYPES[dtype]
    if w.model is None:
        path = default_model_path()
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch_dtype)
    else:
        config = AutoConfig.for_model(**NAMED_SHAPES[w.model])
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return model.to(device).eval()


def bench_workload(w: Workload, peers: list[str], scale: float, out_dir: str | None,
                   quantization: str | None = None, tensor_parallel_size: int = 1,
                   data_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                   quantize_lm_head: bool = False, expert_parallel: bool = False,
                   checkpoint: str | None = None, speculative_config: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    import torch

    from tandem import LLM
    from tandem.bench.roofline import floor_seconds, measure_ceilings, model_cost, moe_routing_scale, step_classes

    device = w.device if (w.device != "cuda" or torch.cuda.is_available()) else "cpu"
    dtype = w.dtype if device.startswith("cuda") else "float32"
    result: dict[str, Any] = {"workload": w.name, "what": w.what, "device": _device_name(device), "dtype": dtype,
                              "scale": scale, "date": time.strftime("%Y-%m-%d"), "quantization": quantization,
                              "quantize_lm_head": quantize_lm_head,
                              "kv_cache_dtype": kv_cache_dtype, "peers": {},
                              "tensor_parallel_size": tensor_parallel_size, "data_parallel_size": data_parallel_size,
                              "enable_expert_parallel": expert_parallel, "checkpoint": checkpoint,
                              "speculative_config": speculative_config}
    peer_results: dict[str, Any] = {}
    vocab = None
    # transformers first, then free it, so tandem can size its KV cache from what is left.
    if "hf" in peers:
        hf = load_hf_peer(w, dtype, device)
        vocab = hf.config.vocab_size
        requests = make_requests(w, vocab, scale=scale)
        warm = [(p, min(n, 4)) for p, n in requests[: min(4, len(requests))]]
        if w.num_requests == 1:  # bs1, bs1-8b
            run_hf_generate(hf, warm[:1], device)
            peer_results["transformers generate (dynamic cache)"] = run_hf_generate(hf, requests, device)
            peer_results["transformers generate (static cache)"] = run_hf_generate(hf, requests, device, "static")
        else:
            run_hf_generate_batch(hf, warm, device)
            peer_results["transformers generate_batch"] = run_hf_generate_batch(hf, requests, device)
        del hf
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    llm_kwargs: dict[str, Any] = dict(dtype=dtype, device=device, max_num_seqs=max(min(w.num_requests, 256), 1),
                                      quantization=quantization, quantize_lm_head=quantize_lm_head,
                                      kv_cache_dtype=kv_cache_dtype,
                                      tensor_parallel_size=tensor_parallel_size,
                                      enable_expert_parallel=expert_parallel,
                                      data_parallel_size=data_parallel_size)
    if w.model is not None:
        llm_kwargs.update(model=w.model, load_format="dummy")
    if speculative_config is not None:
        llm_kwargs["speculative_config"] = _bench_speculative_config(speculative_config, w)
    # The workload's own weights, for the bf16 peer (a checkpoint replaces them for tandem's runs only).
    own_weights = {k: llm_kwargs[k] for k in ("model", "load_format") if k in llm_kwargs}
    if checkpoint is not None:  # its tokenizer is not needed (the prompts are token ids) and can take minutes to build
        llm_kwargs.update(model=checkpoint, load_format="auto", skip_tokenizer_init=True)
    max_len = max(w.prompt_len) + max(w.output_len) + w.shared_prefix_len
    llm_kwargs["max_model_len"] = max(int(max_len * scale) + 16, 64)
    if data_parallel_size > 1:
        return bench_data_parallel(result, peer_results, w, peers, scale, llm_kwargs)
    with environment({"TANDEM_MOE_ROUTE_STATS": "1"}):  # MoE layers count the experts they route to
        llm = LLM(**llm_kwargs)
    vocab = llm.engine.model_config.vocab_size
    requests = make_requests(w, vocab, scale=scale)
    warm = [(p, min(n, 4)) for p, n in requests[: min(8, len(requests))]]
    run_tandem(llm, warm)  # compile kernels, fill allocator caches
    llm.engine.scheduler.reset_prefix_cache()
    counters = [b for n, b in llm.engine.runner.model.named_buffers() if n.endswith("routed_experts")]
    for counter in counters:
        counter.zero_()
    main = run_tandem(llm, requests, record=True)
    routed = sum(int(c) for c in counters)  # after the timed run: the host reads them once
    ceilings = measure_ceilings(torch.device(device), fp8=quantization == "fp8")
    cost = model_cost(llm.engine.runner.model, llm.engine.model_config, tensor_parallel_size,
                      llm.engine.runner.kv_cache.dtype)
    if counters:
        scale_ = moe_routing_scale(routed, main["_step_log"], cost, len(counters))
        result["moe_routing"] = {"distinct_experts_routed": routed, "moe_layers": len(counters),
                                 "over_uniform_estimate": scale_}
        cost = replace(cost, routing_scale=scale_)
    floor = floor_seconds(main["_step_log"], cost, ceilings)
    group = llm.engine.runner.group
    if group is not None:
        # A step's all-reduces (2 per layer + the embedding's) of [tokens, hidden], eager, between steps.
        mc = llm.engine.model_config
        result["all_reduce_ms_per_step"] = {
            str(t): group.measure_all_reduce(t, mc.hidden_size, 2 * mc.num_layers + 1)
            for t in sorted({1, llm_kwargs["max_num_seqs"]})
        }
    variants: dict[str, Callable[[], dict[str, Any]]] = {}
    if "sync" in peers:
        variants["tandem --sync"] = lambda: run_tandem(llm, requests, overlap=False, record=True)
    if "eager" in peers and llm.engine.runner.graphs is not None:
        variants["tandem --no-cuda-graph"] = lambda: run_tandem(llm, requests, graphs=False)
    for name, fn in variants.items():
        llm.engine.scheduler.reset_prefix_cache()
        r = fn()
        r["same_tokens_as_main"] = r["_outputs"] == main["_outputs"]
        r.update(token_agreement(r["_outputs"], main["_outputs"]))
        peer_results[name] = r
    if w.shared_prefix_len and "noprefix" in peers:
        result["prefix_cache"] = prefix_ablation(llm, requests, main["_outputs"])
    moe = llm.engine.model_config.num_experts > 0
    if tensor_parallel_size > 1 and moe and "ep" in peers:
        # The other way of spreading the experts (whole experts per rank <-> every expert sharded), in a fresh
        # engine; same floor (per-rank expert bytes are the same on average). Dummy weights differ per layout.
        llm.shutdown()
        llm = None
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        r = run_fresh_tandem({**llm_kwargs, "enable_expert_parallel": not expert_parallel}, requests, warm)
        r["roofline_fraction"] = floor / r["seconds"]
        peer_results["tandem TP experts" if expert_parallel else "tandem EP experts"] = r
    tp_sizes = tensor_parallel_peer_sizes(peers, tensor_parallel_size)
    if tp_sizes:
        # The same requests on fewer GPUs, after the sharded engine has freed every GPU.
        if llm is not None:
            llm.shutdown()
        del llm
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        llm = None
    for size in tp_sizes:
        try:
            if size == 1:  # in a fresh engine of this process
                r = run_fresh_tandem({**llm_kwargs, "tensor_parallel_size": 1}, requests, warm)
            else:  # in a child process: only a process's first tensor-parallel group gets the peer-to-peer all-reduce
                r = run_tensor_parallel_peer(w, size, scale, quantization, kv_cache_dtype, quantize_lm_head,
                                             expert_parallel)
        except (ValueError, torch.OutOfMemoryError, TensorParallelPeerError) as exc:  # e.g. a 70B shape on one GPU
            result[f"tp{size}_error"] = f"{type(exc).__name__}: {exc}"
            continue
        # Dummy weights are drawn per shard, so another TP size is another random model: tokens comparable only
        # for real checkpoints (the tests check TP=2 == TP=1 on those).
        if w.model is None and "_outputs" in r:
            r["same_tokens_as_main"] = r["_outputs"] == main["_outputs"]
            r.update(token_agreement(r["_outputs"], main["_outputs"]))
        peer_results[f"tandem TP={size}"] = r
    timelines = {"tandem (overlap)": main["_timeline"]}
    for name in ("tandem --sync", "tandem TP=1"):
        if name in peer_results:
            timelines[name] = peer_results[name]["_timeline"]
    if out_dir is not None:
        from tandem.profiling.timeline import plot_timelines

        os.makedirs(out_dir, exist_ok=True)
        plot_timelines({k: v for k, v in timelines.items() if v is not None},
                       os.path.join(out_dir, f"timeline-{w.name}.png"), max_seconds=0.06, start_frac=0.5)
    result.update({
        "tokens_per_s": main["tokens_per_s"], "total_tokens_per_s": main["total_tokens_per_s"],
        "seconds": main["seconds"], "generated_tokens": main["generated_tokens"], "num_steps": main["num_steps"],
        "gpu_busy_pct": main["gpu_busy_pct"], "gpu_busy_pct_per_rank": main["gpu_busy_pct_per_rank"],
        "roofline_floor_s": floor, "roofline_fraction": floor / main["seconds"],
        "step_classes": step_classes(main["_step_log"], main["_timeline"], cost, ceilings),
        "ceilings": {"copy_gbps": ceilings.copy_gbps, "matmul_tflops": ceilings.matmul_tflops,
                     "fp8_matmul_tflops": ceilings.fp8_matmul_tflops},
        "weight_bytes": cost.weight_bytes,
        "expert_bytes": cost.expert_bytes,  # MoE: a step reads the share its tokens route to (roofline.py)
    })
    if (quantization is not None or kv_cache_dtype != "auto" or checkpoint is not None) and "bf16" in peers:
        # The same workload unquantized (bf16 weights and KV cache), in a fresh engine once this one's memory is
        # back (each sizes its KV cache from what is free): the ratio fp8 / bf16 lands in
        # result["ratios"]["tandem bf16"].
        if llm is not None:
            llm.shutdown()  # frees its GPU memory now and, with tensor parallelism, its process group
        del llm
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        unquantized = {k: v for k, v in llm_kwargs.items() if k not in ("model", "load_format")}
        llm = LLM(**{**unquantized, **own_weights, "quantization": None, "quantize_lm_head": False,
                     "kv_cache_dtype": "auto"})
        run_tandem(llm, warm)
        llm.engine.scheduler.reset_prefix_cache()
        r = run_tandem(llm, requests)
        r.update(token_agreement(r["_outputs"], main["_outputs"]))
        r["weight_bytes"] = model_cost(llm.engine.runner.model, llm.engine.model_config).weight_bytes
        peer_results["tandem bf16"] = r
    # Peers in a fresh engine each, once the main one's memory is back. Kernel-path ablations switch one path off
    # through its environment switch (read when graphs are captured, so it must be set before the engine exists);
    # nospec runs without speculative decoding (no head, no copied hidden states, the KV pool sized without them).
    fresh: list[tuple[str, dict[str, str], dict[str, Any]]] = []
    if speculative_config is not None and "nospec" in peers:
        fresh.append(("tandem without speculation", {},
                      {k: v for k, v in llm_kwargs.items() if k != "speculative_config"}))
    if device.startswith("cuda"):
        fresh += [(label, env, llm_kwargs) for peer, label, env in (
            ("nopdl", "tandem without PDL", {"TANDEM_PDL": "0"}),
            ("nogemv", "tandem without GEMV", {"TANDEM_GEMV_MAX_ROWS": "0"})) if peer in peers]
    for label, env, kwargs in fresh:
        if llm is not None:
            llm.shutdown()
        llm = None
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        with environment(env):
            r = run_fresh_tandem(kwargs, requests, warm)
        r.update(token_agreement(r["_outputs"], main["_outputs"]))
        peer_results[label] = r
    _add_peers(result, main, peer_results)
    if llm is not None:
        llm.shutdown()
    del llm
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def bench_data_parallel(result: dict[str, Any], peer_results: dict[str, Any], w: Workload, peers: list[str],
                        scale: float, llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The workload over data_parallel_size replicas (each its own process and GPU(s)); the dp1 peer runs
    the same requests on one engine in a fresh LLM once the replicas are gone, for the DP / one-GPU ratio."""
    from tandem import LLM

    llm = LLM(**llm_kwargs)
    try:
        vocab = llm.engine.vocab_size
        requests = make_requests(w, vocab, scale=scale)
        warm = _replica_warmup(w, vocab, scale, llm_kwargs["data_parallel_size"])
        run_tandem(llm, warm)
        # Timed from the first add_request to the last output: the replicas are started and warm by now.
        routed_before = list(llm.engine.routed_tokens)
        main = run_tandem(llm, requests)
        result["routed_tokens_per_replica"] = [a - b for a, b in zip(llm.engine.routed_tokens, routed_before)]
    finally:
        llm.shutdown()
    if "dp1" in peers:
        # No timeline in this peer either: the ratio compares like with like.
        r = run_fresh_tandem({**llm_kwargs, "data_parallel_size": 1}, requests, warm, record=False)
        # Dummy weights are drawn from the seed in every replica, so the tokens compare (bf16 may round apart).
        r["same_tokens_as_main"] = r["_outputs"] == main["_outputs"]
        r.update(token_agreement(r["_outputs"], main["_outputs"]))
        peer_results["tandem DP=1"] = r
    skipped = sorted(p for p in peers if p in {"sync", "eager", "noprefix", "bf16", "nogemv"} or _tp_peer(p))
    if skipped:
        result["peers_not_run"] = {p: "needs data_parallel_size=1" for p in skipped}
    result.update({
        "tokens_per_s": main["tokens_per_s"], "total_tokens_per_s": main["total_tokens_per_s"],
        "seconds": main["seconds"], "generated_tokens": main["generated_tokens"], "num_steps": None,
        # GPU spans and step logs stay in the replica processes. A roofline floor would be per replica
        # (each GPU streams its own weights every step of its own batches), and needs those step logs.
        "gpu_busy_pct": None, "gpu_busy_pct_per_rank": None, "roofline_floor_s": None, "roofline_fraction": None,
    })
    _add_peers(result, main, peer_results)
    if "tandem DP=1" in peer_results:
        # DP=M tok/s over M x one engine's: 1.0 is perfect scaling.
        m = llm_kwargs["data_parallel_size"]
        result["dp_efficiency"] = main["tokens_per_s"] / (m * peer_results["tandem DP=1"]["tokens_per_s"])
    return result


def _replica_warmup(w: Workload, vocab: int, scale: float, data_parallel_size: int) -> list[tuple[list[int], int]]:
    """Warm-up requests that reach every replica and share no prefix with the measured ones (the replicas'
    prefix caches cannot be reset from here): another seed, no shared prefix (which would route them all
    to one replica), four per replica."""
    requests = make_requests(replace(w, shared_prefix_len=0, num_requests=4 * data_parallel_size), vocab,
                             seed=1, scale=scale)
    return [(p, min(n, 4)) for p, n in requests]


def _add_peers(result: dict[str, Any], main: dict[str, Any], peer_results: dict[str, Any]) -> None:
    for name, r in peer_results.items():
        result["peers"][name] = r["tokens_per_s"]
        result.setdefault("peer_details", {})[name] = {k: v for k, v in r.items() if not k.startswith("_")}
        result.setdefault("ratios", {})[name] = main["tokens_per_s"] / r["tokens_per_s"]


def _tp_peer(peer: str) -> int | None:
    """K of a `tpK` peer name, else None."""
    return int(peer[2:]) if peer.startswith("tp") and peer[2:].isdigit() and int(peer[2:]) > 0 else None


def tensor_parallel_peer_sizes(peers: list[str], tensor_parallel_size: int) -> list[int]:
    """The tensor-parallel sizes of the `tpK` peers below this run's size, in the order given."""
    sizes = [_tp_peer(p) for p in peers]
    return [k for k in dict.fromkeys(sizes) if k is not None and k < tensor_parallel_size]


TP_PEER_FIELDS = ("tokens_per_s", "total_tokens_per_s", "seconds", "generated_tokens", "num_steps", "gpu_busy_pct",
                  "gpu_busy_pct_per_rank", "roofline_fraction", "all_reduce_ms_per_step")


class TensorParallelPeerError(RuntimeError):
    """A `tpK` peer's child bench process failed (its stderr's tail in the message)."""


def run_tensor_parallel_peer(w: Workload, size: int, scale: float, quantization: str | None, kv_cache_dtype: str,
                             quantize_lm_head: bool, expert_parallel: bool) -> dict[str, Any]:
    """The workload at tensor_parallel_size `size` (> 1) in a child `tandem bench` process: a later tensor-parallel
    group of this process would all-reduce through NCCL only, which is not what that size runs at on its own."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tandem-tp-peer-") as tmp:
        out = os.path.join(tmp, "peer.json")
        cmd = [sys.executable, "-m", "tandem", "bench", "--workload", w.name, "--no-peers", "--scale", str(scale),
               "--tensor-parallel-size", str(size), "--kv-cache-dtype", kv_cache_dtype, "--out", out]
        if quantization is not None:
            cmd += ["--quantization", quantization]
        if quantize_lm_head:
            cmd.append("--quantize-lm-head")
        if expert_parallel:
            cmd.append("--enable-expert-parallel")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(out):
            raise TensorParallelPeerError(f"the TP={size} peer exited {done.returncode}: {done.stderr[-2000:]}")
        with open(out) as f:
            r = json.load(f)["results"][0]
    return {k: r[k] for k in TP_PEER_FIELDS if k in r}


def _bench_speculative_config(config: dict[str, Any], w: Workload) -> dict[str, Any]:
    """--speculative-config for a workload's engine: an EAGLE-3 head named "random" becomes a head of the workload's
    shape with random weights (a named shape's dummy weights only)."""
    if config.get("method") != "eagle3" or config.get("model") != "random":
        return config
    if w.model is None:
        raise ValueError(f"speculative_config model 'random' needs a workload of a named shape; {w.name!r} has none")
    from tandem.bench.spec_workload import random_eagle3_folder

    return {**config, "model": random_eagle3_folder(w.model, tempfile.mkdtemp(prefix="tandem-eagle3-"))}


def run_fresh_tandem(llm_kwargs: dict[str, Any], requests: list[tuple[list[int], int]],
                     warm: list[tuple[list[int], int]], record: bool = True) -> dict[str, Any]:
    """A peer engine built for one measured pass (warmed up first), then released."""
    from tandem import LLM

    peer = LLM(**llm_kwargs)
    try:
        run_tandem(peer, warm)
        peer.engine.scheduler.reset_prefix_cache()
        return run_tandem(peer, requests, record=record)
    finally:
        peer.shutdown()


def prefix_ablation(llm: Any, requests: list[tuple[list[int], int]], outputs_with_cache: list[list[int]]
                    ) -> dict[str, Any]:
    """Prefill time (one new token per request) with the prefix cache and without, and the full run's
    tokens without it (they must equal the cached run's)."""
    manager = llm.engine.scheduler.kv_cache_manager
    prefill_only = [(p, 1) for p, _ in requests]
    timings = {}
    for enabled in (True, False):
        llm.engine.scheduler.reset_prefix_cache()
        manager.enable_prefix_caching = enabled
        timings[enabled] = run_tandem(llm, prefill_only)["seconds"]
    cold = run_tandem(llm, requests)  # prefix caching still off
    manager.enable_prefix_caching = True
    llm.engine.scheduler.reset_prefix_cache()
    return {
        "prefill_seconds_with_cache": timings[True], "prefill_seconds_without_cache": timings[False],
        "prefill_speedup": timings[False] / timings[True],
        "tokens_per_s_without_cache": cold["tokens_per_s"],
        "same_tokens_without_cache": cold["_outputs"] == outputs_with_cache,
        **token_agreement(cold["_outputs"], outputs_with_cache),
    }


def token_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """How far two runs' greedy tokens agree: whole requests, and tokens before the first difference.
    bf16 runs that batch differently round differently, and random-weight models have near-tied logits,
    so a rare late divergence is expected on the GPU; on the CPU in fp32 the tests demand equality."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix += n / max(len(x), 1)
    return {"identical_requests_fraction": same / max(len(a), 1), "agreeing_prefix_fraction": prefix / max(len(a), 1)}


def _print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'workload':<11} {'tok/s':>10} {'seconds':>8} {'roofline':>8} {'gpu busy':>8}  peers (tok/s, tandem x)")
    for r in results:
        busy = f"{r['gpu_busy_pct']:.1f}%" if r.get("gpu_busy_pct") is not None else "-"
        roofline = f"{r['roofline_fraction']:.3f}" if r.get("roofline_fraction") is not None else "-"
        peers = ", ".join(f"{k}: {v:.1f} ({r['ratios'][k]:.2f}x)" for k, v in r["peers"].items())
        if "prefix_cache" in r:
            pc = r["prefix_cache"]
            peers += (f"; prefill {pc['prefill_speedup']:.2f}x faster with prefix cache, "
                      f"same tokens: {pc['same_tokens_without_cache']}")
        if r.get("dp_efficiency") is not None:
            peers += f"; DP efficiency {r['dp_efficiency']:.3f}, routed tokens per replica {r['routed_tokens_per_replica']}"
        if r.get("all_reduce_ms_per_step"):
            peers += "; all-reduce ms/step (tokens: ms) " + ", ".join(
                f"{t}: {ms:.2f}" for t, ms in r["all_reduce_ms_per_step"].items())
        print(f"{r['workload']:<11} {r['tokens_per_s']:>10.1f} {r['seconds']:>8.2f} {roofline:>8} "
              f"{busy:>8}  {peers}")


def cmd_bench(args: argparse.Namespace) -> int:
    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    for n in names:
        if n not in WORKLOADS and n not in ("serve", "structured", "score", "spec", "lora"):
            raise ValueError(f"unknown workload {n!r}; choose from "
                             f"{sorted(WORKLOADS) + ['serve', 'structured', 'score', 'spec', 'lora']} or all")
    peers = [] if args.no_peers else args.peers.split(",")
    for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size),
                        ("--data-parallel-size", args.data_parallel_size)):
        if value < 1:  # before any peer has loaded a model
            raise ValueError(f"{flag} must be >= 1, got {value}")
    results = []
    for n in names:
        if n == "serve":  # offline against a server it starts: a table of its own
            from tandem.bench.serve_workload import run_serve_workload

            print("== serve: the same requests offline and through tandem serve", flush=True)
            results.append(run_serve_workload(args))
            continue
        if n == "structured":  # 0% / 50% / 100% of the requests under a JSON schema, and penalties: its own table
            from tandem.bench.structured_workload import run_structured_workload

            print("== structured: the same requests with 0%, 50%, 100% under a JSON schema", flush=True)
            model = args.structured_model if args.structured_model != "embedded" else None
            backends = args.structured_backends.split(",") if args.structured_backends else None
            results.append(run_structured_workload(model, args.structured_requests, int(128 * args.scale) or 1,
                                                   int(256 * args.scale) or 1, args.plot_dir, backends))
            continue
        if n == "score":  # scoring (prompt_logprobs, no new token) against prefill of the same prompts
            from tandem.bench.score_workload import run_score_workload

            print("== score: the same prompts scored and prefilled with one new token", flush=True)
            model = args.score_model if args.score_model != "embedded" else None
            results.append(run_score_workload(model, args.score_requests, int(512 * args.scale) or 1))
            continue
        if n == "spec":  # speculative decoding against plain decoding on one engine
            from tandem.bench.spec_workload import run_spec_workload

            acceptance = [float(a) for a in args.spec_acceptance.split(",")] if args.spec_acceptance else None
            model = args.spec_model if args.spec_model != "embedded" else None
            if acceptance is not None and model is None:
                raise ValueError("--spec-acceptance needs --spec-model, a named shape with random weights")
            print("== spec: speculative decoding against plain decoding", flush=True)
            results.append(run_spec_workload(model, args.spec_k, acceptance,
                                             [int(b) for b in args.spec_batch.split(",")],
                                             int(256 * args.scale) or 1, args.spec_draft_model,
                                             args.spec_eagle3_head))
            continue
        if n == "lora":  # adapters against the base model at the same batch sizes
            from tandem.bench.lora_workload import run_lora_workload

            print("== lora: random rank-16 adapters on all seven projections against the base model", flush=True)
            results.append(run_lora_workload(args.lora_model, args.scale))
            continue
        print(f"== {n}: {WORKLOADS[n].what}", flush=True)
        results.append(bench_workload(WORKLOADS[n], peers, args.scale, args.plot_dir, args.quantization,
                                      args.tensor_parallel_size, args.data_parallel_size, args.kv_cache_dtype,
                                      args.quantize_lm_head, args.enable_expert_parallel, args.checkpoint,
                                      args.speculative_config))
        _print_table(results[-1:])
    _print_table([r for r in results if r["workload"] not in ("serve", "structured", "score", "spec", "lora")])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"command": "tandem " + " ".join(sys.argv[1:]), "results": results}, f, indent=2)
        print(f"wrote {args.out}")
    return 0


def add_bench_args(sub: argparse._SubParsersAction, add_engine_args: Callable) -> None:
    bench = sub.add_parser("bench", help="offline throughput of named workloads with peers side by side; "
                                         "`tandem bench serve` for serving latency")
    bench.add_argument("--workload", default="cpu",
                       help=f"comma list of {sorted(WORKLOADS) + ['serve', 'structured', 'score', 'spec']} or all")
    bench.add_argument("--peers", default="hf,sync,eager,noprefix,bf16",
                       help="comma list: hf (transformers), sync, eager (no CUDA graphs), noprefix, "
                            "bf16 (with --quantization or --kv-cache-dtype fp8: the engine with bf16 weights and "
                            "KV cache, for the fp8 / bf16 ratio), "
                            "tpK, K < N (with --tensor-parallel-size N > 1: the same run on K GPUs; tp1 in a fresh "
                            "engine, K > 1 in a child process), "
                            "ep (MoE with --tensor-parallel-size N > 1: the other expert layout, TP or EP), "
                            "dp1 (with --data-parallel-size M > 1: the same run on one engine, in a fresh LLM), "
                            "nogemv (CUDA: a fresh engine without the decode GEMV kernel, TANDEM_GEMV_MAX_ROWS=0), "
                            "nospec (with --speculative-config: a fresh engine without it), "
                            "nopdl (CUDA: a fresh engine whose Triton kernels launch without programmatic "
                            "dependent launch, TANDEM_PDL=0); "
                            "with M > 1 only hf and dp1 run")
    bench.add_argument("--quantization", default=None, choices=["fp8", "int4", "int8"],
                       help="run tandem with FP8 weights (roofline on FP8 bytes), or int4 / int8 weight-only codes "
                            "(roofline on the packed codes, scales and zeros)")
    bench.add_argument("--checkpoint", default=None,
                       help="run tandem from this checkpoint folder (e.g. a GPTQ / AWQ / compressed-tensors "
                            "folder of the workload's shape, scripts/make_int_checkpoint.py) instead of the "
                            "workload's random weights; the bf16 peer keeps the random bf16 weights")
    bench.add_argument("--quantize-lm-head", action="store_true",
                       help="with --quantization fp8: the lm_head in FP8 too (the bf16 peer keeps bf16)")
    bench.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                       help="run tandem with an FP8 KV cache (roofline on its FP8 bytes)")
    bench.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="shard tandem's model over this many GPUs (a tpK peer runs the same on K)")
    bench.add_argument("--enable-expert-parallel", action="store_true",
                       help="with --tensor-parallel-size N > 1 and a MoE model: whole experts per rank (the ep peer "
                            "runs the other layout)")
    bench.add_argument("--data-parallel-size", type=int, default=1,
                       help="run tandem as this many engine replicas, each on its own GPU(s) (the dp1 peer: one)")
    bench.add_argument("--no-peers", action="store_true")
    bench.add_argument("--structured-model", default="llama-3-8b",
                       help="shape of the structured workload (random weights), or 'embedded' for SmolLM2")
    bench.add_argument("--structured-requests", type=int, default=64)
    bench.add_argument("--structured-backends", default=None,
                       help="comma list of grammar backends (xgrammar, llguidance) whose constrained passes run on the "
                            "same engine, side by side (default: TANDEM_STRUCTURED_BACKEND, else llguidance)")
    bench.add_argument("--lora-model", default="llama-3-8b",
                       help="shape of the lora workload (a named shape or a model folder; random weights)")
    bench.add_argument("--score-model", default="llama-3-8b",
                       help="shape of the score workload (a named shape or a model folder; random weights), "
                            "or 'embedded' for SmolLM2")
    bench.add_argument("--spec-model", default="embedded",
                       help="spec workload: the embedded SmolLM2 (real acceptance, n-gram) or a named shape (random "
                            "weights, with --spec-acceptance)")
    bench.add_argument("--spec-acceptance", default=None,
                       help="spec workload: comma list of per-draft acceptance probabilities for a proposer that "
                            "offers the target's own recorded tokens (e.g. 0.6,0.8,0.9)")
    bench.add_argument("--spec-k", type=int, default=4, help="spec workload: num_speculative_tokens")
    bench.add_argument("--speculative-config", type=json.loads, default=None,
                       help="the named workloads' engine with speculative decoding, as JSON (serve's field; an "
                            "eagle3 model \"random\": a head of the workload's shape with random weights); peer "
                            "nospec: the same workload without it")
    bench.add_argument("--spec-draft-model", default=None,
                       help="spec workload: method draft_model with this draft (a named shape with random weights "
                            "when --spec-model is one, else a model path); default: ngram")
    bench.add_argument("--spec-eagle3-head", default=None,
                       help="spec workload: method eagle3 with this EAGLE-3 head folder, or 'random': a head of "
                            "--spec-model's shape with random weights (its draft cost, with --spec-acceptance)")
    bench.add_argument("--spec-batch", default="1,8", help="spec workload: comma list of batch sizes")
    bench.add_argument("--score-requests", type=int, default=1000,
                       help="prompts of the score workload (512 tokens each, times --scale)")
    bench.add_argument("--scale", type=float, default=1.0, help="shrink prompt/output lengths (smoke runs)")
    bench.add_argument("--out", default=None, help="write results JSON here")
    bench.add_argument("--plot-dir", default=None, help="write timeline PNGs here")
    from tandem.bench.serve_workload import add_serve_workload_args

    add_serve_workload_args(bench)
    bench.set_defaults(func=cmd_bench)
    bench_sub = bench.add_subparsers(dest="bench_command")
    try:
        from tandem.bench.serve import add_bench_serve_args, bench_serve_main

        serve = bench_sub.add_parser("serve", help="open-loop load generator against an OpenAI-compatible server")
        add_bench_serve_args(serve)
        serve.set_defaults(func=bench_serve_main)
        from tandem.bench.soak import add_bench_soak_args, bench_soak_main

        soak = bench_sub.add_parser("soak", help="hours of mixed load on `tandem serve`: latency, RSS, descriptors "
                                                 "and KV blocks over time (JSON + PNG)")
        add_bench_soak_args(soak)
        soak.set_defaults(func=bench_soak_main)
    except ImportError:
        pass


def cmd_profile(args: argparse.Namespace) -> int:
    """Runs one workload in sync and overlap modes with the timeline on; writes traces and a PNG."""
    from tandem import LLM
    from tandem.profiling.timeline import plot_timelines

    w = WORKLOADS[args.workload]
    os.makedirs(args.out_dir, exist_ok=True)
    kwargs: dict[str, Any] = dict(max_num_seqs=min(w.num_requests, 256))
    if w.model is not None:
        kwargs.update(model=w.model, load_format="dummy")
    import torch

    if w.device == "cpu" or not torch.cuda.is_available():
        kwargs.update(device="cpu", dtype="float32")
    max_len = int((max(w.prompt_len) + max(w.output_len) + w.shared_prefix_len) * args.scale) + 16
    llm = LLM(max_model_len=max(max_len, 64), **kwargs)
    requests = make_requests(w, llm.engine.model_config.vocab_size, scale=args.scale)
    run_tandem(llm, [(p, 4) for p, _ in requests[:8]])
    timelines = {}
    for label, overlap in (("sync", False), ("overlap", True)):
        r = run_tandem(llm, requests, overlap=overlap, record=True)
        tl = r["_timeline"]
        tl.to_chrome_trace(os.path.join(args.out_dir, f"trace-{w.name}-{label}.json"), label)
        timelines[f"{label}"] = tl
        print(f"{label:>8}: {r['seconds']:.2f} s, {r['tokens_per_s']:.1f} tok/s, GPU busy {tl.gpu_busy_pct():.1f}%")
    png = os.path.join(args.out_dir, f"timeline-{w.name}.png")
    plot_timelines(timelines, png, max_seconds=args.window, start_frac=0.5)
    print(f"wrote {png} and Chrome traces in {args.out_dir}")
    return 0


def add_profile_args(sub: argparse._SubParsersAction, add_engine_args: Callable) -> None:
    p = sub.add_parser("profile", help="CPU/GPU timeline of sync vs overlap (Chrome trace + PNG)")
    p.add_argument("--workload", default="cpu", choices=sorted(WORKLOADS))
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--out-dir", default="profile")
    p.add_argument("--window", type=float, default=0.06, help="seconds of timeline to draw (from mid-run)")
    p.set_defaults(func=cmd_profile)
