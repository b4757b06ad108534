"""The 4- and 8-bit weight layout the Triton int-weight kernels read (IntWeight), made once at load from the
tandem int-N layout by repack_int_weight."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tandem.kernels.reference import check_int_weight

WORD_BITS = 32
# 4 bits: the element of its word's 8 that nibble i holds. A word's codes of elements 2i and 2i + 1 then sit in
# bits 4i and 4i + 16, the low bits of its two 16-bit halves once shifted right by 4i: one and-or makes the
# pair (2i, 2i + 1) of 16-bit floats in the order the tensor cores read it (triton_int_weight._WORD_ASM).
NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The words of a weight whose shape allows it are held in tiles of TILE rows x TILE words (16 channels x 64 bytes:
# what one warp of the tensor-core kernels reads of a 16-channel block per step), each tile's rows one after
# another, the tiles of a 16-channel block one after another along K, the blocks by channel. A 16-byte load of
# every lane of a warp then reads 512 contiguous bytes, and a program streams whole kilobytes, where rows of the
# plain layout lie a row's length apart (one-row GEMVs 2-12% faster on an H200: docs/quantization.md).
TILE = 16


@dataclass(slots=True)
class IntWeight:
    """A weight W [N, K] = q * scale + min per group of group_size elements of a row (min = -zero * scale),
    as the kernels read it: codes in int32 words along K, scales and mins in the activation dtype. A stack of
    MoE experts' weights has one leading dimension more: words [E, N, K * bits // 32], scales and mins
    [E, N, K // group_size]."""

    words: torch.Tensor  # int32 [N, K * bits // 32]: 8 bits, element 4w + i in byte i of word w; 4 bits, nibble
    # i of word w holds element 8w + NIBBLE_ORDER[i]; tiled: the same words in tiles (tile_words)
    scales: torch.Tensor  # [N, K // group_size]
    mins: torch.Tensor  # [N, K // group_size]: -zero * scale; 4 bits: rounded to the scales' dtype, 8 bits: fp32
    bits: int
    group_size: int
    tiled: bool = False  # words held in TILE x TILE tiles (tile_words), not row after row

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): output and input features (of each expert, for a stack)."""
        return self.words.shape[-2], self.words.shape[-1] * (WORD_BITS // self.bits)


def stack_int_weights(parts: list[IntWeight]) -> IntWeight:
    """MoE experts' weights of one layout as one stack (words [E, N, K * bits // 32], scales and mins [E, N,
    groups]); ValueError where they disagree on bits, group size or layout."""
    first = parts[0]
    if any((p.bits, p.group_size, p.tiled) != (first.bits, first.group_size, first.tiled) for p in parts):
        raise ValueError("stacked integer weights must share bits, group size and word layout")
    return IntWeight(torch.stack([p.words for p in parts]), torch.stack([p.scales for p in parts]),
                     torch.stack([p.mins for p in parts]), first.bits, first.group_size, first.tiled)


def tiles(n: int, k: int, bits: int) -> bool:
    """Whether a weight [n, k] of `bits`-bit codes can be held in tiles: whole tiles of TILE channels and TILE
    words."""
    return n % TILE == 0 and (k * bits) % (TILE * WORD_BITS) == 0


def use_tiles(n: int, k: int, bits: int) -> bool:
    """Whether repack_int_weight holds such a weight in tiles by default: wherever it can, unless
    TANDEM_INT_TILES=0 (read at each repack, i.e. when a model loads: row after row, to compare)."""
    return tiles(n, k, bits) and os.environ.get("TANDEM_INT_TILES", "1") != "0"


def tile_words(words: torch.Tensor) -> torch.Tensor:
    """Row-after-row words [..., N, W] -> the same shape holding them in tiles: tile (b, c) (channels 16b .. 16b +
    15, words 16c .. 16c + 15) at b W / 16 + c tiles from the start, row r of it at 16 r words into the tile; so the
    words of channel n, word w lie at (n // 16) 16 W + (w // 16) 256 + (n % 16) 16 + w % 16."""
    *lead, n, w = words.shape
    return (words.reshape(*lead, n // TILE, TILE, w // TILE, TILE).transpose(-3, -2).contiguous()
            .reshape(*lead, n, w))


def untile_words(words: torch.Tensor) -> torch.Tensor:
    """tile_words undone: the words row after row."""
    *lead, n, w = words.shape
    return (words.reshape(*lead, n // TILE, w // TILE, TILE, TILE).transpose(-3, -2).contiguous()
            .reshape(*lead, n, w))


def repack_int_weight(
    qweight: torch.Tensor,  # uint8 [N, K // 2] (4 bits) or [N, K] (8 bits), the tandem int-N layout
    scales: torch.Tensor,  # [N, K // group_size] in the activation dtype
    zeros: torch.Tensor,  # [N, K // group_size] in the activation dtype
    bits: int,
    group_size: int,
    tiled: bool | None = None,  # None: use_tiles
) -> IntWeight:
    """The kernels' layout of a weight in the tandem int-N layout, made once at load (on the weight's device;
    one pass over the codes, shape-only tensor ops). ValueError when the weight does not fit the layout or the
    kernels: K and group_size must be multiples of a word's elements (8 at 4 bits, 4 at 8 bits), and tiles
    whole tiles."""
    n, k = check_int_weight(qweight, scales, zeros, bits, group_size)
    per_word = WORD_BITS // bits
    if k % per_word or group_size % per_word:
        raise ValueError(f"{bits}-bit kernels need K and group_size multiples of {per_word}, got K {k} and "
                         f"group_size {group_size}")
    if bits == 4:
        codes = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).view(n, k // 8, 8)  # element order
        nibbles = torch.cat((codes[:, :, 0::2], codes[:, :, 1::2]), dim=-1)  # [N, K // 8, 8]: NIBBLE_ORDER
        words = (nibbles[:, :, 0::2] | (nibbles[:, :, 1::2] << 4)).contiguous().view(torch.int32).view(n, k // 8)
    else:
        words = qweight.contiguous().view(torch.int32)
    # The 4-bit tile GEMM adds the min in the activation dtype (one packed FMA per two weights): off by at most
    # 2**-9 |zero * scale| <= 2**-5 scale in bf16. 8-bit zeros reach 255, so there the kernels' fp32 math
    # gets fp32 mins.
    mins = -(zeros.float() * scales.float())
    mins = mins.to(scales.dtype) if bits == 4 else mins
    tiled = use_tiles(n, k, bits) if tiled is None else tiled
    if tiled and not tiles(n, k, bits):
        raise ValueError(f"a [{n}, {k}] weight of {bits}-bit codes is not whole tiles of {TILE} channels and {TILE} "
                         "words")
    words = tile_words(words) if tiled else words.contiguous()
    return IntWeight(words, scales.contiguous(), mins.contiguous(), bits, group_size, tiled)


def dequantize_repacked(weight: IntWeight) -> torch.Tensor:  # [N, K] (a stack: [E, N, K]) in the scales' dtype
    """The weight an IntWeight holds, q * scale + min in fp32 rounded once to the scales' dtype."""
    n, k = weight.shape
    lead = weight.words.shape[:-2]  # () for one weight, (E,) for a stack of experts
    per_word = WORD_BITS // weight.bits
    shifts = torch.arange(per_word, device=weight.words.device, dtype=torch.int32) * weight.bits
    words = untile_words(weight.words) if weight.tiled else weight.words
    slots = (words[..., None] >> shifts) & ((1 << weight.bits) - 1)  # [..., N, K // per_word, per_word]
    if weight.bits == 4:  # back to element order: nibbles 0-3 hold the even elements, 4-7 the odd
        slots = torch.stack((slots[..., :4], slots[..., 4:]), dim=-1).reshape(slots.shape)
    q = slots.reshape(*lead, n, k // weight.group_size, weight.group_size).float()
    w = q * weight.scales.float()[..., None] + weight.mins.float()[..., None]
    return w.view(*lead, n, k).to(weight.scales.dtype)
