"""GGUF files kept quantized: which linears run from their blocks (and in which int-N layout), the integer
Linears made for them before any tensor is read, and their blocks streamed in the tandem int-N layout."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from tandem.layers.linear import Linear
from tandem.layers.moe import RouterLinear
from tandem.layers.parallel import ParallelLMHead
from tandem.models.gguf_blocks import BLOCK_TYPES
from tandem.models.gguf_weights import hf_tensor_name
from tandem.models.int_loading import module_name
from tandem.models.llama import FUSED_PROJECTIONS, LlamaForCausalLM

logger = logging.getLogger(__name__)
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass(slots=True)
class GGUFIntPlan:
    """The linears of a GGUF file kept in its blocks: module name -> (bits, group size) of its int-N layout
    (the widest of its parts' BLOCK_TYPES), and the quantized tensors dequantized instead, with why."""

    layouts: dict[str, tuple[int, int]] = field(default_factory=dict)
    dequantized: dict[str, str] = field(default_factory=dict)  # GGUF tensor name -> reason

    def log(self, path: str) -> None:
        if not self.dequantized:
            return
        names = sorted(self.dequantized)
        shown = "; ".join(f"{n} ({self.dequantized[n]})" for n in names[:8])
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        logger.info("GGUF %s: %d linears run from their quantized blocks; dequantized to the model dtype at load: "
                    "%s%s", path, len(self.layouts), shown, more)


def plan_gguf_int(reader, model: nn.Module) -> GGUFIntPlan:
    """Which of the model's linears a GGUF file's blocks fill as integer weights: a decoder Linear whose every
    part (q / k / v, gate / up) is one of BLOCK_TYPES and whose local input columns hold whole groups. The rest
    of the quantized tensors (embeddings, the lm_head, MoE experts and routers, other block types) are
    dequantized."""
    plan = GGUFIntPlan()
    modules = dict(model.named_modules())
    llama = isinstance(model, LlamaForCausalLM)
    parts: dict[str, dict[str, tuple[str, str]]] = {}  # module -> part -> (GGUF name, block type)
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind in _FLOAT_TYPES:
            continue
        name = hf_tensor_name(tensor.name)
        target, part = module_name(name.removesuffix(".weight"))
        module = modules.get(target)
        decoder_linear = isinstance(module, Linear) and not isinstance(module, (ParallelLMHead, RouterLinear))
        if not (llama and name.endswith(".weight") and decoder_linear):
            plan.dequantized[tensor.name] = f"{kind}: not a decoder linear"
        elif kind not in BLOCK_TYPES:
            plan.dequantized[tensor.name] = f"{kind}: block type not kept"
        else:
            parts.setdefault(target, {})[part or ""] = (tensor.name, kind)
    for target, got in parts.items():
        expected = {p for p, (t, _) in FUSED_PROJECTIONS.items() if target.endswith("." + t)} or {""}
        bits = max(BLOCK_TYPES[k].bits for _, k in got.values())
        group = min(BLOCK_TYPES[k].group for _, k in got.values())
        why = None
        if set(got) != expected:
            why = "another part of its fused projection is not kept"
        elif modules[target].in_features % group:
            why = f"{modules[target].in_features} local input columns do not hold whole groups of {group}"
        if why is None:
            plan.layouts[target] = (bits, group)
        else:
            plan.dequantized.update({n: f"{k}: {why}" for n, k in got.values()})
    return plan


def prepare_gguf_int_linears(model: nn.Module, plan: GGUFIntPlan) -> None:
    """Gives every planned Linear empty integer parameters for the blocks to fill."""
    modules = dict(model.named_modules())
    for target, (bits, group) in plan.layouts.items():
        modules[target].use_int_weight_(bits, group, name=target)
