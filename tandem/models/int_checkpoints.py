"""Hugging Face 4- and 8-bit checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized): their
quantization_config, and each layer's tensors unpacked from the format's published bit layout into a
PackedIntWeight (the tandem int-N layout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.layers.int_quant import INT_BITS, PackedIntWeight, pack_codes

INT_METHODS = ("gptq", "awq", "compressed-tensors")
GPTQ_GROUP_SIZES = (32, 64, 128, -1)
GPTQ_FORMATS = ("gptq", "gptq_v2")  # gptq: zero points stored minus one; gptq_v2: as they are
AWQ_GROUP_SIZES = (32, 64, 128)
# AWQ's GEMM packing puts output column 8c + AWQ_ORDER[i] of a word's eight into nibble i.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True, slots=True)
class IntCheckpointConfig:
    method: str  # one of INT_METHODS
    bits: int
    group_size: int  # input columns per group; -1: one group per output channel
    act_order: bool  # g_idx permutes input columns (GPTQ desc_act, compressed-tensors actorder "group")
    zeros_minus_one: bool = False  # GPTQ's "gptq" checkpoint format
    symmetric: bool = True  # compressed-tensors: no weight_zero_point tensors (GPTQ / AWQ always store zeros)

    def tensor_names(self) -> tuple[str, ...]:
        """Suffixes of the tensors every quantized layer holds."""
        if self.method == "compressed-tensors":
            base = ("weight_packed", "weight_scale", "weight_shape")
            zero = () if self.symmetric else ("weight_zero_point",)
            return base + zero + (("weight_g_idx",) if self.act_order else ())
        return ("qweight", "qzeros", "scales") + (("g_idx",) if self.act_order else ())

    @property
    def packed_name(self) -> str:
        return "weight_packed" if self.method == "compressed-tensors" else "qweight"


def checkpoint_int_config(hf_config: dict[str, Any]) -> IntCheckpointConfig | None:
    """config.json's quantization_config as an IntCheckpointConfig when it describes integer weights; None
    without one or for FP8 schemes; ValueError for what tandem cannot run, naming the key and its value."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "gptq":
        return _gptq_config(qc)
    if method == "awq":
        return _awq_config(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_config(qc)
    return None


def _check_bits(method: str, bits: Any, allowed: tuple[int, ...] = INT_BITS) -> int:
    if bits not in allowed:
        raise ValueError(f"{method} checkpoint: {bits}-bit weights are not supported (bits must be one of {allowed})")
    return int(bits)


def _gptq_config(qc: dict[str, Any]) -> IntCheckpointConfig:
    bits = _check_bits("GPTQ", qc.get("bits"))
    group = qc.get("group_size", 128)
    if group not in GPTQ_GROUP_SIZES:
        raise ValueError(f"GPTQ checkpoint: group_size {group} is not supported (one of {GPTQ_GROUP_SIZES})")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in GPTQ_FORMATS or qc.get("is_marlin_format"):
        raise ValueError(f"GPTQ checkpoint: checkpoint_format {fmt!r} is not supported (one of {GPTQ_FORMATS})")
    if qc.get("lm_head"):
        raise ValueError("GPTQ checkpoint: a quantized lm_head is not supported (lm_head: true)")
    return IntCheckpointConfig("gptq", bits, group, bool(qc.get("desc_act")), zeros_minus_one=fmt == "gptq")


def _awq_config(qc: dict[str, Any]) -> IntCheckpointConfig:
    bits = _check_bits("AWQ", qc.get("bits", qc.get("w_bit")), (4,))
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if group not in AWQ_GROUP_SIZES:
        raise ValueError(f"AWQ checkpoint: group_size {group} is not supported (one of {AWQ_GROUP_SIZES})")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ checkpoint: version {version!r} is not supported (the GEMM packing, 'gemm', only)")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ checkpoint: zero_point false is not supported (AWQ GEMM checkpoints with zero points)")
    return IntCheckpointConfig("awq", bits, group, act_order=False)


