"""Test helpers: integer quantization of a weight, a reference dequantization, and packers that write GPTQ, AWQ
and compressed-tensors tensors from their published bit layouts (written here, independent of tandem's
unpackers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column 8c + AWQ_ORDER[i] goes to nibble i of word c


@dataclass
class Quantized:
    codes: torch.Tensor  # int64 [out, in], unsigned codes in [0, 2**bits)
    zeros: torch.Tensor  # int64 [groups, out]
    scales: torch.Tensor  # float16 [groups, out]
    g_idx: torch.Tensor  # int64 [in]: the group of each input column
    bits: int

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in]: (q[n, k] - z[g_idx[k], n]) * s[g_idx[k], n]."""
        z = self.zeros[self.g_idx].t().float()  # [out, in]
        s = self.scales[self.g_idx].t().float()
        return (self.codes.float() - z) * s


def act_order_g_idx(in_features: int, group: int, seed: int) -> torch.Tensor:
    """A g_idx as desc_act writes it: columns in a shuffled order, each run of `group` of them one group."""
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed), device="cpu")
    g_idx = torch.empty(in_features, dtype=torch.int64, device="cpu")
    g_idx[order] = torch.arange(in_features, device="cpu") // group
    return g_idx.to(torch.get_default_device())  # the same order on every device


def quantize(weight: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx: torch.Tensor | None = None,
             min_zero: int = 0) -> Quantized:
    """Min-max quantization per (row, group) of equally many columns; group_size -1 = one group a row; sym:
    zero 2**(bits - 1)."""
    out_features, in_features = weight.shape
    group = in_features if group_size == -1 else group_size
    if g_idx is None:
        g_idx = torch.arange(in_features) // group
    num_groups = in_features // group
    levels = (1 << bits) - 1
    order = torch.sort(g_idx, stable=True).indices  # the columns of group 0, then of group 1, ...
    w = weight.float()[:, order].reshape(out_features, num_groups, group)
    if sym:
        scale = w.abs().amax(dim=2).clamp(min=1e-6) / (levels // 2)
        zero = torch.full((out_features, num_groups), 1 << (bits - 1), dtype=torch.int64)
    else:
        low, high = w.amin(dim=2).clamp(max=0), w.amax(dim=2).clamp(min=0)
        scale = ((high - low) / levels).clamp(min=1e-6)
        zero = (-low / scale).round().long().clamp(min_zero, levels)
    scale = scale.half().float()  # [out, groups], as the checkpoint stores it
    sorted_codes = (w / scale[:, :, None] + zero[:, :, None]).round().clamp(0, levels).long()
    codes = torch.empty(out_features, in_features, dtype=torch.int64)
    codes[:, order] = sorted_codes.reshape(out_features, in_features)
    return Quantized(codes, zero.t().contiguous(), scale.t().half().contiguous(), g_idx, bits)


def _pack_along(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int values -> int32 words, 32 // bits per word along dim, element i of a word at bits i * bits."""
    f = 32 // bits
    v = values.long()
    if dim == 0:
        v = v.t()
    rows, cols = v.shape
    words = torch.zeros(rows, cols // f, dtype=torch.int64)
    for i in range(f):
        words |= v[:, i::f] << (bits * i)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.t().contiguous() if dim == 0 else words


def gptq_tensors(q: Quantized, v1: bool) -> dict[str, torch.Tensor]:
    """qweight int32 [in / f, out], qzeros int32 [groups, out / f] (v1: zero - 1), scales fp16, g_idx int32."""
    mask = (1 << q.bits) - 1
    zeros = (q.zeros - 1) & mask if v1 else q.zeros
    return {
        "qweight": _pack_along(q.codes.t(), q.bits, dim=0),
        "qzeros": _pack_along(zeros, q.bits, dim=1),
        "scales": q.scales.clone(),
        "g_idx": q.g_idx.to(torch.int32),
    }


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, out] 4-bit values -> int32 [rows, out / 8] in AWQ's interleaved order."""
    rows, cols = values.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_ORDER):
        words |= values[:, column::8].long() << (4 * i)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def awq_tensors(q: Quantized) -> dict[str, torch.Tensor]:
    """qweight int32 [in, out / 8], qzeros int32 [groups, out / 8], scales fp16 [groups, out]."""
    return {"qweight": _awq_pack(q.codes.t()), "qzeros": _awq_pack(q.zeros), "scales": q.scales.clone()}


def compressed_tensors_tensors(q: Quantized, sym: bool, with_g_idx: bool = False) -> dict[str, torch.Tensor]:
    """weight_packed int32 [out, in / f] (signed code + 2**(bits-1), which is the unsigned code), weight_scale
    [out, groups], weight_zero_point int32 [out / f, groups] packed along out (asymmetric), weight_shape."""
    out_features, in_features = q.codes.shape
    tensors = {
        "weight_packed": _pack_along(q.codes, q.bits, dim=1),
        "weight_scale": q.scales.t().contiguous(),
        "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }
    if not sym:
        tensors["weight_zero_point"] = _pack_along(q.zeros.t(), q.bits, dim=0)
    if with_g_idx:
        tensors["weight_g_idx"] = q.g_idx.to(torch.int32)
    return tensors
