"""Loading 4- and 8-bit weights: a checkpoint's quantized layers turned into integer Linears before the tensors
arrive, its tensors repacked into the tandem int-N layout as they stream, and round-to-nearest int4 / int8."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tandem.layers.linear import Linear
from tandem.layers.moe import FusedMoE, RouterLinear
from tandem.layers.parallel import ParallelLMHead, materialize
from tandem.models.int_checkpoints import UNPACKERS, IntCheckpointConfig
from tandem.models.llama import FUSED_PROJECTIONS, LlamaForCausalLM
from tandem.models.moe import EXPERT_MATRIX, EXPERT_PROJ

# quantization= values that quantize every linear at load, round to nearest: their bit widths.
RTN_METHODS = {"int4": 4, "int8": 8}
# Tensors of quantized layers that carry nothing tandem uses.
_UNUSED = ("weight_global_scale",)


def quantized_prefixes(names: Iterable[str], cfg: IntCheckpointConfig) -> list[str]:
    """The checkpoint layers (name prefixes) that hold quantized weights."""
    suffix = "." + cfg.packed_name
    return sorted(n[: -len(suffix)] for n in names if n.endswith(suffix))


def module_name(prefix: str) -> tuple[str, str | None]:
    """(this model's module for a checkpoint layer, the fused projection's source part or None)."""
    head, _, last = prefix.rpartition(".")
    fused = FUSED_PROJECTIONS.get(last)
    if fused is None:
        return prefix, None
    return f"{head}.{fused[0]}" if head else fused[0], last


def prepare_int_linears(model: nn.Module, prefixes: list[str], cfg: IntCheckpointConfig) -> None:
    """Gives every Linear that a quantized checkpoint layer feeds, and every MoE block whose experts are
    quantized, empty integer parameters for the loader to fill (a quantized lm_head too: GPTQModel's `lm_head:
    true`). ValueError, before any tensor is read, for a layer tandem cannot hold in 4 / 8 bits (a tied model's
    lm_head, a router, a fused projection or a block's experts quantized in part, act-order experts, an act-order
    row-parallel shard), naming it."""
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"{type(model).__name__}: 4- / 8-bit checkpoints load into Llama-family models only (the "
                         "others run quantization int4 / int8 from a full-precision checkpoint)")
    modules = dict(model.named_modules())
    sources: dict[str, set[str]] = {}
    experts: dict[str, set[tuple[int, str]]] = {}
    for prefix in prefixes:
        expert = EXPERT_MATRIX.match(prefix)
        if expert is not None:
            _expert_source(prefix, expert, modules, experts)
            continue
        target, part = module_name(prefix)
        module = modules.get(target)
        is_head = prefix.split(".")[-1] == "lm_head" or target.endswith("lm_head")
        if is_head and not isinstance(module, ParallelLMHead):
            raise ValueError(f"checkpoint layer {prefix!r}: a quantized lm_head needs a model with its own (this "
                             "one ties its logits to the embedding table, which stays in the model dtype)")
        if isinstance(module, (FusedMoE, RouterLinear)) or target.endswith(".mlp.gate"):
            raise ValueError(f"checkpoint layer {prefix!r}: a quantized MoE router is not supported (it stays in the "
                             "model dtype)")
        if not isinstance(module, Linear):
            raise ValueError(f"checkpoint layer {prefix!r} holds quantized weights but {type(model).__name__} has "
                             f"no linear {target!r} to take them")
        sources.setdefault(target, set()).add(part or "")
    for target, parts in sources.items():
        expected = {p for p, (t, _) in FUSED_PROJECTIONS.items() if target.endswith("." + t)} or {""}
        if parts != expected:
            raise ValueError(f"{target}: the checkpoint quantizes {sorted(parts)} of its fused parts "
                             f"{sorted(expected)}; all or none must be quantized")
        module = modules[target]
        module.use_int_weight_(cfg.bits, cfg.group_size, cfg.act_order, name=target)
    for target, have in experts.items():
        block = modules[target]
        missing = [f"experts.{e}.{p}" for e in range(block.num_experts) for p in ("gate", "up", "down")
                   if (e, p) not in have]
        if missing:
            raise ValueError(f"{target}: the checkpoint quantizes {len(have)} of its {3 * block.num_experts} expert "
                             f"matrices (not {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}); "
                             "all or none must be quantized")
        block.use_int_experts_(cfg.bits, cfg.group_size, name=f"{target}.experts", act_order=cfg.act_order)


def _expert_source(prefix: str, match: re.Match[str], modules: dict[str, nn.Module],
                   experts: dict[str, set[tuple[int, str]]]) -> None:
    """Records a quantized checkpoint expert matrix under its MoE block (experts[block] gets (expert, proj));
    ValueError naming the layer where the model has no such block or expert."""
    target = f"{match.group(1)}.mlp"
    block, proj, expert = modules.get(target), EXPERT_PROJ.get(match.group(3)), int(match.group(2))
    if not isinstance(block, FusedMoE) or proj is None or expert >= block.num_experts:
        raise ValueError(f"checkpoint layer {prefix!r} holds quantized weights but {target!r} has no such expert")
    experts.setdefault(target, set()).add((expert, proj))


def repack_int_checkpoint(weights: Iterable[tuple[str, object]], cfg: IntCheckpointConfig,
                          prefixes: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) stream with each quantized layer's tensors gathered and yielded as
    `<layer>.qweight`, `.scales`, `.zeros` (and `.perm` with act order) in the tandem int-N layout, as soon as
    the layer's last tensor arrives; other tensors pass through. ValueError naming the layer when its tensors
    disagree with the quantization_config or are incomplete."""
    unpack = UNPACKERS[cfg.method]
    needed = cfg.tensor_names()
    optional = ("g_idx", "weight_g_idx", "weight_zero_point") + _UNUSED
    quantized = set(prefixes)
    done: set[str] = set()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        if prefix in done and suffix in optional:
            continue  # a layer's optional tensor after it was complete (an identity g_idx, symmetric zero points)
        if prefix not in quantized or suffix not in needed + optional:
            if prefix in quantized and suffix == "weight":
                raise ValueError(f"checkpoint layer {prefix!r} holds both a full-precision weight and quantized ones")
            yield name, tensor
            continue
        if suffix in _UNUSED:
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = materialize(tensor)
        if not all(n in parts for n in needed):
            continue
        packed = unpack(prefix, cfg, pending.pop(prefix))
        yield prefix + ".qweight", packed.qweight
        yield prefix + ".scales", packed.scales
        yield prefix + ".zeros", packed.zeros
        if packed.perm is not None:
            yield prefix + ".perm", packed.perm
        quantized.discard(prefix)
        done.add(prefix)
    if pending or quantized:
        layer = sorted(pending or quantized)[0]
        have = sorted(pending.get(layer, {}))
        raise ValueError(f"checkpoint layer {layer!r} is incomplete: it has {have}, a {cfg.method} layer needs "
                         f"{list(needed)}")


def quantize_linears_int(model: nn.Module, bits: int) -> None:
    """Turns every Linear but the lm_head (and MoE routers) and every MoE block's experts into integer codes,
    round to nearest per group of input columns (quantization int4 / int8: rtn_group_size, 128 where it
    divides), one module at a time; embeddings and the lm_head keep the model dtype. ValueError naming a layer
    no group size divides."""
    for name, module in model.named_modules():
        if isinstance(module, (Linear, FusedMoE)) and name.split(".")[-1] != "lm_head":
            module.quantize_int_(bits, name=name)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def decoder_layer(name: str, outside: int | None = None) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (model.layers.{i}.*), `outside` for the others."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match is not None else outside


def streams_int_quantization(model_cls: type) -> bool:
    """Whether quantization int4 / int8 of a full-precision checkpoint quantizes each decoder layer as it loads
    (quantize_as_loaded: the Llama family, whose layers are model.layers.{i}); others load whole, then quantize."""
    return issubclass(model_cls, LlamaForCausalLM)


def quantize_as_loaded(model: nn.Module, weights: Iterable[tuple[str, object]], bits: int,
                       device: torch.device) -> Iterator[tuple[str, object]]:
    """A full-precision checkpoint's (name, tensor) stream, ordered by decoder layer (model.layers.{i}, the rest
    first), for a model built on the meta device (quantization int4 / int8): what lies outside the decoder layers
    gets its storage first; each layer gets it at its first tensor, and its linears and MoE experts are quantized
    (round to nearest, as quantize_linears_int) once its last tensor has been copied: at the next layer's first,
    or at the end. So one decoder layer at most is held in full precision, not the model. ValueError for a tensor
    of a layer already quantized (a stream out of order)."""
    layers = model.model.layers
    for name, module in model.named_modules():
        if not name.startswith("model.layers."):
            _materialize_own(module, device)
    current: int | None = None
    done: set[int] = set()
    for name, tensor in weights:
        index = decoder_layer(name)
        if index is not None and index != current:
            if index in done:
                raise ValueError(f"weight {name!r} comes after its layer was quantized (tensors out of layer order)")
            if current is not None:
                _quantize_layer(layers[current], current, bits)
                done.add(current)
            if index < len(layers):
                materialize_meta(layers[index], device)
            current = index
        yield name, tensor
    if current is not None:
        _quantize_layer(layers[current], current, bits)


def _quantize_layer(layer: nn.Module, index: int, bits: int) -> None:
    for name, module in layer.named_modules():
        if isinstance(module, (Linear, FusedMoE)):
            module.quantize_int_(bits, name=f"model.layers.{index}.{name}")


def repack_int_linears(model: nn.Module) -> None:
    """Every integer Linear's weight in the GPU kernels' layout only (Linear.repack_int_): run once the model is
    loaded (shards cut, every tensor in place) on a GPU whose 16-bit activations run the kernels."""
    for module in model.modules():
        if isinstance(module, Linear) and module.int_bits:
            module.repack_int_()


class EmptyOnMeta(TorchFunctionMode):
    """While a model is built: torch.empty (the uninitialized parameters of Linear, Embedding and FusedMoE, which
    the loader fills) on the meta device, everything else (norms' ones, rotary tables) where it would be. An
    integer model then never allocates its full-precision linears: prepare_int_linears (or the dummy
    initialization) gives them their integer parameters, and materialize_meta the rest their storage."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.empty:
            kwargs = {**kwargs, "device": torch.device("meta")}
        return func(*args, **kwargs)


def materialize_meta(module: nn.Module, device: torch.device) -> None:
    """Gives every parameter still on the meta device uninitialized storage on `device` (same shape, dtype)."""
    for sub in module.modules():
        _materialize_own(sub, device)


def _materialize_own(module: nn.Module, device: torch.device) -> None:
    """materialize_meta for the module's own parameters (not its children's)."""
    for name, param in list(module.named_parameters(recurse=False)):
        if param.is_meta:
            setattr(module, name, nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                               requires_grad=False))
