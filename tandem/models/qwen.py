"""Qwen2/2.5 (bias on q/k/v) and Qwen3 (per-head RMSNorm on q and k): the Llama decoder with those flags."""

from __future__ import annotations

from tandem.config import ModelConfig
from tandem.distributed.group import TPGroup
from tandem.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        if not config.attention_bias:
            raise ValueError("qwen2 requires attention_bias=True (q/k/v projections carry a bias)")
        super().__init__(config, tp)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        if not config.qk_norm:
            raise ValueError("qwen3 requires qk_norm=True (per-head RMSNorm on q and k)")
        super().__init__(config, tp)
