"""The tensor-core W4A16 GEMV (triton_int_gemv_mma): its inline assembly run on CPU by a model of the few PTX
instructions it uses (mma.sync's fragment layouts as the PTX ISA defines them for m16n8k16), its shape rules,
its sm_90 build, and on a GPU against the reference."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tandem.kernels import triton_int_gemv_mma as mma
from tandem.kernels.int_weight import dequantize_repacked, repack_int_weight, stack_int_weights
from tests.kernels.sm90 import compile_sm90

CUDA = torch.cuda.is_available()


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def run_warps(asm: str, inputs: list[np.ndarray], outputs: int) -> list[np.ndarray]:
    """Executes `asm` on warps of 32 threads: inputs [operand] uint32 [T] (thread i = lane i % 32 of warp i // 32;
    operands numbered after the outputs), returns the outputs [operand] as uint32 [T]. Knows mov, shr.u32, lop3
    (0xea: a & b | c), shl.b32, prmt.b32, add.f32 and mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32."""
    warps = inputs[0].size // 32
    regs = {f"${outputs + i}": np.asarray(v, dtype=np.uint32).reshape(warps, 32) for i, v in enumerate(inputs)}
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes % 4

    def get(name: str) -> np.ndarray:
        name = name.strip()
        if name.startswith("0f"):
            return np.full((warps, 32), int(name[2:], 16), dtype=np.uint32)
        if name[0].isdigit():
            return np.full((warps, 32), int(name, 0), dtype=np.uint32)
        return regs[name]

    def halves(name: str) -> tuple[np.ndarray, np.ndarray]:  # a register's two bf16 (low first) as float32
        v = get(name)
        return bf16_to_f32(v & 0xFFFF), bf16_to_f32(v >> 16)

    a_at = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]  # (row, first col) of a0 .. a3
    c_at = [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]  # (row, col) of c0 .. c3
    w = np.arange(warps)[:, None]
    for line in (part.strip() for part in asm.split("\n")):
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, rest = line.rstrip(";").split(None, 1)
        if op.startswith("mma.sync"):
            d, a, b, c = [[r.strip() for r in grp.split(",")] for grp in re.findall(r"\{([^}]*)\}", rest)]
            A = np.zeros((warps, 16, 16))
            B = np.zeros((warps, 16, 8))
            C = np.zeros((warps, 16, 8))
            for reg, (row, col) in zip(a, a_at):
                A[w, row, col], A[w, row, col + 1] = halves(reg)
            for reg, k in zip(b, [2 * t, 2 * t + 8]):
                B[w, k, g], B[w, k + 1, g] = halves(reg)
            for reg, (row, col) in zip(c, c_at):
                C[w, row, col] = get(reg).view(np.float32)
            D = (A @ B + C).astype(np.float32)
            for reg, (row, col) in zip(d, c_at):
                regs[reg] = D[w, row, col].view(np.uint32)
            continue
        args = [r.strip() for r in rest.split(",")]
        if op in ("mov.b32", "mov.f32"):
            value = get(args[1])
        elif op == "shr.u32":
            value = get(args[1]) >> np.uint32(int(args[2]))
        elif op == "shl.b32":
            value = get(args[1]) << np.uint32(int(args[2]))
        elif op == "lop3.b32":
            assert args[4] == "0xea", line
            value = (get(args[1]) & get(args[2])) | get(args[3])
        elif op == "prmt.b32":  # bytes of (a, b) picked by the selector's nibbles
            both = [(get(args[1]) >> np.uint32(8 * i)) & 0xFF for i in range(4)]
            both += [(get(args[2]) >> np.uint32(8 * i)) & 0xFF for i in range(4)]
            sel = int(args[3], 0)
            value = sum(both[(sel >> (4 * i)) & 7] << np.uint32(8 * i) for i in range(4))
        elif op == "add.f32":
            value = (get(args[1]).view(np.float32) + get(args[2]).view(np.float32)).view(np.uint32)
        else:
            raise AssertionError(f"unknown instruction {line}")
        regs[args[0]] = np.asarray(value, dtype=np.uint32)
    return [regs[f"${i}"].reshape(-1) for i in range(outputs)]


@pytest.mark.parametrize("bits", [4, 8])
def test_part_assembly_sums_x_times_the_codes(bits):
    """One part (16 rows, 128 elements at 4 bits, 64 at 8; one warp): lane (g, t) passes words 4t .. 4t + 3 of
    rows g and g + 8 and x at their elements as bf16 pairs (at 8 bits through the sum assembly, which pairs them
    by word); it gets F = sum_k x_k (OFFSET + q_k / 16) of both rows and X = sum_k x_k, in every lane, as the kernel
    reads them."""
    part, offset = mma.part_elements(bits), (1 if bits == 4 else 17)
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (16, part), generator=gen, dtype=torch.uint8)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes
    ones = torch.ones(16, 1)
    words = repack_int_weight(qweight, ones, ones, bits, part).words.numpy().view(np.uint32)  # [16, 16]
    x = torch.randn(part, generator=gen).to(torch.bfloat16)
    x_bits = x.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    x_pairs = x_bits[0::2] | (x_bits[1::2] << 16)  # int32 view of x
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes % 4
    w_in = [words[g, 4 * t + i] for i in range(4)] + [words[g + 8, 4 * t + i] for i in range(4)]
    regs = part // 8  # x's pairs a lane
    x_in = [x_pairs[regs * t + i] for i in range(regs)]
    if bits == 4:
        (xs,) = run_warps(mma.SUM_ASM_4.value, x_in, 1)
        f_lo, f_hi = run_warps(mma.PART_ASM_4.value, w_in + x_in, 2)
    else:
        xs, *b_regs = run_warps(mma.SUM_ASM_8.value, x_in, 9)
        f_lo, f_hi = run_warps(mma.PART_ASM_8.value, w_in + b_regs, 2)
    want = (x.double()[None, :] * (offset + codes.double() / 16)).sum(1).numpy()  # [16]
    np.testing.assert_allclose(f_lo.view(np.float32), want[g], rtol=1e-6, atol=1e-3)
    np.testing.assert_allclose(f_hi.view(np.float32), want[g + 8], rtol=1e-6, atol=1e-3)
    np.testing.assert_allclose(xs.view(np.float32), np.full(32, x.double().sum().item()), rtol=1e-5, atol=1e-4)


def test_shapes_it_takes():
    assert mma.mma_gemv_fits(1, 4096, 4, 128) and mma.mma_gemv_fits(1, 14336, 4, 14336)
    assert mma.mma_gemv_fits(1, 4096, 8, 64) and not mma.mma_gemv_fits(2, 4096, 4, 128)  # one row only
    assert not mma.mma_gemv_fits(1, 4128, 8, 64)  # K whole parts
    # Groups of half or a quarter of a part: GGUF's 32 (Q4_0, Q4_K, Q8_0, Q5_K) and 16 (Q6_K); not 8 or 96.
    assert [mma.groups_a_part(4, g) for g in (256, 128, 64, 32, 16, 96)] == [1, 1, 2, 4, 0, 0]
    assert [mma.groups_a_part(8, g) for g in (128, 64, 32, 16, 8)] == [1, 1, 2, 4, 0]
    assert mma.mma_gemv_fits(1, 4096, 4, 32) and mma.mma_gemv_fits(1, 4096, 8, 16)
    assert not mma.mma_gemv_fits(1, 4096, 4, 16) and not mma.mma_gemv_fits(1, 4096, 4, 96)
    # Four groups a part: at most 2 blocks a program (lanes t and t ^ 2 hold one block's sums)
    assert mma.mma_gemv_config(57344, 8192, 4, 132, gated=True, group_size=32)["ROW_BLOCKS"] == 2
    assert mma.mma_gemv_config(57344, 8192, 4, 132, gated=True, group_size=64)["ROW_BLOCKS"] == 4
    with pytest.raises(ValueError, match="row blocks"):
        mma.mma_gemv_constexprs(4096, 4096, 4, 32, {"ROW_BLOCKS": 4, "SPLIT_K": 1, "num_warps": 4}, False, 0)
    assert mma.mma_k_split(4096, 4, 1, 8) == 4096 and mma.mma_k_split(4096, 4, 4, 8) == 1024
    assert mma.mma_k_split(14336, 4, 2, 8) == 7168 and mma.mma_k_split(4096, 8, 4, 8) == 1024
    # The H200 sweep's best tiles for the 8B shape at 4 bits (6-8 programs of 4 warps an SM).
    assert mma.mma_gemv_config(28672, 4096, 4, 132) == {"ROW_BLOCKS": 2, "SPLIT_K": 1, "num_warps": 4}
    assert mma.mma_gemv_config(6144, 4096, 4, 132) == {"ROW_BLOCKS": 1, "SPLIT_K": 2, "num_warps": 4}
    assert mma.mma_gemv_config(4096, 4096, 4, 132) == {"ROW_BLOCKS": 1, "SPLIT_K": 4, "num_warps": 4}
    assert mma.mma_gemv_config(4096, 14336, 4, 132) == {"ROW_BLOCKS": 1, "SPLIT_K": 4, "num_warps": 4}
    # A long K that stays whole (the 70B qkv): 2 blocks of 8 warps at 4 bits; 8 bits and several rows keep theirs.
    assert mma.mma_gemv_config(10240, 8192, 4, 132) == {"ROW_BLOCKS": 2, "SPLIT_K": 1, "num_warps": 8}
    assert mma.mma_gemv_config(10240, 8192, 8, 132) == {"ROW_BLOCKS": 1, "SPLIT_K": 1, "num_warps": 4}
    assert mma.mma_gemv_config(10240, 8192, 4, 132, m_rows=2)["num_warps"] == 4
    assert mma.mma_gemv_config(8192, 8192, 4, 132) == {"ROW_BLOCKS": 1, "SPLIT_K": 2, "num_warps": 4}
    # Several rows of x: one block a program, and the split of that many programs (where one row takes more
    # blocks, N already fills the GPU: no split either way).
    assert mma.mma_gemv_config(28672, 4096, 4, 132, m_rows=8) == {"ROW_BLOCKS": 1, "SPLIT_K": 1, "num_warps": 4}
    assert mma.mma_gemv_config(4096, 14336, 4, 132, m_rows=2) == mma.mma_gemv_config(4096, 14336, 4, 132)
    # Gated: a gate block and its up block at least, so gate_up keeps its tile; small ones split K instead.
    assert mma.mma_gemv_config(28672, 4096, 4, 132, gated=True) == {"ROW_BLOCKS": 2, "SPLIT_K": 1, "num_warps": 4}
    assert mma.mma_gemv_config(57344, 8192, 4, 132, gated=True)["ROW_BLOCKS"] == 4
    assert mma.mma_gemv_config(1024, 4096, 4, 132, gated=True) == {"ROW_BLOCKS": 2, "SPLIT_K": 4, "num_warps": 4}
    with pytest.raises(ValueError, match="gated"):
        mma.mma_gemv_constexprs(1024, 4096, 4, 128, {"ROW_BLOCKS": 1, "SPLIT_K": 1, "num_warps": 4}, False, 0, True)
    sms = 132
    for bits in (4, 8):
        for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
            cfg = mma.mma_gemv_config(n, k, bits, sms)
            programs = -(-n // (16 * cfg["ROW_BLOCKS"]))
            assert 4 * sms <= programs * cfg["SPLIT_K"] <= mma.PROGRAMS_PER_SM * sms
            flags = mma.mma_gemv_constexprs(n, k, bits, 128, cfg, False, 2)
            assert flags["EVEN"] and k % mma.mma_k_split(k, bits, cfg["SPLIT_K"], cfg["num_warps"]) == 0


_COMPILE_SM90 = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.int_weight import tiles
from tandem.kernels.triton_int_gemv_mma import _int_mma_gemv_kernel, mma_gemv_config, mma_gemv_constexprs

names = ["x_ptr", "w_ptr", "s_ptr", "mn_ptr", "b_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "N", "K", "K_SPLIT"]
out = {}
CASES = [
        ("even", 4096, 4096, 4, 4, False, False, 128), ("ragged", 4100, 4096 + 128, 4, 4, False, False, 128),
        ("even-row-major", 4096, 4096, 4, 4, False, False, 128), ("int8-row-major", 4096, 4096, 8, 2, False, False, 64),
        ("one-block", 6144, 4096, 4, 1, False, False, 128), ("two-blocks", 4096, 4096, 4, 2, False, False, 128),
        ("int8", 4096, 4096, 8, 4, False, False, 128), ("int8-ragged", 4100, 4096 + 64, 8, 2, False, False, 64),
        ("folded", 6144, 4096, 4, 1, False, True, 128), ("gated", 28672, 4096, 4, 2, True, False, 128),
        ("gated-four", 57344, 8192, 4, 4, True, False, 128),
        ("gated-ragged-folded", 2 * 4100, 4096, 8, 2, True, True, 128),
        ("group32", 6144, 4096, 4, 1, False, True, 32), ("group32-gated", 28672, 4096, 4, 2, True, False, 32),
        ("group64", 4096, 4096, 4, 4, False, False, 64), ("int8-group16", 4096, 4096, 8, 2, False, False, 16),
        ("int8-group32-ragged", 4100, 4096 + 64, 8, 2, False, False, 32)]
ROWS = [("rows8", 4096, 4096, 4, 1, False, False, 128, 8), ("rows3-int8-ragged", 4100, 4096 + 64, 8, 1, False, False,
                                                             64, 3)]
for name, n, k, bits, rows, gated, reduce, group, m in [(*case, 1) for case in CASES] + ROWS:
    mins = "*bf16" if bits == 4 else "*fp32"
    types = ["*bf16", "*i32", "*bf16", mins, "*bf16", "*bf16", "*fp32", "*i32", "i32", "i32", "i32"]
    cfg = {**mma_gemv_config(n, k, bits, 132, gated), "ROW_BLOCKS": rows}
    cfg["SPLIT_K"] = max(cfg["SPLIT_K"], 2) if reduce else cfg["SPLIT_K"]
    # the layout a weight of the shape gets (int_weight.tiles), and row after row where it cannot or the case says
    flags = mma_gemv_constexprs(n, k, bits, group, cfg, True, 2, gated, reduce, m,
                                tiles(n, k, bits) and not name.endswith("row-major"))
    signature = dict(zip(names, types))
    signature.update({key: "constexpr" for key in flags if key not in signature})
    src = ASTSource(fn=_int_mma_gemv_kernel, signature=signature, constexprs=flags,
                    attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 7, 10)})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"],
                                                                             "num_stages": 1})
    ptx = kernel.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    loop = ""  # the K loop: from a label to the branch back to it
    for branch in re.finditer(r"bra(?:\.uni)?\s+(\$L__BB\w+);", ptx):
        label = ptx.find(branch.group(1) + ":")
        if 0 <= label < branch.start():
            loop = ptx[label:branch.end()]
    out[name] = {"even": flags["EVEN"], "blocks": rows, "bits": bits, "mma": ptx.count("mma.sync.aligned.m16n8k16"),
                 "atomics": ptx.count("atom.global"), "reduce": reduce,
                 "local": "ld.local" in ptx or "st.local" in ptx, "v4_loads": "ld.global.v4" in ptx,
                 "stores_before_wait": any(op in ptx[:max(wait, 0)] for op in ("st.global", "red.global")),
                 "prefetch_before_wait": 0 <= ptx.find("prefetch.global.L2") < wait,
                 "waits": wait >= 0, "loop_mma": loop.count("mma.sync"), "bar_in_loop": "bar.sync" in loop}
json.dump(out, sys.stdout)
"""


