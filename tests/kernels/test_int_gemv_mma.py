"""The tensor-core W4A16 GEMV (triton_int_gemv_mma): its inline assembly run on CPU by a model of the few PTX
instructions it uses (mma.sync's fragment layouts as the PTX ISA defines them for m16n8k16), its shape rules,
its sm_90 build, and on a GPU against the reference."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tandem.kernels import triton_int_gemv_mma as mma
from tandem.kernels.int_weight import repack_int_weight
from tests.kernels.sm90 import compile_sm90

CUDA = torch.cuda.is_available()


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def run_warps(asm: str, inputs: list[np.ndarray], outputs: int) -> list[np.ndarray]:
    """Executes `asm` on warps of 32 threads: inputs [operand] uint32 [T] (thread i = lane i % 32 of warp i // 32;
    operands numbered after the outputs), returns the outputs [operand] float32 [T]. Knows mov, shr.u32, lop3
    (0xea: a & b | c), add.f32 and mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32."""
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
        elif op == "lop3.b32":
            assert args[4] == "0xea", line
            value = (get(args[1]) & get(args[2])) | get(args[3])
        elif op == "add.f32":
            value = (get(args[1]).view(np.float32) + get(args[2]).view(np.float32)).view(np.uint32)
        else:
            raise AssertionError(f"unknown instruction {line}")
        regs[args[0]] = np.asarray(value, dtype=np.uint32)
    return [regs[f"${i}"].reshape(-1).view(np.float32) for i in range(outputs)]


def test_part_assembly_sums_x_times_the_codes():
    """One part (16 rows x 128 elements, one warp): lane (g, t) passes words 4t .. 4t + 3 of rows g and g + 8 and
    x's elements 32t .. 32t + 31 as bf16 pairs; it gets F = sum_k x_k (128 + q_k) of both rows, and the sum
    assembly X = sum_k x_k, in every lane, as the kernel reads them."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 128), generator=gen, dtype=torch.uint8)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    ones = torch.ones(16, 1)
    words = repack_int_weight(qweight, ones, ones, 4, 128).words.numpy().view(np.uint32)  # [16, 16]
    x = torch.randn(128, generator=gen).to(torch.bfloat16)
    x_bits = x.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    x_pairs = x_bits[0::2] | (x_bits[1::2] << 16)  # [64]: int32 view of x
    lanes = np.arange(32)
    g, t = lanes >> 2, lanes % 4
    w_in = [words[g, 4 * t + i] for i in range(4)] + [words[g + 8, 4 * t + i] for i in range(4)]
    x_in = [x_pairs[16 * t + i] for i in range(16)]
    f_lo, f_hi = run_warps(mma.PART_ASM.value, w_in + x_in, 2)
    want = (x.double()[None, :] * (128 + codes.double())).sum(1).numpy()  # [16]
    np.testing.assert_allclose(f_lo, want[g], rtol=1e-6, atol=1e-3)
    np.testing.assert_allclose(f_hi, want[g + 8], rtol=1e-6, atol=1e-3)
    (xs,) = run_warps(mma.SUM_ASM.value, x_in, 1)
    np.testing.assert_allclose(xs, np.full(32, x.double().sum().item()), rtol=1e-5, atol=1e-4)


