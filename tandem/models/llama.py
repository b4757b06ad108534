"""Llama-family decoder (Llama 2/3, Mistral, SmolLM2; Qwen2/Qwen3 via flags) over the paged KV cache."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.distributed.group import TPGroup, Unreduced
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.fp8 import PartialSums, QuantizedRows
from tandem.layers.attention import Attention
from tandem.layers.norm import RMSNorm
from tandem.layers.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_tp_shape,
    column_parts,
    kv_head_start,
    local_kv_heads,
    materialize,
    parallel_logits,
)
from tandem.layers.rotary import RotaryEmbedding
from tandem.models.weights import WeightLoader

# Hugging Face projection name -> (our fused projection, shard index in it).
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class AuxHiddenStates:
    """Where the forward copies the residual stream entering some layers (an EAGLE-3 head reads three of them):
    columns [j * hidden, (j + 1) * hidden) of `out` get the stream entering layer `layers[j]`, one row per token."""

    layers: tuple[int, ...]
    out: torch.Tensor  # [>= num_tokens, len(layers) * hidden_size], the model dtype


def _copy_residual_stream(aux: AuxHiddenStates, layer: int, hidden: torch.Tensor | PartialSums | Unreduced,
                          residual: torch.Tensor | None) -> torch.Tensor:
    """Every column block j of aux.out with aux.layers[j] == layer <- hidden + residual (the embeddings before the
    first layer); returns hidden summed, for the layer to go on with (a split-K linear's partial sums, or this
    rank's share of a row-parallel product: an all-reduce every rank joins, in place of the next norm's)."""
    if not isinstance(hidden, torch.Tensor):
        hidden = hidden.reduce()
    stream = hidden if residual is None else hidden + residual
    num_tokens, width = stream.shape
    for j, wanted in enumerate(aux.layers):
        if wanted == layer:
            aux.out[:num_tokens, j * width : (j + 1) * width].copy_(stream)
    return hidden


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        # This rank's heads: a 1/tp share of the query heads, and its KV heads (split, or one replicated).
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = local_kv_heads(config, tp)
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.shard_sizes = (q_size, kv_size, kv_size)
        # Checkpoints hold q_proj, k_proj and v_proj apart: source rows count within each.
        kv_start = kv_head_start(config, tp) * self.head_dim
        parts = [(tp.rank * q_size, q_size), (kv_start, kv_size), (kv_start, kv_size)]
        full_kv = config.num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, parts, [config.num_heads * self.head_dim, full_kv,
                                                                         full_kv], bias=config.attention_bias)
        # Qwen2 (and Qwen2-MoE) has a bias on q/k/v only; Llama's attention_bias covers o_proj too.
        o_bias = config.attention_bias and config.architecture not in ("qwen2", "qwen2_moe")
        self.o_proj = RowParallelLinear(config.num_heads * self.head_dim, config.hidden_size, tp, bias=o_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(
        self,
        rotary: tuple[torch.Tensor, torch.Tensor],  # (cos, sin) of this step's positions
        hidden: torch.Tensor | QuantizedRows,  # [num_tokens, hidden_size], normed (quantized for FP8 qkv)
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
        # On CUDA one kernel normalizes (Qwen3) and rotates q and k and writes k and v into the cache: the
        # decode attention kernel itself in decode steps, a kernel before attention otherwise.
        out = self.attn.rotary_attend(q, k, v, rotary, k_cache, v_cache, meta,
                                      self.q_norm if self.qk_norm else None, self.k_norm if self.qk_norm else None,
                                      fp8_out=self.o_proj.takes_fp8_rows)
        return self.o_proj(out, defer_reduce=True)  # into post_attention_layernorm: PartialSums are fine


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, intermediate_size: int | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"{config.architecture}: unsupported hidden_act {config.hidden_act!r} (expected silu)")
        inter = intermediate_size or config.intermediate_size
        gate_up = column_parts([inter, inter], tp, fused_source=False)  # gate_proj and up_proj split on their own
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, gate_up, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        fp8_out = self.down_proj.takes_fp8_rows  # down_proj in FP8: silu(gate) * up comes quantized
        # Into the next add + RMSNorm (the next layer's or the final one): PartialSums are fine.
        return self.down_proj(self.gate_up_proj.forward_silu_and_mul(x, fp8_out), defer_reduce=True)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, tp)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, tp)  # a MoE block in the MoE families
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
        # Norm outputs that feed FP8 projections only come quantized per token where those would quantize
        # them (RMSNorm's fp8_out): no separate quantization kernel.
        fp8_qkv = self.self_attn.qkv_proj.takes_fp8_rows
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden, fp8_out=fp8_qkv)
        else:
            normed, residual = self.input_layernorm(hidden, residual, fp8_out=fp8_qkv)
        hidden = self.self_attn(rotary, normed, k_cache, v_cache, meta)
        # A MoE block takes the normed rows as a tensor (its router reads them too).
        fp8_mlp = isinstance(self.mlp, LlamaMLP) and self.mlp.gate_up_proj.takes_fp8_rows
        normed, residual = self.post_attention_layernorm(hidden, residual, fp8_out=fp8_mlp)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, make_mlp=lambda config, tp, layer: None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp, make_mlp(config, tp, i))
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        # One cos/sin table shared by all layers (no parameters: not in checkpoints).
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        tp = tp or TPGroup()
        check_tp_shape(config, tp.parallel)
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, tp, self.make_mlp)
        # Tied models read logits through the embedding table; no separate lm_head parameter exists (until
        # quantize_lm_head_fp8_ / _int_ gives them a quantized copy).
        self.lm_head = (None if config.tie_word_embeddings
                        else ParallelLMHead(config.hidden_size, config.vocab_size, tp))

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int32 or int64
        positions: torch.Tensor,  # [num_tokens] int32 or int64
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        aux: AuxHiddenStates | None = None,  # speculative decoding's EAGLE-3 head: off (None) costs nothing
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden = self.model.embed_tokens(input_ids)
        rotary = self.model.rotary_emb(positions)
        residual = None
        for i, layer in enumerate(self.model.layers):
            if aux is not None and i in aux.layers:
                hidden = _copy_residual_stream(aux, i, hidden, residual)
            hidden, residual = layer(rotary, hidden, residual, kv_cache[i, 0], kv_cache[i, 1], meta)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def make_mlp(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module | None:
        """Layer `layer`'s MLP; None: the dense LlamaMLP (the MoE families override this)."""
        return None

    def load_special(self, name: str, tensor, loader: WeightLoader, modules: dict[str, nn.Module]) -> bool:
        """Loads a checkpoint tensor the generic mapping cannot (MoE experts); False: not one of those."""
        return False

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] in the model dtype (into `out` when given)."""
        if self.lm_head is not None:
            return self.lm_head.logits(hidden, out)
        return parallel_logits(hidden, self.model.embed_tokens.weight, self.config.vocab_size, self.tp, out)

    def quantize_lm_head_fp8_(self) -> bool:
        """The logits projection in FP8 (per-vocabulary-row scales); a tied model gets an FP8 copy of its
        embedding table for it. False, and nothing changes, where the shape cannot be FP8."""
        head = self._head_to_quantize()
        if not head.quantize_fp8_():
            return False
        self.lm_head = head
        return True

    def quantize_lm_head_int_(self, bits: int) -> None:
        """The logits projection in `bits`-bit integer codes (round to nearest, rtn_group_size's group); a tied
        model gets them from its embedding table, which keeps the model dtype for lookups. ValueError naming the
        lm_head where no group size divides the hidden size."""
        head = self._head_to_quantize()
        head.quantize_int_(bits, name="lm_head")
        self.lm_head = head

    def _head_to_quantize(self) -> ParallelLMHead:
        """The lm_head, or for a tied model a head over its embedding rows (ParallelLMHead.tied_copy)."""
        if self.lm_head is not None:
            return self.lm_head
        return ParallelLMHead.tied_copy(self.model.embed_tokens, self.config.vocab_size, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face (name, tensor or lazy slice) pairs; each rank keeps only its shard."""
        loader = WeightLoader(self)
        modules = dict(self.named_modules())
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (self.lm_head is None and name == "lm_head.weight"):
                continue
            if self.load_special(name, tensor, loader, modules):
                continue
            parts = name.split(".")
            fused = FUSED_PROJECTIONS.get(parts[-2]) if len(parts) >= 2 else None
            shard = 0
            if fused is not None:
                target, shard = fused
                parts = parts[:-2] + [target, parts[-1]]
            param_name = ".".join(parts)
            module = modules.get(".".join(parts[:-1]))
            offset = 0
            if parts[-1] == "perm":  # an integer weight's act-order input permutation: one per layer (a
                # row-parallel layer's rank: the input columns of the sorted columns it holds)
                if isinstance(module, RowParallelLinear):
                    tensor = module.shard_for_load(tensor, is_bias=False, param="perm")
                loader.copy_shared(param_name, materialize(tensor), source=name)
                continue
            if isinstance(module, ColumnParallelLinear):
                tensor, offset = module.shard_for_load(tensor, shard)
            elif isinstance(module, RowParallelLinear):
                tensor = module.shard_for_load(tensor, is_bias=parts[-1] == "bias", param=parts[-1])
                if tensor is None:
                    continue  # the bias lives on rank 0
            elif isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
                tensor = module.shard_for_load(tensor)
            else:
                tensor = materialize(tensor)
            loader.copy(param_name, tensor, offset, source=name)
        loader.finish()
