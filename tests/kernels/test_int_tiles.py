"""The tiled word layout of IntWeight (int_weight.tile_words): where each word lies, when a weight gets it, and that
every kernel reading IntWeight words gives the same output, bit for bit, on a weight held in tiles and on the same
weight held row after row (Triton interpreter on CPU; the GPU tests run the tiled layout wherever shapes allow)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import triton_int_mma_rows as rows
from tandem.kernels.int_weight import (
    IntWeight,
    dequantize_repacked,
    repack_int_weight,
    stack_int_weights,
    tile_words,
    tiles,
    untile_words,
)
from tandem.kernels.triton_int_weight import dequantize_int_weight_triton, int_weight_matmul_triton
from tandem.kernels.triton_moe_int import fused_moe_int_triton
from tests.kernels.test_int_gemv_mma import emulate_inline_asm, random_int_weight, run_in_interpreter
from tests.kernels.test_triton_moe import routing

CUDA = torch.cuda.is_available()


def both_layouts(n: int, k: int, bits: int, group: int, seed: int) -> tuple[IntWeight, IntWeight]:
    """One random weight repacked row after row and in tiles (fp32 scales and mins)."""
    return (random_int_weight(n, k, bits, group, seed, tiled=False)[0],
            random_int_weight(n, k, bits, group, seed, tiled=True)[0])


def test_where_each_word_lies():
    """Word w of channel n at (n // 16) 16 W + (w // 16) 256 + (n % 16) 16 + w % 16 (W words a row), for a stack
    too; untile_words undoes it."""
    words = torch.arange(3 * 48 * 32, dtype=torch.int32).view(3, 48, 32)  # value = where it lay row after row
    tiled = tile_words(words)
    flat = tiled.view(3, -1)
    for n in (0, 7, 15, 16, 31, 47):
        for w in (0, 3, 15, 16, 31):
            at = (n // 16) * 16 * 32 + (w // 16) * 256 + (n % 16) * 16 + w % 16
            assert flat[1, at].item() == words[1, n, w].item()
    assert torch.equal(untile_words(tiled), words)


def test_which_weights_get_tiles(monkeypatch):
    """Whole tiles of 16 channels and 16 words (K a multiple of 128 at 4 bits, 64 at 8): in tiles unless asked
    otherwise (or TANDEM_INT_TILES=0); asked for tiles on another shape: refused. Both layouts hold the same
    weight."""
    assert tiles(4096, 4096, 4) and tiles(32, 64, 8) and not tiles(40, 4096, 4) and not tiles(32, 96, 4)
    plain, tiled = both_layouts(32, 256, 4, 128, seed=1)
    assert tiled.tiled and not plain.tiled and not torch.equal(plain.words, tiled.words)
    assert torch.equal(dequantize_repacked(plain), dequantize_repacked(tiled))
    codes = torch.zeros(40, 64, dtype=torch.uint8)
    ones = torch.ones(40, 1)
    assert not repack_int_weight(codes, ones, ones, 4, 128).tiled
    with pytest.raises(ValueError, match="whole tiles"):
        repack_int_weight(codes, ones, ones, 4, 128, tiled=True)
    codes, ones = torch.zeros(32, 64, dtype=torch.uint8), torch.ones(32, 1)
    assert repack_int_weight(codes, ones, ones, 4, 128).tiled
    monkeypatch.setenv("TANDEM_INT_TILES", "0")
    assert not repack_int_weight(codes, ones, ones, 4, 128).tiled


@pytest.mark.skipif(CUDA, reason="the interpreter cases")
@pytest.mark.parametrize("bits,m,gemv", [(4, 2, True), (8, 1, True), (4, 4, False), (8, 4, False)])
def test_fp32_kernels_read_both_layouts_alike(bits, m, gemv):
    """The CUDA-core GEMV and the tile GEMM (EVEN and with a ragged K split) and the dequantization kernel."""
    plain, tiled = both_layouts(32, 512, bits, 64, seed=bits + m)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    for config in (None, {"SPLIT_K": 3}):
        cfg = None if config is None else {**config, "BLOCK_K": 128, "BLOCK_N": 16}
        want = int_weight_matmul_triton(x, plain, gemv=gemv, config=cfg)
        got = int_weight_matmul_triton(x, tiled, gemv=gemv, config=cfg)
        assert torch.equal(got, want)
    assert torch.equal(dequantize_int_weight_triton(tiled, torch.float32),
                       dequantize_int_weight_triton(plain, torch.float32))


@pytest.mark.skipif(CUDA, reason="the interpreter cases")
@pytest.mark.parametrize("bits,k,blocks,gated,split", [
    (4, 1024, 2, False, 2), (8, 1024, 1, False, 1), (4, 1024, 4, True, 2),
    (4, 1152, 2, False, 2), (8, 576, 2, True, 2),  # K past whole rounds: the kernel's ragged path
])
def test_tensor_core_gemv_reads_both_layouts_alike(bits, k, blocks, gated, split, monkeypatch):
    """The one-row tensor-core GEMV (its assembly run by the PTX model), plain and gated, K split or not, whole
    rounds or ragged."""
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_inline_asm", emulate_inline_asm, raising=True)
    plain, tiled = both_layouts(64, k, bits, 64, seed=blocks)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    cfg = {"ROW_BLOCKS": blocks, "SPLIT_K": split, "num_warps": 4}
    want = run_in_interpreter(x, plain, None, cfg, torch.float16, gated=gated, reduce=split > 1)[:2]
    got = run_in_interpreter(x, tiled, None, cfg, torch.float16, gated=gated, reduce=split > 1)[:2]
    for a, b in zip(got, want):  # the output and the splits' partial sums (NaN where none were written)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert not got[0].isnan().any()


@pytest.mark.skipif(CUDA, reason="the interpreter cases")
def test_many_row_kernel_reads_both_layouts_alike(monkeypatch):
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_inline_asm", emulate_inline_asm, raising=True)
    plain, tiled = both_layouts(128, 512, 4, 128, seed=3)
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    cfg = {"ROW_BLOCKS": 2, "SPLIT_K": 2, "num_warps": 4}
    want = rows.int_mma_rows(x, plain, None, defer=True, config=cfg).ws
    assert torch.equal(rows.int_mma_rows(x, tiled, None, defer=True, config=cfg).ws, want)


@pytest.mark.skipif(CUDA, reason="the interpreter cases")
@pytest.mark.parametrize("pair_path", [True, False])
def test_moe_kernels_read_both_layouts_alike(pair_path, monkeypatch):
    """The fused MoE's pair GEMV and its tile kernel over stacks of experts (gate_up's up rows a tile below its
    gate rows), with one expert another rank's."""
    from tandem.kernels.triton_moe import MoETile

    monkeypatch.setenv("TANDEM_MOE_INT_PAIR", "gemv")
    experts, hidden, inter = 3, 128, 128
    stacks = {}
    for tiled in (False, True):
        parts13 = [both_layouts(2 * inter, hidden, 4, 32, seed=e)[tiled] for e in range(experts)]
        parts2 = [both_layouts(hidden, inter, 4, 32, seed=10 + e)[tiled] for e in range(experts)]
        stacks[tiled] = [stack_int_weights(parts) for parts in (parts13, parts2)]
    tokens, top_k = (2, 2) if pair_path else (9, 2)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = routing(tokens, 4, top_k, "random", seed=4)
    weights = torch.rand(tokens, top_k, generator=gen)
    expert_map = torch.tensor([0, -1, 1, 2], dtype=torch.int32)
    outs = [fused_moe_int_triton(x, *stacks[tiled], weights, ids, expert_map, pair_path=pair_path,
                                 tile=None if pair_path else MoETile(16, 16, 64, 4, 2)) for tiled in (False, True)]
    assert torch.equal(outs[0], outs[1])

