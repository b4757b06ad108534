"""GPT-2: learned positions, pre-LayerNorm blocks, fused c_attn, gelu_new MLP, logits tied to wte."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.distributed.group import TPGroup
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.layers.activation import activation_fn
from tandem.layers.attention import Attention
from tandem.layers.linear import Embedding
from tandem.layers.norm import LayerNorm
from tandem.layers.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_tp_shape,
    column_parts,
    materialize,
    parallel_logits,
    transpose,
)
from tandem.models.weights import WeightLoader

# Hugging Face GPT-2 uses Conv1D, whose weight is [in, out]: these are transposed on load.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Causal-mask buffers that old checkpoints carry.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.num_heads = config.num_heads // tp.size  # this rank's heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.c_attn = ColumnParallelLinear(hidden, column_parts([hidden] * 3, tp, fused_source=True), [hidden] * 3,
                                           bias=True)
        self.c_proj = RowParallelLinear(hidden, hidden, tp, bias=True)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.c_attn(hidden).view(num_tokens, 3, self.num_heads, self.head_dim)
        out = self.attn(qkv[:, 0], qkv[:, 1], qkv[:, 2], k_cache, v_cache, meta)  # [num_tokens, hidden]
        return self.c_proj(out)


class GPT2MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.c_fc = ColumnParallelLinear(config.hidden_size, column_parts([inter], tp, fused_source=True), [inter],
                                         bias=True)
        self.c_proj = RowParallelLinear(inter, config.hidden_size, tp, bias=True)
        self.act = activation_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, config.norm_eps)
        self.attn = GPT2Attention(config, tp)
        self.ln_2 = LayerNorm(config.hidden_size, config.norm_eps)
        self.mlp = GPT2MLP(config, tp)

    def forward(
        self, hidden: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), k_cache, v_cache, meta)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.wpe = Embedding(config.max_position_embeddings, config.hidden_size)  # replicated
        self.h = nn.ModuleList(GPT2Block(config, tp) for _ in range(config.num_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.norm_eps)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        if config.num_kv_heads != config.num_heads:
            raise ValueError("gpt2 has no grouped-query attention: num_kv_heads must equal num_heads")
        tp = tp or TPGroup()
        check_tp_shape(config, tp.parallel)
        self.config = config
        self.tp = tp
        self.transformer = GPT2Model(config, tp)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int32 or int64
        positions: torch.Tensor,  # [num_tokens] int32 or int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for i, block in enumerate(self.transformer.h):
            hidden = block(hidden, kv_cache[i, 0], kv_cache[i, 1], meta)
        return self.transformer.ln_f(hidden)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] in the model dtype (into `out` when given)."""
        return parallel_logits(hidden, self.transformer.wte.weight, self.config.vocab_size, self.tp, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face (name, tensor or lazy slice) pairs; each rank keeps only its shard."""
        loader = WeightLoader(self)
        modules = dict(self.named_modules())
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or name == "lm_head.weight":  # lm_head is tied to wte
                continue
            param_name = name if name.startswith("transformer.") else f"transformer.{name}"
            if param_name.endswith(_CONV1D):
                tensor = transpose(tensor)
            module_name, _, leaf = param_name.rpartition(".")
            module = modules.get(module_name)
            offset = 0
            if isinstance(module, ColumnParallelLinear):
                # c_attn is q, k, v stacked: each third is split over the ranks on its own.
                for part in range(len(module.parts)):
                    local, offset = module.shard_for_load(tensor, part)
                    loader.copy(param_name, local, offset, source=name)
                continue
            if isinstance(module, RowParallelLinear):
                tensor = module.shard_for_load(tensor, is_bias=leaf == "bias")
                if tensor is None:
                    continue  # the bias lives on rank 0
            elif isinstance(module, VocabParallelEmbedding):
                tensor = module.shard_for_load(tensor)
            else:
                tensor = materialize(tensor)
            loader.copy(param_name, tensor, offset, source=name)
        loader.finish()
