"""Weight-streaming GEMV for decode at a few rows: y = x W^T (* channel scale) (+ b) with W in bf16/fp16 or
FP8 e4m3, optionally silu(gate) * up of a merged gate/up weight in the same pass, and optionally each token's LoRA
delta added in the epilogue (the expand) after a GEMV over each token's own adapter rows (the shrink)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.lora import LoRAShrunk
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
def _lora_out(y, slots, offs_m, offs_n, n_mask, ls_ptr, lb_ptr, R, stride_lsm, stride_lbs, stride_lbn,
              out_ty: tl.constexpr, BLOCK_R: tl.constexpr):
    # [BLOCK_M, BLOCK_N] fp32 outputs -> rounded to out_ty, plus sum_r s[m, r] * B[slot_m, n, r], rounded again:
    # the bits of the base kernel's output followed by the separate expand (which rounds s to B's dtype too).
    # Rows with slot -1 load nothing and add 0, so they keep the base output bit for bit.
    has = (slots >= 0)[:, None, None]
    b_rows = (lb_ptr + tl.maximum(slots, 0).to(tl.int64)[:, None, None] * stride_lbs
              + offs_n[None, :, None].to(tl.int64) * stride_lbn)  # [BLOCK_M, BLOCK_N, 1]
    delta = tl.zeros(y.shape, dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)[None, None, :]
        s = tl.load(ls_ptr + offs_m[:, None, None] * stride_lsm + r, mask=has & (r < R), other=0.0)
        b = tl.load(b_rows + r, mask=has & n_mask[None, :, None] & (r < R), other=0.0)
        delta += tl.sum(s.to(b.dtype).to(tl.float32) * b.to(tl.float32), axis=2)
    return (y.to(out_ty).to(tl.float32) + delta).to(out_ty).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, up_offset,
    ls_ptr, lb_ptr, lslot_ptr, R, stride_lsm, stride_lbs, stride_lbn,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
    MASK_M: tl.constexpr, MASK_N: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    USE_PDL: tl.constexpr, LORA: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # Program = BLOCK_N output channels for all M (<= BLOCK_M) rows over the whole of K, so each weight
    # element is read once, by one program, and no second kernel adds partial sums. Products accumulate in
    # fp32 per K group of VEC (one thread's 16-byte load) and are reduced over K once, after the loop: no
    # cross-thread reduction inside it. GATED: the program also reads the up rows (up_offset rows below
    # its gate rows) and writes silu(gate) * up, each rounded as the unfused gemv + silu_and_mul round it.
    # LORA: each row's adapter delta for the program's channels (gate and up rows alike) from the shrink at
    # ls_ptr ([M, R] fp32) and B at lb_ptr ([slots, weight rows, R]), token slots at lslot_ptr, added before
    # silu: base + expand in one kernel.
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
    if LORA:  # written by this step (the slot index) and by the shrink: after the wait
        slots = tl.load(lslot_ptr + offs_m, mask=m_mask, other=-1)
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
    if LORA:
        y = _lora_out(y, slots, offs_m, offs_n, n_mask, ls_ptr, lb_ptr, R, stride_lsm, stride_lbs, stride_lbn,
                      out_ty, BLOCK_R)
    if GATED:
        y_up = _channel_out(acc_up, offs_n + up_offset, n_mask, s_ptr, b_ptr, HAS_SCALE, HAS_BIAS)
        if LORA:
            y_up = _lora_out(y_up, slots, offs_m, offs_n + up_offset, n_mask, ls_ptr, lb_ptr, R, stride_lsm,
                             stride_lbs, stride_lbn, out_ty, BLOCK_R)
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
    lora: LoRAShrunk | None = None,  # each row's adapter delta, added before silu (s [M, R], b [slots, N, R])
) -> torch.Tensor:  # [M, N] (or [M, N / 2] gated) in x's dtype
    """x W^T for M <= a few rows, streaming W once at close to copy bandwidth; no host sync, fixed grid
    for a given shape, so it captures in CUDA graphs. With lora, y is the base output plus each token's delta,
    rounded as the base output followed by lora_add_triton's expand rounds it."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv_triton takes x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if gated and n % 2:
        raise ValueError(f"gated gemv needs an even number of weight rows (gate then up), got {n}")
    if lora is not None:
        _check_lora(lora, m, n)
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
    rank = lora.s.shape[1] if lora is not None else 1
    placeholder = x  # pointer arguments the kernel's constexpr switches leave unread
    _gemv_kernel[(triton.cdiv(n_out, block_n),)](
        x, weight, weight_scale if weight_scale is not None else x, bias if bias is not None else x, out,
        m, n_out, k, x.stride(0), weight.stride(0), out.stride(0), n_out,
        lora.s if lora is not None else placeholder, lora.b if lora is not None else placeholder,
        lora.token_slots if lora is not None else placeholder, rank,
        lora.s.stride(0) if lora is not None else 0, lora.b.stride(0) if lora is not None else 0,
        lora.b.stride(1) if lora is not None else 0,
        HAS_SCALE=weight_scale is not None, HAS_BIAS=bias is not None, GATED=gated,
        MASK_M=m != block_m, MASK_N=n_out % block_n != 0, EVEN_K=k % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, VEC=min(16 // weight.element_size(), block_k),
        USE_PDL=pdl, launch_pdl=bool(pdl), LORA=lora is not None,
        BLOCK_R=min(triton.next_power_of_2(rank), max(16, 2048 // (block_m * block_n))), **cfg,
    )
    return out


def _check_lora(lora: LoRAShrunk, m: int, n: int) -> None:
    s, b = lora.s, lora.b
    if (s.shape[0] != m or s.dtype != torch.float32 or b.dim() != 3 or b.shape[1:] != (n, s.shape[1])
            or lora.token_slots.shape[0] < m or s.stride(1) != 1 or b.stride(2) != 1):
        raise ValueError(f"gemv lora epilogue: s {tuple(s.shape)} {s.dtype}, b {tuple(b.shape)}, slots "
                         f"{tuple(lora.token_slots.shape)} for {m} rows x {n} weight rows")


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slots_ptr, out_ptr, M, K, R, stride_xm, stride_as, stride_ar, stride_om,
    MASK_M: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, VEC: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Program = BLOCK_N rank rows of each token's own adapter (A[slot_m] gathered per row) over the whole of K,
    # out[m, r] = sum_k x[m, k] * A[slot_m, r, k] in fp32: the GEMV above with per-row weights, one K tile per
    # program where it fits (a few dozen programs: latency, not bandwidth, is their cost, so no K split and no
    # second pass). Rows with slot -1 (or past M) read no weight and get 0.
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)[None, None, :]
    m_mask = offs_m < M
    pdl_wait(USE_PDL)  # the slots are written by this step, x by the kernel before
    slots = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1)
    rows = ((slots >= 0)[:, None] & (offs_n < R)[None, :])[:, :, None]  # [BLOCK_M, BLOCK_N, 1]
    x_ptrs = x_ptr + offs_m[:, None, None].to(tl.int64) * stride_xm + offs_k  # [BLOCK_M, 1, BLOCK_K]
    a_ptrs = (a_ptr + tl.maximum(slots, 0).to(tl.int64)[:, None, None] * stride_as
              + offs_n[None, :, None].to(tl.int64) * stride_ar + offs_k)  # [BLOCK_M, BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = _load_tile(x_ptrs, m_mask[:, None, None], k_mask, MASK_M, not EVEN_K)
        if EVEN_K:
            a = tl.load(a_ptrs, mask=rows, other=0.0)
        else:
            a = tl.load(a_ptrs, mask=rows & k_mask, other=0.0)
        acc = _fma_tile(acc, x, a, BLOCK_M, BLOCK_N, BLOCK_K, VEC)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, tl.sum(acc, axis=2), mask=m_mask[:, None] & (offs_n < R)[None, :])


