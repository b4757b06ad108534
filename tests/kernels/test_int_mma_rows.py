"""The many-row W4A16 kernel (triton_int_mma_rows): run in the Triton interpreter with its assembly run by the PTX
model of test_int_gemv_mma, its shape rules, its sm_90 build, and on a GPU against the reference and the tile
GEMM it replaces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.kernels import triton_int_mma_rows as rows
from tandem.kernels.int_weight import dequantize_repacked, repack_int_weight
from tests.kernels.sm90 import compile_sm90
from tests.kernels.test_int_gemv_mma import (
    bf16_to_f32,
    check_rows_path,
    emulate_inline_asm,
    random_int_weight,
    run_warps,
)

CUDA = torch.cuda.is_available()


def test_dequant_assembly_gives_the_code_pairs():
    """A word's four code pairs as bf16 1 + q / 16, pair p = elements 2p and 2p + 1 (NIBBLE_ORDER)."""
    codes = torch.arange(16, dtype=torch.uint8).roll(5).view(1, 16)  # 16 elements: two words
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    ones = torch.ones(1, 1)
    words = repack_int_weight(qweight, ones, ones, 4, 16).words.numpy().view(np.uint32)[0]  # [2]
    got = run_warps(rows._DEQUANT_ASM.value, [np.full(32, words[1], dtype=np.uint32)], 4)
    for p, reg in enumerate(got):  # every lane the same
        assert (bf16_to_f32(reg & 0xFFFF) == 1 + codes[0, 8 + 2 * p].item() / 16).all()
        assert (bf16_to_f32(reg >> 16) == 1 + codes[0, 9 + 2 * p].item() / 16).all()


