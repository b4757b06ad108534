"""`tandem generate | serve | bench | profile`: the command line."""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "Name three prime numbers.",
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF folder, .gguf file, Hugging Face Hub id (org/name) or named shape (default: embedded SmolLM2-135M)")
    g.add_argument("--revision", default=None, help="branch, tag or commit of a Hub model id (default: main)")
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=4096)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--sync", action="store_true", help="overlap off: finish each step before scheduling the next")
    g.add_argument("--no-cuda-graph", action="store_true", help="every step eager (no decode or piecewise CUDA graphs)")
    g.add_argument("--piecewise-max-tokens", type=int, default=None,
                   help="steps with prefills (alone or mixed into the decodes), up to this many tokens, run as "
                        "piecewise CUDA graphs (attention launched between the captured pieces); default: all of "
                        "them (max-num-batched-tokens); 0: eager")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: FP8 weights with per-channel scales, FP8 matmuls (CUDA, compute capability >= 8.9)")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization fp8: the lm_head in FP8 too (per vocabulary row; off: the model dtype)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="fp8: K and V stored as float8_e4m3fn (scale 1): twice the tokens in the same memory, half "
                        "the bytes a decode step's attention reads; auto: the model dtype")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N GPUs (one process each; or launch N processes with torchrun)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model, revision=args.revision, load_format=args.load_format, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching, overlap=not args.sync,
        cuda_graph=not args.no_cuda_graph, piecewise_max_tokens=args.piecewise_max_tokens, seed=args.seed,
        quantization=args.quantization, quantize_lm_head=args.quantize_lm_head, kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=getattr(args, "data_parallel_size", 1),  # generate's and serve's own flag
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs, seed=args.sample_seed,
    )
    llm = LLM(**engine_kwargs(args))
    prompts = args.prompt or DEFAULT_PROMPTS
    # The built-in prompts are questions: wrap them in the chat template when the model has one.
    chat = args.chat if args.chat is not None else (
        not args.prompt and bool(getattr(llm.tokenizer, "chat_template", None)))
    start = time.perf_counter()
    if chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    num_generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        print(f"--- {prompt!r}\n{c.text!r}  [{len(c.token_ids)} tokens, finish: {c.finish_reason}]")
    dp = llm.config.data_parallel_size
    where = llm.engine.runner.device if dp == 1 else f"{dp} replicas, device {llm.config.device}"
    print(f"\n{len(outputs)} requests, {num_generated} generated tokens in {seconds:.2f} s: "
          f"{num_generated / seconds:.1f} tok/s ({where}, {llm.config.resolved_dtype()})")
    llm.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions offline and print them with tokens/s")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few built-in prompts")
    gen.add_argument("--data-parallel-size", type=int, default=1,
                     help="engine replicas (processes), each on its own GPU(s) (x --tensor-parallel-size)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap each prompt in the chat template (default: for the built-in prompts only)")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from tandem.server.launcher import add_serve_args, serve_main

        add_serve_args(serve)
        serve.set_defaults(func=serve_main)
    except ImportError as exc:  # server extras missing
        serve.set_defaults(func=lambda a, exc=exc: sys.exit(f"tandem serve needs fastapi and uvicorn: {exc}"))

    from tandem.bench.offline import add_bench_args, add_profile_args

    add_bench_args(sub, add_engine_args)
    add_profile_args(sub, add_engine_args)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