def _compressed_tensors_config(qc: dict[str, Any]) -> IntCheckpointConfig | None:
    groups = list((qc.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    if not weights or all(w.get("type") == "float" for w in weights):
        return None  # FP8 (or no weight scheme): the FP8 checkpoint path decides
    schemes = {_ct_scheme(w, g) for w, g in zip(weights, groups)}
    fmt = qc.get("format")
    formats = {g.get("format") or fmt for g in groups}
    if formats != {"pack-quantized"}:
        raise ValueError(f"compressed-tensors checkpoint: format {sorted(map(str, formats))} is not supported for "
                         "integer weights ('pack-quantized' only)")
    if len(schemes) != 1:
        raise ValueError("compressed-tensors checkpoint: config_groups mix weight schemes "
                         f"{sorted(schemes)}; one scheme for every layer is supported")
    bits, group, act_order, symmetric = schemes.pop()
    return IntCheckpointConfig("compressed-tensors", bits, group, act_order, symmetric=symmetric)


def _ct_scheme(weights: dict[str, Any], group: dict[str, Any]) -> tuple[int, int, bool, bool]:
    """(bits, group size or -1, act order, symmetric) of one compressed-tensors config group; ValueError otherwise."""
    if weights.get("type") != "int":
        raise ValueError(f"compressed-tensors checkpoint: weight type {weights.get('type')!r} is not supported "
                         "beside integer weights")
    bits = _check_bits("compressed-tensors", weights.get("num_bits"))
    if group.get("input_activations") is not None:
        raise ValueError("compressed-tensors checkpoint: quantized input activations are not supported (weight-only "
                         "W4A16 / W8A16 only)")
    strategy = weights.get("strategy")
    if strategy == "group":
        size = weights.get("group_size")
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"compressed-tensors checkpoint: group strategy with group_size {size!r}")
    elif strategy == "channel":
        size = -1
    else:
        raise ValueError(f"compressed-tensors checkpoint: weight strategy {strategy!r} is not supported "
                         "('group' or 'channel')")
    actorder = weights.get("actorder")
    if actorder not in (None, False, "group", "weight", "static", True):
        raise ValueError(f"compressed-tensors checkpoint: actorder {actorder!r} is not supported")
    return bits, size, actorder in ("group", True), bool(weights.get("symmetric", True))


# ----------------------------------------------------------------------------- bit layouts


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> int32 codes, 32 // bits per word along `dim` (0 or 1), element i of a word in bits
    [i * bits, (i + 1) * bits): [r, c] -> [r * f, c] (dim 0) or [r, c * f] (dim 1)."""
    f = 32 // bits
    shifts = torch.arange(f, dtype=torch.int32) * bits
    mask = (1 << bits) - 1
    p = packed.to(torch.int32)
    if dim == 0:
        return ((p[:, None, :] >> shifts[None, :, None]) & mask).reshape(p.shape[0] * f, p.shape[1])
    return ((p[:, :, None] >> shifts[None, None, :]) & mask).reshape(p.shape[0], p.shape[1] * f)


def _require(cond: bool, name: str, why: str) -> None:
    if not cond:
        raise ValueError(f"checkpoint layer {name!r}: {why}")


def _int32(name: str, t: torch.Tensor, what: str) -> torch.Tensor:
    _require(t.dtype == torch.int32 and t.dim() == 2, name,
             f"{what} must be a 2-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    return t


def _num_groups(cfg: IntCheckpointConfig, in_features: int) -> int:
    return 1 if cfg.group_size == -1 else -(-in_features // cfg.group_size)


def _with_act_order(name: str, cfg: IntCheckpointConfig, codes: torch.Tensor, g_idx: torch.Tensor | None,
                    num_groups: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """codes [out, in] with their columns sorted by group (stable) where g_idx permutes them, and the
    permutation; every group must then hold exactly group_size columns."""
    in_features = codes.shape[1]
    group = in_features if cfg.group_size == -1 else cfg.group_size
    if g_idx is None:
        return codes, None
    g = g_idx.to(torch.int64).reshape(-1)
    _require(g.shape[0] == in_features, name, f"g_idx has {g.shape[0]} entries for {in_features} input columns")
    _require(bool(((g >= 0) & (g < num_groups)).all()), name, f"g_idx holds groups outside [0, {num_groups})")
    if not cfg.act_order:
        trivial = torch.arange(in_features) // group
        _require(torch.equal(g, trivial), name, "g_idx reorders input columns but quantization_config has no act "
                 "order (desc_act / actorder)")
        return codes, None
    counts = torch.bincount(g, minlength=num_groups)
    _require(bool((counts == group).all()), name, f"g_idx gives groups of {sorted(set(counts.tolist()))} columns; "
             f"every group must hold group_size={group}")
    perm = torch.sort(g, stable=True).indices
    return codes[:, perm], perm


def _packed(cfg: IntCheckpointConfig, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            perm: torch.Tensor | None) -> PackedIntWeight:
    group = codes.shape[1] if cfg.group_size == -1 else cfg.group_size
    return PackedIntWeight(pack_codes(codes, cfg.bits), scales.contiguous(), zeros.float().contiguous(), cfg.bits,
                           group, perm)


def unpack_gptq(name: str, cfg: IntCheckpointConfig, tensors: dict[str, torch.Tensor]) -> PackedIntWeight:
    """GPTQ: qweight int32 [in / f, out] packed along in, qzeros int32 [groups, out / f] packed along out,
    scales [groups, out], g_idx [in] (f = 32 / bits); W[n, k] = (q - z[g_idx[k], n]) * s[g_idx[k], n], with z
    the stored zero plus one in the "gptq" format."""
    qweight = _int32(name, tensors["qweight"], "qweight")
    qzeros = _int32(name, tensors["qzeros"], "qzeros")
    scales = tensors["scales"]
    codes = unpack_int32(qweight, cfg.bits, dim=0).t()  # [out, in]
    out_features, in_features = codes.shape
    groups = _num_groups(cfg, in_features)
    _require(tuple(scales.shape) == (groups, out_features), name,
             f"scales {tuple(scales.shape)} disagree with qweight {tuple(qweight.shape)} at bits={cfg.bits}, "
             f"group_size={cfg.group_size} (expected {(groups, out_features)})")
    zeros = unpack_int32(qzeros, cfg.bits, dim=1)  # [groups, out (padded to f)]
    _require(zeros.shape[0] == groups and zeros.shape[1] >= out_features, name,
             f"qzeros {tuple(qzeros.shape)} disagree with scales {tuple(scales.shape)} at bits={cfg.bits}")
    zeros = zeros[:, :out_features] + (1 if cfg.zeros_minus_one else 0)
    codes, perm = _with_act_order(name, cfg, codes, tensors.get("g_idx"), groups)
    return _packed(cfg, codes, scales.t(), zeros.t(), perm)


def unpack_awq(name: str, cfg: IntCheckpointConfig, tensors: dict[str, torch.Tensor]) -> PackedIntWeight:
    """AWQ GEMM: qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], both packed along out in
    AWQ_ORDER; scales [groups, out]; W[n, k] = (q - z[k // group, n]) * s[k // group, n]."""
    qweight = _int32(name, tensors["qweight"], "qweight")
    qzeros = _int32(name, tensors["qzeros"], "qzeros")
    scales = tensors["scales"]
    # Nibble i of a word holds column AWQ_ORDER[i]: reading the nibbles at the inverse order restores columns.
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))

    def columns(words: torch.Tensor) -> torch.Tensor:
        vals = unpack_int32(words, cfg.bits, dim=1)  # [rows, out] in nibble order
        return vals.view(vals.shape[0], -1, 8)[:, :, inverse].reshape(vals.shape)

    codes = columns(qweight).t()  # [out, in]
    out_features, in_features = codes.shape
    groups = _num_groups(cfg, in_features)
    _require(tuple(scales.shape) == (groups, out_features), name,
             f"scales {tuple(scales.shape)} disagree with qweight {tuple(qweight.shape)} at bits={cfg.bits}, "
             f"group_size={cfg.group_size} (expected {(groups, out_features)})")
    zeros = columns(qzeros)
    _require(tuple(zeros.shape) == (groups, out_features), name,
             f"qzeros {tuple(qzeros.shape)} disagree with scales {tuple(scales.shape)}")
    return _packed(cfg, codes, scales.t(), zeros.t(), None)


