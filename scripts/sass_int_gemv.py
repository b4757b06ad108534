"""Instructions a weight in the int-weight GEMV's K loop, read from its sm_90 SASS (no GPU needed).

    python scripts/sass_int_gemv.py [--n 4096] [--k 4096] [--bits 4] [--group 128] [--kernel fma,mma,mma-gated]
        [--config JSON] [--dump DIR] [--json]

Compiles the decode GEMV the way int_weight_matmul_triton launches it for one row of the given shape (bf16
activations, PDL on) with Triton's own ptxas for sm_90, disassembles the cubin (cuobjdump), finds the K loop (the
longest backward branch) and prints its instruction count, the count per weight (loop instructions x the warps'
32 lanes / the weights one loop iteration of a program consumes), the same over a whole program at this shape
(the code outside the loop once, an upper bound: both sides of its branches), the opcode mix, the registers and
any local memory (spills). kernel `fma` is the fp32 CUDA-core GEMV (_int_gemv_kernel), `mma` the tensor-core one
(triton_int_gemv_mma), `mma-gated` the same writing silu(gate) * up of its N rows (gate then up). On an H200
(132 SMs x 4 schedulers x ~1.98 GHz, 32 lanes an issue) streaming 4-bit weights at 0.8 of 4.8 TB/s leaves ~4.3
lane-instructions a weight at perfect issue; ~2 or fewer in practice.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tandem.kernels import triton_int_gemv_mma as mma  # noqa: E402
from tandem.kernels import triton_int_mma_rows as rows  # noqa: E402
from tandem.kernels import triton_int_weight as fma  # noqa: E402
from tandem.kernels.int_weight import WORD_BITS, tiles  # noqa: E402

NAMES = ["x_ptr", "w_ptr", "s_ptr", "mn_ptr", "b_ptr", "out_ptr", "ws_ptr", "M", "N", "K", "K_SPLIT", "GROUP",
         "ONE_BITS", "stride_xm", "stride_wn", "stride_sn", "stride_om"]
ALIGNED = {"x_ptr", "w_ptr", "s_ptr", "mn_ptr", "b_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "K", "K_SPLIT", "stride_xm",
           "stride_wn", "stride_sn", "stride_om"}  # multiples of 16 (Triton specializes such arguments)


def nvidia_bin(tool: str) -> str:
    """A tool Triton ships (ptxas, cuobjdump, nvdisasm)."""
    found = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool))
    if not found:
        raise SystemExit(f"this Triton build ships no {tool}")
    return found[0]


def compile_kernel(fn, constexprs: dict, num_warps: int, names: list[str], types: list[str]):
    signature = dict(zip(names, types))
    signature.update({key: "constexpr" for key in constexprs if key not in signature})
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name in ALIGNED})
    return triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": num_warps, "num_stages": 1})


def fma_case(n: int, k: int, bits: int, group: int, override: dict) -> tuple:
    """The CUDA-core GEMV as int_weight_matmul_triton launches it at one row: (kernel, weights an iteration)."""
    cfg = {**fma.int_gemv_config(1, n, k, bits, group, 132), **override}
    block_k, block_n = cfg["BLOCK_K"], cfg["BLOCK_N"]
    gk = fma.part_elements(block_k, group, bits)
    per_word = WORD_BITS // bits
    lines = fma.PREFETCH_STEPS * block_k * bits // 8 // 128
    constexprs = dict(GROUP=group, BITS=bits, HAS_BIAS=False, SPLIT_K=cfg["SPLIT_K"], EVEN=True, MASK_M=False,
                      BLOCK_M=1, BLOCK_N=block_n, TG=block_k // gk, GW=gk // per_word,
                      PREFETCH_LINES=triton.next_power_of_2(lines) if lines else 0, USE_PDL=2,
                      TILED=tiles(n, k, bits))
    mins = "*bf16" if bits == 4 else "*fp32"  # IntWeight's mins: fp32 at 8 bits
    types = ["*bf16", "*i32", "*bf16", mins, "*bf16", "*bf16", "*fp32"] + ["i32"] * 4 + ["constexpr"]
    types += ["i32"] * 5
    kernel = compile_kernel(fma._int_gemv_kernel, constexprs, cfg["num_warps"], NAMES, types)
    rounds = triton.cdiv(triton.cdiv(k, block_k), cfg["SPLIT_K"])
    return kernel, cfg["num_warps"], block_n * block_k, {**cfg, **constexprs}, rounds


def mma_case(n: int, k: int, bits: int, group: int, override: dict, gated: bool = False, m: int = 1) -> tuple:
    """The tensor-core GEMV as int_weight_matmul_triton launches it at one row (gated: silu(gate) * up of n rows,
    gate then up; a K split then adds its partial sums in the kernel, as it does wherever nothing defers them), or
    at m rows of x (one block a program; a K split then goes to the reduce kernel or the norm)."""
    if not mma.mma_gemv_fits(1, k, bits, group):
        raise SystemExit(f"the tensor-core GEMV does not take {bits} bits, group {group}, K {k}")
    cfg = {**mma.mma_gemv_config(n, k, bits, 132, gated, group, m), **override}
    constexprs = mma.mma_gemv_constexprs(n, k, bits, group, cfg, has_bias=False, use_pdl=2, gated=gated,
                                         reduce=m == 1 and cfg["SPLIT_K"] > 1 and (gated or mma.fold_reduce()),
                                         m_rows=m, tiled=tiles(n // 2 if gated else n, k, bits))
    names = NAMES[:7] + ["cnt_ptr", "N", "K", "K_SPLIT"]
    mins = "*bf16" if bits == 4 else "*fp32"  # IntWeight's mins: fp32 at 8 bits
    types = ["*bf16", "*i32", "*bf16", mins, "*bf16", "*bf16", "*fp32", "*i32"] + ["i32"] * 3
    kernel = compile_kernel(mma._int_mma_gemv_kernel, constexprs, cfg["num_warps"], names, types)
    part = mma.part_elements(bits)
    weights = 16 * cfg["ROW_BLOCKS"] * part * cfg["num_warps"]  # each warp: one part of every row block
    rounds = mma.mma_k_split(k, bits, cfg["SPLIT_K"], cfg["num_warps"]) // (part * cfg["num_warps"])
    return kernel, cfg["num_warps"], weights, {**cfg, **constexprs}, rounds


def rows_case(n: int, k: int, bits: int, group: int, override: dict, m: int = 32) -> tuple:
    """The many-row tensor-core kernel (triton_int_mma_rows) as int_weight_matmul_triton launches it at m rows."""
    if bits != 4:
        raise SystemExit("the many-row kernel takes 4 bits")
    cfg = {**rows.mma_rows_config(n, k, 132), **override}
    constexprs = rows.mma_rows_constexprs(m, n, k, group, cfg, has_bias=False, pdl=2, tiled=tiles(n, k, bits))
    names = NAMES[:7] + ["M", "N", "K", "K_SPLIT"]
    types = ["*bf16", "*i32", "*bf16", "*bf16", "*bf16", "*bf16", "*fp32"] + ["i32"] * 4
    kernel = compile_kernel(rows._int_mma_rows_kernel, constexprs, cfg["num_warps"], names, types)
    part = mma.part_elements(bits)
    weights = 16 * cfg["ROW_BLOCKS"] * part * cfg["num_warps"]  # each warp: one part of its row blocks
    rounds = rows.mma_rows_k_split(k, cfg["SPLIT_K"]) // part
    return kernel, cfg["num_warps"], weights, {**cfg, **constexprs}, rounds


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of every instruction, in order."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest loop (a branch back to a lower address), in order."""
    lines = instructions(sass)
    best = (0, 0)
    for addr, text in lines:
        branch = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < addr and addr - int(branch.group(1), 16) > best[1] - best[0]:
            best = (int(branch.group(1), 16), addr)
    return [text for addr, text in lines if best[0] <= addr <= best[1]]