@pytest.mark.skipif(CUDA, reason="the interpreter case; on a GPU: test_gpu_matches_reference_and_the_tile_gemm")
@pytest.mark.parametrize("m,n,k,group,blocks,split,spread", [
    (16, 128, 1024, 128, 2, 2, False),  # EVEN: whole x blocks, one program of 4 warps x 2 channel blocks, K split
    (11, 40, 1152, 128, 2, 2, False),  # ragged: rows past M, N past whole programs, K past whole rounds (dead parts)
    (24, 48, 512, 512, 1, 1, False),  # one block a program, a group a row, no split
    (32, 32, 512, 256, 1, 1, False),  # four x blocks
    (16, 128, 1024, 128, 2, 2, True),  # X_SPREAD: lane t holds words t, t + 4, t + 8, t + 12
    (27, 40, 1152, 128, 2, 2, True),  # and ragged
])
def test_kernel_in_the_interpreter(m, n, k, group, blocks, split, spread, monkeypatch):
    """The whole kernel (lanes' words and x in either spread, the dequantized pairs, the MMAs of every x block and
    channel block, the scales, the warps' and splits' sums) in the interpreter: the fp32 partial sums added over
    the splits equal x (q s + mn) in fp64 (x, q, s and mn exact in the kernel's inputs; only the fp32 sums' order
    differs)."""
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_inline_asm", emulate_inline_asm, raising=True)
    packed = random_int_weight(n, k, 4, group, seed=m + n + k)[0]  # fp32 scales and mins: exact
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    want = x.double() @ dequantize_repacked(packed).double().T
    cfg = {"ROW_BLOCKS": blocks, "SPLIT_K": split, "num_warps": 4, "X_SPREAD": spread}
    if split == 1:  # the kernel writes the output itself (bf16: within its rounding)
        got = rows.int_mma_rows(x, packed, None, config=cfg)
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        return
    got = rows.int_mma_rows(x, packed, None, defer=True, config=cfg)
    assert got.ws.shape == (split, m, n)
    torch.testing.assert_close(got.ws.double().sum(0), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


def test_shapes_it_takes(monkeypatch):
    """9 to 32 rows by default (TANDEM_INT_MMA_ROWS_MAX: fewer, never more), and the H200 sweep's tiles for the
    Llama-3-8B projections: 4 channel blocks a warp where N gives half the SMs a program, else 2; K split to 1.5
    programs an SM."""
    assert rows.mma_rows_config(28672, 4096, 132) == {"ROW_BLOCKS": 4, "SPLIT_K": 2, "num_warps": 4}
    assert rows.mma_rows_config(6144, 4096, 132) == {"ROW_BLOCKS": 2, "SPLIT_K": 8, "num_warps": 4}
    assert rows.mma_rows_config(4096, 4096, 132) == {"ROW_BLOCKS": 2, "SPLIT_K": 8, "num_warps": 4}
    assert rows.mma_rows_config(4096, 14336, 132) == {"ROW_BLOCKS": 2, "SPLIT_K": 8, "num_warps": 4}
    assert rows.mma_rows_config(4096, 512, 132)["SPLIT_K"] == 1  # a split keeps four parts at least
    flags = rows.mma_rows_constexprs(20, 4096, 4096, 128, rows.mma_rows_config(4096, 4096, 132), False, 0)
    assert flags["X_BLOCKS"] == 3 and not flags["FULL_ROWS"] and flags["EVEN"] and not flags["X_SPREAD"]
    # x spread over the lanes at 25 to 32 rows with 2 channel blocks a warp (not gate_up's 4, not 16 rows)
    spread = {(m, n): rows.mma_rows_constexprs(m, n, 4096, 128, rows.mma_rows_config(n, 4096, 132), False, 0)[
        "X_SPREAD"] for m in (16, 25, 32) for n in (4096, 28672)}
    assert spread == {(16, 4096): False, (25, 4096): True, (32, 4096): True, (16, 28672): False,
                      (25, 28672): False, (32, 28672): False}
    monkeypatch.delenv("TANDEM_INT_MMA_ROWS_MAX", raising=False)
    assert rows.rows_max() == 32
    monkeypatch.setenv("TANDEM_INT_MMA_ROWS_MAX", "64")
    assert rows.rows_max() == 32
    monkeypatch.setenv("TANDEM_INT_MMA_ROWS_MAX", "16")
    assert rows.rows_max() == 16
    with pytest.raises(ValueError, match="at most 32"):
        rows.int_mma_rows(torch.zeros(33, 128), random_int_weight(16, 128, 4, 128, 0)[0])


_COMPILE_SM90 = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.int_weight import tiles
from tandem.kernels.triton_int_mma_rows import _int_mma_rows_kernel, mma_rows_config, mma_rows_constexprs

names = ["x_ptr", "w_ptr", "s_ptr", "mn_ptr", "b_ptr", "out_ptr", "ws_ptr", "M", "N", "K", "K_SPLIT"]
out = {}
for name, m, n, k in [("rows32", 32, 28672, 4096), ("rows16-split", 16, 4096, 14336), ("rows32-qkv", 32, 6144, 4096),
                      ("rows20-ragged", 20, 4100, 4096 + 128), ("rows16-row-major", 16, 4096, 4096)]:
    cfg = mma_rows_config(n, k, 132)
    flags = mma_rows_constexprs(m, n, k, 128, cfg, True, 2, tiles(n, k, 4) and not name.endswith("row-major"))
    types = ["*bf16", "*i32", "*bf16", "*bf16", "*bf16", "*bf16", "*fp32", "i32", "i32", "i32", "i32"]
    signature = dict(zip(names, types))
    signature.update({key: "constexpr" for key in flags})
    src = ASTSource(fn=_int_mma_rows_kernel, signature=signature, constexprs=flags,
                    attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 9, 10)})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
    ptx = kernel.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    loop = ""
    for branch in re.finditer(r"bra(?:\.uni)?\s+(\$L__BB\w+);", ptx):
        label = ptx.find(branch.group(1) + ":")
        if 0 <= label < branch.start():
            loop = ptx[label:branch.end()]
    out[name] = {"blocks": cfg["ROW_BLOCKS"], "x_blocks": flags["X_BLOCKS"], "loop_mma": loop.count("mma.sync"),
                 "local": "ld.local" in ptx or "st.local" in ptx, "v4_loads": "ld.global.v4" in ptx,
                 "waits": wait >= 0, "stores_before_wait": "st.global" in ptx[:max(wait, 0)],
                 "bar_in_loop": "bar.sync" in loop}
json.dump(out, sys.stdout)
"""


def test_kernel_compiles_for_sm90():
    """Hopper build without a GPU: per part and x block 8 MMAs for X and 8 a channel block, no local memory,
    16-byte loads, nothing written before the PDL wait, and no barrier in the K loop (every tensor keeps one
    element a thread)."""
    for name, info in compile_sm90(_COMPILE_SM90).items():
        assert info["loop_mma"] == info["x_blocks"] * (8 + 8 * info["blocks"]), (name, info)
        assert not info["local"] and info["v4_loads"] and info["waits"], (name, info)
        assert not info["stores_before_wait"] and not info["bar_in_loop"], (name, info)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m,n,k,group", [(32, 6144, 4096, 128), (9, 4100, 4096 + 128, 128), (32, 4096, 14336, 128),
                                         (20, 28672, 4096, 128), (28, 1024, 2048, 2048)])
def test_gpu_matches_reference_and_the_tile_gemm(m, n, k, group, monkeypatch):
    """bf16 on the GPU, as int_weight_matmul_triton runs it (deferred splits reduced too; TANDEM_INT_MMA_ROWS_MAX=32:
    the kernel's whole range): within assert_close_to's bound of the fp32 reference, and
    close to the tile GEMM on the same codes (TANDEM_INT_MMA_ROWS_MAX=8)."""
    check_rows_path(monkeypatch, 4, m, n, k, group, ("TANDEM_INT_MMA_ROWS_MAX", "32", "8"), rows.use_mma_rows)
