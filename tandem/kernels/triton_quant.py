"""FP8 Triton kernels: per-token activation quantization (row amax, scale, e4m3 cast in one pass), the small-M
FP8-weight GEMM (bf16 rows x widened FP8 weight) and the small-M W8A8 swap-AB GEMM (FP8 x FP8 tensor cores)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8 import DEFER_REDUCE, FP8_DTYPE, FP8_MAX, MIN_AMAX, PartialSums, group_block_k
from tandem.kernels.lora import LoRAShrunk
from tandem.kernels.triton_launch import device_sms, pdl_wait, persistent_state, prefetch_l2, use_pdl
from tandem.kernels.triton_lora import lora_tile_delta, slots_p2

MAX_QUANT_DIM = 65536  # one program holds a whole row in registers


@triton.jit
def store_quantized_row(x, offs, mask, q_row_ptr, scale_ptr, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr):
    # One token's fp32 values (masked lanes 0) -> e4m3 at q_row_ptr + offs and the scale at scale_ptr, with
    # quantize_activation_per_token_ref's math: fp32 amax, scale = amax / 448, IEEE-rounded division (div_rn:
    # Triton's `/` is approximate), clamp, round-to-nearest-even e4m3 cast. Shared by the kernels that write
    # quantized activations (this file's quantizer, RMSNorm's QUANT_OUT).
    scale = store_quantized(x, tl.max(tl.abs(x), axis=0), offs, mask, q_row_ptr, FP8_MAX_C, MIN_AMAX_C)
    tl.store(scale_ptr, scale)


@triton.jit
def store_quantized(x, amax, offs, mask, q_row_ptr, FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr):
    # fp32 values of a row whose |max| is amax -> e4m3 at q_row_ptr + offs; returns the row's scale
    # (store_quantized_row's math from the amax on).
    scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX_C), FP8_MAX_C)
    q = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))
    q = tl.minimum(tl.maximum(q, -FP8_MAX_C), FP8_MAX_C)
    tl.store(q_row_ptr + offs, q.to(q_row_ptr.dtype.element_ty), mask=mask)
    return scale


@triton.jit
def _quant_per_token_kernel(
    x_ptr, q_ptr, scale_ptr, dim, stride_x,
    FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
    SILU_AND_MUL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    # Program = one token (its values: _quant_input).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    x = _quant_input(x_ptr + row * stride_x, offs, mask, dim, SILU_AND_MUL)
    store_quantized_row(x, offs, mask, q_ptr + row * dim, scale_ptr + row, FP8_MAX_C, MIN_AMAX_C)


@triton.jit
def _quant_input(row_ptr, offs, mask, dim, SILU_AND_MUL: tl.constexpr):
    # The fp32 values a quantizer quantizes at offs of one row: the row itself, or (SILU_AND_MUL: the row
    # holds gate then up, dim each) silu(gate) * up rounded as silu_and_mul rounds it (the silu, then the
    # product, in the row's dtype).
    x = tl.load(row_ptr + offs, mask=mask, other=0.0)
    if SILU_AND_MUL:
        up = tl.load(row_ptr + dim + offs, mask=mask, other=0.0)
        g = x.to(tl.float32)
        silu = (g * tl.sigmoid(g)).to(x.dtype).to(tl.float32)
        x = (silu * up.to(tl.float32)).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _quant_wide_kernel(
    x_ptr, q_ptr, scale_ptr, amax_ptr, count_ptr, dim, stride_x, amax_stride,
    FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    SILU_AND_MUL: tl.constexpr, PHASE: tl.constexpr, LAUNCH_STEP: tl.constexpr,
):
    # _quant_per_token_kernel's values with a row spread over dim / BLOCK programs (chunks) instead of one.
    # PHASE 2 (GPU): each chunk raises the row's amax to its own |max| (atomic max), counts itself in
    # (release), waits until every chunk of the row has (acquire), then quantizes its values with the row's
    # scale. PHASE 0 then PHASE 1 (the interpreter, which runs programs one at a time, so none may wait for
    # another): the same in two launches, the first up to the count, the second from the amax read on.
    # The counts only grow, by LAUNCH_STEP a launch (int64; chunk 0 adds LAUNCH_STEP - chunks + 1, the others
    # 1, so the step does not depend on the row's width), and until a program has counted itself in,
    # count // LAUNCH_STEP numbers the row's launch; its parity picks one of two amax slots, and the launch
    # clears the other one for the next launch (the launch before, which used it, has finished).
    pdl_wait(USE_PDL)
    chunk = tl.program_id(0)
    chunks = tl.num_programs(0)
    row = tl.program_id(1).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < dim
    x = _quant_input(x_ptr + row * stride_x, offs, mask, dim, SILU_AND_MUL)
    count = count_ptr + row
    if PHASE != 1:
        launch = tl.atomic_add(count, 0, sem="relaxed", scope="gpu") // LAUNCH_STEP
        tl.atomic_max(amax_ptr + (launch % 2) * amax_stride + row, tl.max(tl.abs(x), axis=0), sem="relaxed",
                      scope="gpu")
        tl.debug_barrier()
        tl.atomic_add(count, tl.where(chunk == 0, LAUNCH_STEP - chunks + 1, 1).to(tl.int64), sem="release",
                      scope="gpu")
    if PHASE != 0:
        if PHASE == 2:
            while tl.atomic_add(count, 0, sem="acquire", scope="gpu") < (launch + 1) * LAUNCH_STEP:
                pass
        else:
            launch = tl.atomic_add(count, 0, sem="acquire", scope="gpu") // LAUNCH_STEP - 1
        amax = tl.atomic_max(amax_ptr + (launch % 2) * amax_stride + row, 0.0, sem="acquire", scope="gpu")
        scale = store_quantized(x, amax, offs, mask, q_ptr + row * dim, FP8_MAX_C, MIN_AMAX_C)
        if chunk == 0:
            tl.store(scale_ptr + row, scale)
            tl.store(amax_ptr + ((launch + 1) % 2) * amax_stride + row, 0.0)


WIDE_BLOCK = 2048  # values per _quant_wide_kernel program
LAUNCH_STEP = 1 << 16  # what a _quant_wide_kernel launch adds to each of its rows' counts (> its chunks)
WIDE_MIN_CHUNKS = 4
WIDE_QUANT = os.environ.get("TANDEM_QUANT_WIDE", "1") == "1"


def _wide_quant_state(device: torch.device, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """_quant_wide_kernel's two amax slots per row (fp32 [2, cap], zero) and launch counts (int64 [cap]), made
    together (a fresh count needs fresh slots). One pair per device (persistent_state)."""
    return persistent_state("the wide quantizer's row state", device, rows,
                            lambda n: (torch.zeros(2, n, dtype=torch.float32, device=device),
                                       torch.zeros(n, dtype=torch.int64, device=device)), 1024)


def use_wide_quant(rows: int, dim: int, device: torch.device) -> bool:
    """Whether a row of `dim` values is quantized by several programs (_quant_wide_kernel): rows at least
    WIDE_MIN_CHUNKS chunks wide, and few enough programs that every one is resident at once on a GPU (the
    chunks of a row wait for each other). On an H200 the wide kernel took Llama-3-8B's SiLU-and-mul rows
    (14,336 values, 7 chunks) from 6.4 to 4.2 us a layer at 32 rows, and o_proj's input (4,096, 2 chunks)
    from 1.8 to 3.1 us: the waiting costs more than one program a row spends on a short row.
    TANDEM_QUANT_WIDE=0 keeps one program a row."""
    chunks = triton.cdiv(dim, WIDE_BLOCK)
    if not WIDE_QUANT or chunks < WIDE_MIN_CHUNKS or chunks >= LAUNCH_STEP:
        return False
    return device.type != "cuda" or rows * chunks <= 4 * device_sms(device)


def quantize_per_token_triton(x: torch.Tensor, silu_and_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] (unit inner stride; rows may be strided) -> (e4m3 [n, k] contiguous, fp32 scale [n, 1]);
    silu_and_mul: x is [n, 2 * k] (gate then up) and the rows quantized are silu(gate) * up."""
    if x.dim() != 2:
        raise ValueError(f"quantize_per_token_triton takes [n, k], got shape {tuple(x.shape)}")
    n, dim = x.shape
    if silu_and_mul:
        if dim % 2:
            raise ValueError(f"silu_and_mul needs an even last dim, got {dim}")
        dim //= 2
    if dim > MAX_QUANT_DIM:
        raise ValueError(f"quantize_per_token_triton supports rows up to {MAX_QUANT_DIM}, got {dim}")
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(n, dim, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=x.device)
    if n == 0:
        return q, scale
    pdl = use_pdl(x.device)
    if use_wide_quant(n, dim, x.device):
        amax, counts = _wide_quant_state(x.device, n)
        phases = (2,) if x.is_cuda else (0, 1)
        for phase in phases:
            _quant_wide_kernel[(triton.cdiv(dim, WIDE_BLOCK), n)](
                x, q, scale, amax, counts, dim, x.stride(0), amax.stride(0),
                FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, BLOCK=WIDE_BLOCK, USE_PDL=pdl, SILU_AND_MUL=silu_and_mul,
                PHASE=phase, LAUNCH_STEP=LAUNCH_STEP, num_warps=4, launch_pdl=bool(pdl),
            )
        return q, scale
    block = triton.next_power_of_2(dim)
    _quant_per_token_kernel[(n,)](
        x, q, scale, dim, x.stride(0),
        FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX, BLOCK_D=block, USE_PDL=pdl, SILU_AND_MUL=silu_and_mul,
        num_warps=min(max(block // 512, 1), 16), launch_pdl=bool(pdl),
    )
    return q, scale


# ----------------------------------------------------------------------------- small-M FP8-weight GEMM


@triton.jit
def _small_m_program(M, N, K, K_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # The grid of both small-M GEMMs is (N tiles, K splits, row blocks): this program's rows, channels, K
    # offsets within a tile, masks and K range [k_begin, k_end).
    pid_k = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = pid_k * K_SPLIT
    return (pid_k, offs_m, offs_n, tl.arange(0, BLOCK_K), offs_m < M, offs_n < N, k_begin,
            tl.minimum(k_begin + K_SPLIT, K))


@triton.jit
def _fp8_weight_matmul_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr,
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    # Program = BLOCK_M rows x BLOCK_N output channels over K range [pid_k * K_SPLIT, +K_SPLIT) (K_SPLIT is a
    # multiple of BLOCK_K). The e4m3 weight tile is widened to x's dtype in registers (exact: e4m3 values are
    # bf16/fp16 values). SPLIT_K == 1 applies the channel scale and bias here; otherwise the fp32 partial sums
    # go to ws [SPLIT_K, M, N] and _split_k_reduce_kernel adds them in split order. The split depends on
    # (N, K) only, so a row's result never depends on the batch it is in, and two runs agree bit for bit.
    pid_k, offs_m, offs_n, offs_k, m_mask, n_mask, k_begin, k_end = _small_m_program(
        M, N, K, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_begin + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_begin + offs_k)[:, None]  # [BLOCK_K, BLOCK_N] of W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = (k0 + offs_k) < k_end
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SPLIT_K == 1:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    else:
        ws_ptrs = ws_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(ws_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _split_k_reduce_kernel(
    ws_ptr, s_ptr, b_ptr, out_ptr, M, N, stride_om,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    pdl_wait(USE_PDL)
    # out[m, n] = (ws[0, m, n] + ws[1, m, n] + ...) * scale[n] + bias[n], always in split order.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = offs // N
    n = offs % N
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_matmul_tile(m: int, n: int, k: int, sms: int) -> dict[str, int]:
    """Tile and split-K for the small-M GEMM, from the shape alone (never from the data: graph-safe, and the
    same split for a row whatever batch it is in). At small M the weight stream is the whole cost, so the
    grid must keep enough loads in flight on every SM, keeping at least four K tiles per program."""
    block_k = 256 if k % 256 == 0 else 128
    # Chosen from H100 runs (2026-11-23; benchmarks/results/ at bd15627): up to 16 rows, 32-wide N tiles unless N alone fills
    # the SMs, split until ~4 programs per SM (bs1 fp8/bf16 1.57x, against 1.51x with ~2); above 16 rows,
    # 64-wide tiles (32-wide ones ran twice as slow at 32 rows) and ~2 programs per SM (seed-async 1.25x).
    if m <= 16:
        block_n = 64 if triton.cdiv(n, 64) >= sms else 32
        max_programs = 4 * sms
    else:
        block_n, max_programs = 64, 2 * sms
    split_k = split_k_until(n, block_n, triton.cdiv(k, block_k), max_programs, max_split=8)
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 3}


def split_k_until(n: int, block_n: int, k_tiles: int, max_programs: int, max_split: int) -> int:
    """Doubles the split over K while the grid stays within max_programs and each split keeps >= 4 K tiles."""
    split = 1
    while split < max_split and triton.cdiv(n, block_n) * split * 2 <= max_programs and k_tiles // (split * 2) >= 4:
        split *= 2
    return split


def fp8_weight_matmul_triton(
    x: torch.Tensor,  # [M, K] bf16/fp16 (fp32 in the interpreter), unit inner stride
    weight: torch.Tensor,  # [N, K] float8_e4m3fn row-major
    weight_scale: torch.Tensor,  # [N, 1] fp32
    bias: torch.Tensor | None,  # [N]
    tile: dict[str, int] | None = None,  # overrides BLOCK_N / BLOCK_K / SPLIT_K / num_warps / num_stages
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, unit inner stride: written in place when given
) -> torch.Tensor:  # [M, N] in x's dtype
    """x (W * scale)^T + b for a few rows: reads the FP8 weight once, split over K where N alone is too narrow
    to fill the GPU."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return out
    sms = device_sms(x.device)
    return _launch_small_m(_fp8_weight_matmul_kernel, (x,), x.stride(0), weight, weight_scale, bias, out,
                           {**fp8_matmul_tile(m, n, k, sms), **(tile or {})})


def small_m_rows(m: int) -> int:
    """BLOCK_M of the small-M GEMMs for m rows: 16-64; more rows tile over the grid's third axis."""
    return min(64, max(16, triton.next_power_of_2(m)))


def _launch_small_m(kernel, operands: tuple, stride_xm: int, weight: torch.Tensor, weight_scale: torch.Tensor | None,
                    bias: torch.Tensor | None, out: torch.Tensor, cfg: dict[str, int], defer: bool = False,
                    extra: tuple = (), **flags: bool) -> torch.Tensor | PartialSums:
    """Runs a small-M GEMM kernel (`operands`: its leading x pointer arguments; `flags`: its own constexpr
    switches) over a grid of N tiles x K splits x row blocks, then, when K is split, the reduce that adds the
    fp32 partials in split order and applies the channel scale (when there is one) and the bias; or, with
    `defer` (and TANDEM_DEFER_REDUCE not 0), hands the partials on as PartialSums for the kernel after it.
    `extra`: pointer arguments of the kernel after its workspace."""
    m, n = out.shape
    k = weight.shape[1]
    block_m = cfg.pop("BLOCK_M", 0) or small_m_rows(m)
    split_k = cfg.pop("SPLIT_K")
    k_split = triton.cdiv(triton.cdiv(k, cfg["BLOCK_K"]), split_k) * cfg["BLOCK_K"]
    split_k = triton.cdiv(k, k_split)  # rounding K_SPLIT up to whole tiles can leave fewer splits
    ws = torch.empty(split_k, m, n, dtype=torch.float32, device=out.device) if split_k > 1 else out
    scale = weight_scale if weight_scale is not None else out  # a placeholder pointer when unscaled
    b = bias if bias is not None else scale
    per_program = cfg["BLOCK_N"] // 2 if flags.get("GATED") == GATE_PAIRS else cfg["BLOCK_N"]  # outputs
    grid = (triton.cdiv(n, per_program), split_k, triton.cdiv(m, block_m))
    pdl = use_pdl(out.device)
    kernel[grid](
        *operands, weight, scale, b, out, ws, *extra,
        m, n, k, k_split, stride_xm, weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0, SPLIT_K=split_k, BLOCK_M=block_m,
        USE_PDL=pdl, launch_pdl=bool(pdl), **flags, **cfg,
    )
    if split_k > 1 and defer and DEFER_REDUCE:
        return PartialSums(ws, weight_scale, bias, out.dtype)
    if split_k > 1:
        reduce_partial_sums_triton(PartialSums(ws, weight_scale, bias, out.dtype), out)
    return out


def reduce_partial_sums_triton(parts: PartialSums, out: torch.Tensor | None = None) -> torch.Tensor:
    """The linear's output [n, out] from a split-K GEMM's partial sums: their sum in split order, times the
    channel scale, plus the bias, rounded to parts.dtype (into `out`, unit inner stride, when given)."""
    splits, m, n = parts.ws.shape
    out = torch.empty(m, n, dtype=parts.dtype, device=parts.ws.device) if out is None else out
    if m * n == 0:
        return out
    block = 1024
    pdl = use_pdl(out.device)
    placeholder = parts.ws
    _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](
        parts.ws, parts.scale if parts.scale is not None else placeholder,
        parts.bias if parts.bias is not None else placeholder, out, m, n, out.stride(0),
        HAS_BIAS=parts.bias is not None, SPLIT_K=splits, BLOCK=block, USE_PDL=pdl, HAS_SCALE=parts.scale is not None,
        launch_pdl=bool(pdl),
    )
    return out


# ----------------------------------------------------------------------------- small-M W8A8 GEMM (swap AB)


@triton.jit
def _swap_ab_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, ws_ptr, oa_ptr,
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    HAS_SCALE: tl.constexpr, X_SCALED: tl.constexpr, GATED: tl.constexpr, up_offset,
    PREFETCH_LINES: tl.constexpr, LINE_K: tl.constexpr, AMAX_OUT: tl.constexpr, GROUP_K: tl.constexpr,
    ls_ptr=None, lb_ptr=None, lslot_ptr=None, R=1, stride_lsm=0, stride_lbs=0, stride_lbn=0,
    LORA: tl.constexpr = False, BLOCK_R: tl.constexpr = 16, SLOTS_P2: tl.constexpr = 2,
):
    # Program = BLOCK_N weight rows x BLOCK_M rows over K range [pid_k * K_SPLIT, +K_SPLIT). Both operands
    # go to the tensor cores in one dtype: e4m3 x e4m3 for W8A8, or both in the model dtype. (Widening FP8
    # weight tiles to bf16/f16 in registers for a W8A16 variant ran at 0.3-0.5 of copy bandwidth on an H200,
    # conversion-bound, 2026-11-25; files in benchmarks/results/ at bd15627.) The weight tile [BLOCK_N, BLOCK_K] is
    # the MMA's A operand and the few token rows its narrow B operand ("swap AB": the MMA's M of 64 is filled
    # by channels, not by the 1-32 tokens). acc[n, m] holds sum_k w[n, k] x[m, k]; the token scale
    # (X_SCALED: e4m3 rows, their scales at xs_ptr) multiplies here, the channel scale (HAS_SCALE) and bias
    # where the sum is final (here when SPLIT_K is 1, else in _split_k_reduce_kernel or the kernel taking
    # PartialSums, partial sums added in split order: bitwise reproducible).
    # GATED (SPLIT_K 1 only) writes silu(gate) * up, each rounded as the unfused GEMM +
    # silu_and_mul round it: GATE_TWO, the program multiplies its BLOCK_N gate rows and the up rows up_offset
    # below (two tiles); GATE_PAIRS, its tile is BLOCK_N / 2 gate rows and their up rows (one tile, BLOCK_N /
    # 2 outputs). AMAX_OUT (SPLIT_K 1 only): each row's |max| over the program's outputs, as stored, goes to
    # oa_ptr[row, program] ([M, N tiles]: the row's |max| is their max, for _quant_from_parts_kernel).
    # GROUP_K > 0 (X_SCALED): x is quantized in groups of GROUP_K columns, scales [M, K / GROUP_K], and each
    # K tile (within one group) adds its product times its group's scale.
    # LORA (model-dtype weights: no channel scale; GATED 0 or 1): the first K split adds each row's adapter delta
    # (shrink at ls_ptr [M, R] fp32, B at lb_ptr [slots, weight rows, R], row slots at lslot_ptr) to its fp32
    # sums, so the delta rides through the split-K reduce (or the PartialSums a norm adds up) like the product.
    pid_k, offs_m, _, offs_k, m_mask, _, k_begin, k_end = _small_m_program(
        M, N, K, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K)
    if GATED == 2:
        j = tl.arange(0, BLOCK_N)
        offs_o = tl.program_id(0) * (BLOCK_N // 2) + (j % (BLOCK_N // 2))  # the output column of each weight row
        n_mask = offs_o < N
        offs_n = offs_o + tl.where(j < BLOCK_N // 2, 0, up_offset)
    else:
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_begin + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
    u_ptrs = w_ptrs + up_offset * stride_wn
    if USE_PDL and PREFETCH_LINES > 0:
        # Before the wait (the previous kernel may still run): the first PREFETCH_LINES 128-byte lines of each
        # weight row of this program's K range go to L2, so the pipelined loads after the wait find them there.
        pf_k = k_begin + tl.arange(0, PREFETCH_LINES) * LINE_K
        pf_mask = n_mask[:, None] & (pf_k < k_end)[None, :]
        pf_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + pf_k[None, :]
        prefetch_l2(pf_ptrs, pf_mask)
        if GATED == 1:
            prefetch_l2(pf_ptrs + up_offset * stride_wn, pf_mask)
    pdl_wait(USE_PDL)
    x_ptrs = xq_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_begin + offs_k)[None, :]  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            w_mask = n_mask[:, None]
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + offs_k) < k_end
            w_mask = n_mask[:, None] & k_mask[None, :]
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if GROUP_K > 0:
            xs = tl.load(xs_ptr + offs_m * (K // GROUP_K) + k0 // GROUP_K, mask=m_mask, other=0.0)
            acc += tl.dot(tl.load(w_ptrs, mask=w_mask, other=0.0), tl.trans(x)) * xs[None, :]
        else:
            acc = tl.dot(tl.load(w_ptrs, mask=w_mask, other=0.0), tl.trans(x), acc)
        if GATED == 1:
            acc_up = tl.dot(tl.load(u_ptrs, mask=w_mask, other=0.0), tl.trans(x), acc_up)
            u_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if X_SCALED and GROUP_K == 0:
        x_scale = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
        acc = acc * x_scale
        if GATED == 1:
            acc_up = acc_up * x_scale
    if LORA:
        if pid_k == 0:
            slots = tl.load(lslot_ptr + offs_m, mask=m_mask, other=-1)
            acc += lora_tile_delta(slots, offs_m, offs_n, n_mask, ls_ptr, lb_ptr, R, stride_lsm, stride_lbs,
                                   stride_lbn, BLOCK_N, BLOCK_M, BLOCK_R, SLOTS_P2)
            if GATED == 1:
                acc_up += lora_tile_delta(slots, offs_m, offs_n + up_offset, n_mask, ls_ptr, lb_ptr, R, stride_lsm,
                                          stride_lbs, stride_lbn, BLOCK_N, BLOCK_M, BLOCK_R, SLOTS_P2)
    if SPLIT_K == 1:
        acc = _channel_epilogue(acc, offs_n, n_mask, s_ptr, b_ptr, HAS_SCALE, HAS_BIAS)
        out_ty = out_ptr.dtype.element_ty
        if GATED == 1:
            acc_up = _channel_epilogue(acc_up, offs_n + up_offset, n_mask, s_ptr, b_ptr, HAS_SCALE, HAS_BIAS)
            acc = _silu_mul(acc, acc_up, out_ty)
            offs_o = offs_n
        elif GATED == 2:
            # rows [0, half) are gate, [half, BLOCK_N) their up rows: [2, half, M] -> [half, M, 2] -> split
            gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N // 2, BLOCK_M)), (1, 2, 0)))
            acc = _silu_mul(gate, up, out_ty)
            offs_o = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            n_mask = offs_o < N
        else:
            offs_o = offs_n
        mask = n_mask[:, None] & m_mask[None, :]
        val = acc.to(out_ty)
        tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_o[:, None], val, mask=mask)
        if AMAX_OUT:
            row_max = tl.max(tl.where(mask, tl.abs(val.to(tl.float32)), 0.0), axis=0)
            tl.store(oa_ptr + offs_m * tl.num_programs(0) + tl.program_id(0), row_max, mask=m_mask)
    else:
        mask = n_mask[:, None] & m_mask[None, :]
        ws_ptrs = ws_ptr + (pid_k * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(ws_ptrs, acc, mask=mask)


@triton.jit
def _silu_mul(gate, up, out_ty: tl.constexpr):
    # silu(gate) * up with the roundings of the unfused GEMM + silu_and_mul: each projection rounded to the
    # output dtype, F.silu rounding before the multiply.
    g = gate.to(out_ty).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(out_ty).to(tl.float32)
    return silu * up.to(out_ty).to(tl.float32)


GATE_NONE, GATE_TWO, GATE_PAIRS = 0, 1, 2  # its GATED


@triton.jit
def _channel_epilogue(acc, offs_n, n_mask, s_ptr, b_ptr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    # [BLOCK_N, BLOCK_M] fp32 sums -> times the channel scale, plus the bias (both per output channel n).
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    return acc


LONE_STAGE_BYTES = 144 * 1024  # shared memory for the pipeline of a W8A8 program alone on its SM
LONE_MAX_STAGES = 6  # measured up to 6 (8 did not fit beside the epilogue)


def w8a8_tile(m: int, n: int, k: int, sms: int) -> dict[str, int]:
    """Tile of the W8A8 small-M GEMM from the shape alone (graph-safe): 64 channels per program (one
    warpgroup's MMA height), K tiles of 256, 4 pipeline stages, and K split in two where N gives fewer than
    2/3 of the SMs a 64-channel tile (and each half keeps >= 4 K tiles). Measured on an H200 over Llama-3-8B's
    projections at 16 and 32 pre-quantized rows (scripts/bench_fp8_linear.py --sweep, 2026-11-25;
    benchmarks/results/ at bd15627): o and down (64 N tiles) run best split 2-4, qkv (96) and gate_up (448) unsplit
    (gate_up 33.9 against 38.9 us split, which also writes and re-reads its fp32 partial sums).
    Where the grid has no more programs than the GPU has SMs, each program streams alone on its SM and
    nothing else hides its load latency, so it gets as many stages as LONE_STAGE_BYTES of shared memory hold
    (up to LONE_MAX_STAGES): in the seed-async decode step on an H200 (scripts/profile_decode.py,
    2026-11-25) 6 stages took qkv (96 programs) from 10.6 to 8.5 us a layer, down (128) from 17.6 to
    15.9 and o (128) from 6.6 to 6.1; gate_up (448 programs, two an SM) ran slower at 6. Grids of more
    programs than SMs at up to 32 rows take K tiles of 128, so that four programs fit an SM and up to 4 x sms
    run at once, with no second wave on part of the GPU: gate_up 32.6 -> 31.7 us a layer (same step, H200).
    TANDEM_W8A8_TILE="KEY=VALUE,..." overrides it for tuning runs (SPLIT_K=auto: split until ~2 programs per
    SM, keeping >= 4 K tiles per split); an item "NxK:KEY=VALUE" only for the weights of that shape."""
    block_k = 256 if k % 256 == 0 else 128
    narrow = 3 * triton.cdiv(n, 64) < 2 * sms
    split = 2 if narrow and triton.cdiv(k, block_k) >= 8 else 1
    block_m = small_m_rows(m)
    programs = triton.cdiv(n, 64) * split * triton.cdiv(m, block_m)
    if programs > sms and block_m <= 32 and k % 128 == 0:
        block_k = 128  # 48 KiB a program at 4 stages: 4 fit an SM, so up to 4 x sms programs all run at once
    stages = 4
    if programs <= sms:
        stage_bytes = (64 + block_m) * block_k  # one e4m3 weight tile and one of x
        stages = max(stages, min(LONE_MAX_STAGES, LONE_STAGE_BYTES // stage_bytes,
                                 triton.cdiv(triton.cdiv(k, block_k), split)))
    tile: dict[str, int | str] = {"BLOCK_N": 64, "BLOCK_K": block_k, "SPLIT_K": split, "num_warps": 4,
                                  "num_stages": stages}
    for item in filter(None, os.environ.get("TANDEM_W8A8_TILE", "").split(",")):
        shape, _, item = item.rpartition(":")
        if shape and shape != f"{n}x{k}":
            continue
        key, _, value = item.partition("=")
        if key not in tile:
            raise ValueError(f"TANDEM_W8A8_TILE: unknown key {key!r} (expected one of {sorted(tile)})")
        tile[key] = value if value == "auto" else int(value)
    if tile["SPLIT_K"] == "auto":
        tile["SPLIT_K"] = split_k_until(n, int(tile["BLOCK_N"]), triton.cdiv(k, int(tile["BLOCK_K"])), 2 * sms,
                                        max_split=16)
    return {key: int(value) for key, value in tile.items()}


def fp8_w8a8_matmul_triton(
    x: torch.Tensor,  # [M, K] bf16/fp16 (fp32 in the interpreter), unit inner stride
    weight: torch.Tensor,  # [N, K] float8_e4m3fn row-major
    weight_scale: torch.Tensor,  # [N, 1] fp32
    bias: torch.Tensor | None,  # [N]
    tile: dict[str, int] | None = None,  # overrides BLOCK_N / BLOCK_K / SPLIT_K / num_warps / num_stages
    defer: bool = False,  # split over K: may return PartialSums instead of running the reduce
    out: torch.Tensor | None = None,  # [M, N] in x's dtype, unit inner stride: written in place when given
) -> torch.Tensor | PartialSums:  # [M, N] in x's dtype
    """x (W * scale)^T + b for up to a few dozen rows with x quantized per token (as _scaled_mm's path does):
    FP8 x FP8 on the tensor cores, the weight read once, split over K where N alone is too narrow."""
    if x.shape[0] == 0:
        return torch.empty(0, weight.shape[0], dtype=x.dtype, device=x.device) if out is None else out
    xq, xs = quantize_per_token_triton(x) if x.is_cuda else _quantize_ref(x)
    return fp8_w8a8_matmul_quantized(xq, xs, weight, weight_scale, bias, x.dtype, tile, defer, out)


def fp8_w8a8_matmul_quantized(
    xq: torch.Tensor,  # [M, K] float8_e4m3fn, unit inner stride
    x_scale: torch.Tensor,  # [M, 1] fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn row-major
    weight_scale: torch.Tensor,  # [N, 1] fp32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
    tile: dict[str, int] | None = None,
    defer: bool = False,  # split over K: may return PartialSums instead of running the reduce
    out: torch.Tensor | None = None,  # [M, N] in out_dtype, unit inner stride: written in place when given
) -> torch.Tensor | PartialSums:  # [M, N] in out_dtype
    """The W8A8 swap-AB GEMM on rows already quantized per token (by quantize_per_token_triton or by the
    kernel that produced them), or in groups of columns (x_scale [M, G], contiguous: QuantizedRows)."""
    m, k = xq.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device) if out is None else out
    if m == 0:
        return out
    sms = device_sms(xq.device)
    cfg = {**w8a8_tile(m, n, k, sms), **(tile or {})}
    group_k = 0
    if x_scale.shape[1] > 1:
        group_k = k // x_scale.shape[1]
        cfg["BLOCK_K"] = group_block_k(group_k, cfg["BLOCK_K"])
        if not cfg["BLOCK_K"] or k % group_k or not x_scale.is_contiguous():
            raise ValueError(f"rows quantized in groups of {group_k} of {k} columns: no FP8 K tile fits a group")
    return _launch_small_m(_swap_ab_kernel, (xq, x_scale), xq.stride(0), weight, weight_scale, bias, out, cfg,
                           defer, (out,), HAS_SCALE=True, X_SCALED=True, GATED=GATE_NONE, up_offset=0,
                           AMAX_OUT=False, GROUP_K=group_k, **_prefetch(weight, cfg))


def fp8_w8a8_gated(
    xq: torch.Tensor,  # [M, K] float8_e4m3fn, unit inner stride
    x_scale: torch.Tensor,  # [M, 1] fp32
    weight: torch.Tensor,  # [2 * I, K] float8_e4m3fn row-major: gate rows then up rows
    weight_scale: torch.Tensor,  # [2 * I, 1] fp32
    out_dtype: torch.dtype,
    quantize: bool = False,  # return the output quantized per token
    tile: dict[str, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [M, I] silu(gate) * up, or (e4m3 [M, I], fp32 [M, 1])
    """silu(x Wg^T) * (x Wu^T) of a merged gate/up FP8 weight on quantized rows, in one W8A8 swap-AB pass
    (each program's tile: BLOCK_N / 2 gate rows and their up rows). quantize: the GEMM also writes each
    program's row maxima, and a quantizer that needs no reduction of its own (_quant_from_parts_kernel) turns
    the rows into what quantize_per_token_triton would (bit for bit), in place of the SiLU-and-mul quantizer
    that found the row maxima itself (4.2 us a layer on Llama-3-8B's 32 x 14,336 rows, H200)."""
    m, k = xq.shape
    n = weight.shape[0]
    if n % 2:
        raise ValueError(f"a gated GEMM needs an even number of weight rows (gate then up), got {n}")
    out = torch.empty(m, n // 2, dtype=out_dtype, device=xq.device)
    cfg = {**w8a8_tile(m, n, k, device_sms(xq.device)), **(tile or {}), "SPLIT_K": 1}  # silu needs whole sums
    tiles = triton.cdiv(n // 2, cfg["BLOCK_N"] // 2)
    parts = torch.empty(m, tiles, dtype=torch.float32, device=xq.device) if quantize else out
    if m:
        _launch_small_m(_swap_ab_kernel, (xq, x_scale), xq.stride(0), weight, weight_scale, None, out, cfg, False,
                        (parts,), HAS_SCALE=True, X_SCALED=True, GATED=GATE_PAIRS, up_offset=n // 2,
                        AMAX_OUT=quantize, GROUP_K=0, **_prefetch(weight, cfg))
    return quantize_from_parts(out, parts) if quantize else out


@triton.jit
def _quant_from_parts_kernel(
    x_ptr, parts_ptr, q_ptr, scale_ptr, dim, num_parts, stride_x,
    FP8_MAX_C: tl.constexpr, MIN_AMAX_C: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Program = BLOCK values of one row: the row's |max| is the max of its num_parts partial maxima (written
    # by the kernel that produced the row), then store_quantized's math; chunk 0 writes the scale.
    pdl_wait(USE_PDL)
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    p = tl.arange(0, PARTS)
    amax = tl.max(tl.load(parts_ptr + row * num_parts + p, mask=p < num_parts, other=0.0), axis=0)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = store_quantized(x, amax, offs, mask, q_ptr + row * dim, FP8_MAX_C, MIN_AMAX_C)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)


def quantize_from_parts(x: torch.Tensor, parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, k] rows and [n, p] partial |max| values whose max per row is the row's |max| -> (e4m3 [n, k], fp32
    scale [n, 1]) equal to quantize_per_token_triton(x), from one pass with no reduction across programs."""
    n, dim = x.shape
    q = torch.empty(n, dim, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=x.device)
    if n == 0:
        return q, scale
    pdl = use_pdl(x.device)
    _quant_from_parts_kernel[(triton.cdiv(dim, WIDE_BLOCK), n)](
        x, parts, q, scale, dim, parts.shape[1], x.stride(0), FP8_MAX_C=FP8_MAX, MIN_AMAX_C=MIN_AMAX,
        BLOCK=WIDE_BLOCK, PARTS=triton.next_power_of_2(parts.shape[1]), USE_PDL=pdl, num_warps=4,
        launch_pdl=bool(pdl),
    )
    return q, scale


PREFETCH_TILES = int(os.environ.get("TANDEM_PREFETCH_TILES", "2"))  # K tiles per program the swap-AB GEMM sends to L2


def _prefetch(weight: torch.Tensor, cfg: dict[str, int]) -> dict[str, int]:
    """The swap-AB kernel's L2 prefetch before its PDL wait: 128-byte lines per weight row (PREFETCH_TILES K
    tiles; 0 turns it off) and the K elements per line."""
    line_k = 128 // weight.element_size()
    lines = PREFETCH_TILES * cfg["BLOCK_K"] // line_k
    return {"PREFETCH_LINES": triton.next_power_of_2(lines) if lines > 0 else 0, "LINE_K": line_k}


def _quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from tandem.kernels.fp8 import quantize_activation_per_token_ref  # the interpreter's path

    return quantize_activation_per_token_ref(x)


# ----------------------------------------------------------------------------- small-M GEMM in the model dtype


def skinny_tile(m: int, n: int, k: int, sms: int) -> dict[str, int]:
    """Tile of the swap-AB GEMM with 16-bit weights, from the shape alone (graph-safe): 64 channels per
    program (one warpgroup's MMA height), K tiles of 128 (32 KiB of weight and x per stage), 4 stages, K split
    until ~2 programs per SM while each split keeps >= 4 K tiles."""
    block_k = 128
    split_k = split_k_until(n, 64, triton.cdiv(k, block_k), 2 * sms, max_split=8)
    return {"BLOCK_N": 64, "BLOCK_K": block_k, "SPLIT_K": split_k, "num_warps": 4, "num_stages": 4}


def skinny_matmul_triton(
    x: torch.Tensor,  # [M, K] bf16/fp16 (fp32 in the interpreter), unit inner stride
    weight: torch.Tensor,  # [N, K] in x's dtype, row-major (gated: gate rows then up rows)
    bias: torch.Tensor | None,  # [N]
    tile: dict[str, int] | None = None,  # overrides BLOCK_N / BLOCK_K / SPLIT_K / num_warps / num_stages
    gated: bool = False,  # silu(gate) * up of a merged gate/up weight: [M, N / 2], K never split
    defer: bool = False,  # split over K: may return PartialSums instead of running the reduce
    lora: LoRAShrunk | None = None,  # each row's adapter delta, added to the sums (s [M, R], b [slots, N, R])
) -> torch.Tensor | PartialSums:  # [M, N] (or [M, N / 2] gated) in x's dtype
    """x W^T + b for a few dozen rows with the weight in the model dtype: the swap-AB tile GEMM (channels
    fill the MMA's M; the rows are its narrow N), the weight read once, split over K where N alone is too
    narrow to fill the GPU; gated, silu(gate) * up in the same pass. With lora, each row's LoRA delta joins its
    fp32 sums before the one rounding (base + expand in one kernel)."""
    m, k = x.shape
    n = weight.shape[0]
    if gated and n % 2:
        raise ValueError(f"a gated GEMM needs an even number of weight rows (gate then up), got {n}")
    if lora is not None and (lora.s.shape[0] != m or lora.s.dtype != torch.float32 or lora.b.dim() != 3
                             or lora.b.shape[1:] != (n, lora.s.shape[1]) or lora.token_slots.shape[0] < m
                             or lora.s.stride(1) != 1 or lora.b.stride(2) != 1):
        raise ValueError(f"skinny lora epilogue: s {tuple(lora.s.shape)} {lora.s.dtype}, b {tuple(lora.b.shape)}, "
                         f"slots {tuple(lora.token_slots.shape)} for {m} rows x {n} weight rows")
    if x.stride(1) != 1:
        x = x.contiguous()
    n_out = n // 2 if gated else n
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    sms = device_sms(x.device)
    cfg = {**skinny_tile(m, n_out, k, sms), **(tile or {})}
    if gated:
        cfg["SPLIT_K"] = 1  # silu needs the whole sum
    flags = {}
    if lora is not None:
        rank = lora.s.shape[1]
        flags = dict(ls_ptr=lora.s, lb_ptr=lora.b, lslot_ptr=lora.token_slots, R=rank, stride_lsm=lora.s.stride(0),
                     stride_lbs=lora.b.stride(0), stride_lbn=lora.b.stride(1), LORA=True,
                     BLOCK_R=max(16, min(triton.next_power_of_2(rank), 64)), SLOTS_P2=slots_p2(lora.b.shape[0]))
    return _launch_small_m(_swap_ab_kernel, (x, x), x.stride(0), weight, None, bias, out, cfg, defer, (out,),
                           HAS_SCALE=False, X_SCALED=False, GATED=GATE_TWO if gated else GATE_NONE, up_offset=n_out,
                           AMAX_OUT=False, GROUP_K=0, **_prefetch(weight, cfg), **flags)


def finish_split(ws: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, split_k: int, defer: bool
                 ) -> torch.Tensor | PartialSums:
    """A kernel's output once it ran: `out` itself (no K split), or its fp32 partial sums ws [split_k, M, N] (the
    bias added when reduced) reduced into `out`, or handed on as PartialSums where `defer` and
    TANDEM_DEFER_REDUCE allow (the RMSNorm after adds them)."""
    if split_k == 1:
        return out
    parts = PartialSums(ws, None, bias, out.dtype)
    if defers(defer):
        return parts
    reduce_partial_sums_triton(parts, out)
    return out


def defers(defer: bool) -> bool:
    """Whether a split-K kernel asked to `defer` hands on its partial sums (TANDEM_DEFER_REDUCE not 0): the one
    switch finish_split and the kernels that add their splits themselves read."""
    return defer and DEFER_REDUCE
