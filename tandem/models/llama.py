"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2; Qwen2/Qwen3 via flags) over the paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.config import ModelConfig
from tandem.layers.activation import silu_and_mul
from tandem.layers.attention import Attention
from tandem.layers.attention_metadata import AttentionMetadata
from tandem.layers.linear import Embedding, Linear, lm_head_logits
from tandem.layers.norm import RMSNorm
from tandem.layers.rotary import RotaryEmbedding, rotary_write_kv
from tandem.models.weights import WeightLoader

# Hugging Face projection name -> (our fused projection, shard index in it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.shard_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        # Qwen2 has a bias on q/k/v only; Llama's attention_bias covers o_proj too.
        o_bias = config.attention_bias and config.architecture != "qwen2"
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) of this step's positions
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        q_size, kv_size, _ = self.shard_sizes
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        q = qkv[:, :q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        # On CUDA one kernel normalizes (Qwen3) and rotates q and k in place (qkv is this layer's own buffer)
        # and writes k and v into the cache.
        q, k = rotary_write_kv(q, k, v, *rotary, k_cache, v_cache, meta.slot_mapping,
                               self.q_norm if self.qk_norm else None, self.k_norm if self.qk_norm else None)
        out = self.attn.attend(q, k_cache, v_cache, meta)  # [num_tokens, num_heads * head_dim]
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"{config.architecture}: unsupported hidden_act {config.hidden_act!r} (expected silu)")
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,  # [num_tokens, hidden_size]
        residual: torch.Tensor | None,  # the running residual stream; None before the first layer
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rotary, hidden, k_cache, v_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        # One cos/sin table shared by all layers (no parameters: not in checkpoints).
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # Tied models read logits through the embedding table; no separate lm_head parameter exists.
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int32 or int64
        positions: torch.Tensor,  # [num_tokens] int32 or int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary_emb(positions)
        residual = None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(rotary, hidden, residual, kv_cache[i, 0], kv_cache[i, 1], meta)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return lm_head_logits(hidden, weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (self.lm_head is None and name == "lm_head.weight"):
                continue
            parts = name.split(".")
            fused = _FUSED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is None:
                loader.copy(name, tensor)
                continue
            target, shard = fused
            param_name = ".".join(parts[:-2] + [target, parts[-1]])
            loader.copy(param_name, tensor, self._shard_offset(target, shard), source=name)
        loader.finish()

    def _shard_offset(self, target: str, shard: int) -> int:
        config = self.config
        if target == "gate_up_proj":
            return shard * config.intermediate_size
        return (0, config.num_heads, config.num_heads + config.num_kv_heads)[shard] * config.head_dim
