"""Weight-streaming GEMV for decode at a few rows: y = x W^T (* channel scale) (+ b) with W in bf16/fp16 or
FP8 e4m3, and optionally silu(gate) * up of a merged gate/up weight in the same pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.triton_launch import device_sms, pdl_wait, use_pdl


@triton.jit
def _load_tile(ptrs, row_mask, k_mask, MASK_ROWS: tl.constexpr, MASK_K: tl.constexpr):
    # A [rows, 1, BLOCK_K] (x) or [1, rows, BLOCK_K] (weight) tile, row_mask / k_mask shaped to broadcast
    # against it; masks are compile-time optional so full tiles keep 16-byte vector loads.
    if MASK_ROWS:
        if MASK_K:
            tile = tl.load(ptrs, mask=row_mask & k_mask, other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_mask, other=0.0)
    else:
        if MASK_K:
            tile = tl.load(ptrs, mask=k_mask, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def _fma_tile(acc, x, w, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr):
    # acc [BLOCK_M, BLOCK_N, BLOCK_K // VEC] += x [BLOCK_M, 1, BLOCK_K] * w [1, BLOCK_N, BLOCK_K], each thread
    # first summing the VEC products of its own 16-byte weight vector (registers only, no shuffles), so the
    # fp32 accumulator is VEC times smaller than the tile and more of the weight stream fits in flight.
    # Both tiles are loaded 3-D so they share the weight's coalesced layout (no shared-memory shuffle).
    p = x.to(tl.float32) * w.to(tl.float32)
    return acc + tl.sum(tl.reshape(p, [BLOCK_M, BLOCK_N, BLOCK_K // VEC, VEC]), axis=3)


@triton.jit
def _channel_out(acc, offs_n, n_mask, s_ptr, b_ptr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    # [BLOCK_M, BLOCK_N, BLOCK_K // VEC] partial sums -> [BLOCK_M, BLOCK_N] fp32 outputs with scale and bias.
    y = tl.sum(acc, axis=2)
    if HAS_SCALE:
        y = y * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, up_offset,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    MASK_M: tl.constexpr, MASK_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program = BLOCK_N output channels for all M (<= BLOCK_M) rows over the whole of K, so each weight
    # element is read once, by one program, and no second kernel adds partial sums. Products accumulate in
    # fp32 per K group of VEC (one thread's 16-byte load) and are reduced over K once, after the loop: no
    # cross-thread reduction inside it. GATED: the program also reads the up rows (up_offset rows below
    # its gate rows) and writes silu(gate) * up, each rounded as the unfused gemv + silu_and_mul round it.
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)[None, None, :]
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = m_mask[:, None, None]
    w_rows = n_mask[None, :, None]
    x_ptrs = x_ptr + offs_m[:, None, None].to(tl.int64) * stride_xm + offs_k  # [BLOCK_M, 1, BLOCK_K]
    w_ptrs = w_ptr + offs_n[None, :, None].to(tl.int64) * stride_wn + offs_k  # [1, BLOCK_N, BLOCK_K]
    u_ptrs = w_ptrs + up_offset * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    # The first K tile of the weight is loaded before pdl_wait: under programmatic dependent launch it
    # streams while the kernel that produces x is still running.
    k_mask = offs_k < K
    w = _load_tile(w_ptrs, w_rows, k_mask, MASK_N, not EVEN_K)
    if GATED:
        u = _load_tile(u_ptrs, w_rows, k_mask, MASK_N, not EVEN_K)
    pdl_wait(USE_PDL)
    x = _load_tile(x_ptrs, x_rows, k_mask, MASK_M, not EVEN_K)
    acc = _fma_tile(acc, x, w, BLOCK_M, BLOCK_N, BLOCK_K, VEC)
    if GATED:
        acc_up = _fma_tile(acc_up, x, u, BLOCK_M, BLOCK_N, BLOCK_K, VEC)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        k_mask = (k0 + offs_k) < K
        x = _load_tile(x_ptrs, x_rows, k_mask, MASK_M, not EVEN_K)
        w = _load_tile(w_ptrs, w_rows, k_mask, MASK_N, not EVEN_K)
        acc = _fma_tile(acc, x, w, BLOCK_M, BLOCK_N, BLOCK_K, VEC)
        if GATED:
            u = _load_tile(u_ptrs, w_rows, k_mask, MASK_N, not EVEN_K)
            acc_up = _fma_tile(acc_up, x, u, BLOCK_M, BLOCK_N, BLOCK_K, VEC)

    out_ty = out_ptr.dtype.element_ty
    y = _channel_out(acc, offs_n, n_mask, s_ptr, b_ptr, HAS_SCALE, HAS_BIAS)
    if GATED:
        y_up = _channel_out(acc_up, offs_n + up_offset, n_mask, s_ptr, b_ptr, HAS_SCALE, HAS_BIAS)
        gate = y.to(out_ty).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32)  # F.silu rounds before the multiply
        y = silu * y_up.to(out_ty).to(tl.float32)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(out_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv_config(m: int, n: int, k: int, weight_bytes: int, gated: bool, sms: int) -> dict[str, int]:
    """Tile from the shape alone (graph-safe), as measured on an H100 over the Llama-2-7B / Llama-3-8B
    projections (scripts/bench_gemv.py --sweep; benchmarks/results/ at bd15627): at one row, 16-bit weights
    stream 4 KiB of one weight row per K step (BLOCK_N 1, 4 warps) and FP8 weights 2 KiB of each of 4 rows
    (gate/up: 1 KiB of one pair with 2 warps, on an H200 1.02-1.04x two pairs with 4, h200_s7_gemv_fp8_sweep.json at bd15627);
    at 2-4 rows (16-bit only: FP8 runs the tile GEMMs there) 2 KiB of 4 rows (1 pair) per K step with 2 warps,
    as the products of every row are live at once. Narrower row blocks where N would leave SMs idle. A K that the tile does not divide runs masked (EVEN_K false)."""
    if weight_bytes == 1:
        block_n, block_k, num_warps = (1, 1024, 2) if gated else (4, 2048, 4)
    elif m == 1:
        block_n, block_k, num_warps = 1, 2048, 4
    else:
        block_n, block_k, num_warps = (1 if gated else 4), 1024, 2
    while block_k > 128 and block_k >= 2 * k:  # small models: no tile mostly past the end of K
        block_k //= 2
    while block_n > 1 and triton.cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": num_warps, "num_stages": 1}


def gemv_triton(
    x: torch.Tensor,  # [M, K] bf16/fp16 (fp32 in the interpreter), unit inner stride
    weight: torch.Tensor,  # [N, K] row-major: the model dtype, or float8_e4m3fn with weight_scale
    weight_scale: torch.Tensor | None = None,  # [N, 1] fp32 for FP8 weights
    bias: torch.Tensor | None = None,  # [N]
    gated: bool = False,  # weight holds gate rows then up rows; returns silu(gate) * up, [M, N / 2]
    config: dict[str, int] | None = None,  # overrides gemv_config's tile (benchmarks, tests)
) -> torch.Tensor:  # [M, N] (or [M, N / 2] gated) in x's dtype
    """x W^T for M <= a few rows, streaming W once at close to copy bandwidth; no host sync, fixed grid
    for a given shape, so it captures in CUDA graphs."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv_triton takes x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if gated and n % 2:
        raise ValueError(f"gated gemv needs an even number of weight rows (gate then up), got {n}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    n_out = n // 2 if gated else n
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0 or n_out == 0:
        return out
    sms = device_sms(x.device)
    cfg = {**gemv_config(m, n_out, k, weight.element_size(), gated, sms), **(config or {})}
    block_m = triton.next_power_of_2(m)
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    pdl = use_pdl(x.device)
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x, weight, weight_scale if weight_scale is not None else x, bias if bias is not None else x, out,
        m, n_out, k, x.stride(0), weight.stride(0), out.stride(0), n_out,
        HAS_SCALE=weight_scale is not None, HAS_BIAS=bias is not None, GATED=gated,
        MASK_M=m != block_m, MASK_N=n_out % block_n != 0, EVEN_K=k % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, VEC=min(16 // weight.element_size(), block_k),
        USE_PDL=pdl, launch_pdl=bool(pdl), **cfg,
    )
    return out

