"""EAGLE-3 draft head: its Hugging Face folder (config.json + safetensors) read and checked against the target model,
and its forward, one decoder layer over fc(three of the target's hidden states) and the next token's embedding."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tandem.config import ModelConfig
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.ops import dense_rows, paged_attention, write_kv
from tandem.layers.rotary import RotaryEmbedding, apply_rotary

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# Checkpoint name -> ours: the published heads name their layer `midlayer` (some tools `layers.0`, under `model.`).
_LAYER_PREFIXES = ("midlayer.", "layers.0.")
_LAYER_TENSORS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                  "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    """The head's numbers from its config.json."""

    hidden_size: int
    target_hidden_size: int  # width of each of the three target hidden states fc reads
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (d2t maps into it)
    draft_vocab_size: int  # rows of the head's lm_head
    norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    aux_layers: tuple[int, ...] | None  # target layers whose input stream fc reads; None: (2, L // 2, L - 3)
    norm_before_residual: bool  # the residual is the normed fused hidden state (some heads), not the raw one

    @staticmethod
    def from_folder(folder: str) -> Eagle3Config:
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"speculative_config.model {folder!r} has no config.json: an EAGLE-3 head is a folder "
                             "with config.json and safetensors")
        with open(path) as f:
            raw = json.load(f)
        return Eagle3Config.from_dict(raw)

    @staticmethod
    def from_dict(raw: dict[str, Any]) -> Eagle3Config:
        archs = raw.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise ValueError(f"speculative_config.model: config.json architectures {archs} name no EAGLE-3 head "
                             f"(expected one of {ARCHITECTURES})")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"speculative_config.model: hidden_act {raw['hidden_act']!r} is not supported (silu)")
        for name in ("attention_bias", "mlp_bias"):
            if raw.get(name):
                raise ValueError(f"speculative_config.model: {name} is not supported in an EAGLE-3 head")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"speculative_config.model: num_hidden_layers is {raw['num_hidden_layers']}; only "
                             "single-layer EAGLE-3 heads are supported")
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else None
        theta = float(raw.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0)
        scaling = raw.get("rope_scaling") or rope
        eagle = raw.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids")
        vocab = int(raw["vocab_size"])
        return Eagle3Config(
            hidden_size=hidden, target_hidden_size=int(raw.get("target_hidden_size") or hidden), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads), intermediate_size=int(raw["intermediate_size"]),
            vocab_size=vocab, draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            rope_scaling=scaling if scaling and scaling.get("rope_type", scaling.get("type")) != "default" else None,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            aux_layers=tuple(int(i) for i in layers) if layers else None,
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )

    def check_target(self, target: ModelConfig) -> tuple[int, ...]:
        """ValueError naming the field where the head cannot draft for `target`; else the aux layer ids."""
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(f"speculative_config.model: the head's target_hidden_size (or hidden_size) is "
                             f"{self.target_hidden_size}, the target model's hidden_size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model: the head's vocab_size is {self.vocab_size}, the target "
                             f"model's {target.vocab_size}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"speculative_config.model: draft_vocab_size {self.draft_vocab_size} must be in "
                             f"[1, vocab_size={self.vocab_size}]")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"speculative_config.model: num_attention_heads {self.num_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_kv_heads}")
        n = target.num_layers
        layers = self.aux_layers if self.aux_layers is not None else (2, n // 2, n - 3)
        if len(layers) != 3 or any(not 0 <= i < n for i in layers):
            raise ValueError(f"speculative_config.model: eagle_aux_hidden_state_layer_ids {list(layers)} must be "
                             f"three layer ids of the target's {n} layers")
        return tuple(layers)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 2 * block_size * self.num_kv_heads * self.head_dim * dtype.itemsize


def _expected_shapes(c: Eagle3Config) -> dict[str, tuple[int, ...]]:
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer = {"input_layernorm.weight": (h,), "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
             "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (c.intermediate_size, h), "mlp.up_proj.weight": (c.intermediate_size, h),
             "mlp.down_proj.weight": (h, c.intermediate_size)}
    return {"fc.weight": (h, 3 * c.target_hidden_size), "norm.weight": (h,),
            "lm_head.weight": (c.draft_vocab_size, h), **{f"layer.{k}": v for k, v in layer.items()}}


def _canonical(name: str) -> str:
    name = name.removeprefix("model.")
    for prefix in _LAYER_PREFIXES:
        if name.startswith(prefix):
            return "layer." + name[len(prefix):]
    return name


def read_head_tensors(folder: str) -> dict[str, torch.Tensor]:
    """The folder's safetensors under our names (layer.*, fc, norm, lm_head, d2t, embed_tokens); {} if none."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        for name, tensor in load_file(path).items():
            tensors[_canonical(name)] = tensor
    return tensors


class Eagle3Head:
    """The head's weights on the device and its forward pieces (plain PyTorch: eager on CPU and GPU)."""

    def __init__(self, config: Eagle3Config, tensors: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_positions: int) -> None:
        self.config = c = config
        for name, shape in _expected_shapes(c).items():
            if name not in tensors:
                raise ValueError(f"speculative_config.model: the head's weights lack {name!r}")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"speculative_config.model: {name} has shape {list(tensors[name].shape)}, the "
                                 f"head's config.json says {list(shape)}")
        unknown = sorted(set(tensors) - set(_expected_shapes(c)) - {"d2t", "t2d", "embed_tokens.weight"})
        if unknown:
            raise ValueError(f"speculative_config.model: the head's weights hold tensors an EAGLE-3 head of this "
                             f"format does not have: {unknown[:5]}")
        d2t = tensors.get("d2t")
        if d2t is None:
            if c.draft_vocab_size != c.vocab_size:
                raise ValueError("speculative_config.model: draft_vocab_size < vocab_size but the head has no d2t")
            d2t = torch.zeros(c.vocab_size, dtype=torch.int64)
        ids = torch.arange(c.draft_vocab_size) + d2t.to(torch.int64) if d2t.shape == (c.draft_vocab_size,) else None
        if ids is None or int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise ValueError(f"speculative_config.model: d2t must hold {c.draft_vocab_size} offsets mapping each "
                             f"draft id into the target vocabulary [0, {c.vocab_size})")
        w = {k: tensors[k].to(device=device, dtype=dtype) for k in _expected_shapes(c)}
        layer = "layer.self_attn."
        self.qkv = torch.cat([w[layer + "q_proj.weight"], w[layer + "k_proj.weight"], w[layer + "v_proj.weight"]])
        self.o_proj, self.fc, self.lm_head = w[layer + "o_proj.weight"], w["fc.weight"], w["lm_head.weight"]
        self.gate_up = torch.cat([w["layer.mlp.gate_proj.weight"], w["layer.mlp.up_proj.weight"]])
        self.down = w["layer.mlp.down_proj.weight"]
        self.input_norm, self.hidden_norm = w["layer.input_layernorm.weight"], w["layer.hidden_norm.weight"]
        self.post_norm, self.norm = w["layer.post_attention_layernorm.weight"], w["norm.weight"]
        self.draft_to_target = ids.to(device)  # [draft_vocab] target token id of each draft id
        embed = tensors.get("embed_tokens.weight")
        self.embed: torch.Tensor | None = None if embed is None else embed.to(device=device, dtype=dtype)
        self.rotary = RotaryEmbedding(c.head_dim, max(max_positions, c.max_position_embeddings), c.rope_theta,
                                      c.rope_scaling).to(device=device, dtype=dtype)

    def use_target_embeddings(self, weight: torch.Tensor) -> None:
        """The target's embedding table, where the folder has none of its own."""
        if self.embed is None:
            if weight.shape != (self.config.vocab_size, self.config.hidden_size):
                raise ValueError(f"speculative_config.model: the head has no embed_tokens, and the target's "
                                 f"embeddings {list(weight.shape)} do not fit its hidden_size "
                                 f"{self.config.hidden_size}")
            self.embed = weight

    def release(self) -> None:
        """Drops every weight, and the reference to the target's embeddings (the engine is shut down)."""
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.new_empty(0))
        self.embed = None

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.norm_eps).to(x.dtype)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[n, 3 x target hidden] -> [n, hidden]: the first draft step's hidden state input."""
        return dense_rows(aux, self.fc)

    def qkv_rows(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows (token, hidden state, position) -> rotated q [n, heads, dim], k and v [n, kv heads, dim] and the
        residual [n, hidden]."""
        c = self.config
        assert self.embed is not None
        embeds = self._rms(self.embed[token_ids], self.input_norm)
        normed = self._rms(hidden, self.hidden_norm)
        residual = normed if c.norm_before_residual else hidden
        qkv = dense_rows(torch.cat([embeds, normed], dim=-1), self.qkv)
        n, q_size, kv_size = qkv.shape[0], c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = qkv[:, :q_size].view(n, c.num_heads, c.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(n, c.num_kv_heads, c.head_dim)
        v = qkv[:, q_size + kv_size :].view(n, c.num_kv_heads, c.head_dim)
        cos, sin = self.rotary(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.contiguous(), residual

    def finish_rows(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [n, heads x dim] -> the layer's output stream [n, hidden] (before the final norm):
        the next chain step's hidden state input."""
        hidden = dense_rows(attn, self.o_proj) + residual
        return dense_rows(dense_rows(self._rms(hidden, self.post_norm), self.gate_up, gated=True), self.down) + hidden

    def layer_rows(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                   kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The head's layer over rows (token, hidden state, position): their K/V written into the paged head cache
        kv [2, blocks, block_size, kv heads, dim] at meta.slot_mapping (-1: not written), each row's query
        attending to its sequence's cached positions (meta), -> output streams [n, hidden]. Every row's K/V is
        written before any attention reads: a row may read those of earlier rows of its sequence."""
        q, k, v, residual = self.qkv_rows(token_ids, hidden, positions)
        write_kv(k, v, kv[0], kv[1], meta.slot_mapping)
        attn = paged_attention(q, kv[0], kv[1], meta, self.config.head_dim**-0.5)
        return self.finish_rows(attn.reshape(q.shape[0], -1), residual)

    def draft(self, stream: torch.Tensor) -> torch.Tensor:
        """[n, hidden] output streams -> [n] greedy target token ids (argmax over the draft vocabulary)."""
        logits = dense_rows(self._rms(stream, self.norm), self.lm_head)
        return self.draft_to_target[logits.argmax(dim=-1)]


def random_head_tensors(config: Eagle3Config, seed: int) -> dict[str, torch.Tensor]:
    """Random weights of the head's shape (benchmarks of the draft's cost where no trained head is at hand):
    N(0, 0.02) projections, unit norms, and d2t mapping draft id i to target id i."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * 0.02)
               for name, shape in _expected_shapes(config).items()}
    tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    return tensors
