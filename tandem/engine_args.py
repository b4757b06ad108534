"""The engine's command-line flags, shared by `tandem generate`, `tandem serve` and `tandem bench`."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags (model, memory, scheduling, overlap, graphs, quantization, parallelism)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF folder, .gguf file, Hugging Face Hub id (org/name) or named shape (default: embedded SmolLM2-135M)")
    g.add_argument("--revision", default=None, help="branch, tag or commit of a Hub model id (default: main)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts must be token ids and outputs carry no text")
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
    g.add_argument("--quantization", default=None, choices=["fp8", "int4", "int8"],
                   help="fp8: FP8 weights with per-channel scales, FP8 matmuls (CUDA, compute capability >= 8.9); "
                        "int4 / int8: weight-only integer codes, round to nearest at load, group 128 (4- and 8-bit "
                        "GPTQ, AWQ and compressed-tensors checkpoints load without this flag)")
    g.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization fp8 / int4 / int8: the lm_head in that format too (FP8 per vocabulary "
                        "row; int4 / int8 round to nearest, group 128; off: the model dtype)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="fp8: K and V stored as float8_e4m3fn (scale 1): twice the tokens in the same memory, half "
                        "the bytes a decode step's attention reads; auto: the model dtype")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N GPUs (one process each; or launch N processes with torchrun)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models over the tensor-parallel ranks: whole experts per rank (expert e on rank "
                        "e mod N) instead of every expert sharded; attention stays tensor-parallel")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) beside the base model")
    g.add_argument("--max-loras", type=int, default=1, help="adapters resident on the device at once (slots)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in host memory, least recently used out first (default: --max-loras)")
    g.add_argument("--grammar-backend", default=None, choices=["xgrammar", "llguidance"],
                   help="grammar backend of structured output and tool calls (default: TANDEM_STRUCTURED_BACKEND, "
                        "else llguidance)")
    g.add_argument("--no-strict-json-schema", action="store_true",
                   help="read JSON schemas (response_format, guided_json, tools' parameters) as JSON Schema does: "
                        "an object that does not set additionalProperties may hold properties it does not name "
                        "(default: it holds only those it names)")
    g.add_argument("--structured-forced-drafts", action="store_true",
                   help="structured output: tokens a grammar forces (e.g. a JSON key) are verified as drafts, several "
                        "per forward (default off: at 64 constrained requests the per-row masks cost more host time "
                        "than the forwards they save; see docs/serving.md)")
    g.add_argument("--max-forced-drafts", type=int, default=8,
                   help="structured output: most grammar-forced tokens verified per request and step (1-16)")
    g.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(fields: method, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, "
                        "disable_by_batch_size; docs/serving.md)")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from parsed engine flags."""
    return dict(
        model=args.model, revision=args.revision, skip_tokenizer_init=args.skip_tokenizer_init,
        load_format=args.load_format, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching, overlap=not args.sync,
        cuda_graph=not args.no_cuda_graph, piecewise_max_tokens=args.piecewise_max_tokens, seed=args.seed,
        quantization=args.quantization, quantize_lm_head=args.quantize_lm_head, kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
        data_parallel_size=getattr(args, "data_parallel_size", 1),  # generate's and serve's own flag
        grammar_backend=getattr(args, "grammar_backend", None),
        strict_json_schema=not getattr(args, "no_strict_json_schema", False),
        structured_forced_drafts=getattr(args, "structured_forced_drafts", False),
        max_forced_drafts=getattr(args, "max_forced_drafts", 8),
        speculative_config=getattr(args, "speculative_config", None),
        enable_lora=getattr(args, "enable_lora", False), max_loras=getattr(args, "max_loras", 1),
        max_lora_rank=getattr(args, "max_lora_rank", 16), max_cpu_loras=getattr(args, "max_cpu_loras", None),
    )