def test_kernel_compiles_for_sm90():
    """Hopper build without a GPU: mma.sync (a part: 8 for X at 4 bits, 4 at 8, then 8 for each 16-row block), no
    local memory, 16-byte loads, under PDL weight lines sent to L2 and nothing written before the wait, and no
    barrier in the K loop (no layout change through shared memory: every tensor keeps one element a thread);
    gated (a gate block and its up block), with the split added in the kernel (one atomic count) and with several
    rows of x alike."""
    for name, info in compile_sm90(_COMPILE_SM90).items():
        assert info["mma"] >= 12 and not info["local"] and info["v4_loads"], (name, info)
        assert info["waits"] and info["prefetch_before_wait"] and not info["stores_before_wait"], (name, info)
        x_mmas = 8 if info["bits"] == 4 else 4
        assert info["loop_mma"] == x_mmas + 8 * info["blocks"], (name, info)  # X's, then 8 a block
        assert not info["bar_in_loop"], (name, info)
        assert (info["atomics"] > 0) == info["reduce"], (name, info)  # the split counter only where it folds


_COMPILE_PAIR_SM90 = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.int_weight import tiles
from tandem.kernels.triton_int_gemv_mma import _int_mma_pair_kernel, mma_gemv_config, mma_gemv_constexprs

