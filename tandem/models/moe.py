"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (gated shared expert) and Qwen3-MoE (qk-norm), the Llama decoder
with a routed-experts block in place of the MLP in the layers the config names."""

from __future__ import annotations

import re

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.distributed.group import TPGroup, Unreduced
from tandem.layers.linear import Linear
from tandem.layers.moe import FusedMoE, RouterLinear
from tandem.layers.parallel import materialize
from tandem.models.llama import LlamaForCausalLM, LlamaMLP
from tandem.models.weights import WeightLoader

# model.layers.{i}.{mlp | block_sparse_moe}.experts.{e}.{proj}.weight (per-expert checkpoints), or the stacked
# model.layers.{i}.mlp.experts.{gate_up_proj | down_proj} (transformers 5's in-memory layout, GGUF's ffn_*_exps).
# One expert's matrix of a per-expert checkpoint (groups: layer, expert, projection); its tensors are .weight, or,
# where the checkpoint's experts are quantized, .qweight / .scales / .zeros in the tandem int-N layout
# (int_loading.repack_int_checkpoint turns GPTQ / AWQ / compressed-tensors tensors into these).
EXPERT_MATRIX = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)$")
EXPERT_PROJ = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_INT_PARTS = ("qweight", "scales", "zeros", "perm")  # perm: act order's input columns
_STACKED = re.compile(r"^(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj|gate_proj|up_proj)(?:\.weight)?$")
_PROJ = {**EXPERT_PROJ, "gate_up_proj": "gate_up"}


class Qwen2MoeSparseBlock(FusedMoE):
    """Routed experts plus a shared expert for every token, scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__(config, tp)
        self.shared_expert = LlamaMLP(config, tp, config.shared_expert_intermediate_size)
        self.shared_expert_gate = RouterLinear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor | Unreduced:
        routed = super().forward(x, reduce=False)
        shared = self.shared_expert
        # This rank's partial product (Linear.forward: no all-reduce); the per-token gate commutes with the
        # cross-rank sum, so one all-reduce covers routed and shared experts.
        partial = Linear.forward(shared.down_proj, shared.gate_up_proj.forward_silu_and_mul(x))
        out = routed + torch.sigmoid(self.shared_expert_gate(x)) * partial
        return self.tp.all_reduce_or_defer(out) if reduce and self.tp.size > 1 else out


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama decoder whose MoE layers hold routed experts; loads per-expert or stacked expert tensors."""

    block_cls: type[FusedMoE] = FusedMoE

    def make_mlp(self, config: ModelConfig, tp: TPGroup, layer: int) -> nn.Module | None:
        if config.num_experts == 0 or config.num_experts_per_tok == 0:
            raise ValueError(f"{config.architecture}: num_experts and num_experts_per_tok must be positive")
        return self.block_cls(config, tp) if config.is_moe_layer(layer) else None

    def load_special(self, name: str, tensor, loader: WeightLoader, modules: dict[str, nn.Module]) -> bool:
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
        if name.endswith(".mlp.gate.weight"):  # Mixtral's router lives under block_sparse_moe
            loader.copy(name, materialize(tensor))
            return True
        prefix, _, suffix = name.rpartition(".")
        match = EXPERT_MATRIX.match(prefix) if suffix == "weight" or suffix in _INT_PARTS else None
        if match is not None and suffix in _INT_PARTS:
            layer = match.group(1)
            block, proj = modules.get(f"{layer}.mlp"), EXPERT_PROJ.get(match.group(3))
            if not isinstance(block, FusedMoE) or not block.int_bits or proj is None:
                raise ValueError(f"unexpected quantized expert weight {name!r}")
            for param, copied in block.load_int_expert(int(match.group(2)), proj, suffix, tensor, name):
                loader.count(f"{layer}.mlp.{param}", copied)
            return True
        stacked = None if match else _STACKED.match(name)
        if match is None and stacked is None:
            return False
        layer = (match or stacked).group(1)
        block = modules.get(f"{layer}.mlp")
        if not isinstance(block, FusedMoE):
            raise ValueError(f"expert weight {name!r} for a layer without experts")
        if match is not None:
            proj = _PROJ.get(match.group(3))
            if proj is None:
                raise ValueError(f"unexpected expert weight {name!r}")
            param, copied = block.load_expert(int(match.group(2)), proj, tensor)
        else:
            param, copied = block.load_stacked(_PROJ[stacked.group(2)], tensor)
        loader.count(f"{layer}.mlp.{param}", copied)
        return True


class MixtralForCausalLM(MoEForCausalLM):
    pass


class Qwen2MoeForCausalLM(MoEForCausalLM):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        if not config.attention_bias:
            raise ValueError("qwen2_moe requires attention_bias=True (q/k/v projections carry a bias)")
        # Without a shared expert (shared_expert_intermediate_size 0) the block is the routed experts alone.
        self.block_cls = Qwen2MoeSparseBlock if config.shared_expert_intermediate_size else FusedMoE
        super().__init__(config, tp)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        if not config.qk_norm:
            raise ValueError("qwen3_moe requires qk_norm=True (per-head RMSNorm on q and k)")
        super().__init__(config, tp)
