"""Architecture name -> model class, and the mapping from a Hugging Face config to ModelConfig."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from tandem.config import ModelConfig
from tandem.layers.rotary import SUPPORTED_ROPE_TYPES, rope_type_of
from tandem.models.gpt2 import GPT2LMHeadModel
from tandem.models.llama import LlamaForCausalLM
from tandem.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from tandem.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "mixtral": MixtralForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}

# Hugging Face model_type -> ModelConfig.architecture.
ARCHITECTURE_OF_MODEL_TYPE: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gpt2": "gpt2",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
}

_QWEN2 = ("qwen2", "qwen2_moe")  # q/k/v bias always
_QWEN3 = ("qwen3", "qwen3_moe")  # per-head q/k RMSNorm


def model_config_from_hf(hf_config: Any, extra_eos_token_ids: Iterable[int | None] = ()) -> ModelConfig:
    """Maps a transformers PretrainedConfig to ModelConfig; extra_eos_token_ids come from generation_config."""
    model_type = getattr(hf_config, "model_type", None)
    architecture = ARCHITECTURE_OF_MODEL_TYPE.get(model_type)
    if architecture is None:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {sorted(ARCHITECTURE_OF_MODEL_TYPE)}")
    eos = _unique_ids([getattr(hf_config, "eos_token_id", None), *extra_eos_token_ids])
    if architecture == "gpt2":
        return _gpt2_config(hf_config, eos)
    return _llama_family_config(hf_config, architecture, eos)


def _llama_family_config(cfg: Any, architecture: str, eos: tuple[int, ...]) -> ModelConfig:
    if getattr(cfg, "mlp_bias", False):
        raise ValueError(f"{cfg.model_type}: mlp_bias=True is not supported")
    if architecture in _QWEN2 + _QWEN3 and getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"{cfg.model_type}: use_sliding_window=True is not supported")
    theta, scaling = _rope(cfg)
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    return ModelConfig(
        architecture=architecture,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        norm_eps=cfg.rms_norm_eps,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        # Qwen2's q/k/v projections always carry a bias; Llama and Qwen3 read attention_bias.
        attention_bias=architecture in _QWEN2 or bool(getattr(cfg, "attention_bias", False)),
        qk_norm=architecture in _QWEN3,
        hidden_act=getattr(cfg, "hidden_act", "silu"),
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_ids=eos,
        **_moe_fields(cfg, architecture),
    )


def _moe_fields(cfg: Any, architecture: str) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields (none for a dense model)."""
    if architecture == "mixtral":
        # router_jitter_noise is training-only: inference routes on the clean logits, as transformers does.
        return dict(num_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                    moe_intermediate_size=cfg.intermediate_size, norm_topk_prob=True)
    if architecture in ("qwen2_moe", "qwen3_moe"):
        return dict(
            num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=bool(cfg.norm_topk_prob),
            shared_expert_intermediate_size=getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
            decoder_sparse_step=getattr(cfg, "decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(getattr(cfg, "mlp_only_layers", None) or ()),
        )
    return {}


def _gpt2_config(cfg: Any, eos: tuple[int, ...]) -> ModelConfig:
    if getattr(cfg, "scale_attn_by_inverse_layer_idx", False) or getattr(cfg, "reorder_and_upcast_attn", False):
        raise ValueError("gpt2: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    if not getattr(cfg, "scale_attn_weights", True):
        raise ValueError("gpt2: scale_attn_weights=False is not supported")
    return ModelConfig(
        architecture="gpt2",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        num_layers=cfg.n_layer,
        num_heads=cfg.n_head,
        num_kv_heads=cfg.n_head,
        head_dim=cfg.n_embd // cfg.n_head,
        intermediate_size=getattr(cfg, "n_inner", None) or 4 * cfg.n_embd,
        max_position_embeddings=cfg.n_positions,
        norm_eps=cfg.layer_norm_epsilon,
        tie_word_embeddings=True,
        hidden_act=cfg.activation_function,
        bos_token_id=getattr(cfg, "bos_token_id", None),
        eos_token_ids=eos,
    )


def _rope(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5 `rope_parameters` or the older `rope_theta` + `rope_scaling`."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = float(params.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    rope_type = rope_type_of(params)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{cfg.model_type}: unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    return theta, {**params, "rope_type": rope_type}


def _unique_ids(values: Iterable[Any]) -> tuple[int, ...]:
    """Flattens ints and lists of ints, dropping None and duplicates, keeping first-seen order."""
    ids: list[int] = []
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)