def opcode(text: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", text)
    return text.split()[0].split(".")[0]


def report(kernel, warps: int, weights: int, params: dict, dump: str | None, name: str, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([nvidia_bin("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([nvidia_bin("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        Path(dump, f"{name}.sass").write_text(sass)
        Path(dump, f"{name}.ptx").write_text(kernel.asm["ptx"])
    body = loop_body(sass)
    # The whole program's issue at this shape: the code outside the loop (address math, prefetch, the sums over
    # warps, the stores; its branches' both sides counted, an upper bound) once, the loop `rounds` times.
    outside = len([text for _, text in instructions(sass) if not text.startswith("NOP")]) - len(body)
    regs = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)  # where ptxas keeps spilled registers
    mix = collections.Counter(opcode(text) for text in body)
    return {"kernel": name, "loop_instructions": len(body), "weights_per_iteration": weights, "warps": warps,
            "per_weight": round(len(body) * warps * 32 / weights, 3), "rounds": rounds,
            "program_per_weight": round((outside + rounds * len(body)) * warps * 32 / (rounds * weights), 3),
            "registers": int(regs.group(1)) if regs else None,
            "local_bytes": int(local.group(1)) if local else None, "stack_bytes": int(stack.group(1)) if stack else None,
            "spills": sum(mix[op] for op in ("LDL", "STL")), "mix": dict(mix.most_common()), "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--kernel", default="fma,mma", help="fma, mma, mma-gated (silu(gate) * up of N rows) "
                        "and mma-rows (the many-row kernel at --m rows)")
    parser.add_argument("--config", default="{}", help="JSON entries that override the config (both kernels)")
    parser.add_argument("--m", type=int, default=1,
                        help="rows of x for the tensor-core GEMV (up to 8; mma-rows: 9 to 32)")
    parser.add_argument("--dump", default=None, help="folder for the SASS and PTX")
    parser.add_argument("--json", action="store_true", help="print the full reports as JSON")
    args = parser.parse_args()
    reports = []
    for name in args.kernel.split(","):
        case = {"fma": fma_case, "mma": lambda *a: mma_case(*a, m=args.m),
                "mma-gated": lambda *a: mma_case(*a, gated=True),
                "mma-rows": lambda *a: rows_case(*a, m=args.m)}[name]
        kernel, warps, weights, params, rounds = case(args.n, args.k, args.bits, args.group, json.loads(args.config))
        reports.append(report(kernel, warps, weights, params, args.dump, name, rounds))
    if args.json:
        json.dump(reports, sys.stdout, indent=1, default=str)
        return
    for r in reports:
        top = ", ".join(f"{op} {count}" for op, count in list(r["mix"].items())[:12])
        print(f"{r['kernel']}: N {args.n} K {args.k} int{args.bits} g{args.group}: {r['loop_instructions']} loop "
              f"instructions x {r['warps']} warps x 32 / {r['weights_per_iteration']} weights = "
              f"{r['per_weight']} a weight ({r['program_per_weight']} with the code outside the loop, "
              f"{r['rounds']} rounds a program); {r['registers']} registers, local {r['local_bytes']} B, "
              f"stack {r['stack_bytes']} B, spills {r['spills']}\n  {top}")


if __name__ == "__main__":
    main()
