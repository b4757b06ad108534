"""Packs an adapter's A / B pairs into the layout of the model's (fused, possibly sharded) linears: per linear one
A [parts * max_rank, in_local] and one B [out_local, parts * max_rank], the scale folded into B."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tandem.layers.linear import Linear
from tandem.layers.parallel import ColumnParallelLinear, RowParallelLinear
from tandem.lora.peft import PROJECTIONS, AdapterHeader, LoRAAdapter

# tandem's linears an adapter may touch (those peft.PROJECTIONS name) -> the adapter parts each holds (every part
# on max_rank columns of its own).
TARGETS = {"qkv_proj": 3, "gate_up_proj": 2, "o_proj": 1, "down_proj": 1, "c_attn": 1, "c_fc": 1, "c_proj": 1}


@dataclass(slots=True)
class PackedAdapter:
    """One adapter in the pool's layout, on the host (pinned where the device is a GPU): per target linear name,
    (A [parts * max_rank, in_local], B [out_local, parts * max_rank]) in the model dtype; linears the adapter does
    not touch are absent (their slot rows are zeroed when it pages in)."""

    lora_int_id: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    num_bytes: int


def lora_targets(model: nn.Module) -> dict[str, Linear]:
    """The linears an adapter may touch, by module name: the dense decoders' fused qkv, o, fused gate_up, down
    (GPT-2: c_attn, both c_proj, c_fc)."""
    return {name: m for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in TARGETS and isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


def num_parts(name: str) -> int:
    """The adapter parts target linear `name` holds (q, k, v in a fused qkv; one for a projection taken whole, or
    for a linear of another name)."""
    return TARGETS.get(name.rsplit(".", 1)[-1], 1)


def whole_shape(linear: Linear, part: int | None) -> tuple[int, int]:
    """(in, out) of the whole (unsharded) base projection an adapter's module stands for: part `part` of a fused
    column-parallel linear, or the whole linear (part None; a row-parallel linear, whose input is split)."""
    if isinstance(linear, ColumnParallelLinear):
        return linear.in_features, sum(linear.full_sizes) if part is None else linear.full_sizes[part]
    return linear.in_features * linear.tp.size, linear.out_features


def module_shapes(targets: dict[str, Linear]) -> dict[str, tuple[int, int]]:
    """Every Hugging Face module an adapter may target in this model (`model.layers.3.self_attn.q_proj`): its
    whole base projection's (in, out)."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, linear in targets.items():
        prefix, kind = name.rsplit(".", 1)
        for module, (target, part) in PROJECTIONS.items():
            if target == kind:
                shapes[f"{prefix}.{module}"] = whole_shape(linear, part)
    return shapes


def _target(where: str, module: str, a_shape: Sequence[int], b_shape: Sequence[int], targets: dict[str, Linear]
            ) -> tuple[str, Linear, int | None]:
    """(tandem's linear name, the linear, the part; None: the whole linear) that holds HF `module`; ValueError naming
    the adapter (`where`) when the model lacks it or A [r, in] / B [out, r] do not match its base projection."""
    prefix, _, proj = module.rpartition(".")
    target_name, part = PROJECTIONS[proj]
    name = f"{prefix}.{target_name}"
    linear = targets.get(name)
    if linear is None:
        raise ValueError(f"{where}: target module {module!r} is not a projection this model has")
    full_in, full_out = whole_shape(linear, part)
    if a_shape[1] != full_in or b_shape[0] != full_out:
        raise ValueError(f"{where}: {module} has A {tuple(a_shape)} / B {tuple(b_shape)}, but the base "
                         f"projection maps {full_in} -> {full_out} features")
    return name, linear, part


def check_header(header: AdapterHeader, targets: dict[str, Linear]) -> None:
    """pack_adapter's checks of modules and shapes, from the header alone (before any weight is read)."""
    where = f"LoRA adapter {header.request.lora_name!r} ({header.request.lora_path})"
    for module, (a_shape, b_shape) in header.shapes.items():
        _target(where, module, a_shape, b_shape, targets)


def pack_adapter(adapter: LoRAAdapter, targets: dict[str, Linear], max_rank: int, dtype: torch.dtype,
                 pin: bool) -> PackedAdapter:
    """This rank's shard of each module, as the base layer keeps it (B's output rows in a column-parallel linear,
    A's input columns in a row-parallel one). ValueError naming the adapter for a module the model lacks or a shape
    that does not match its base."""
    where = f"LoRA adapter {adapter.name!r} ({adapter.request.lora_path})"
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    r, num_bytes = adapter.rank, 0
    for module, (a, b) in adapter.weights.items():
        name, linear, part = _target(where, module, a.shape, b.shape, targets)
        parts = num_parts(name)
        if name not in packed:
            packed[name] = (torch.zeros(parts * max_rank, linear.in_features),
                            torch.zeros(linear.out_features, parts * max_rank))
        big_a, big_b = packed[name]
        cols = slice((part or 0) * max_rank, (part or 0) * max_rank + r)
        if isinstance(linear, ColumnParallelLinear):
            big_a[cols] = a
            # Each of the linear's parts this module covers: this rank's rows of it (all of them: taken whole).
            for p in range(len(linear.parts)) if part is None else (part,):
                local_b, offset = linear.shard_for_load(b, p)
                big_b[offset : offset + linear.parts[p][1], cols] = local_b * adapter.scaling
        else:
            big_a[cols] = linear.shard_for_load(a, is_bias=False)
            big_b[:, cols] = b * adapter.scaling
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (big_a, big_b) in packed.items():
        host_a, host_b = big_a.to(dtype), big_b.to(dtype)
        if pin:
            host_a, host_b = host_a.pin_memory(), host_b.pin_memory()
        out[name] = (host_a, host_b)
        num_bytes += host_a.nbytes + host_b.nbytes
    return PackedAdapter(adapter.request.lora_int_id, out, num_bytes)