def test_shapes_it_takes():
    assert mma.mma_gemv_fits(1, 4096, 4, 128) and mma.mma_gemv_fits(1, 14336, 4, 14336)
    assert not mma.mma_gemv_fits(2, 4096, 4, 128)  # one row only
    assert not mma.mma_gemv_fits(1, 4096, 8, 128) and not mma.mma_gemv_fits(1, 4096, 4, 32)
    assert not mma.mma_gemv_fits(1, 4160, 4, 64)
    assert mma.mma_k_split(4096, 1, 8) == 4096 and mma.mma_k_split(4096, 4, 8) == 1024
    assert mma.mma_k_split(14336, 2, 8) == 7168
    assert mma.mma_gemv_config(28672, 4096, 132) == {"ROW_BLOCKS": 4, "SPLIT_K": 1, "num_warps": 8}
    assert mma.mma_gemv_config(6144, 4096, 132)["ROW_BLOCKS"] == 1
    assert mma.mma_gemv_config(4096, 4096, 132) == {"ROW_BLOCKS": 4, "SPLIT_K": 4, "num_warps": 8}
    assert mma.mma_gemv_config(4096, 14336, 132)["SPLIT_K"] == 8
    sms = 132
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        cfg = mma.mma_gemv_config(n, k, sms)
        programs = -(-n // (16 * cfg["ROW_BLOCKS"]))
        assert programs * cfg["SPLIT_K"] >= 1.9 * sms  # ~two programs an SM
        flags = mma.mma_gemv_constexprs(n, k, 128, cfg, False, 2)
        assert flags["EVEN"] and k % mma.mma_k_split(k, cfg["SPLIT_K"], cfg["num_warps"]) == 0


_COMPILE_SM90 = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tandem.kernels.triton_int_gemv_mma import _int4_mma_gemv_kernel, mma_gemv_config, mma_gemv_constexprs

names = ["x_ptr", "w_ptr", "s_ptr", "mn_ptr", "b_ptr", "out_ptr", "ws_ptr", "N", "K", "K_SPLIT"]
types = ["*bf16", "*i32", "*bf16", "*bf16", "*bf16", "*bf16", "*fp32", "i32", "i32", "i32"]
out = {}
for name, n, k, rows in [("even", 4096, 4096, 4), ("ragged", 4100, 4096 + 128, 4), ("one-block", 6144, 4096, 1),
                         ("two-blocks", 4096, 4096, 2)]:
    cfg = {**mma_gemv_config(n, k, 132), "ROW_BLOCKS": rows}
    flags = mma_gemv_constexprs(n, k, 128, cfg, True, 2)
    signature = dict(zip(names, types))
    signature.update({key: "constexpr" for key in flags if key not in signature})
    src = ASTSource(fn=_int4_mma_gemv_kernel, signature=signature, constexprs=flags,
                    attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 9)})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"],
                                                                             "num_stages": 1})
    ptx = kernel.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    loop = ""  # the K loop: from a label to the branch back to it
    for branch in re.finditer(r"bra(?:\.uni)?\s+(\$L__BB\w+);", ptx):
        label = ptx.find(branch.group(1) + ":")
        if 0 <= label < branch.start():
            loop = ptx[label:branch.end()]
    out[name] = {"even": flags["EVEN"], "blocks": rows, "mma": ptx.count("mma.sync.aligned.m16n8k16"),
                 "local": "ld.local" in ptx or "st.local" in ptx, "v4_loads": "ld.global.v4" in ptx,
                 "stores_before_wait": any(op in ptx[:max(wait, 0)] for op in ("st.global", "red.global")),
                 "prefetch_before_wait": 0 <= ptx.find("prefetch.global.L2") < wait,
                 "waits": wait >= 0, "loop_mma": loop.count("mma.sync"), "bar_in_loop": "bar.sync" in loop}