def lora_shrink_triton(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                       block_k: int | None = None) -> torch.Tensor:
    """[M, R] fp32: x [M, K] @ A[slot]^T per row for the decode GEMV's few rows (a [slots, R, K] unit last stride,
    token_slots [>= M] int, -1: none, zeros). One program per rank row, each reading its K in one tile of up to
    16K elements a row (block_k overrides: tests), so the kernel costs about one memory round trip."""
    m, k = x.shape
    if a.dim() != 3 or a.shape[2] != k or token_slots.shape[0] < m or a.stride(2) != 1:
        raise ValueError(f"lora shrink: x {tuple(x.shape)}, a {tuple(a.shape)}, slots {tuple(token_slots.shape)}")
    rank = a.shape[1]
    out = torch.empty(m, rank, dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    block_m = triton.next_power_of_2(m)
    block_k = block_k or min(triton.next_power_of_2(k), max(256, 16384 // block_m))
    pdl = use_pdl(x.device)
    _lora_shrink_kernel[(rank,)](
        x, a, token_slots, out, m, k, rank, x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        MASK_M=m != block_m, EVEN_K=k % block_k == 0, BLOCK_M=block_m, BLOCK_N=1, BLOCK_K=block_k,
        VEC=min(16 // a.element_size(), block_k), USE_PDL=pdl, launch_pdl=bool(pdl), num_warps=8, num_stages=1,
    )
    return out
