"""GGUF quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) unpacked from their published byte layouts into the
tandem int-N layout (PackedIntWeight), without a copy of the weight in a floating dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.layers.int_quant import PackedIntWeight, pack_codes

SUPER_BLOCK = 256  # elements of a k-quant super-block (QK_K)


@dataclass(frozen=True, slots=True)
class BlockType:
    """How a GGUF block type is kept: its block (elements, bytes) and the int-N layout it lands in."""

    name: str
    block: int  # elements per block along a row
    block_bytes: int
    bits: int  # the int-N layout's bit width (5- and 6-bit codes ride in 8 bits)
    group: int  # columns per scale / zero group in that layout


# ggml type names -> how each is kept. Q5_K and Q6_K codes (5 and 6 bits) do not divide a 32-bit word, which the
# kernels' code extraction assumes, so they take the 8-bit path: 1 byte a code plus the group's scale and zero.
BLOCK_TYPES = {
    "Q4_0": BlockType("Q4_0", 32, 18, 4, 32),
    "Q4_1": BlockType("Q4_1", 32, 20, 4, 32),
    "Q8_0": BlockType("Q8_0", 32, 34, 8, 32),
    "Q4_K": BlockType("Q4_K", SUPER_BLOCK, 144, 4, 32),
    "Q5_K": BlockType("Q5_K", SUPER_BLOCK, 176, 8, 32),
    "Q6_K": BlockType("Q6_K", SUPER_BLOCK, 210, 8, 16),
}


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at bytes [at, at + 2) of each block, as fp32 [blocks, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """uint8 [blocks, bytes] -> codes [blocks, 2 * bytes]: each run of `run` bytes holds `run` elements in its low
    nibbles, then the next `run` in its high nibbles (ggml's order)."""
    nb, nbytes = qs.shape
    q = qs.reshape(nb, nbytes // run, 1, run)
    return torch.cat((q & 0xF, q >> 4), dim=2).reshape(nb, 2 * nbytes)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the 12 bytes of 6-bit sub-block scales and mins -> two int [blocks, 8]. Bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7, bytes 4-7 the same for the mins, bytes 8-11 the
    low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    s = packed.to(torch.int32).reshape(-1, 3, 4)
    lo, mi, hi = s[:, 0], s[:, 1], s[:, 2]
    scales = torch.cat((lo & 63, (hi & 15) | ((lo >> 2) & 48)), dim=1)
    mins = torch.cat((mi & 63, (hi >> 4) | ((mi >> 2) & 48)), dim=1)
    return scales, mins


def _with_min(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(codes, scale, zero) of value = scale * q + low per group: zero = -low / scale. A group whose scale is 0 holds
    the one value `low`: its codes become 0 and (0 - (-1)) * low gives it back."""
    flat = scale == 0  # [blocks, groups]
    safe = torch.where(flat, torch.ones_like(scale), scale)
    zero = torch.where(flat, -torch.ones_like(scale), -low / safe)
    if bool(flat.any()):
        q = q.reshape(*flat.shape, -1).masked_fill(flat[:, :, None], 0).reshape(q.shape)
    return q, torch.where(flat, low, scale), zero


def _unpack(kind: str, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks uint8 [blocks, block_bytes] -> (codes uint8 [blocks, block], scales and zeros fp32 [blocks, groups])
    with value = (code - zero) * scale, in the type's own grouping."""
    nb = b.shape[0]
    if kind == "Q4_0":  # d, 16 bytes of nibbles: d * (q - 8)
        return _nibbles(b[:, 2:], 16), _f16(b, 0), torch.full((nb, 1), 8.0)
    if kind == "Q4_1":  # d, m, 16 bytes of nibbles: d * q + m
        return _with_min(_nibbles(b[:, 4:], 16), _f16(b, 0), _f16(b, 2))
    if kind == "Q8_0":  # d, 32 int8: d * q
        q = (b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return q, _f16(b, 0), torch.full((nb, 1), 128.0)
    if kind in ("Q4_K", "Q5_K"):  # d, dmin, 12 bytes of 6-bit scales and mins, [qh,] qs: d * sc * q - dmin * m
        sc, mn = _k_scales(b[:, 4:16])
        if kind == "Q4_K":
            q = _nibbles(b[:, 16:], 32)
        else:  # bit i of high byte j belongs to element 32 i + j
            high = (b[:, 16:48].reshape(nb, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)) & 1
            q = _nibbles(b[:, 48:], 32) | (high.reshape(nb, SUPER_BLOCK) << 4)
        return _with_min(q, _f16(b, 0) * sc.float(), -(_f16(b, 2) * mn.float()))
    if kind == "Q6_K":  # 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d: d * sc * (q - 32)
        low = _nibbles(b[:, :128], 64)  # element 128 h + 64 s + j: half h, nibble s, byte j
        qh = b[:, 128:192].reshape(nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
        q = low | ((qh & 3).reshape(nb, SUPER_BLOCK) << 4)  # element 128 h + 32 i + j: bits 2i of byte j of half h
        scale = _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
        return q, scale, torch.full((nb, 16), 32.0)
    raise ValueError(f"GGUF block type {kind} is not kept quantized (kept: {sorted(BLOCK_TYPES)})")


def unpack_gguf_tensor(kind: str, data: torch.Tensor, in_features: int, name: str = "tensor") -> PackedIntWeight:
    """A GGUF tensor's rows of blocks (uint8 [out, in / block * block_bytes]) -> PackedIntWeight in the type's
    layout (BLOCK_TYPES), scales and zeros in fp32. ValueError naming the tensor when the bytes do not fit."""
    spec = BLOCK_TYPES.get(kind)
    if spec is None:
        raise ValueError(f"GGUF tensor {name!r}: block type {kind} is not kept quantized (kept: {sorted(BLOCK_TYPES)})")
    out_features = data.shape[0]
    if in_features % spec.block or data.dtype != torch.uint8 or data.dim() != 2 \
            or data.shape[1] != in_features // spec.block * spec.block_bytes:
        raise ValueError(f"GGUF tensor {name!r}: {kind} bytes {tuple(data.shape)} do not hold {in_features} columns "
                         f"(blocks of {spec.block} elements in {spec.block_bytes} bytes)")
    codes, scales, zeros = _unpack(kind, data.reshape(-1, spec.block_bytes))
    groups = in_features // spec.group
    return PackedIntWeight(pack_codes(codes.reshape(out_features, in_features), spec.bits),
                           scales.reshape(out_features, groups), zeros.reshape(out_features, groups),
                           spec.bits, spec.group)


def widen(packed: PackedIntWeight, bits: int, group: int) -> PackedIntWeight:
    """The same weight at a wider bit width and / or a finer grouping (a fused projection whose parts come in
    different block types holds them all in the widest one): exact, codes copied, scales and zeros repeated."""
    if bits < packed.bits or packed.group_size % group:
        raise ValueError(f"cannot hold {packed.bits}-bit weights of group {packed.group_size} as {bits}-bit "
                         f"group {group}")
    qweight = pack_codes(packed.codes(), bits) if bits != packed.bits else packed.qweight
    repeat = packed.group_size // group
    return PackedIntWeight(qweight, packed.scales.repeat_interleave(repeat, dim=1),
                           packed.zeros.repeat_interleave(repeat, dim=1), bits, group)
