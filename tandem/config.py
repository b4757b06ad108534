"""EngineConfig (frozen, validated once) and ModelConfig (the architecture's numbers); environment overrides."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# Structured output's grammar backends (grammar_backend, TANDEM_STRUCTURED_BACKEND).
GRAMMAR_BACKENDS = ("xgrammar", "llguidance")
# What EngineConfig.quantization accepts (None: the checkpoint's own weights).
QUANTIZATIONS = (None, "fp8", "int4", "int8")
# kv_cache_dtype names (vLLM's): None stands for the model dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# Speculative decoding's proposers (SpeculativeConfig.method), and the ones designed but not built yet.
SPEC_METHODS = ("ngram", "draft_model", "eagle3")
SPEC_METHODS_PLANNED = ("eagle", "mtp", "medusa")
MAX_SPEC_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, given as vLLM's `speculative_config` dict (docs/serving.md, "Speculative decoding").

    ngram (prompt lookup): the last prompt_lookup_max..prompt_lookup_min tokens of a request are looked up in
    its prompt and output, and up to num_speculative_tokens tokens that followed the latest match are proposed.
    draft_model: a smaller model with the same vocabulary (`model`: folder, GGUF, Hub id or named shape) decodes
    the drafts greedily in an engine of its own (paged KV cache with prefix caching, CUDA graphs).
    eagle3: an EAGLE-3 head (`model`: its Hugging Face folder) drafts greedily from three of the target's hidden
    states (speculative/eagle3.py).
    Speculation runs while at most disable_by_batch_size requests run (above, a step's forward is no longer
    bound by reading the weights, and verifying drafts costs more than it saves)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 16
    model: str | None = None  # draft_model: the draft model; eagle3: the head's folder
    # draft_model: KV blocks of the draft's own cache (None: enough for max_num_seqs requests of max_model_len)
    num_kv_blocks: int | None = None
    # Speculate only while measured steps say it pays (speculative/controller.py); False: whenever drafts exist.
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method in SPEC_METHODS_PLANNED:
            raise ValueError(f"speculative_config.method {self.method!r} is not available yet; methods: "
                             f"{', '.join(SPEC_METHODS)}")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}")
        for name, low, high in (("num_speculative_tokens", 1, MAX_SPEC_TOKENS), ("prompt_lookup_min", 1, 64),
                                ("prompt_lookup_max", 1, 64), ("disable_by_batch_size", 1, 1 << 20)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"speculative_config.{name} must be an integer in [{low}, {high}], got {value!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model must name the draft model for method 'draft_model'")
        if self.method == "eagle3" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model must name the EAGLE-3 head's folder for method 'eagle3'")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config.model is only read by methods 'draft_model' and 'eagle3', not "
                             f"{self.method!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"speculative_config.num_kv_blocks must be an integer >= 2, got {self.num_kv_blocks!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @staticmethod
    def parse(value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """A SpeculativeConfig from vLLM's dict form (None stays None); ValueError naming an unknown field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = set(SpeculativeConfig.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ValueError("speculative_config needs a 'method' (one of: " + ", ".join(SPEC_METHODS) + ")")
        return SpeculativeConfig(**value)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # key of tandem.models.registry.MODEL_REGISTRY: llama, qwen2, qwen3, gpt2, mixtral, qwen*_moe
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_parameters / rope_scaling (llama3 etc.)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qkv bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0 experts: a dense model). Each token runs num_experts_per_tok of num_experts MLPs of
    # moe_intermediate_size, weighted by its router's softmax (renormalized over the chosen ones with
    # norm_topk_prob); a shared expert (Qwen2-MoE) runs for every token behind a sigmoid gate.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1  # layer i is a MoE layer when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements (not bytes) of K and V per token over all layers; multiply by the dtype size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """This process's place in the tensor-parallel group: rank r of size ranks (0 of 1 when unsharded)."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False  # MoE experts whole on ranks (expert e on rank e mod size), not sharded

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not in [0, {self.size})")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None  # None: from the model folder / GGUF
    skip_tokenizer_init: bool = False  # no tokenizer: prompts must be token ids, outputs carry no text
    revision: str | None = None  # branch, tag or commit of a Hugging Face Hub model id; None: main
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    hf_overrides: dict[str, Any] = field(default_factory=dict)  # config fields, e.g. a named shape for dummy
    max_model_len: int | None = None  # None: min(model's max positions, 8192)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from the memory budget below
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    overlap: bool = True
    cuda_graph: bool = True
    # Steps with prefills (alone or mixed into decodes), up to this many tokens, run piecewise CUDA graphs; None:
    # every such step (max_num_batched_tokens); 0: they run eagerly.
    piecewise_max_tokens: int | None = None
    seed: int = 0
    # None | fp8 (weights in float8_e4m3fn, per-output-channel scales) | int4 / int8 (weight-only integer codes,
    # round to nearest at load, group 128; docs/quantization.md)
    quantization: str | None = None
    # With quantization fp8: the lm_head (logits projection) in FP8 too, per vocabulary row; with int4 / int8: in
    # those integer codes too (round to nearest, group 128). Off, it keeps the model dtype, as vLLM's fp8 and
    # GPTQ / AWQ do. A tied model gets a copy of its embedding table in that format for the logits.
    quantize_lm_head: bool = False
    # auto: the KV cache in the model dtype; fp8 (= fp8_e4m3): K and V stored as float8_e4m3fn (scale 1, saturated
    # at +-448), half the bytes of bf16 per token: twice the tokens fit, and decode attention reads half as much.
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1  # GPUs (or CPU processes) one model is sharded over, Megatron-style
    data_parallel_size: int = 1  # whole-engine replicas, each on its own tensor_parallel_size GPUs
    # MoE models over tensor_parallel_size ranks: whole experts per rank (expert e on rank e mod N) instead of
    # every expert sharded along its intermediate dimension; attention and dense layers stay tensor-parallel.
    enable_expert_parallel: bool = False
    # The grammar backend of structured output (xgrammar or llguidance); None: TANDEM_STRUCTURED_BACKEND, else the
    # default (structured/grammar.py).
    grammar_backend: str | None = None
    # A JSON schema's object that names its properties and says nothing of others generates only those (and a
    # prefixItems tuple no further items), as OpenAI's structured outputs and xgrammar's strict mode do; False keeps
    # the JSON-Schema reading (any other property allowed), where a model can add keys until max_tokens.
    strict_json_schema: bool = True
    # Structured output: where a request's grammar admits exactly one continuation (a JSON key, punctuation, a
    # closing bracket), up to max_forced_drafts of those tokens are verified as drafts in the request's next step
    # (one forward yields them all; each row sampled under its own mask, so outputs are unchanged; a draft row takes
    # its request's LoRA adapter). Off under tensor parallelism (no verify rows there). Off by default: at 64
    # constrained requests on an H200 the draft rows' masks cost more host time than the forwards they save
    # (docs/serving.md).
    structured_forced_drafts: bool = False
    max_forced_drafts: int = 8
    # Speculative decoding: None (off), a SpeculativeConfig or vLLM's dict form ({"method": "ngram", ...}).
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    # LoRA adapters (tandem/lora/, docs/serving.md): max_loras adapters resident on the device at once (a fixed pool
    # of slots), each of rank <= max_lora_rank; up to max_cpu_loras kept loaded in host memory (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        self._check_lora()
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization == "fp8" and self.dtype not in ("auto", "bfloat16"):
            # Rowwise-scaled FP8 GEMMs write bfloat16 (the only output type every torch/CUDA combination has).
            raise ValueError(f"quantization fp8 runs with dtype bfloat16 (or auto), got {self.dtype!r}")
        if self.quantize_lm_head and self.quantization not in ("fp8", "int4", "int8"):
            raise ValueError("quantize_lm_head needs quantization fp8, int4 or int8 (it puts the lm_head in that "
                             f"format beside the other linears), got {self.quantization!r}")
        if not isinstance(self.structured_forced_drafts, bool):
            raise ValueError(f"structured_forced_drafts must be true or false, got {self.structured_forced_drafts!r}")
        k = self.max_forced_drafts
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(f"max_forced_drafts must be an integer in [1, {MAX_SPEC_TOKENS}], got {k!r}")
        if self.grammar_backend is not None and self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision.strip()):
            raise ValueError(f"revision must be a non-empty branch, tag or commit, got {self.revision!r}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors, gguf or dummy, got {self.load_format!r}")
        if self.piecewise_max_tokens is not None and (
                not isinstance(self.piecewise_max_tokens, int) or self.piecewise_max_tokens < 0):
            raise ValueError(f"piecewise_max_tokens must be an integer >= 0 (0: off), "
                             f"got {self.piecewise_max_tokens!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.data_parallel_size > 1 and self.device.startswith("cuda:"):
            # Each replica is given its own GPUs through CUDA_VISIBLE_DEVICES and numbers them from 0.
            raise ValueError(f"data_parallel_size > 1 picks each replica's GPUs itself: use device 'cuda' or "
                             f"'auto', not {self.device!r} (restrict the GPUs with CUDA_VISIBLE_DEVICES)")
        if self.cpu_kv_cache_gib <= 0:
            raise ValueError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool) or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config as __post_init__ left it (a dict is parsed there)."""
        spec = self.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)
        return spec

    @property
    def forced_drafts(self) -> int:
        """Grammar-forced drafts per request and step: max_forced_drafts, or 0 where they are off (switched off, or
        tensor parallelism, whose steps have no verify rows for them)."""
        if not self.structured_forced_drafts or self.tensor_parallel_size > 1:
            return 0
        return self.max_forced_drafts

    def resolved_device(self) -> torch.device:
        name = self.device
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        if name == "cuda":  # an explicit index: set_device and the streams need one
            name = f"cuda:{torch.cuda.current_device()}"
        return torch.device(name)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def resolved_kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model dtype, or float8_e4m3fn for kv_cache_dtype fp8."""
        kv = KV_CACHE_DTYPES[self.kv_cache_dtype]
        return self.resolved_dtype() if kv is None else kv


# Net allocations of GC-tracked objects between young-generation collections while an engine runs (Python's
# default is 700). A decode step at 1000 requests allocates thousands of short-lived containers (scheduled
# entries, outputs, token lists); at 700 the collector ran about ten times per step and took a fifth to a
# quarter of the host's step time (1000 requests of a 1-layer model on a 2-core CPU: 1.90 -> 1.45 ms per step).
# Cycles are still collected, in larger and rarer batches.
GC_GEN0_THRESHOLD = 50_000


def relax_gc() -> None:
    """Sets GC_GEN0_THRESHOLD for the rest of the process (the server's engine-core and API processes)."""
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])


@contextlib.contextmanager
def relaxed_gc() -> Iterator[None]:
    """GC_GEN0_THRESHOLD inside the block only (generate() in the caller's process), restored afterwards."""
    previous = gc.get_threshold()
    relax_gc()
    try:
        yield
    finally:
        gc.set_threshold(*previous)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for the duration of the block, then restores (or removes) them: for a child
    process about to be spawned (spawn copies the environment then), or an engine built under a setting."""
    previous = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