def unpack_compressed_tensors(name: str, cfg: IntCheckpointConfig,
                              tensors: dict[str, torch.Tensor]) -> PackedIntWeight:
    """compressed-tensors pack-quantized: weight_packed int32 [out, in / f] packed along in, each value the
    signed code plus 2**(bits - 1); weight_scale [out, groups]; weight_zero_point (asymmetric only) int32
    [out / f, groups] packed along out the same way (or int8 [out, groups] unpacked, signed); weight_shape
    [2] = (out, in); weight_g_idx [in] with actorder group. W = (q - zp) * s in the signed codes."""
    packed = _int32(name, tensors["weight_packed"], "weight_packed")
    scales = tensors["weight_scale"]
    shape = tensors["weight_shape"].reshape(-1).tolist()
    _require(len(shape) == 2, name, f"weight_shape {shape} is not (out, in)")
    out_features, in_features = int(shape[0]), int(shape[1])
    codes = unpack_int32(packed, cfg.bits, dim=1)
    _require(codes.shape[0] == out_features and codes.shape[1] >= in_features, name,
             f"weight_packed {tuple(packed.shape)} does not hold weight_shape {shape} at num_bits={cfg.bits}")
    codes = codes[:, :in_features]
    groups = _num_groups(cfg, in_features)
    _require(tuple(scales.shape) == (out_features, groups), name,
             f"weight_scale {tuple(scales.shape)} disagrees with weight_shape {shape} at group_size="
             f"{cfg.group_size} (expected {(out_features, groups)})")
    offset = 1 << (cfg.bits - 1)
    zp = tensors.get("weight_zero_point")
    if zp is None:
        zeros = torch.full((out_features, groups), float(offset))
    elif zp.dtype == torch.int32:
        zeros = unpack_int32(zp.reshape(-1, groups), cfg.bits, dim=0)[:out_features].float()
    else:
        zeros = zp.reshape(out_features, -1).float() + offset
    _require(tuple(zeros.shape) == (out_features, groups), name,
             f"weight_zero_point {tuple(zp.shape) if zp is not None else None} disagrees with weight_scale "
             f"{tuple(scales.shape)}")
    codes, perm = _with_act_order(name, cfg, codes, tensors.get("weight_g_idx"), groups)
    return _packed(cfg, codes, scales, zeros, perm)


UNPACKERS = {"gptq": unpack_gptq, "awq": unpack_awq, "compressed-tensors": unpack_compressed_tensors}