names = ["x_ptr", "w_ptr", "s_ptr", "mn_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "topk_w_ptr", "ids_ptr", "map_ptr",
         "N", "K", "K_SPLIT", "top_k", "num_tokens"]
out = {}
for name, n, k, bits, group, gated, split, mapped in [("gate_up", 1536, 2048, 4, 128, True, 1, False),
                                                      ("down", 2048, 768, 4, 128, False, 2, True),
                                                      ("gate_up-g32", 1536, 2048, 4, 32, True, 2, False)]:
    cfg = {**mma_gemv_config(n, k, bits, 16, gated, group), "SPLIT_K": split}
    flags = mma_gemv_constexprs(n, k, bits, group, cfg, False, 2, gated, split > 1, tiled=tiles(n // 2, k, bits))
    flags.pop("HAS_BIAS"), flags.pop("PREFETCH_PARTS"), flags.pop("M_ROWS")
    flags.update(MUL_WEIGHT=not gated, HAS_MAP=mapped, SPLIT_MAJOR=not gated)
    types = ["*bf16", "*i32", "*bf16", "*bf16", "*bf16" if gated else "*fp32", "*fp32", "*i32", "*fp32", "*i32",
             "*i32", "i32", "i32", "i32", "i32", "i32"]
    signature = dict(zip(names, types))
    signature.update({key: "constexpr" for key in flags})
    src = ASTSource(fn=_int_mma_pair_kernel, signature=signature, constexprs=flags,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(10)})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
    ptx = kernel.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    first_load = min(i for i in (ptx.find("ld.global"), len(ptx)) if i >= 0)
    out[name] = {"mma": ptx.count("mma.sync.aligned.m16n8k16"), "local": "ld.local" in ptx or "st.local" in ptx,
                 "wait_first": 0 <= wait < first_load, "atomics": ptx.count("atom.global"), "split": split}
json.dump(out, sys.stdout)
"""


def test_pair_kernel_compiles_for_sm90():
    """The MoE pair kernel's Hopper build: the GEMV's MMAs, no local memory, the PDL wait before any load (the
    pairs' experts come from the router before it), and the split counter only where K is split."""
    for name, info in compile_sm90(_COMPILE_PAIR_SM90).items():
        assert info["mma"] >= 16 and not info["local"] and info["wait_first"], (name, info)
        assert (info["atomics"] > 0) == (info["split"] > 1), (name, info)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits,n,k,group,split,bias", [
    (4, 1536, 4096, 128, None, False),  # the default config
    (4, 4100, 4096 + 128, 128, None, True),  # N past whole 16-row blocks, K past whole rounds of the warps
    (4, 512, 14336, -1, 4, False),  # one group a row (per channel), K split over programs, added by the last
    (4, 1024, 2048, 256, 2, True),  # bias added by the program that adds the splits
    (8, 1536, 4096, 128, None, False),
    (8, 4100, 4096 + 64, 64, None, True),
    (4, 1536, 4096, 32, None, False),  # groups under a part: four (GGUF Q4_0 / Q4_K)
    (4, 4100, 4096 + 128, 64, 2, True),  # two
    (8, 1536, 4096, 16, None, False),  # Q6_K's
    (8, 4100, 4096 + 64, 32, 2, True),  # Q8_0's
])
def test_gpu_matches_reference_and_the_fp32_gemv(bits, n, k, group, split, bias, monkeypatch):
    """bf16 on the GPU: close to the fp32 product of the reference dequantization within assert_close_to's bound
    (the layout's 4-bit mins are rounded to bf16, the reference's are not: errors of a few 1e-3 of the largest
    output), and closer to the fp32 CUDA-core GEMV (TANDEM_INT_GEMV_MMA=0), which reads the same codes, scales and
    mins: the codes and x are exact in the MMA and its sums fp32, so only the bf16 output rounding and the fp32
    sum order differ."""
    from tandem.kernels.triton_int_weight import int_weight_matmul_triton
    from tests.kernels.test_triton_int_weight import assert_close_to, make_weight, reference

    group_size = k if group == -1 else group
    qweight, scales, zeros, _ = make_weight(n, k, bits, group_size, torch.bfloat16, seed=n + k)
    packed = repack_int_weight(qweight, scales, zeros, bits, group_size)
    gen = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen) if bias else None
    ref = reference(x, qweight, scales, zeros, bits, group_size, b)
    assert mma.use_mma_gemv(x, packed)
    out = mma.int_mma_gemv(x, packed, b, config={"SPLIT_K": split} if split else None)
    assert_close_to(out, ref)
    monkeypatch.setenv("TANDEM_INT_GEMV_MMA", "0")
    assert not mma.use_mma_gemv(x, packed)
    fp32_gemv = int_weight_matmul_triton(x, packed, b)
    torch.testing.assert_close(out.float(), fp32_gemv.float(), atol=2e-3 * ref.abs().max().item(), rtol=1e-2)


