"""4- and 8-bit integer weights in the tandem int-N layout: its description (PackedIntWeight), nibble packing,
round-to-nearest quantization, and the weight-only linear that runs them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels.fp8 import PartialSums
from tandem.kernels.int_weight import IntWeight, repack_int_weight, stack_int_weights
from tandem.kernels.ops import gather_columns, int_weight_linear
from tandem.kernels.reference import dequantize_int_weight, unpack_int4_rows

INT_BITS = (4, 8)
# Group sizes of quantization="int4" / "int8" (round to nearest at load): 128, the common choice of 4-bit
# checkpoints, where it divides a layer's (local) input columns, else the next that does.
RTN_GROUP_SIZES = (128, 64, 32)


@dataclass(slots=True)
class PackedIntWeight:
    """A weight W [out, in] as unsigned codes with a scale and a zero point per (row, group of columns):
    W[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]. With perm (act order), column k
    of W multiplies input column perm[k]: the layer reads x[..., perm]."""

    qweight: torch.Tensor  # uint8 [out, in // 2] (4 bits: even k in the low nibble of byte k // 2) or [out, in]
    scales: torch.Tensor  # [out, in // group_size] in the model dtype
    zeros: torch.Tensor  # [out, in // group_size] in the model dtype: the zero point as a real number
    bits: int
    group_size: int  # columns per group; in_features for one group per row (never -1 here)
    perm: torch.Tensor | None = None  # int64 [in]: the input column each weight column reads

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (8 // self.bits)

    def codes(self) -> torch.Tensor:
        """uint8 [out, in]: the unpacked codes, in the weight's column order."""
        return unpack_int4_rows(self.qweight) if self.bits == 4 else self.qweight

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in] in the input's column order (perm undone): what x is multiplied by."""
        w = dequantize_int_weight(self.qweight, self.scales, self.zeros, self.bits, self.group_size)
        if self.perm is None:
            return w
        original = torch.empty_like(w)
        original[:, self.perm] = w
        return original


def check_int_layout(name: str, bits: int, group_size: int, out_features: int, in_features: int) -> int:
    """The group size in columns (in_features for -1); ValueError naming the layer when the layout cannot hold
    a weight of this shape."""
    if bits not in INT_BITS:
        raise ValueError(f"{name}: {bits}-bit integer weights are not supported (bits must be one of {INT_BITS})")
    group = in_features if group_size == -1 else group_size
    if group <= 0 or in_features % group:
        raise ValueError(f"{name}: group size {group_size} does not divide its {in_features} input columns (a "
                         "tensor-parallel shard must hold whole groups)")
    if bits == 4 and in_features % 2:
        raise ValueError(f"{name}: 4-bit weights need an even number of input columns, got {in_features}")
    return group


def rtn_group_size(in_features: int, name: str = "linear") -> int:
    """The first of RTN_GROUP_SIZES that divides in_features; ValueError naming the layer when none does."""
    for group in RTN_GROUP_SIZES:
        if in_features % group == 0:
            return group
    raise ValueError(f"{name}: no group size of {RTN_GROUP_SIZES} divides its {in_features} input columns "
                     "(int4 / int8 quantize whole groups)")


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] (values < 16, in even) -> uint8 [out, in // 2], even columns in the low nibbles."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [out, in] -> the layout's qweight."""
    codes = codes.to(torch.uint8)
    return pack_int4_rows(codes) if bits == 4 else codes.contiguous()


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int, name: str = "weight") -> PackedIntWeight:
    """[out, in] float -> PackedIntWeight, asymmetric round to nearest per (row, group): each group's minimum and
    maximum map to codes 0 and 2**bits - 1 (the range always holds 0, so zero weights stay exact). The scale is
    rounded to the weight's dtype before the codes are computed, so the stored scale is the one they assume."""
    out_features, in_features = weight.shape
    group = check_int_layout(name, bits, group_size, out_features, in_features)
    levels = (1 << bits) - 1
    w = weight.float().reshape(out_features, in_features // group, group)  # [out, groups, group]
    low = w.amin(dim=2).clamp(max=0.0)
    high = w.amax(dim=2).clamp(min=0.0)
    scale = ((high - low) / levels).clamp(min=1e-8).to(weight.dtype).float()  # [out, groups]
    zero = (-low / scale).round().clamp(0, levels)
    q = (w / scale[:, :, None] + zero[:, :, None]).round().clamp(0, levels).reshape(out_features, in_features)
    return PackedIntWeight(pack_codes(q.to(torch.uint8), bits), scale.to(weight.dtype), zero.to(weight.dtype),
                           bits, group)


def quantize_rtn_experts(weights: torch.Tensor, bits: int, group_size: int | None = None,
                         name: str = "experts", tiled: bool | None = None) -> IntWeight:
    """A stack of MoE experts' weights [E, N, K] -> one IntWeight stack in the kernels' layout (words
    [E, N, K * bits // 32], scales and mins [E, N, K // group]): quantize_rtn of each expert, group_size None:
    rtn_group_size(K); tiled: repack_int_weight's. One expert's temporaries at a time."""
    num_experts, n, k = weights.shape
    group = rtn_group_size(k, name) if group_size is None else group_size
    parts = []
    for e in range(num_experts):
        packed = quantize_rtn(weights[e], bits, group, f"{name}[{e}]")
        parts.append(repack_int_weight(packed.qweight, packed.scales, packed.zeros, bits, group, tiled))
    return stack_int_weights(parts)


def int_linear(
    x: torch.Tensor,  # [..., in] in the model dtype
    packed: PackedIntWeight | None,  # None: the layer holds only the kernels' layout (Linear.repack_int_)
    bias: torch.Tensor | None,  # [out]
    repacked: IntWeight | None = None,  # the GPU kernels' copy of the same weight (repack_int_weight), if made
    perm: torch.Tensor | None = None,  # int64 [in]: act order's input columns (packed.perm when packed is given)
    defer_reduce: bool = False,  # 2-D x: a K split may come back as PartialSums (Linear.forward's contract)
    gated: bool = False,  # gate rows then up rows: silu(gate) * up, [..., out / 2]
) -> torch.Tensor | PartialSums:  # [..., out] in x's dtype
    """x W^T + b for an integer weight; the one place act order's column permutation is applied."""
    if packed is not None:
        perm = packed.perm
    if perm is not None:
        x = gather_columns(x, perm)
    if packed is None:
        if repacked is None:
            raise ValueError("an integer linear needs its weight in the int-N layout or the kernels' layout")
        return int_weight_linear(x, None, None, None, repacked.bits, repacked.group_size, bias=bias,
                                 packed=repacked, defer_reduce=defer_reduce, gated=gated)
    return int_weight_linear(x, packed.qweight, packed.scales, packed.zeros, packed.bits, packed.group_size,
                             bias=bias, packed=repacked, defer_reduce=defer_reduce, gated=gated)
