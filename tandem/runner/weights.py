"""Loading and placing one rank's weights: the device and dtype checks a configuration needs, then its model shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.config import EngineConfig, ModelConfig
from tandem.distributed.group import TPGroup
from tandem.kernels.fp8 import FP8_DTYPE
from tandem.layers.quantization import check_fp8_device
from tandem.models.loader import load_model_and_tokenizer


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module  # in eval mode, on its device, holding this rank's shard
    config: ModelConfig
    tokenizer: Any  # None on ranks other than 0 and for named shapes
    kv_cache_dtype: torch.dtype


def load_weights(config: EngineConfig, device: torch.device, dtype: torch.dtype, tp: TPGroup) -> LoadedModel:
    """Checks that the device can run what the configuration asks for (FP8 weights or KV cache), then loads the
    rank's shard of the model onto it; the tokenizer on rank 0 only."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(config.seed)
    if config.quantization == "fp8":
        check_fp8_device(device)
    kv_cache_dtype = config.resolved_kv_cache_dtype()
    if kv_cache_dtype == FP8_DTYPE and device.type == "cuda":
        # The CPU holds one too (the reference kernels convert with torch); the Triton kernels need e4m3
        # conversions in hardware.
        check_fp8_device(device, "kv_cache_dtype fp8")
    model, model_config, tokenizer = load_model_and_tokenizer(config, device, dtype, tp,
                                                              load_tokenizer=tp.rank == 0)
    model.eval()
    return LoadedModel(model, model_config, tokenizer, kv_cache_dtype)