class _AsmCall:
    def __init__(self, results: list):
        self.results = results

    def get_result(self, i: int):
        return self.results[i]


def emulate_inline_asm(self, asm, constraints, values, types, is_pure, pack):
    """The Triton interpreter's inline assembly, run by run_warps (one element a thread: the kernel's layout)."""
    from triton.runtime.interpreter import TensorHandle
    import triton.language as tl

    outputs = constraints.count("=")
    inputs = [np.ascontiguousarray(v.data).reshape(-1).view(np.uint32) for v in values]
    shape = values[0].data.shape
    types = [tl.float32 if c.strip() == "=f" else tl.int32 for c in constraints.split(",")[:outputs]]
    got = run_warps(asm, inputs, outputs)
    return _AsmCall([TensorHandle(r.view(np.float32 if ty == tl.float32 else np.int32).reshape(shape).copy(), ty)
                     for r, ty in zip(got, types)])


@pytest.mark.skipif(CUDA, reason="the interpreter case: the GPU one is test_gpu_matches_reference_and_the_fp32_gemv")
@pytest.mark.parametrize("bits,n,k,group,blocks,warps,split", [
    (4, 64, 2048, 128, 4, 8, 1),  # EVEN, 4 blocks: lane t scales block t
    (4, 32, 1024, 256, 2, 4, 2),  # 2 blocks, K split over 2 programs (a part of each warp a split)
    (4, 40, 1152, 1152, 1, 4, 2),  # ragged: N past whole blocks, K past whole rounds (dead parts), per channel
    (8, 64, 1024, 64, 4, 8, 1),
    (8, 40, 576, 192, 2, 4, 2),
    # groups under a part: B's columns split by group, and at four a part lanes t and t ^ 2 added
    (4, 32, 1024, 32, 2, 4, 2),  # GGUF Q4_K / Q4_0's 32: four groups a part, 2 blocks, K split
    (4, 40, 1152, 32, 1, 4, 2),  # ragged, one block
    (4, 64, 1024, 64, 4, 4, 1),  # two groups a part: 4 blocks still
    (8, 32, 512, 16, 2, 4, 1),  # Q6_K's 16 at 8 bits: four a part
    (8, 40, 576, 32, 4, 4, 2),  # Q8_0's 32 at 8 bits: two a part, ragged
])
def test_kernel_in_the_interpreter(bits, n, k, group, blocks, warps, split, monkeypatch):
    """The whole kernel (lanes' words, x, scales, the block each lane scales, the warps' and splits' sums) in the
    Triton interpreter with its assembly run by run_warps: the fp32 partial sums added over the splits equal
    x (q s + mn) in fp64 (x, q, s and mn exact in the MMA's bf16 and fp32 inputs; only the fp32 sums' order
    differs)."""
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_inline_asm", emulate_inline_asm, raising=True)
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.005
    zeros = torch.randint(0, 2**bits, (n, k // group), generator=gen).float()
    packed = repack_int_weight(qweight, scales, zeros, bits, group)  # fp32 scales and mins: exact in the kernel
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    cfg = {"ROW_BLOCKS": blocks, "SPLIT_K": split, "num_warps": warps}
    flags = mma.mma_gemv_constexprs(n, k, bits, group, cfg, has_bias=False, use_pdl=0, tiled=packed.tiled)
    k_split = mma.mma_k_split(k, bits, split, warps)
    ws = torch.full((flags["SPLIT_K"], 1, n), float("nan"))
    mma._int_mma_gemv_kernel[(-(-n // (16 * blocks)), flags["SPLIT_K"])](
        x, packed.words, packed.scales, packed.mins, packed.scales, ws, ws, ws, n, k, k_split, **flags,
        num_warps=warps)
    w = (codes.double() * scales.double().repeat_interleave(group, 1)
         + packed.mins.double().repeat_interleave(group, 1))
    want = x.double() @ w.T
    torch.testing.assert_close(ws.double().sum(0), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


def run_in_interpreter(x, packed, bias, cfg, out_dtype, gated=False, reduce=False):
    """The kernel launched as int_mma_gemv launches it (PDL off), in the Triton interpreter with its assembly run
    by run_warps: (output [1, N or N / 2] in out_dtype, the splits' partial sums ws [SPLIT_K, 1, N], counters)."""
    n, k = packed.shape
    bits, group = packed.bits, packed.group_size
    flags = mma.mma_gemv_constexprs(n, k, bits, group, cfg, bias is not None, 0, gated, reduce, tiled=packed.tiled)
    channels = 16 * (cfg["ROW_BLOCKS"] // 2 if gated else cfg["ROW_BLOCKS"])
    out = torch.full((1, n // 2 if gated else n), float("nan"), dtype=out_dtype)
    ws = torch.full((flags["SPLIT_K"], 1, n), float("nan"))
    counts = torch.zeros(64, dtype=torch.int32)
    mma._int_mma_gemv_kernel[(-(-out.shape[1] // channels), flags["SPLIT_K"])](
        x, packed.words, packed.scales, packed.mins, bias if bias is not None else packed.scales, out, ws, counts, n,
        k, mma.mma_k_split(k, bits, cfg["SPLIT_K"], cfg["num_warps"]), **flags, num_warps=cfg["num_warps"])
    return out, ws, counts


def random_int_weight(n, k, bits, group, seed, tiled=None):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.005
    zeros = torch.randint(0, 2**bits, (n, k // group), generator=gen).float()
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen)
    return repack_int_weight(qweight, scales, zeros, bits, group, tiled), x, bias


@pytest.mark.skipif(CUDA, reason="the interpreter case; on a GPU: test_gpu_gated_and_folded_match_the_unfused_path")
@pytest.mark.parametrize("bits,n,k,group,blocks,split,bias", [
    (4, 64, 1024, 256, 2, 2, True),  # EVEN: 2 programs of 16 channels, each split added by the last to arrive
    (4, 40, 1152, 1152, 2, 2, False),  # ragged: 20 channels (past whole blocks), K past whole rounds
    (4, 128, 512, 128, 4, 1, True),  # 4 blocks: two gate blocks and their up blocks, no split
    (8, 72, 576, 192, 4, 2, True),  # ragged at 8 bits
    (4, 64, 1024, 32, 2, 2, True),  # four groups a part: the gate lanes t and t ^ 2 added, then the up lanes
    (8, 40, 576, 16, 2, 1, False),  # at 8 bits, ragged
])
def test_gated_and_folded_kernel_in_the_interpreter(bits, n, k, group, blocks, split, bias, monkeypatch):
    """The kernel that adds its own K splits (REDUCE) writes what the split-K reduce of its partial sums writes,
    bit for bit, and leaves its counters at zero; the gated kernel writes silu(gate) * up of those outputs
    rounded as the GEMV + silu_and_mul round them (fp16 output: the interpreter's bf16 is wrong)."""
    from triton.runtime.interpreter import InterpreterBuilder

    from tandem.kernels.fp8 import PartialSums

    monkeypatch.setattr(InterpreterBuilder, "create_inline_asm", emulate_inline_asm, raising=True)
    packed, x, b = random_int_weight(n, k, bits, group, seed=n + k + blocks)
    b = b.to(torch.float16) if bias else None
    cfg = {"ROW_BLOCKS": blocks, "SPLIT_K": split, "num_warps": 4}
    plain, ws, _ = run_in_interpreter(x, packed, b, {**cfg, "ROW_BLOCKS": blocks // 2}, torch.float16)
    want = PartialSums(ws, None, b, torch.float16).reduce() if split > 1 else plain
    if split > 1:
        folded, _, counts = run_in_interpreter(x, packed, b, {**cfg, "ROW_BLOCKS": blocks // 2}, torch.float16,
                                               reduce=True)
        assert torch.equal(folded, want) and not counts.any()
    gated, _, counts = run_in_interpreter(x, packed, b, cfg, torch.float16, gated=True, reduce=split > 1)
    gate, up = want.chunk(2, dim=-1)
    torch.testing.assert_close(gated, torch.nn.functional.silu(gate.float()).half() * up, rtol=2e-3, atol=1e-5)
    assert not counts.any()


def _expert_stack(num_experts, n, k, bits, group, seed):
    """A stack of random experts as IntWeight [E, N, K] (fp32 scales and mins: exact in the kernel) and each
    expert's dequantized weight in fp64."""
    packed, dense = [], []
    for e in range(num_experts):
        gen = torch.Generator().manual_seed(seed + e)
        codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
        qweight = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes
        scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.005
        zeros = torch.randint(0, 2**bits, (n, k // group), generator=gen).float()
        w = repack_int_weight(qweight, scales, zeros, bits, group)
        packed.append(w)
        dense.append(codes.double() * scales.double().repeat_interleave(group, 1)
                     + w.mins.double().repeat_interleave(group, 1))
    return stack_int_weights(packed), dense


@pytest.mark.skipif(CUDA, reason="the interpreter case; on a GPU: test_gpu_pair_gemv_matches_the_cuda_core_pairs")
@pytest.mark.parametrize("bits,group,gated,split,mapped,split_major", [
    (4, 128, True, 1, False, False),  # MoE gate_up: the token's row, silu(gate) * up
    (4, 128, False, 2, True, True),  # down: the pair's row, its routing weight, K split, another rank's expert
    (4, 32, True, 2, False, False),  # GGUF-sized groups, gated and split
    (8, 64, False, 1, False, False),
])
def test_pair_kernel_in_the_interpreter(bits, group, gated, split, mapped, split_major, monkeypatch):
    """The MoE decode on the tensor-core GEMV (int_mma_pair_gemv): each (token, expert) pair's output is its row of
    x against its expert's dequantized weight (gated: silu(gate) * up of the token's row; else times the pair's
    routing weight), at its row (split_major: grouped by top-k slot); a pair whose expert lives on another rank
    writes nothing; a K split's counters are left at zero."""
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_inline_asm", emulate_inline_asm, raising=True)
    num_experts, n, k, top_k, tokens = 4, 64, 512, 2, 3
    stack, dense = _expert_stack(num_experts, n, k, bits, group, seed=bits + group)
    gen = torch.Generator().manual_seed(7)
    pairs = tokens * top_k
    ids = torch.tensor([0, 3, 1, 3, 2, 0], dtype=torch.int32)
    x = torch.randn(tokens if gated else pairs, k, generator=gen).to(torch.bfloat16)
    weights = None if gated else torch.rand(pairs, generator=gen)
    expert_map = torch.tensor([0, 1, -1, 3], dtype=torch.int32) if mapped else None  # expert 2 elsewhere
    out = torch.full((pairs, n // 2 if gated else n), float("nan"), dtype=torch.float16 if gated else torch.float32)
    config = {"SPLIT_K": split}
    mma.int_mma_pair_gemv(x, stack, out, ids, top_k, gated, expert_map, weights, split_major, config=config)
    for p in range(pairs):
        expert = int(ids[p])
        row = (p % top_k) * tokens + p // top_k if split_major else p
        if mapped and expert == 2:
            assert torch.isnan(out[row]).all(), p
            continue
        y = x[p // top_k if gated else p].double() @ dense[expert].T
        if gated:
            gate, up = y.chunk(2)
            want = torch.nn.functional.silu(gate) * up
            torch.testing.assert_close(out[row].double(), want, rtol=4e-3, atol=1e-3 * want.abs().max().item())
        else:
            want = y * weights[p].double()
            torch.testing.assert_close(out[row].double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
    if split > 1:
        from tandem.kernels.triton_int_gemv_mma import _split_counters

        assert not _split_counters(x.device, 1).any()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits,group,mapped,into_norm", [(4, 128, False, False), (4, 32, True, True),
                                                          (8, 64, False, True)])
def test_gpu_pair_gemv_matches_the_cuda_core_pairs(bits, group, mapped, into_norm, monkeypatch):
    """The MoE decode (Qwen3-30B-A3B's expert shape, 2 tokens x top 8 of 16 experts) on the tensor-core pair GEMV
    (TANDEM_MOE_INT_PAIR=mma_gemv) against the CUDA-core pair GEMV on the same codes: both sum exact products in
    fp32, so only the sum order and the bf16 rounding of silu(gate) * up differ; with an expert map (another
    rank's experts add nothing) and the partial sums handed to the norm alike."""
    from tandem.kernels.fp8 import PartialSums
    from tandem.kernels.int_weight import IntWeight
    from tandem.kernels.triton_moe_int import fused_moe_int_triton

    experts, hidden, inter, tokens, top_k = 16, 2048, 768, 2, 8

    def stack(n, k, seed):
        ws = []
        for e in range(experts):
            gen = torch.Generator().manual_seed(seed + e)
            codes = torch.randint(0, 2**bits, (n, k), generator=gen, dtype=torch.uint8)
            qweight = codes[:, 0::2] | (codes[:, 1::2] << 4) if bits == 4 else codes
            scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
            zeros = torch.full((n, k // group), 2.0 ** (bits - 1), dtype=torch.bfloat16)
            ws.append(repack_int_weight(qweight.cuda(), scales.cuda(), zeros.cuda(), bits, group))
        return stack_int_weights(ws)

    w13, w2 = stack(2 * inter, hidden, 0), stack(hidden, inter, 100)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=gen), dim=-1)
    expert_map = None
    if mapped:  # this rank holds the even experts
        expert_map = torch.full((experts,), -1, dtype=torch.int32, device="cuda")
        expert_map[0::2] = torch.arange(experts // 2, dtype=torch.int32, device="cuda")
        w13 = IntWeight(w13.words[0::2].contiguous(), w13.scales[0::2].contiguous(), w13.mins[0::2].contiguous(),
                        bits, group, w13.tiled)
        w2 = IntWeight(w2.words[0::2].contiguous(), w2.scales[0::2].contiguous(), w2.mins[0::2].contiguous(),
                       bits, group, w2.tiled)
    outs = []
    for kernel in ("mma_gemv", "gemv"):
        monkeypatch.setenv("TANDEM_MOE_INT_PAIR", kernel)
        out = fused_moe_int_triton(x, w13, w2, weights, ids, expert_map, pair_path=True, into_norm=into_norm)
        outs.append(out.reduce() if isinstance(out, PartialSums) else out.float())
    torch.testing.assert_close(outs[0].float(), outs[1].float(), rtol=2e-2, atol=2e-2 * outs[1].abs().max().item())


@pytest.mark.skipif(CUDA, reason="the interpreter case; on a GPU: test_gpu_rows_match_the_tile_gemm")
@pytest.mark.parametrize("bits,m,n,k,group,split", [
    (4, 8, 64, 1024, 128, 2),  # every column of B a row of x
    (4, 3, 40, 1152, 128, 2),  # ragged: rows past M (zeros), N past whole blocks, K past whole rounds
    (8, 5, 48, 512, 64, 2),
    (4, 2, 32, 512, 512, 1),  # one split: the kernel writes the output, bias and all
])
def test_rows_in_the_interpreter(bits, m, n, k, group, split, monkeypatch):
    """Up to 8 rows of x through the GEMV (int_mma_gemv, TANDEM_INT_MMA_MAX_ROWS): B's column c is row c of x, a
    lane keeps the block's sums for two rows of x; each row's output equals x (q s + mn) in fp64 (the partial sums,
    handed on with defer; one split: the bf16 output, within its rounding)."""
    from triton.runtime.interpreter import InterpreterBuilder

    from tandem.kernels.fp8 import PartialSums

    monkeypatch.setattr(InterpreterBuilder, "create_inline_asm", emulate_inline_asm, raising=True)
    packed, _, bias = random_int_weight(n, k, bits, group, seed=m + n + k)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = dequantize_repacked(packed).double()
    want = x.double() @ w.T
    if split == 1:
        got = mma.int_mma_gemv(x, packed, bias.to(torch.bfloat16), config={"SPLIT_K": 1})
        want = want + bias.to(torch.bfloat16).double()
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        return
    got = mma.int_mma_gemv(x, packed, None, defer=True, config={"SPLIT_K": split})
    assert isinstance(got, PartialSums) and got.ws.shape == (split, m, n)
    torch.testing.assert_close(got.ws.double().sum(0), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bits,m,n,k,group", [(4, 2, 6144, 4096, 128), (4, 8, 4100, 4096 + 128, 128),
                                              (4, 5, 4096, 14336, 128), (8, 8, 1536, 4096, 64)])
def test_gpu_rows_match_the_tile_gemm(bits, m, n, k, group, monkeypatch):
    """2 to 8 rows of x through the tensor-core GEMV (TANDEM_INT_MMA_MAX_ROWS=8) in bf16, deferred splits reduced
    too: within assert_close_to's bound of the fp32 reference, and close to the tile GEMM on the same codes (both
    round only the output and, in the GEMM, each weight to bf16)."""
    check_rows_path(monkeypatch, bits, m, n, k, group, ("TANDEM_INT_MMA_MAX_ROWS", "8", "1"), mma.use_mma_gemv)


def check_rows_path(monkeypatch, bits, m, n, k, group, switch, uses) -> None:
    """Several rows of bf16 x through int_weight_matmul_triton with the environment variable switch[0] at switch[1]
    (uses(x, weight) true: the kernel under test) and then at switch[2] (false: the tile GEMM): the first within
    assert_close_to's bound of the fp32 reference, its deferred splits reduced alike, and close to the second."""
    from tandem.kernels.fp8 import PartialSums
    from tandem.kernels.triton_int_weight import int_weight_matmul_triton
    from tests.kernels.test_triton_int_weight import assert_close_to, make_weight, reference

    qweight, scales, zeros, _ = make_weight(n, k, bits, group, torch.bfloat16, seed=m + n)
    packed = repack_int_weight(qweight, scales, zeros, bits, group)
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=gen)
    ref = reference(x, qweight, scales, zeros, bits, group, b)
    name, on, off = switch
    monkeypatch.setenv(name, on)
    assert uses(x, packed)
    out = int_weight_matmul_triton(x, packed, b)
    assert_close_to(out, ref)
    deferred = int_weight_matmul_triton(x, packed, b, defer=True)
    deferred = deferred.reduce() if isinstance(deferred, PartialSums) else deferred
    torch.testing.assert_close(deferred.float(), out.float(), atol=2e-3 * ref.abs().max().item(), rtol=1e-2)
    monkeypatch.setenv(name, off)
    assert not uses(x, packed)
    gemm = int_weight_matmul_triton(x, packed, b)
    torch.testing.assert_close(out.float(), gemm.float(), atol=1e-2 * ref.abs().max().item(), rtol=2e-2)