json.dump(out, sys.stdout)
"""


def test_kernel_compiles_for_sm90():
    """Hopper build without a GPU: mma.sync (a part: 8 for X, then 8 for each 16-row block), no local memory, 16-byte
    loads, under PDL weight lines sent to L2 and nothing written before the wait, and no barrier in the K loop
    (no layout change through shared memory: every tensor keeps one element a thread)."""
    for name, info in compile_sm90(_COMPILE_SM90).items():
        assert info["mma"] >= 16 and not info["local"] and info["v4_loads"], (name, info)
        assert info["waits"] and info["prefetch_before_wait"] and not info["stores_before_wait"], (name, info)
        assert info["loop_mma"] == 8 + 8 * info["blocks"], (name, info)  # X's 8, then 8 a block
        assert not info["bar_in_loop"], (name, info)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n,k,group,split,bias", [
    (1536, 4096, 128, None, False),  # the default config
    (4100, 4096 + 128, 128, None, True),  # N past whole 16-row blocks, K past whole rounds of the warps
    (512, 14336, -1, 4, False),  # one group a row (per channel), K split over programs with a reduce
    (1024, 2048, 256, 2, True),  # bias added by the reduce
])
def test_gpu_matches_reference_and_the_fp32_gemv(n, k, group, split, bias, monkeypatch):
    """bf16 on the GPU: close to the fp32 product of the reference dequantization (the codes and x are exact in
    the MMA and its sums fp32: only the bf16 output rounding and the fp32 sum order differ, far inside
    assert_close_to's bound) and to the fp32 CUDA-core GEMV (TANDEM_INT_GEMV_MMA=0)."""
    from tandem.kernels.triton_int_weight import int_weight_matmul_triton
    from tests.kernels.test_triton_int_weight import assert_close_to, make_weight, reference

    group_size = k if group == -1 else group
    qweight, scales, zeros, _ = make_weight(n, k, 4, group_size, torch.bfloat16, seed=n + k)
    packed = repack_int_weight(qweight, scales, zeros, 4, group_size)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16) if bias else None
    ref = reference(x, qweight, scales, zeros, 4, group_size, b)
    assert mma.use_mma_gemv(x, packed)
    out = mma.int4_mma_gemv(x, packed, b, config={"SPLIT_K": split} if split else None)
    assert_close_to(out, ref)
    torch.testing.assert_close(out.float(), ref, atol=2e-3 * ref.abs().max().item(), rtol=1e-2)
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
    got = run_warps(asm, inputs, outputs)
    return _AsmCall([TensorHandle(r.reshape(shape).copy(), tl.float32) for r in got])


@pytest.mark.skipif(CUDA, reason="the interpreter case: the GPU one is test_gpu_matches_reference_and_the_fp32_gemv")
@pytest.mark.parametrize("n,k,group,blocks,warps,split", [
    (64, 2048, 128, 4, 8, 1),  # EVEN, 4 blocks: lane t scales block t
    (32, 1024, 256, 2, 4, 2),  # 2 blocks, K split over 2 programs (a part of each warp a split)
    (40, 1152, 1152, 1, 4, 2),  # ragged: N past whole blocks, K past whole rounds (dead parts), per-channel group
])
def test_kernel_in_the_interpreter(n, k, group, blocks, warps, split, monkeypatch):
    """The whole kernel (lanes' words, x, scales, the block each lane scales, the warps' and splits' sums) in the
    Triton interpreter with its assembly run by run_warps: the fp32 partial sums added over the splits equal
    x (q s + mn) in fp64 (x, q, s and mn exact in the MMA's bf16 and fp32 inputs; only the fp32 sums' order
    differs)."""
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(InterpreterBuilder, "create_inline_asm", emulate_inline_asm, raising=True)
    gen = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    qweight = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = torch.rand(n, k // group, generator=gen) * 0.02 + 0.005
    zeros = torch.randint(0, 16, (n, k // group), generator=gen).float()
    packed = repack_int_weight(qweight, scales, zeros, 4, group)  # fp32 scales and mins: exact in the kernel
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    cfg = {"ROW_BLOCKS": blocks, "SPLIT_K": split, "num_warps": warps}
    flags = mma.mma_gemv_constexprs(n, k, group, cfg, has_bias=False, use_pdl=0)
    k_split = mma.mma_k_split(k, split, warps)
    ws = torch.full((flags["SPLIT_K"], 1, n), float("nan"))
    mma._int4_mma_gemv_kernel[(-(-n // (16 * blocks)), flags["SPLIT_K"])](
        x, packed.words, packed.scales, packed.mins, packed.scales, ws, ws, n, k, k_split, **flags, num_warps=warps)
    w = (codes.double() * scales.double().repeat_interleave(group, 1)
         + packed.mins.double().repeat_interleave(group, 1))
    want = x.double() @ w.T
    torch.testing.assert_close(ws.double().sum(0), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
